"""GPU check of Q-AdamW's FAST_IEEE sequences (triton_rows._sqrt_fast / _div_fast) against IEEE.

    python scripts/gpu/check_fast_ieee.py                 # H200: all three parts (~1-2 min)
    python scripts/gpu/check_fast_ieee.py --div-pairs 2e9 --kernel-n 2e7
    TRITON_INTERPRET=1 python scripts/gpu/check_fast_ieee.py --self-test   # CPU, tiny sizes

1. sqrt, EXHAUSTIVE: every non-negative FP32 bit pattern (2^31, +0 .. +inf and the positive
   NaNs) through _sqrt_fast vs torch.sqrt and vs Triton's sqrt_rn, bit for bit. Mismatches
   are counted inside the proven domain (x == +0 or 2^-100 <= x <= FP32_MAX: must be 0) and
   outside it (information only: the kernel sends those entries to its sqrt_rn fallback).
2. division: random pairs with uniformly drawn exponents and random mantissas/signs over the
   proven domain (m == ±0 or 2^-76 <= |m| <= 2^64, d in [2^-60, 2^45]), plus hard cases —
   quotients next to a rounding midpoint (m = RN(d · mid) and its ±1..2-ulp neighbours),
   exact quotients and their neighbours, the domain's corners, signed zeros — vs the FP64
   quotient rounded to FP32 (correctly rounded) and Triton's div_rn. Again: in-domain mismatches must be 0; an out-of-domain
   sweep over all exponent pairs is reported for information.
3. the whole kernel, FAST_IEEE on vs off (Philox path, same seed), a few steps on a ~1e7
   entry tensor with heavy-tailed gradients, zero runs and a few huge / tiny entries (so that
   some programs take the fallback): params and every state tensor bit-identical.

Prints the counts; exits 1 on any in-domain mismatch. NaN results compare equal to NaN (the
payload is not part of the contract: downstream FADD/FFMA canonicalise it). Under
TRITON_INTERPRET=1 the MUFU approximations are emulated with ±2-ulp perturbations (beyond
the documented error), so the self-test checks the same exactness claim on the interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fullstack_fp4.optim.q_adamw.triton_rows import _div_fast, _sqrt_fast  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BLOCK = 1024


@triton.jit
def _sqrt_kernel(x_ptr, fast_ptr, ieee_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = i < n
    x = tl.load(x_ptr + i, mask=msk, other=0.0)
    tl.store(fast_ptr + i, _sqrt_fast(x), mask=msk)
    tl.store(ieee_ptr + i, tl.sqrt_rn(x), mask=msk)


@triton.jit
def _div_kernel(m_ptr, d_ptr, fast_ptr, ieee_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = i < n
    m = tl.load(m_ptr + i, mask=msk, other=0.0)
    d = tl.load(d_ptr + i, mask=msk, other=1.0)
    tl.store(fast_ptr + i, _div_fast(m, d), mask=msk)
    tl.store(ieee_ptr + i, tl.div_rn(m, d), mask=msk)


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise equal, or both NaN."""
    return (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))


def _bits_f32(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).view(torch.float32)


def check_sqrt(dev, chunk: int, limit: int | None) -> int:
    total = (1 << 31) if limit is None else limit
    lo, fmax = 2.0 ** -100, torch.finfo(torch.float32).max
    bad_in = bad_out = n_in = 0
    worst = []
    t0 = time.time()
    start = 0
    while start < total:
        cnt = min(chunk, total - start)
        if limit is None:
            bits = torch.arange(start, start + cnt, dtype=torch.int64, device=dev)
        else:   # a sample spread over the whole range (self-test)
            bits = torch.randint(0, 1 << 31, (cnt,), dtype=torch.int64, device=dev)
            bits[:8] = torch.tensor([0, 1, 0x00800000, 0x0D000000, 0x3F800000, 0x7F7FFFFF,
                                     0x7F800000, 0x7FC00000])
        x = _bits_f32(bits)
        fast, ieee = torch.empty_like(x), torch.empty_like(x)
        _sqrt_kernel[(triton.cdiv(cnt, BLOCK),)](x, fast, ieee, cnt, BLOCK=BLOCK)
        ref = x.double().sqrt().float()     # FP64 then RN: correctly rounded (53 >= 2·24 + 2)
        ok = _same(fast, ref) & _same(fast, ieee)
        dom = (x == 0) | ((x >= lo) & (x <= fmax))
        n_in += int(dom.sum())
        bad_in += int((~ok & dom).sum())
        bad_out += int((~ok & ~dom).sum())
        if (~ok & dom).any() and len(worst) < 5:
            j = torch.nonzero(~ok & dom)[:5 - len(worst), 0]
            worst += [(hex(int(bits[k])), float(fast[k]), float(ref[k]), float(ieee[k])) for k in j]
        start += cnt
    print(f"sqrt: {total} bit patterns ({n_in} in the domain) in {time.time() - t0:.1f} s: "
          f"{bad_in} mismatches in the domain, {bad_out} outside it (fallback there)"
          + (f"; first: {worst}" if worst else ""), flush=True)
    return bad_in


