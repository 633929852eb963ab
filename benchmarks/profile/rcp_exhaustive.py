"""Every FP32 ``d`` in ``[2^-100, 2^126]``: the branch-free reciprocal of
``fp4_math.candidate_nb`` (``1.0/d`` as Triton compiles it, ``div.full.f32``, then
two steps ``e = fma(-d, r, 1)``, ``r = fma(r, e, r)``) against ``div_rn(1, d)``, bit for bit.

That range is every ``d·kd`` the block-scale factor can see (the helper's docstring); outside
it the helper never takes this path. ~1.9e9 values, a few ms of GPU time: the check is by
exhaustion, not by sampling. Prints the mismatch count and up to 8 of them.

Usage (GPU): ``python benchmarks/profile/rcp_exhaustive.py``.
"""

import struct
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _rcp_check_kernel(bad_ptr, ex_ptr, LO, N, BLOCK: tl.constexpr, ITER: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITER)
    for it in tl.static_range(ITER):
        i = base + it * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        bits = (LO + i).to(tl.int32)
        d = bits.to(tl.float32, bitcast=True)
        r = 1.0 / d
        e = tl.fma(-d, r, 1.0)
        r = tl.fma(r, e, r)
        e = tl.fma(-d, r, 1.0)
        r = tl.fma(r, e, r)
        want = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
        wrong = m & (r.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True))
        n = tl.sum(wrong.to(tl.int32), 0)
        if n > 0:
            k = tl.atomic_add(bad_ptr, n)
            if k < 8:
                tl.store(ex_ptr + k, tl.max(tl.where(wrong, bits, 0), 0))


def main() -> int:
    lo = struct.unpack("<i", struct.pack("<f", 2.0 ** -100))[0]
    hi = struct.unpack("<i", struct.pack("<f", 2.0 ** 126))[0]
    n = hi - lo + 1
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    ex = torch.zeros(8, dtype=torch.int32, device="cuda")
    block, it = 1024, 8
    _rcp_check_kernel[(triton.cdiv(n, block * it),)](bad, ex, lo, n, BLOCK=block, ITER=it,
                                                     num_warps=8)
    torch.cuda.synchronize()
    nb = int(bad.item())
    print(f"rcp_exhaustive: {n} values d in [2^-100, 2^126], mismatches against div_rn: {nb}")
    for b in ex.tolist()[:min(nb, 8)]:
        d = struct.unpack("<f", struct.pack("<i", b))[0]
        print(f"  d = {d!r} (bits {b:#010x})")
    print("PASS" if nb == 0 else "FAIL")
    return 0 if nb == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
