"""Q-AdamW codecs: round trips, error vs direct NVFP4, the guard, extreme values, padding."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "studies"))

from fullstack_fp4.optim import (decode_exp_avg, decode_exp_avg_sq, encode_exp_avg,  # noqa: E402
                                 encode_exp_avg_sq, state_bytes_per_param)
from fullstack_fp4.optim.q_adamw.codecs import bf16_toward_zero  # noqa: E402
from q_adamw_error_table import direct_nvfp4, synthetic_moments  # noqa: E402


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def moments():
    # synthetic_moments draws its Student-t noise from the global RNG: pin it, so the moments
    # do not depend on which tests ran before (the pipeline/direct error ratio is 0.32-0.42
    # over global seeds 1000-1007; one unpinned run in five came out above the 0.5 target)
    with torch.random.fork_rng():
        torch.manual_seed(1000)
        return synthetic_moments(1 << 14, steps=60, structured=True)


def test_exp_avg_round_trip_heavy_tailed():
    g = torch.Generator().manual_seed(1)
    m = torch.distributions.StudentT(2.0).sample((5000,)) * 1e-3
    st = encode_exp_avg(m, generator=g)
    mh = decode_exp_avg(st)
    assert mh.shape == m.shape and torch.isfinite(mh).all()
    # NVFP4 with SR on RHT-mixed blocks: ~10-20% relative L2 error; 0.3 catches a broken codec.
    assert _rel(mh, m) < 0.3
    # 5000 entries pad to 79 tiles of 64
    assert st.codes.dtype == torch.uint8 and st.codes.numel() == 5056 // 2


def test_exp_avg_stochastic_rounding_is_unbiased():
    m = torch.linspace(-1, 1, 4096) ** 3
    acc = torch.zeros(4096, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    k = 200
    for _ in range(k):
        acc += decode_exp_avg(encode_exp_avg(m, generator=g)).double()
    one = decode_exp_avg(encode_exp_avg(m, generator=g))
    # the average of k independent SR decodes is ~sqrt(k) times closer than one decode
    assert _rel(acc / k, m) < 0.25 * _rel(one, m)


def test_exp_avg_sq_round_trip_lognormal_and_student_t():
    g = torch.Generator().manual_seed(2)
    for v in (torch.exp(2.0 * torch.randn(6000, generator=g)) * 1e-6,
              (torch.distributions.StudentT(3.0).sample((6000,)) * 1e-3) ** 2):
        vh = decode_exp_avg_sq(encode_exp_avg_sq(v))
        assert (vh >= 0).all() and torch.isfinite(vh).all()
        assert _rel(vh.sqrt(), v.sqrt()) < 0.2


def test_second_moment_error_vs_direct_nvfp4(moments):
    """Pipeline vs direct NVFP4 of v on heavy-tailed (row×col×lognormal, t3) moments.

    Measured on sqrt(v), the quantity Adam divides by: 66% lower here (0.080 against 0.234;
    target ≥ 50%). On v itself (relL2, dominated by the largest entries) the two are closer
    (0.028 against 0.039 here; README.md has draws where direct NVFP4 is better on v).
    """
    m, v = moments
    vp = decode_exp_avg_sq(encode_exp_avg_sq(v))
    vd = direct_nvfp4(v)
    e_pipe = _rel(vp.sqrt(), v.sqrt())
    e_direct = _rel(vd.clamp(min=0).sqrt(), v.sqrt())
    assert e_pipe < 0.5 * e_direct, (e_pipe, e_direct)


def test_second_moment_error_vs_direct_nvfp4_iid_over_draws():
    """The same on the iid lognormal-σ set, the harder one, as a mean over four pinned draws of
    32,768 entries (benchmarks/studies/q_adamw_iid_floor.py's: global seed, then the set): the codec's
    sqrt(v) error is below half of direct NVFP4's (measured 0.485); codec version 1 (6-rule,
    32-entry tiles) on the same draws is not (0.572), so the test tells the two apart."""
    ratios = {"version 2": [], "version 1": []}
    for seed in range(4):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            _, v = synthetic_moments(1 << 15, seed=seed, structured=False)
        s = v.double().sqrt()
        direct = _rel(direct_nvfp4(v).clamp(min=0).sqrt(), s)
        for name, kw in (("version 2", {}), ("version 1", {"tile": 32, "scale_rule": "6"})):
            vh = decode_exp_avg_sq(encode_exp_avg_sq(v, **kw))
            ratios[name].append(_rel(vh.sqrt(), s) / direct)
    mean = {k: sum(r) / len(r) for k, r in ratios.items()}
    assert mean["version 2"] < 0.5 < mean["version 1"], mean


def test_update_error_vs_direct_nvfp4(moments):
    m, v = moments
    u = m.double() / (v.double().sqrt() + 1e-8)

    def uerr(vh):
        return _rel(m.double() / (vh.double().clamp(min=0).sqrt() + 1e-8), u)

    e_pipe = uerr(decode_exp_avg_sq(encode_exp_avg_sq(v)))
    e_direct = uerr(direct_nvfp4(v))
    assert e_pipe < 1.0 and e_direct > 100 * e_pipe, (e_pipe, e_direct)


def test_guard_entry_far_below_tile_mean():
    """One entry 1e-6 of its tile's others: its update must not blow up (it does unguarded)."""
    v = torch.full((1024,), 1.0)
    v[7::32] = 4.0 + torch.arange(32.0)  # some spread in every tile
    small = torch.arange(3, 1024, 32)
    v[small] = 1e-12                      # sqrt: 1e-6 vs ~1
    m = torch.full((1024,), 1e-3)
    u = m / (v.sqrt() + 1e-8)
    st = encode_exp_avg_sq(v)
    u_g = m / (decode_exp_avg_sq(st).sqrt() + 1e-8)
    u_none = m / (decode_exp_avg_sq(st, guard="none").sqrt() + 1e-8)
    assert torch.isfinite(u_g).all()
    # guarded: no update beyond the codec's ordinary error (measured max 1.74× here, on the
    # large entries of a tile; the tiny ones get ~1e-6 of theirs, i.e. much smaller)
    assert (u_g <= 2.5 * u).all()
    assert (u_g[small] <= 1e-2).all()
    # the test can fail: without the guard the same state gives ~1e5-times larger updates
    assert (u_none[small] > 10 * u_g[small]).any()


