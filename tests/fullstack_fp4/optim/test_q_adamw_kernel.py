"""Fused Triton step vs the PyTorch reference, same uniforms: bit-identical (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the interpreter (set before triton loads); never on a GPU,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # where it would turn every later kernel into Python
triton = pytest.importorskip("triton")

from fullstack_fp4.optim.q_adamw.codecs import padded_numel  # noqa: E402
from fullstack_fp4.optim.q_adamw.optimizer import (kernel_hyper, kernel_views,  # noqa: E402
                                                   q_adamw_step_reference)
from fullstack_fp4.optim.q_adamw.state import init_state  # noqa: E402
from fullstack_fp4.optim.q_adamw import triton_rows as ts  # noqa: E402
from fullstack_fp4.optim.q_adamw.triton_step import recip_table  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter or a GPU")
@pytest.mark.parametrize("n,phase,fast_dec", [(1500, 0, False), (2048 + 33, 960, True)])
def test_kernel_matches_reference_bit_for_bit(n, phase, fast_dec):
    """phase 960: the tensor starts 64 entries before a chunk boundary (a distributed-optimizer
    piece), so the first program sees 60 rows before the tensor and the chunk scales shift."""
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
        else "cpu"
    gen = torch.Generator().manual_seed(n)
    npad = padded_numel(n)
    p = torch.randn(n, generator=gen).to(dev)
    st = init_state(n, dev, phase)
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    for t in range(1, 4):
        # heavy-tailed gradients, a zero run and a huge entry
        g = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen)))
        g[100:140] = 0.0
        g[7] = 1e15
        g = g.to(dev)
        u = torch.rand(npad, generator=gen).to(dev)
        q_adamw_step_reference(p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, step=t, rand=u, phase=phase)
        launch(p2, g, kernel_views(st2), n, npad, seed=1, rand=u, phase=phase, row0=3,
               fast_dec=fast_dec,
               **kernel_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, t, dev))
        assert torch.equal(p, p2), t
        for k in st:
            assert torch.equal(st[k], st2[k]), (t, k)
    assert torch.isfinite(p2).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter or a GPU")
@pytest.mark.parametrize("u8,rounds", [(True, 10), (False, 7)])
def test_philox_path_matches_reference_with_kernel_uniforms(u8, rounds):
    """The default path draws its uniforms from Philox in the kernel (no ``rand``):
    ``kernel_uniforms`` (PyTorch Philox, an independent implementation of the stream) handed to
    the reference gives the same params and states bit for bit — for a piece that starts at row
    3 of its tensor (the counter is the whole tensor's row) on a shifted chunk grid. The
    reference with torch.rand uniforms must differ (the check can fail)."""
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
        else "cpu"
    from fullstack_fp4.optim.q_adamw.optimizer import kernel_uniforms
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    n, phase, row0, seed = 2048 + 33, 960, 3, 0x1234567
    gen = torch.Generator().manual_seed(7)
    npad = padded_numel(n)
    p = torch.randn(n, generator=gen).to(dev)
    st = init_state(n, dev, phase)
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    p3, st3 = p.clone(), {k: v.clone() for k, v in st.items()}
    for t in range(1, 3):
        g = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))).to(dev)
        u = kernel_uniforms(seed + t, npad, row0, u8=u8, rounds=rounds, device=dev)
        q_adamw_step_reference(p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, step=t, rand=u, phase=phase)
        q_adamw_step_reference(p3, g, st3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, step=t, phase=phase,
                               rand=torch.rand(npad, generator=gen).to(dev))
        launch(p2, g, kernel_views(st2), n, npad, seed=seed + t, phase=phase, row0=row0,
               u8=u8, rounds=rounds, **kernel_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, t, dev))
        assert torch.equal(p, p2), t
        for k in st:
            assert torch.equal(st[k], st2[k]), (t, k)
    assert not torch.equal(st["exp_avg_codes"], st3["exp_avg_codes"])


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="rcp.approx exists only in the compiled kernel (the interpreter divides "
                           "with div_rn)")
def test_approx_division_moves_only_p_within_its_bound():
    """``fast_div``: the update m'/d as m' · rcp.approx(d). m', v' and sqrt(v') do not depend on
    the division, so the states must stay the reference's bit for bit; p' may move by the
    update's extra error, |u|·2^-22 (rcp ≤ 1 ulp, the product's ½ ulp, the IEEE quotient's ½
    ulp), plus the two FMAs' roundings of p'. Each step starts from the reference's p (the bound is
    per step). Some p' must differ: the approximate path is really compiled in."""
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    n, phase, lr, wd = 2048 + 33, 960, 1e-2, 0.01
    gen = torch.Generator().manual_seed(11)
    npad = padded_numel(n)
    p = torch.randn(n, generator=gen).cuda()
    st = init_state(n, "cuda", phase)
    st2 = {k: v.clone() for k, v in st.items()}
    differ = 0
    for t in range(1, 4):
        g = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
        g[100:140] = 0.0
        g[7] = 1e15
        g, u = g.cuda(), torch.rand(npad, generator=gen).cuda()
        p_old, p2 = p.clone(), p.clone()
        q_adamw_step_reference(p, g, st, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=wd, step=t, rand=u, phase=phase)
        launch(p2, g, kernel_views(st2), n, npad, seed=1, rand=u, phase=phase, row0=3,
               fast_div=True, **kernel_hyper(lr, 0.9, 0.999, 1e-8, wd, t, "cuda"))
        for k in st:
            assert torch.equal(st[k], st2[k]), (t, k)
        # |p' − p·decay| = lr_t·|u| up to one rounding: doubled in the bound for that
        step_u = (p.double() - p_old.double() * (1 - lr * wd)).abs()
        ulp = (torch.nextafter(p.abs(), torch.full_like(p, float("inf"))) - p.abs()).double()
        diff = (p2.double() - p.double()).abs()
        # two FMA roundings, of p' and of the kernel's p' (up to a binade above): 2 ulp
        excess = diff - (step_u * 2.0 ** -21 + 2 * ulp)
        assert (excess <= 0).all(), (t, float(excess.max()))
        differ += int((diff > 0).sum())
    assert differ > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's path")
