"""On the GPU: `partial_nvfp4_linear` with nothing kept against the NVFP4 linear (same draws:
same codes, so equal up to the FP32 accumulation), at 500 tokens and at one linear of the
ablation model (8 × 512: 32,768 tokens, 512 -> 1408). Prints PASS/FAIL lines.

    python3 scripts/gpu/check_partial_nvfp4.py
"""
import sys

import torch

sys.path.insert(0, ".")
from fullstack_fp4.linear import nvfp4_linear  # noqa: E402
from fullstack_fp4.linear.partial_nvfp4 import partial_nvfp4_linear  # noqa: E402


def run(fn, x, w, dy, seed, **kw):
    """y, dX, dW; the stochastic rounding draws from the global RNG, seeded alike (the trainer's way)."""
    torch.manual_seed(seed)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xr, wr, **kw)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(dev="cuda", shapes=((500, 512, 1408), (32768, 512, 1408))):
    g = torch.Generator(device=dev).manual_seed(0)
    ok = True
    for t, fin, fout in shapes:
        x = torch.randn(t, fin, device=dev, generator=g).bfloat16()
        w = (torch.randn(fout, fin, device=dev, generator=g) / fin ** 0.5).bfloat16()
        dy = torch.randn(t, fout, device=dev, generator=g).bfloat16()
        got, ref = run(partial_nvfp4_linear, x, w, dy, 7), run(nvfp4_linear, x, w, dy, 7)
        errs = [rel(a, b) for a, b in zip(got, ref)]
        # BF16 outputs: the two accumulations may round a value to neighbouring BF16 numbers
        good = all(e < 4e-3 for e in errs)
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} nothing kept == nvfp4_linear at {t}x{fin}->{fout}: "
              f"rel err y {errs[0]:.2e}, dX {errs[1]:.2e}, dW {errs[2]:.2e}")
        kept = run(partial_nvfp4_linear, x, w, dy, 7, keep=["w"])
        print(f"     keep=[w]: rel diff to nvfp4_linear y {rel(kept[0], ref[0]):.3e}, "
              f"dX {rel(kept[1], ref[1]):.3e}, dW {rel(kept[2], ref[2]):.3e}")
    print("ALL PASS" if ok else "SOME FAILED")


if __name__ == "__main__":
    main()
