"""Q-Attn on the GPU: correctness check, then time and memory vs torch SDPA (flash), BF16.

1. Correctness at a small shape (1×4×200×128, GQA 2, causal, K-smoothing on): the Triton
   prologue's views must equal the PyTorch reference's bit for bit; forward O and LSE, and
   dQ/dK/dV given the same (O, LSE), within the test suite's tolerances (O 1e-2, dQ/dK 2e-2
   on the GPU: MMA accumulation order can flip a few dS codes, dV 1e-2). Aborts on failure.
2. Timing at 1×24×4096×128 and 4×24×2048×128, causal: forward and forward+backward, median
   of CUDA-event timings after warm-up, Q-Attn (default paths: NVFP4 QKᵀ and dS, emulated on
   Hopper with BF16 tensor cores on exactly-representable dequantized values) vs
   ``F.scaled_dot_product_attention`` (flash backend). Memory saved for backward = bytes of
   the tensors autograd holds for the backward (``saved_tensors_hooks``, deduplicated by
   storage) for each.

3. Stage breakdown at 1×24×4096×128: prologue, forward kernel, backward kernels. With
   ``--sweep`` every ``FP4_QATTN_FWD`` / ``FP4_QATTN_BWD`` config in FWD_SWEEP / BWD_SWEEP
   (block sizes, warps, stages; see ``triton_fwd._config``, ``triton_bwd.bwd_config``).

Prints a markdown table; writes ``q_attn_bench.json`` into ``$OUT`` if set.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fullstack_fp4.attention import q_attention  # noqa: E402
from fullstack_fp4.attention import reference  # noqa: E402
from fullstack_fp4.attention.paths import resolve_paths  # noqa: E402
from fullstack_fp4.attention.prologue import make_views  # noqa: E402
from fullstack_fp4.attention.triton_bwd import attention_backward  # noqa: E402
from fullstack_fp4.attention.triton_fwd import attention_forward  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def correctness():
    torch.manual_seed(0)
    b, h, hk, s, d = 1, 4, 2, 200, 128
    q = (torch.randn(b, h, s, d, device="cuda") * 1.5).bfloat16()
    k = (torch.randn(b, hk, s, d, device="cuda") + torch.randn(1, hk, 1, d, device="cuda")).bfloat16()
    v = torch.randn(b, hk, s, d, device="cuda").bfloat16()
    do = torch.randn(b, h, s, d, device="cuda").bfloat16()
    vt = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="triton")
    vr = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="reference")
    views_equal = all(torch.equal(getattr(vt, n).float(), getattr(vr, n).float())
                      for n in ("q_hd", "k_hd", "q_sq", "k_sq"))
    o, lse = attention_forward(vt, v, causal=True, scale=d ** -0.5)
    o_r, lse_r = reference.forward(v, vr, causal=True, scale=d ** -0.5, paths=resolve_paths(None))
    g = attention_backward(do, o, lse, v, vt, causal=True, scale=d ** -0.5)
    g_r = reference.backward(do, o, v, vr, causal=True, scale=d ** -0.5, paths=resolve_paths(None))
    res = {"views_bit_exact": views_equal, "O": rel(o, o_r),
           "lse_maxabs": (lse - lse_r).abs().max().item(),
           "dQ": rel(g[0], g_r[0]), "dK": rel(g[1], g_r[1]), "dV": rel(g[2], g_r[2])}
    ok = (views_equal and res["O"] < 1e-2 and res["lse_maxabs"] < 1e-3 and res["dQ"] < 2e-2
          and res["dK"] < 2e-2 and res["dV"] < 1e-2)
    res["ok"] = ok
    return res


def saved_bytes(fn, *args):
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return total[0]


def time_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(z))
    return sorted(ts)[len(ts) // 2]


def bench(b, h, s, d):
    q, k, v = [torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

    def sdpa(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def qattn(q, k, v):
        return q_attention(q, k, v, causal=True)

    out = {}
    for name, fn in (("sdpa_flash_bf16", sdpa), ("q_attn", qattn)):
        with torch.no_grad():
            f_ms = time_ms(lambda: fn(q, k, v))

        def fb():
            o = fn(q, k, v)
            o.backward(do)
        fb_ms = time_ms(fb)
        out[name] = {"fwd_ms": f_ms, "fwd_bwd_ms": fb_ms, "saved_bytes": saved_bytes(fn, q, k, v)}
    flops = 4 * b * h * s * s * d / 2 * 3.5          # causal fwd (2 GEMMs) + bwd (5 GEMMs)
    out["ratio_fwd_bwd"] = out["q_attn"]["fwd_bwd_ms"] / out["sdpa_flash_bf16"]["fwd_bwd_ms"]
    out["ratio_fwd"] = out["q_attn"]["fwd_ms"] / out["sdpa_flash_bf16"]["fwd_ms"]
    out["q_attn_tflops_fwd_bwd"] = flops / out["q_attn"]["fwd_bwd_ms"] / 1e9
    return out


FWD_SWEEP = ("", "128,128,8,2", "128,128,8,3", "128,64,8,2", "128,64,4,3", "64,64,4,3")
BWD_SWEEP = ("", "8,1,8,1", "8,3,8,3", "4,2,4,2", "4,1,4,1", "8,2,4,2")


def breakdown(b, h, s, d, sweep):
    """Per-stage times at one shape (ms): prologue (make_views), forward kernel, backward
    kernels (incl. the delta pre-pass); with ``sweep`` each FP4_QATTN_FWD / FP4_QATTN_BWD
    variant ('' = the built-in default) is timed, so the next default can be read off."""
    torch.manual_seed(0)
    q, k, v, do = [torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    scale = d ** -0.5
    rows = {"prologue_ms": time_ms(lambda: make_views(q, k, qk_fp4=True, ds_fp4=True,
                                                      smooth=True, backend="triton"))}
    views = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="triton")
    o, lse = attention_forward(views, v, causal=True, scale=scale)
    for name, env, cfgs, fn in (
            ("fwd", "FP4_QATTN_FWD", FWD_SWEEP,
             lambda: attention_forward(views, v, causal=True, scale=scale)),
            ("bwd", "FP4_QATTN_BWD", BWD_SWEEP,
             lambda: attention_backward(do, o, lse, v, views, causal=True, scale=scale))):
        for cfg in (cfgs if sweep else ("",)):
            os.environ[env] = cfg
            try:
                rows[f"{name}[{cfg or 'default'}]_ms"] = time_ms(fn)
            except Exception as e:  # noqa: BLE001 -- a config that fails to compile/launch
                rows[f"{name}[{cfg or 'default'}]_ms"] = f"failed: {type(e).__name__}"
            finally:
                os.environ.pop(env, None)
    return rows


def main():
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    sweep = "--sweep" in sys.argv
    c = correctness()
    print("correctness vs reference:", json.dumps(c))
    if not c["ok"]:
        raise SystemExit("correctness check failed; not benchmarking")
    results = {"device": torch.cuda.get_device_name(), "correctness": c,
               "note": "NVFP4 GEMMs emulated on Hopper (BF16 MMA on exact dequantized values)"}
    print("\n| shape (causal) | SDPA fwd ms | Q-Attn fwd ms | ratio | SDPA fwd+bwd ms | "
          "Q-Attn fwd+bwd ms | ratio | saved MiB SDPA / Q-Attn |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in ((1, 24, 4096, 128), (4, 24, 2048, 128)):
        r = bench(*shape)
        results["x".join(map(str, shape))] = r
        s, qa = r["sdpa_flash_bf16"], r["q_attn"]
        print(f"| {'x'.join(map(str, shape))} | {s['fwd_ms']:.3f} | {qa['fwd_ms']:.3f} | "
              f"{r['ratio_fwd']:.2f} | {s['fwd_bwd_ms']:.3f} | {qa['fwd_bwd_ms']:.3f} | "
              f"{r['ratio_fwd_bwd']:.2f} | {s['saved_bytes'] / 2**20:.1f} / "
              f"{qa['saved_bytes'] / 2**20:.1f} |")
    for shape in ((1, 24, 4096, 128),):
        r = breakdown(*shape, sweep)
        results["breakdown_" + "x".join(map(str, shape))] = r
        print(f"\nstage times at {'x'.join(map(str, shape))} causal (ms; sweep={sweep}):")
        for key, val in r.items():
            print(f"  {key:32s} {val if isinstance(val, str) else f'{val:.3f}'}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "q_attn_bench.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