def test_approx_division_under_the_interpreter_is_the_ieee_step():
    """The interpreter cannot run rcp.approx (inline PTX): launch(fast_div=True) must fall back
    to div_rn there, i.e. give the reference's step bit for bit, not fail."""
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    n = 1500
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen)
    st = init_state(n, "cpu")
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    g = torch.randn(n, generator=gen)
    u = torch.rand(padded_numel(n), generator=gen)
    q_adamw_step_reference(p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.01, step=1, rand=u)
    launch(p2, g, kernel_views(st2), n, padded_numel(n), seed=1, rand=u, fast_div=True,
           **kernel_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, 1, "cpu"))
    assert torch.equal(p, p2)
    assert all(torch.equal(st[k], st2[k]) for k in st)


def test_kernel_uniforms_layout():
    """Hand-checked layout of ``kernel_uniforms``: row r's bytes (8-bit) / halves (16-bit) of
    Philox(counter 2r[+1]) in order, and a piece at row0 is the whole tensor's stream sliced."""
    from fullstack_fp4.nvfp4.sr_stream import philox4x32_10
    from fullstack_fp4.optim.q_adamw.optimizer import kernel_uniforms
    seed = (5 << 32) | 77
    whole = kernel_uniforms(seed, 64)
    assert torch.equal(kernel_uniforms(seed, 32, row0=2), whole[32:])
    w = [int(x) for x in philox4x32_10(torch.tensor([2]), torch.tensor([0]), 77, 5)]
    want = [((w[j // 4] >> (8 * (j % 4))) & 255) + 0.5 for j in range(16)]
    assert whole[16:32].tolist() == [x / 256 for x in want]
    w = [int(x) for c in (6, 7)
         for x in philox4x32_10(torch.tensor([c]), torch.tensor([0]), 77, 5)]
    want = [(w[j // 2] >> (16 * (j % 2))) & 0xFFFF for j in range(16)]
    assert kernel_uniforms(seed, 64, u8=False)[48:].tolist() == [x / 65536 for x in want]
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel_uniforms(seed, 40)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter or a GPU")
@pytest.mark.parametrize("n,phase", [(1500, 0), (2048 + 33, 960)])
def test_kernel_model_out_is_the_bf16_cast_of_p(n, phase):
    """``model_out``: the kernel also writes p_new.to(bfloat16) bit for bit, into exactly the n
    entries of the destination (phase 960: a distributed-optimizer piece whose first program
    starts 60 rows before it — nothing may be written there), and changes nothing else: p and
    the states are the reference's, which writes the same BF16 values (``copy_``)."""
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
        else "cpu"
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    gen = torch.Generator().manual_seed(n + 1)
    npad = padded_numel(n)
    p = torch.randn(n, generator=gen).to(dev)
    st = init_state(n, dev, phase)
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    # the destination is a slice of a larger BF16 buffer (the model param / param buffer)
    guard = torch.full((n + 2000,), -7.0, dtype=torch.bfloat16, device=dev)
    out_ref = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    for t in range(1, 4):
        g = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))).to(dev)
        u = torch.rand(npad, generator=gen).to(dev)
        q_adamw_step_reference(p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, step=t, rand=u, phase=phase, model_out=out_ref)
        launch(p2, g, kernel_views(st2), n, npad, seed=1, rand=u, phase=phase, row0=3,
               model_out=guard[1000:1000 + n],
               **kernel_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, t, dev))
        assert torch.equal(p, p2), t
        for k in st:
            assert torch.equal(st[k], st2[k]), (t, k)
        want = p2.to(torch.bfloat16).view(torch.int16)
        assert torch.equal(guard[1000:1000 + n].view(torch.int16), want), t
        assert torch.equal(out_ref.view(torch.int16), want), t
        assert (guard[:1000] == -7.0).all() and (guard[1000 + n:] == -7.0).all(), t


def test_launch_refuses_a_model_out_that_does_not_fit():
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    n = 64
    st = kernel_views(init_state(n, "cpu"))
    for bad in (torch.empty(n + 1, dtype=torch.bfloat16), torch.empty(n, dtype=torch.float16),
                torch.empty(2 * n, dtype=torch.bfloat16)[::2]):
        with pytest.raises(ValueError, match="model_out"):
            launch(torch.zeros(n), torch.zeros(n), st, n, n, seed=1, model_out=bad,
                   **kernel_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, 1, "cpu"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="checks the kernel's integer BF16 rounding in the interpreter")
def test_bf16_bits_is_torchs_cast():
    """_bf16_bits' integer RNE (what the interpreter runs, and the GPU with BF16_HW_CVT=False)
    == torch's FP32 -> BF16 cast, bits included: every tie with an even and an odd BF16 below,
    their FP32 neighbours, a tie that carries into the exponent, the largest finite values
    (round to ±Inf or to ±BF16_MAX), subnormals, ±0 and ±Inf; NaNs stay NaN (0x7FC0; torch's
    cast picks its own NaN payload) — including NaNs whose bits would carry into −0 or ±Inf."""
    import triton.language as tl

    @triton.jit
    def k(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, ts._bf16_bits(tl.load(x_ptr + i), False))

    gen = torch.Generator().manual_seed(9)
    hi = torch.randint(0, 1 << 16, (4096,), generator=gen, dtype=torch.int64)
    ties = (hi << 16) | 0x8000                               # exactly halfway, both parities
    bits = torch.cat([ties, ties - 1, ties + 1, (hi << 16),
                      torch.randint(-2 ** 31, 2 ** 31, (4096,), generator=gen),
                      torch.tensor([0x3F7F8000, 0x3F80_8000, 0x7F7F8000, 0x7F7F7FFF, 0x7F7FFFFF,
                                    0x00008000, 0x00018000, 0x00000001, 0x0000FFFF, 0,
                                    0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                                    0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF,
                                    0x7F807FFF, 0x7F808000, 0xFF7FFFFF])])
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    N = 1 << (bits.numel() - 1).bit_length()
    x = torch.cat([bits, torch.zeros(N - bits.numel(), dtype=torch.int32)]).view(torch.float32)
    out = torch.empty(N, dtype=torch.int16)
    k[(1,)](x, out, N=N)
    want = x.to(torch.bfloat16).view(torch.int16)
    nan = torch.isnan(x)
    assert torch.equal(out[~nan], want[~nan])
    assert (out[nan] == 0x7FC0).all() and nan.sum() >= 6


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="checks the kernel's rounding helpers in the interpreter")
def test_rounding_helpers_match_nvfp4_and_torch():
    """The kernel's branch-free E2M1/E4M3 rounding == nvfp4.e2m1's thresholds / torch's cast,
    on every grid point, every midpoint (tie) and their FP32 neighbours."""
    import triton.language as tl

    from fullstack_fp4.nvfp4.e2m1 import e2m1_round_nearest, e2m1_round_stochastic

    @triton.jit
    def k(a_ptr, u_ptr, x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a = tl.load(a_ptr + i)
        x = tl.load(x_ptr + i)
        u = tl.load(u_ptr + i)
        tl.store(o_ptr + i, ts._rtn_code(a).to(tl.float32))
        tl.store(o_ptr + N + i, ts._rtn_val(a))
        tl.store(o_ptr + 2 * N + i, ts._sr_code(a, ts._dither(u)).to(tl.float32))
        v, c = ts._e4m3_rne(x)
        tl.store(o_ptr + 3 * N + i, v)
        tl.store(o_ptr + 4 * N + i, c.to(tl.float32))

    def around(pts):
        pts = torch.tensor(sorted(set(pts)), dtype=torch.float32)
        up = torch.nextafter(pts, torch.tensor(float("inf")))
        dn = torch.nextafter(pts, torch.tensor(float("-inf")))
        return torch.cat([pts, up, dn])

    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m = ((e4[1:] + e4[:-1]) / 2).tolist()
    a = around(grid + mids).clamp(0.0, 6.0)
    a = torch.cat([a, torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 6.0])
    x = around(e4.tolist() + e4m).clamp(0.0, 448.0)
    x = torch.cat([x, torch.rand(2048, generator=torch.Generator().manual_seed(2)) * 448.0,
                   torch.rand(2048, generator=torch.Generator().manual_seed(3)) * 0.05])
    N = 1 << (max(a.numel(), x.numel()) - 1).bit_length()
    a = torch.cat([a, torch.zeros(N - a.numel())])
    x = torch.cat([x, torch.zeros(N - x.numel())])
    u = torch.rand(N, generator=torch.Generator().manual_seed(1))
    out = torch.empty(5 * N)
    k[(1,)](a, u, x, out, N=N)
    code, val, sr, e4v, e4c = out.view(5, N)
    ref = e2m1_round_nearest(a).float()
    assert torch.equal(code, ref)
    grid_t = torch.tensor(grid)
    assert torch.equal(val, grid_t[ref.long()])
    assert torch.equal(sr, _sr_oracle(a, u).float())
    on23 = (a >= 1.0) | (a * 2.0 ** 23 == torch.round(a * 2.0 ** 23))
    assert torch.equal(sr[on23], e2m1_round_stochastic(a[on23], u[on23]).float())
    q = x.to(torch.float8_e4m3fn)
    assert torch.equal(e4v, q.float())
    assert torch.equal(e4c, q.view(torch.uint8).float())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="checks the kernel's decode in the interpreter")
@pytest.mark.parametrize("fast", [False, True])
def test_decode_rows_all_codes_scales_extreme_decs(fast):
    """_decode_rows (nibble trick with 2^126 and the inverse RHT's 1/4 split over s and the
    decode factor, or the select chain): the products x are exactly q · fp32(s) / 4 (· 2^-8 with
    the nibble trick), and x · _dec_factor(dec) == (q · (fp32(s) / 4)) · dec in torch — one
    rounding — for every 4-bit code × every finite E4M3 scale × chunk decode scales from the
    smallest subnormal to FP32_MAX / 1536 (the largest a chunk can have), subnormal results
    included; and == nvfp4's order ((q · s) · dec) · 1/4 wherever that stays normal and finite
    (it overflows for q · s · dec > FP32_MAX; the folded order does not)."""
    import triton.language as tl

    from fullstack_fp4.nvfp4.e2m1 import e2m1_decode

    @triton.jit
    def k(c_ptr, s_ptr, d_ptr, o_ptr, x_ptr, R: tl.constexpr, FAST: tl.constexpr):
        rows = tl.arange(0, R)
        q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15, d = \
            ts._decode_rows(c_ptr, s_ptr, d_ptr, rows, rows, R, FAST)
        d = ts._dec_factor(d, FAST)
        b = o_ptr + rows * 16
        tl.store(b + 0, q0 * d); tl.store(b + 1, q1 * d); tl.store(b + 2, q2 * d)
        tl.store(b + 3, q3 * d); tl.store(b + 4, q4 * d); tl.store(b + 5, q5 * d)
        tl.store(b + 6, q6 * d); tl.store(b + 7, q7 * d); tl.store(b + 8, q8 * d)
        tl.store(b + 9, q9 * d); tl.store(b + 10, q10 * d); tl.store(b + 11, q11 * d)
        tl.store(b + 12, q12 * d); tl.store(b + 13, q13 * d); tl.store(b + 14, q14 * d)
        tl.store(b + 15, q15 * d)
        b = x_ptr + rows * 16
        tl.store(b + 0, q0); tl.store(b + 1, q1); tl.store(b + 2, q2); tl.store(b + 3, q3)
        tl.store(b + 4, q4); tl.store(b + 5, q5); tl.store(b + 6, q6); tl.store(b + 7, q7)
        tl.store(b + 8, q8); tl.store(b + 9, q9); tl.store(b + 10, q10); tl.store(b + 11, q11)
        tl.store(b + 12, q12); tl.store(b + 13, q13); tl.store(b + 14, q14)
        tl.store(b + 15, q15)

    R = 64 * 64                                   # 64 chunks of 64 rows
    gen = torch.Generator().manual_seed(7)
    codes = torch.arange(16, dtype=torch.uint8)
    codes = ((codes[1::2] << 4) | codes[0::2]).repeat(R)          # every code in every row
    sc = (torch.arange(R) % 127).to(torch.uint8)                   # every finite E4M3 >= 0
    fmax = torch.finfo(torch.float32).max
    dec = torch.exp2(torch.rand(64, generator=gen, dtype=torch.float64) * 260 - 140).float()
    dec[:10] = torch.tensor([0.0, 1.4e-45, 2.9e-39, 1 / fmax, 2.0 ** -126, 1.0, 2.0 ** 100,
                             fmax / 2688, fmax / 1536, 1.5e35])
    dec = dec.clamp(max=fmax / 1536)
    out = torch.empty(R * 16)
    xs = torch.empty(R * 16)
    k[(1,)](codes, sc, dec, out, xs, R=R, FAST=fast)
    q = e2m1_decode(torch.stack([codes & 15, codes >> 4], -1).reshape(-1)).view(R, 16)
    sf = sc.view(torch.float8_e4m3fn).float()[:, None]
    x64 = q.double() * sf.double() / 4                             # exact
    assert torch.equal(xs.view(R, 16).double() * (256.0 if fast else 1.0), x64)
    d = dec.repeat_interleave(64)[:, None]
    ref = (q * (sf * 0.25)) * d
    assert torch.equal(out.view(R, 16).view(torch.int32), ref.view(torch.int32))
    assert torch.equal(ref, (x64 * d.double()).float())            # one rounding of the exact
    assert (ref.abs() < 2.0 ** -126).any() and (ref != 0).any()
    other_order = ((q * sf) * d) * 0.25
    normal = (other_order.abs() >= 2.0 ** -126) & torch.isfinite(other_order)
    assert torch.equal(ref[normal], other_order[normal])
    assert torch.isinf(other_order).any() and torch.isfinite(ref).all()   # q · s · dec > FP32_MAX


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="checks the kernel's row encoders in the interpreter")
def test_encode_rows_match_reference_on_edge_blocks():
    """encode46 (m: SR) / _encode_v == codecs._quantize_chunked (4/6 + SR, "4" + RTN) bit for bit on
    chunks with edge blocks: all zero, subnormal, a block whose 6-candidate E4M3 scale
    underflows to 0 while the 4-candidate's does not (the 4/6 rule must then pick 4), blocks
    across 2^-40..1 of the chunk amax, and chunks of amax 1e38 / 1e-38 / 0."""
    import triton.language as tl

    from fullstack_fp4.optim.q_adamw.codecs import _quantize_chunked

    @triton.jit
    def k(y_ptr, u_ptr, o_ptr, tab_ptr, R: tl.constexpr):
        rows = tl.arange(0, R)
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = ts._ld16(
            y_ptr, rows, R * 16, 0.0)
        u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11, u12, u13, u14, u15 = ts._ld16(
            u_ptr, rows, R * 16, 0.0)
        w0, w1, sc, dec = ts.encode46(
            y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
            ts._dither(u0), ts._dither(u1), ts._dither(u2), ts._dither(u3), ts._dither(u4),
            ts._dither(u5), ts._dither(u6), ts._dither(u7), ts._dither(u8), ts._dither(u9),
            ts._dither(u10), ts._dither(u11), ts._dither(u12), ts._dither(u13),
            ts._dither(u14), ts._dither(u15), tab_ptr, R, True)
        tl.store(o_ptr + rows * 4, w0)
        tl.store(o_ptr + rows * 4 + 1, w1)
        tl.store(o_ptr + rows * 4 + 2, sc)
        tl.store(o_ptr + R * 4 + tl.arange(0, R // 64), dec.to(tl.int32, bitcast=True))
        w0, w1, sc, dec = ts._encode_v(
            y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, tab_ptr, R)
        b = o_ptr + R * 4 + R // 64
        tl.store(b + rows * 4, w0)
        tl.store(b + rows * 4 + 1, w1)
        tl.store(b + rows * 4 + 2, sc)
        tl.store(b + R * 4 + tl.arange(0, R // 64), dec.to(tl.int32, bitcast=True))

    gen = torch.Generator().manual_seed(11)
    R = 64 * 4
    y = torch.randn(R, 16, generator=gen)
    y *= torch.exp2(-40 * torch.rand(R, 1, generator=gen))           # blocks across 2^-40..1
    y[0:64:8] *= 0.0                                                  # zero blocks
    y[1:64:8] = torch.randn(8, 16, generator=gen) * 1e-41            # subnormal blocks
    y[2, 0] = 1536.0                                                  # chunk 0: amax 1536, enc 1
    y[3:64:8] = torch.rand(8, 16, generator=gen) * 0.005             # bamax·enc in (2^-8, 6·2^-10]:
    y[3:64:8, 0] = torch.linspace(0.0040, 0.0058, 8)                 # s6 = 0, s4 = 2^-9
    y[64:128] *= 1e38 / y[64:128].abs().max()
    y[128:192] *= 1e-38 / y[128:192].abs().max()
    y[192:256] = 0.0
    y = y.reshape(-1)
    u = torch.rand(R * 16, generator=gen)
    out = torch.zeros(2 * (R * 4 + R // 64), dtype=torch.int32)
    k[(1,)](y, u, out, recip_table("cpu"), R=R)
    for half, (rule, rand) in enumerate((("4over6", u), ("4", None))):
        o = out[half * (R * 4 + R // 64):(half + 1) * (R * 4 + R // 64)]
        codes, bs, dec = _quantize_chunked(y, rule, rand)
        assert torch.equal(o[:R * 4].view(R, 4)[:, :2].contiguous().view(torch.uint8).reshape(-1),
                           codes), rule
        assert torch.equal(o[:R * 4].view(R, 4)[:, 2].to(torch.uint8), bs.view(torch.uint8)), rule
        assert torch.equal(o[R * 4:].view(torch.float32), dec), rule
        # the s6-underflow blocks: 4/6 took the 4-candidate, the "4" rule has only it (the
        # nonzero scale 2^-9)
        assert (bs.view(torch.uint8)[3:64:8] == 1).all() and (codes.view(R, 8)[3:64:8] != 0).any()


def _sr_oracle(a, u):
    """Independent SR oracle for a in [0, 6]: a < 1 rounded to nearest-even on 2^-23 in FP64
    (torch.round: half to even), then nvfp4.e2m1's threshold rule (u < frac, frac exact)."""
    from fullstack_fp4.nvfp4.e2m1 import e2m1_round_stochastic
    a64 = a.double()
    ar = torch.where(a64 < 1.0, torch.round(a64 * 2.0 ** 23) / 2.0 ** 23, a64).float()
    return e2m1_round_stochastic(ar, u)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="checks the kernel's rounding helpers in the interpreter")
def test_sr_code_and_dithers_exhaustive_thresholds():
    """_sr_code with every dither source (FP32 uniforms via _dither, 16-bit Philox halves via
    _u16, centred 8-bit bytes via _u8) == the threshold rule on u = K / 2^22: on every a whose
    fraction is at a threshold of the uniform grid (u = frac exactly, and one step of u either
    side), on the 2^-23 rounding ties below 1, on tiny and subnormal a, and on random a; and
    codecs.sr_codes (the reference) == the same oracle, signs included."""
    import triton.language as tl

    from fullstack_fp4.optim.q_adamw.codecs import sr_codes

    @triton.jit
    def k(a_ptr, u_ptr, r_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a = tl.load(a_ptr + i)
        u = tl.load(u_ptr + i)
        r = tl.load(r_ptr + i).to(tl.uint32, bitcast=True)
        tl.store(o_ptr + i, ts._sr_code(a, ts._dither(u)))
        d0, d1 = ts._u16(r)
        tl.store(o_ptr + N + i, ts._sr_code(a, d0))
        tl.store(o_ptr + 2 * N + i, ts._sr_code(a, d1))
        e0, e1, e2, e3 = ts._u8(r)
        tl.store(o_ptr + 3 * N + i, ts._sr_code(a, e0))
        tl.store(o_ptr + 4 * N + i, ts._sr_code(a, e3))

    gen = torch.Generator().manual_seed(5)
    N = 1 << 14
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    lo_i = torch.randint(0, 7, (N,), generator=gen)
    step = grid[lo_i + 1] - grid[lo_i]
    kk = torch.randint(0, 1 << 16, (N,), generator=gen)
    # a whose fraction is k / 2^16 (the threshold of the 16-bit uniform k) or a neighbour
    a = grid[lo_i] + step * (kk.double() / 2.0 ** 16).float()
    a = torch.where(torch.arange(N) % 3 == 1, torch.nextafter(a, torch.tensor(7.0)), a)
    a = torch.where(torch.arange(N) % 3 == 2, torch.nextafter(a, torch.tensor(-1.0)), a)
    sel = torch.arange(N) % 8
    # 2^-23 ties below 1 (odd multiples of 2^-24 in [0, 0.5)), tiny and subnormal values
    tie = (torch.randint(0, 1 << 22, (N,), generator=gen) * 2 + 1).double() * 2.0 ** -24
    a = torch.where(sel == 3, tie.float(), a)
    a = torch.where(sel == 4, torch.rand(N, generator=gen) * 2.0 ** -20, a)
    a = torch.where(sel == 5, torch.rand(N, generator=gen) * 1e-40, a)
    a = torch.where(sel == 6, torch.rand(N, generator=gen) * 6.0, a).clamp(0.0, 6.0)
    a[:8] = grid
    a[8] = 0.0
    # uniforms: 16-bit halves k (lo) / k2 (hi) of r; FP32 u = k / 2^16, or random FP32
    k2 = torch.randint(0, 1 << 16, (N,), generator=gen)
    r = (kk | (k2 << 16)).to(torch.int64)
    r = torch.where(r >= 2 ** 31, r - 2 ** 32, r).to(torch.int32)
    u = torch.where(sel == 7, torch.rand(N, generator=gen), (kk.double() / 2.0 ** 16).float())
    out = torch.empty(5 * N, dtype=torch.int32)
    k[(1,)](a, u, r, out, N=N)
    o = out.view(5, N).long()
    assert torch.equal(o[0], _sr_oracle(a, u).long())
    assert torch.equal(o[1], _sr_oracle(a, (kk.double() / 2.0 ** 16).float()).long())
    assert torch.equal(o[2], _sr_oracle(a, (k2.double() / 2.0 ** 16).float()).long())
    # 8-bit: the centred grid (k + ½) / 2^8 of the linear's stream (nvfp4.sr_stream)
    assert torch.equal(o[3], _sr_oracle(a, (((kk & 255).double() + 0.5) / 256).float()).long())
    assert torch.equal(o[4], _sr_oracle(a, (((k2 >> 8).double() + 0.5) / 256).float()).long())
    # the reference, signed (negative values get bit 3, -0.0 does not)
    y = torch.where(torch.arange(N) % 2 == 0, a, -a)
    y[8] = -0.0
    ref = _sr_oracle(a, u) | ((y < 0).to(torch.uint8) << 3)
    assert torch.equal(sr_codes(y, u), ref)
    assert sr_codes(y, u)[8] == 0


def test_kernel_signs_are_nvfp4s():
    from fullstack_fp4.nvfp4.hadamard import DEFAULT_SIGNS
    assert ts._SIGNS == tuple(int(v) for v in DEFAULT_SIGNS)