@pytest.mark.parametrize("val", [0.0, 1e-30, 1e30, 1e-45, 3e38])
def test_extreme_values_no_nan_inf(val):
    v = torch.full((200,), val)
    v[64:128] = 0.0         # one whole tile of zeros (zeros inside a non-zero tile get μ/4)
    vh = decode_exp_avg_sq(encode_exp_avg_sq(v))
    mh = decode_exp_avg(encode_exp_avg(v.sqrt() * torch.where(torch.arange(200) % 2 == 0, 1, -1),
                                       generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(vh).all() and (vh >= 0).all() and torch.isfinite(mh).all()
    assert (vh[64:128] == 0).all()
    if 0 < val < 1e38:
        assert _rel(vh, v) < 0.05 and _rel(mh.abs(), v.sqrt()) < 0.3


def test_zeros_decode_to_zero():
    z = torch.zeros(777)
    assert (decode_exp_avg_sq(encode_exp_avg_sq(z)) == 0).all()
    assert (decode_exp_avg(encode_exp_avg(z, generator=torch.Generator())) == 0).all()


@pytest.mark.parametrize("n", [1, 17, 1000, 1025, 3000])
def test_any_length_and_padding_never_leaks(n):
    g = torch.Generator().manual_seed(n)
    v = torch.rand(n, generator=g) + 0.1
    m = torch.randn(n, generator=g)
    sv = encode_exp_avg_sq(v)
    npad = -(-n // 64) * 64         # the 64-entry tile (codecs.TILE)
    assert sv.codes.numel() == npad // 2 and sv.tile_mean.numel() == npad // 64
    # the last tile's mean is over the real entries only (padding is not averaged in)
    last = v[(npad // 64 - 1) * 64:].sqrt()
    assert abs(float(sv.tile_mean[-1]) - float(last.mean())) <= 0.01 * float(last.mean())
    # a prefix's codes don't depend on what follows the real entries
    rand = torch.rand(npad + 64, generator=g)
    a = encode_exp_avg(m, rand=rand)
    b = encode_exp_avg(torch.cat([m, torch.randn(40, generator=g)]), rand=rand)
    full_blocks = (n // 16) * 16 if n % 64 else n
    if n >= CHUNK_FULL:
        assert torch.equal(a.codes[: full_blocks // 2][:512], b.codes[: full_blocks // 2][:512])
    assert decode_exp_avg(a).numel() == n and decode_exp_avg_sq(sv).numel() == n


CHUNK_FULL = 1024


def test_bf16_toward_zero_is_a_lower_bound():
    x = torch.rand(10000) * torch.exp(10 * torch.randn(10000))
    f = bf16_toward_zero(x).float()
    assert (f <= x).all() and (f >= x * (1 - 2 ** -7)).all()


def test_bytes_per_param_under_budget():
    assert state_bytes_per_param(3072 * 3072) < 1.2
    st_m = encode_exp_avg(torch.zeros(1 << 16), generator=torch.Generator())
    st_v = encode_exp_avg_sq(torch.zeros(1 << 16))
    assert (st_m.nbytes() + st_v.nbytes()) / (1 << 16) == pytest.approx(
        state_bytes_per_param(1 << 16))


def _fma_oracle(a: float, b: float, c: float) -> int:
    """FP32 bits of RN(a·b + c) from exact rational arithmetic: the nearest of the FP32
    neighbours of the exact value, ties to the even significand (finite, nonzero results)."""
    import struct
    from fractions import Fraction

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    x = struct.unpack("<i", struct.pack("<f", float(exact)))[0]   # within an ulp of the result

    def val(bits):
        return Fraction(struct.unpack("<f", struct.pack("<i", bits))[0])
    cands = [x - 1, x, x + 1] if exact > 0 else [x + 1, x, x - 1]
    return min(cands, key=lambda k: (abs(val(k) - exact), k & 1))


def test_fma_rn_is_one_rounding():
    """codecs._fma_rn (the reference's fused multiply-add, the kernel's FFMA) == the correctly
    rounded a·b + c of an exact rational oracle: on sums that land within 2^-40 relative of an
    FP32 rounding midpoint (where FP64 then FP32 rounds twice: the naive form is wrong on some,
    checked), on cancelling sums, and on random operands across 2^±30."""
    from fullstack_fp4.optim.q_adamw.codecs import _fma_rn

    gen = torch.Generator().manual_seed(5)
    n = 4000
    a = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen))
    b = torch.randn(n, generator=gen)
    c = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen))
    c[: n // 4] = (-(a[: n // 4].double() * b[: n // 4].double())).float()   # cancellation
    # products x² = 1 + 2^-11 + 2^-24 (x = 1 + 2^-12): an FP32 midpoint; c = ±2^-k tips it
    k = torch.randint(40, 90, (n // 4,), generator=gen).double()
    sign = torch.where(torch.rand(n // 4, generator=gen) < 0.5, -1.0, 1.0).double()
    a[n // 4: n // 2] = 1 + 2.0 ** -12
    b[n // 4: n // 2] = 1 + 2.0 ** -12
    c[n // 4: n // 2] = (sign * torch.exp2(-k)).float()
    r = _fma_rn(a, b, c).view(torch.int32)
    want = torch.tensor([_fma_oracle(float(x), float(y), float(z))
                         for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())],
                        dtype=torch.int32)
    ok = r != 0        # exact zeros (exact products, first quarter): signed zeros checked below
    assert torch.equal(r[ok], want[ok])
    assert (_fma_rn(a[: n // 4], b[: n // 4], c[: n // 4]).abs()
            <= (a[: n // 4].double() * b[: n // 4].double() * 2.0 ** -24).abs().float()).all()
    naive = (a.double() * b.double() + c.double()).float().view(torch.int32)
    assert (naive[ok] != want[ok]).any()      # the double rounding the round-to-odd avoids
    # hand-computed: (1 + 2^-12)² + 2^-70 rounds up, − 2^-70 down; signed zeros; inf passes
    x = 1 + 2.0 ** -12
    r = _fma_rn(torch.tensor([x, x, 0.0, -0.0]), torch.tensor([x, x, 1.0, 1.0]),
                torch.tensor([2.0 ** -70, -2.0 ** -70, -0.0, -0.0]))
    assert r[0].item() == 1 + 2.0 ** -11 + 2.0 ** -23 and r[1].item() == 1 + 2.0 ** -11
    assert r[2].item() == 0.0 and not r[2].signbit() and r[3].signbit()
    assert _fma_rn(torch.tensor([float("inf")]), 1.0, 1.0).isinf().all()


def test_decode_is_one_rounding_of_the_exact_value():
    """decode_exp_avg == fp32(H16 · (q · s / 4) · signs · d) and decode_exp_avg_sq's
    r̂ + μ == fp32(that + μ), the inner value exact in FP64 (an independent oracle: the
    Sylvester matrix, not the butterfly) — the inverse RHT is exact and rounds nothing; the
    chunks span amaxes 1e-30 .. 1e30 so the decode scales do too."""
    from fullstack_fp4.nvfp4.e2m1 import e2m1_decode, unpack_codes
    from fullstack_fp4.nvfp4.hadamard import DEFAULT_SIGNS
    from fullstack_fp4.optim.q_adamw.codecs import CHUNK, REL_FLOOR

    gen = torch.Generator().manual_seed(3)
    n = 8 * CHUNK
    x = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
    x *= torch.logspace(-30, 30, 8).repeat_interleave(CHUNK)
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(DEFAULT_SIGNS, dtype=torch.float64)

    def exact(st):
        q = e2m1_decode(unpack_codes(st.codes)).double().view(-1, 16)
        s = st.block_scale.float().double()[:, None] / 4
        d = st.chunk_scale.double().repeat_interleave(CHUNK)
        return ((q * s) @ h * signs).reshape(-1) * d           # h symmetric: rows · h

    st = encode_exp_avg(x, generator=gen)
    assert torch.equal(decode_exp_avg(st), exact(st).float())
    sv = encode_exp_avg_sq(x.abs())
    mu = sv.tile_mean.double().repeat_interleave(64)
    sh = torch.maximum((exact(sv) + mu).float(), (mu * REL_FLOOR).float())
    fmax = torch.finfo(torch.float32).max
    assert torch.equal(decode_exp_avg_sq(sv), torch.clamp(sh * sh, max=fmax))


def _m_target(rule):
    return {"4over6": 1536.0, "6": 2688.0, "4": 1536.0}[rule]


def _amax_across_fp32(seed):
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-149, 128, (4000,), generator=g).double()
    a = (torch.rand(4000, generator=g, dtype=torch.float64) + 1.0) * torch.exp2(e - 1)
    return torch.cat([a, torch.tensor([0.0, 1e-45, 2.0 ** -126, 1.0, 3.4028234663852886e38],
                                      dtype=torch.float64)]).float()


@pytest.mark.parametrize("rule", ["4over6", "6", "4"])
def test_chunk_scales_decode_scale_first(rule):
    """codecs.chunk_scales against FP64 by hand: dec = fl(amax · fl(1/M)) clamped to
    [2^-126, 2^126], enc = fl(1/dec) (an FP64 product of two FP32s is exact and 1/dec in FP64
    never sits on an FP32 midpoint, so one rounding to FP32 is the correctly rounded result),
    over amax across all of FP32; and the property the rule is for: the chunk's largest block
    gets the E4M3 scale M/6 exactly (M/4 with the "4" rule, whose blocks map their max to 4;
    nvfp4.reference's candidate with this enc)."""
    from fullstack_fp4.nvfp4.reference import scale_candidate
    from fullstack_fp4.optim.q_adamw.codecs import chunk_scales
    M = _m_target(rule)
    a = _amax_across_fp32(5)
    enc, dec = chunk_scales(a, rule)
    inv_m = torch.tensor(1.0 / M, dtype=torch.float64).float().double()
    want_dec = (a.double() * inv_m).float().clamp(2.0 ** -126, 2.0 ** 126)
    assert torch.equal(dec, want_dec)
    assert torch.equal(enc, (1.0 / dec.double()).float())
    assert (dec[a == 0] == 2.0 ** -126).all() and torch.isfinite(enc).all()
    big = a.double() >= M * 2.0 ** -120          # enc far from the clamp and from overflow
    assert big.sum() > 3000
    x = a[big].view(-1, 1, 1)
    target = 4.0 if rule == "4" else 6.0
    s, _ = scale_candidate(x, x, enc[big].view(-1, 1, 1), dec[big].view(-1, 1, 1), target)
    assert (s.float() == M / target).all()


def test_recip_table_is_the_correctly_rounded_reciprocal():
    """triton_step.recip_table against FP64 by hand: entry c is fl(0.25 / s) for the E4M3
    code c (s = 2^(e-7)(1 + m/8), subnormals m · 2^-9; +inf at c = 0 and 127) and entry
    128 + c is fl(1/c). FP64 then one rounding to FP32 is correct here: the quotients' binary
    expansions (1/9, 1/11, 1/13, ...) never hold the 28-bit run of equal bits a double rounding
    needs."""
    from fullstack_fp4.optim.q_adamw.triton_step import recip_table
    tab = recip_table("cpu")
    assert tab.dtype == torch.float32 and tab.numel() == 128 + 65
    for c in range(1, 127):
        e, m = c >> 3, c & 7
        s = m * 2.0 ** -9 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
        assert tab[c].item() == torch.tensor(0.25 / s, dtype=torch.float64).float().item(), c
    assert tab[0] == float("inf") and tab[127] == float("inf")
    for c in range(1, 65):
        assert tab[128 + c].item() == torch.tensor(1.0 / c, dtype=torch.float64).float().item()


def test_table_factor_is_nvfp4s_factor_to_a_last_bit():
    """The element factor f = fl(fl(0.25 / s) · enc) (the kernel's table times the chunk's
    enc) against NVFP4's fl(0.25 / fl(s · dec)) with its own M / amax scales, for every E4M3
    scale and chunk amaxes across FP32's normal range: the same value up to the last bit or two
    (both are two roundings of 0.25 · enc / s, the enc and dec also a bit apart; measured:
    within 4 units of 2^-24, about half bit-equal), so the
    codec's rounding decisions are NVFP4's except at exact ties."""
    from fullstack_fp4.nvfp4.reference import tensor_scales
    from fullstack_fp4.optim.q_adamw.codecs import FP32_MAX, chunk_scales
    from fullstack_fp4.optim.q_adamw.triton_step import recip_table
    a = _amax_across_fp32(7)
    a = a[(a.double() > 1e-30) & (a.double() < 1e30)]
    s = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:, None]
    enc, _ = chunk_scales(a, "4over6")
    enc_n, dec_n = tensor_scales(a, "4over6")
    f = torch.clamp(recip_table("cpu")[1:127, None] * enc[None, :], max=FP32_MAX * 0.25)
    f_n = torch.clamp(0.25 / (s * dec_n[None, :]), max=FP32_MAX * 0.25)
    ok = (f_n < FP32_MAX * 0.25) & (f_n > 1e-37)
    rel = ((f.double() - f_n.double()) / f_n.double()).abs()[ok]
    assert ok.sum() > 100000 and rel.max() <= 4 * 2.0 ** -24
    assert (rel == 0).float().mean() > 0.3          # about half are bit-equal (0.49 here)


def test_tile_mean_factor_at_a_partial_tile():
    """The v tile mean is fl(sum · fl(1/cnt)): the full tiles' is sum / 64 exactly, a partial
    tile's (the tensor's tail) one rounding of the product, within an ulp of the division."""
    n = 64 * 5 + 7
    g = torch.Generator().manual_seed(9)
    v = torch.rand(n, generator=g) ** 4
    st = encode_exp_avg_sq(v)
    s = torch.sqrt(v.double())
    full = s[:320].view(5, 64).mean(dim=1)
    tail = s[320:].mean()
    mean = st.tile_mean.double()
    # BF16 RNE of an FP32 within an ulp of the exact mean: within BF16's half ulp + a hair
    assert torch.allclose(mean[:5], full, rtol=2 ** -8 + 2 ** -20, atol=0)
    assert abs(mean[5].item() - tail.item()) <= tail.item() * (2 ** -8 + 2 ** -20)