def _rand_f32(n, e_lo, e_hi, dev, gen, signed=True):
    """Uniform unbiased exponent in [e_lo, e_hi], random 23 mantissa bits, random sign."""
    e = torch.randint(e_lo + 127, e_hi + 127 + 1, (n,), device=dev, generator=gen)
    mant = torch.randint(0, 1 << 23, (n,), device=dev, generator=gen)
    bits = (e << 23) | mant
    if signed:
        bits = bits | (torch.randint(0, 2, (n,), device=dev, generator=gen) << 31)
    return _bits_f32(bits)


def _hard_pairs(n, dev, gen):
    """Quotients next to rounding midpoints, exact quotients and their 1-ulp neighbours."""
    d = _rand_f32(n, -60, 45, dev, gen, signed=False)
    # a midpoint: 25-bit odd significand in [1, 2), scaled so that m = d · mid lands in range
    k = torch.randint(1 << 24, 1 << 25, (n,), device=dev, generator=gen) | 1
    emid = torch.randint(-30, 30, (n,), device=dev, generator=gen)
    mid = k.double() * torch.pow(2.0, (emid - 24).double())
    m = (d.double() * mid).float()
    # exact quotients: small-significand q times small-significand d (product has <= 24 bits)
    q = torch.randint(1, 1 << 11, (n,), device=dev, generator=gen).double() * \
        torch.pow(2.0, torch.randint(-20, 20, (n,), device=dev, generator=gen).double())
    d2 = (torch.randint(1, 1 << 12, (n,), device=dev, generator=gen).double()
          * torch.pow(2.0, torch.randint(-30, 30, (n,), device=dev, generator=gen).double())).float()
    m2 = (d2.double() * q).float()
    ms, ds = [], []
    for mm, dd in ((m, d), (m2, d2)):
        b = mm.view(torch.int32)
        for off in (-2, -1, 0, 1, 2):
            ms.append((b + off).view(torch.float32))
            ds.append(dd)
    m = torch.cat(ms)
    sign = torch.randint(0, 2, (m.numel(),), device=dev, generator=gen).bool()
    return torch.where(sign, -m, m), torch.cat(ds)


def _corners(dev):
    f = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
    ms = [0.0, -0.0, 2.0 ** -76, -(2.0 ** -76), 2.0 ** 64, -(2.0 ** 64), 1.0, -1.0, 3.0, 1e-20]
    ds = [2.0 ** -60, 2.0 ** 45, 1.0, 3.0, 1e-8, 1.0000001, 0.99999994]
    mm = torch.tensor(ms).repeat_interleave(len(ds))
    dd = torch.tensor(ds).repeat(len(ms))
    # and the neighbours of the domain edges inside it
    return f(mm.tolist()), f(dd.tolist())


def _div_batch(m, d):
    fast, ieee = torch.empty_like(m), torch.empty_like(m)
    _div_kernel[(triton.cdiv(m.numel(), BLOCK),)](m, d, fast, ieee, m.numel(), BLOCK=BLOCK)
    ref = (m.double() / d.double()).float()   # correctly rounded, as for sqrt
    return _same(fast, ref) & _same(fast, ieee), fast, ref


def _in_div_domain(m, d):
    am = m.abs()
    return ((am == 0) | ((am >= 2.0 ** -76) & (am <= 2.0 ** 64))) & \
        (d >= 2.0 ** -60) & (d <= 2.0 ** 45)


def check_div(dev, pairs: int, chunk: int) -> int:
    gen = torch.Generator(device=dev).manual_seed(20261201)
    t0 = time.time()
    bad, done, first = 0, 0, []
    cm, cd = _corners(dev)
    batches = [(cm, cd)]
    while done < pairs:
        cnt = min(chunk, pairs - done)
        if not batches:
            if (done // chunk) % 4 == 1:     # every 4th batch: the hard cases
                batches.append(_hard_pairs(max(cnt // 10, 1), dev, gen))
            else:
                m = _rand_f32(cnt, -76, 63, dev, gen)
                m[:cnt // 64] = 0.0
                batches.append((m, _rand_f32(cnt, -60, 44, dev, gen, signed=False)))
        m, d = batches.pop()
        dom = _in_div_domain(m, d)
        ok, fast, ref = _div_batch(m, d)
        miss = ~ok & dom
        bad += int(miss.sum())
        if miss.any() and len(first) < 5:
            j = torch.nonzero(miss)[:5 - len(first), 0]
            first += [(float(m[k]), float(d[k]), float(fast[k]), float(ref[k])) for k in j]
        done += int(dom.sum())
    # information: every exponent pair (signed m, positive d), inside and outside the domain
    m = _rand_f32(min(chunk, 1 << 24), -149, 127, dev, gen)
    d = _rand_f32(m.numel(), -126, 127, dev, gen, signed=False)
    ok, _, _ = _div_batch(m, d)
    outside = int((~ok & ~_in_div_domain(m, d)).sum())
    print(f"div: {done} in-domain pairs in {time.time() - t0:.1f} s: {bad} mismatches"
          + (f"; first (m, d, fast, ieee): {first}" if first else "")
          + f"; full-range sample of {m.numel()}: {outside} mismatches outside the domain "
          f"(fallback there)", flush=True)
    return bad


def check_kernel(dev, n: int, steps: int) -> int:
    from fullstack_fp4.optim.q_adamw.codecs import padded_numel
    from fullstack_fp4.optim.q_adamw.optimizer import _hyper, _init_state, _kernel_views
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    gen = torch.Generator(device=dev).manual_seed(7)
    npad = padded_numel(n)
    p = torch.randn(n, device=dev, generator=gen)
    st = _init_state(n, dev)
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    bad = 0
    for t in range(1, steps + 1):
        g = torch.randn(n, device=dev, generator=gen) * \
            torch.exp(3 * torch.randn(n, device=dev, generator=gen))
        g[1000:5000] = 0.0
        g[::100003] = 1e25          # v > 2^64: those programs take the fallback
        g[7::200003] = 1e-30        # tiny v / m
        for a, b, fast in ((p, st, False), (p2, st2, True)):
            launch(a, g, _kernel_views(b), n, npad, seed=3, fast_ieee=fast,
                   **_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t, dev))
        nb = int((~_same(p, p2)).sum()) + sum(int((st[k] != st2[k]).sum()) for k in st)
        print(f"kernel step {t}: {n} entries, FAST_IEEE on vs off: {nb} differing "
              f"params/state elements", flush=True)
        bad += nb
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--div-pairs", type=float, default=1.0e9)
    ap.add_argument("--kernel-n", type=float, default=1.0e7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk", type=float, default=2 ** 27)
    ap.add_argument("--self-test", action="store_true",
                    help="tiny sizes (CPU interpreter): sqrt on a sample, 2e4 division pairs")
    args = ap.parse_args(argv)
    dev = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
    if dev == "cpu" and not INTERP:
        print("no GPU: run with TRITON_INTERPRET=1 (and --self-test)")
        return 2
    if args.self_test:
        bad = check_sqrt(dev, 1 << 14, 1 << 14)
        bad += check_div(dev, 20_000, 1 << 13)
        bad += check_kernel(dev, 5000, 2)
    else:
        bad = check_sqrt(dev, int(args.chunk), None)
        bad += check_div(dev, int(args.div_pairs), int(args.chunk))
        bad += check_kernel(dev, int(args.kernel_n), args.steps)
    print("FAST_IEEE check:", "OK (0 mismatches)" if bad == 0 else f"FAILED ({bad} mismatches)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
