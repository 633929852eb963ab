"""Fused row/column NVFP4 operands (``kernels/quantize_two_ways.py``) against the reference composition.

Oracles, all independent of the kernels under test: ``quantize_reference`` (the FP32 contract),
``hadamard16`` of the zero-padded transpose for the column way, the PyTorch decode of
``gemm.decode_to_bf16`` on CPU tensors, and for stochastic rounding the uniforms of the
PyTorch stream ``sr_stream.sr_uniforms`` for a seed (the Philox mapping the kernels draw).
Everything is compared bit for bit. Kernels run on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16, quantize_reference
from fullstack_fp4.nvfp4.gemm import decode_to_bf16
from fullstack_fp4.nvfp4.sr_stream import sr_uniforms

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not (_INTERPRET or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if (torch.cuda.is_available() and not _INTERPRET) else "cpu"


def _m(t, c, seed, dtype=torch.bfloat16):
    """Spread magnitudes with an outlier, a zero block, a block whose E4M3 scale is subnormal
    (~1e-3 of the amax range) and one whose scale underflows to 0 (~1e-6)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(t, c, generator=g) * torch.logspace(-2, 1, c)
    m[1, 3] = 37.0
    m[16:32, 16:32] = 0
    m[:, 32:48] = torch.randn(t, 16, generator=g) * 4e-4    # block scale ~0.01 < 2^-6
    m[:, 48:64] = torch.randn(t, 16, generator=g) * 1e-6    # block scale rounds to 0
    return m.to(dtype)


def _col_ref(m):
    t = m.shape[0]
    return hadamard16(F.pad(m.float(), (0, 0, 0, (-t) % 16)).t(), DEFAULT_SIGNS)


def _same_q(a, b):
    assert torch.equal(a.data.cpu(), b.data.cpu())
    assert torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
    assert int(a.tensor_scale.cpu().view(torch.int32)) == int(b.tensor_scale.cpu().view(torch.int32))
    assert tuple(a.shape) == tuple(b.shape) and tuple(a.tile) == tuple(b.tile)


def _same_bf16(a, b):
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    assert torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def _bits(v) -> int:
    return int(v.reshape(()).float().view(torch.int32))


@pytest.mark.parametrize("t", [40, 32])
def test_amax_both_ways(t):
    """Also with the max in the first and in the last program's tile (under the interpreter,
    T = 40 runs 8 programs: 4 channel strips × 2 token spans; T = 32 runs 4)."""
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import amax_two_ways
    m = _m(t, 128, 1)
    obs = amax_two_ways(m.to(DEV)).cpu()
    assert int(obs[0]) == _bits(m.float().abs().amax())
    assert int(obs[1]) == _bits(_col_ref(m).abs().amax())
    assert int(amax_two_ways(m.to(DEV), col=False).cpu()[1]) == 0
    for i, j in ((0, 0), (t - 1, 127)):              # the first and the last program's tile
        mo = m.clone()
        mo[i, j] = 64.0
        obs = amax_two_ways(mo.to(DEV)).cpu()
        assert int(obs[0]) == _bits(torch.tensor(64.0))
        assert int(obs[1]) == _bits(_col_ref(mo).abs().amax())


@pytest.mark.parametrize("shapes,ways", [(((40, 128), (32, 64)), (True, True, True, False)),
                                         (((48, 64), (16, 160)), (True, False, True, True)),
                                         (((32, 96), (40, 128)), (False, True, True, False))])
def test_amax_pair_is_two_passes(shapes, ways):
    """x's and W's amaxes from one launch (the linear's forward) against the PyTorch amaxes:
    tensors of different widths (the pair takes the wider lane count, so the narrow one runs
    masked) and token counts; W's max planted in its last tile, x's in its first, so a program
    index off by one between the two halves of the grid would miss one of them."""
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import amax_two_ways_pair
    (tx, cx), (ty, cy) = shapes
    rx, cx_, ry, cy_ = ways
    x, y = _m(tx, cx, 5), _m(ty, cy, 6) * 0.5
    x[0, 0], y[ty - 1, cy - 1] = 80.0, -90.0
    ox, oy = (o.cpu() for o in amax_two_ways_pair(x.to(DEV), y.to(DEV), row_x=rx, col_x=cx_,
                                                  row_y=ry, col_y=cy_))
    for obs, m, r, c in ((ox, x, rx, cx_), (oy, y, ry, cy_)):
        assert int(obs[0]) == (_bits(m.float().abs().amax()) if r else 0)
        assert int(obs[1]) == (_bits(_col_ref(m).abs().amax()) if c else 0)


def test_quantize_writes_the_gemm_alpha():
    """``row_peer_scale`` / ``col_peer_scale``: the kernel's ``ts · peer`` equals torch.mul of
    the tensor scales it stored, bit for bit (the GEMM reads it as its alpha), and asking
    for none leaves the outputs as they were."""
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import (ColWay, RowWay, amax_two_ways,
                                                            quantize_two_ways)
    m = _m(32, 64, 7).to(DEV)
    obs = amax_two_ways(m)
    peer_r = torch.tensor([3.0e-4], device=DEV)
    peer_c = torch.tensor([7.5e-6], device=DEV)
    kw = dict(row=RowWay("stochastic"), col=ColWay("stochastic", decoded=True, codes=False),
              seed_row=3, seed_col=4)
    q = quantize_two_ways(m, obs, row_peer_scale=peer_r, col_peer_scale=peer_c, **kw)
    plain = quantize_two_ways(m, obs, **kw)
    assert plain.row_alpha is None and plain.col_alpha is None
    _same_bf16(q.row_decoded, plain.row_decoded)
    _same_bf16(q.col_decoded, plain.col_decoded)
    assert _bits(q.row_alpha) == _bits(torch.mul(q.row_scale.cpu(), peer_r.cpu()))
    assert _bits(q.col_alpha) == _bits(torch.mul(q.col_scale.cpu(), peer_c.cpu()))
    assert _bits(q.row_scale) == _bits(plain.row_scale)
    with pytest.raises(ValueError, match="peer scale"):
        quantize_two_ways(m, obs, row=RowWay(), col_peer_scale=peer_c)
    with pytest.raises(ValueError, match="peer scale"):
        quantize_two_ways(m, obs, row=RowWay(), row_peer_scale=torch.ones(2, device=DEV))


@pytest.mark.parametrize("dtype,scale,odd_stride", [(torch.float32, 1e-40, False),
                                                    (torch.float16, 1.0, False),
                                                    (torch.bfloat16, 1.0, True)])
def test_amax_element_reads(dtype, scale, odd_stride):
    """The element path (FP32, FP16, BF16 with an odd row stride), FP32 subnormals included:
    the kernel takes the RHT's ``× ¼`` once on its max, the reference on every element."""
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import amax_two_ways
    m = (_m(40, 96, 4, torch.float32) * scale).to(dtype)
    if odd_stride:
        m = torch.cat([m, m[:, :1]], 1)[:, :96]       # row stride 97: not read as words
    obs = amax_two_ways(m.to(DEV)).cpu()
    assert int(obs[0]) == _bits(m.float().abs().amax())
    assert int(obs[1]) == _bits(_col_ref(m).abs().amax())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_amax_sees_non_finite(bad):
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import amax_two_ways
    m = _m(24, 64, 2)
    m[20, 5] = bad
    obs = amax_two_ways(m.to(DEV)).cpu()
    assert int(obs[0]) >= 0x7F800000 and int(obs[1]) >= 0x7F800000


@pytest.mark.parametrize("dtype,c", [(torch.bfloat16, 128), (torch.float32, 64)])
def test_x_operands_nearest(dtype, c):
    """fprop x (1×16, decoded) and RHT(xᵀ) (codes, and decoded) from one read; T % 16 != 0;
    128 channels: two channel blocks under the interpreter's tile."""
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import ColWay, RowWay, amax_two_ways, quantize_two_ways
    m = _m(40, c, 3, dtype)
    md = m.to(DEV)
    q = quantize_two_ways(md, amax_two_ways(md), row=RowWay(codes=True),
                          col=ColWay(decoded=True, codes=True))
    rr, rc = quantize_reference(m), quantize_reference(_col_ref(m))
    rc.dtype = m.dtype
    _same_q(q.row_q, rr)
    _same_bf16(q.row_decoded, decode_to_bf16(rr))
    _same_q(q.col_q, rc)
    _same_bf16(q.col_decoded, decode_to_bf16(rc))
    assert q.col_q.shape == (c, 48) and q.col_decoded.shape == (c, 48)
    # the reference itself saw subnormal and zero block scales in both ways
    for r in (rr, rc):
        s = r.block_scale.view(torch.uint8)
        assert bool((s == 0).any()) and bool(((s > 0) & (s < 8)).any())


@pytest.mark.parametrize("tbs,t,rounding,i64", [(4, 56, "nearest", False),
                                                (2, 56, "stochastic", False),
                                                (4, 64, "stochastic", True)])
def test_column_codes_of_several_token_blocks_a_program(tbs, t, rounding, i64, monkeypatch):
    """With ``COL_CODES_TBS`` token blocks a program (a channel's codes and scale bytes of those
    blocks stored as one run each; what x's call takes when the token blocks divide), both ways
    equal the reference. T = 56 zero-pads the program's last token block; 128 channels make two
    channel programs under the interpreter; the 2-block form stores its scales as 16-bit words,
    the 4-block form as 32-bit ones; int64 offsets and counters too."""
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    monkeypatch.setattr(tqd, "COL_CODES_TBS", tbs)
    monkeypatch.setattr(tqd, "_needs_i64", lambda t, c, stride: i64)
    m = _m(t, 128, 11)
    md = m.to(DEV)
    sr = rounding == "stochastic"
    q = tqd.quantize_two_ways(md, tqd.amax_two_ways(md), row=tqd.RowWay(rounding),
                              col=tqd.ColWay(rounding, decoded=True, codes=True),
                              seed_row=21 if sr else None, seed_col=22 if sr else None)
    mt = _col_ref(m)
    kw = lambda shape, seed: dict(rounding="stochastic", rand=sr_uniforms(shape, seed)) if sr else {}
    rr, rc = quantize_reference(m, **kw(m.shape, 21)), quantize_reference(mt, **kw(mt.shape, 22))
    rc.dtype = m.dtype
    _same_bf16(q.row_decoded, decode_to_bf16(rr))
    _same_q(q.col_q, rc)
    _same_bf16(q.col_decoded, decode_to_bf16(rc))
    assert q.col_q.shape == (128, 64)


@pytest.mark.parametrize("codes,direct,t", [(True, True, 40), (False, True, 40),
                                            (False, False, 40), (False, True, 48)])
def test_dy_operands_stochastic_match_philox_draws(codes, direct, t, monkeypatch):
    """dgrad dY (1×16, SR) and wgrad RHT(dYᵀ) (SR), decoded, with quantize_triton's Philox
    draws for the two seeds. ``codes=False`` is the linear's own call: decoded operands only,
    rounded straight to values (``SR_DIRECT``: ``_dec_sr_bits``) or through the nibble. Row 1
    holds ``-0.0`` (decodes to +0), tiny negatives beside the 37 outlier (round to 0 as ``-0``,
    or to the first step) and tiny positives. T = 48: every program's tokens and channels
    exist (the kernel's maskless EVEN form)."""
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import ColWay, RowWay, amax_two_ways, quantize_two_ways
    monkeypatch.setattr(tqd, "SR_DIRECT", direct)
    m = _m(t, 64, 4)
    m[1, 0], m[1, 1], m[1, 2], m[1, 4] = -0.0, -1e-3, 1e-3, -0.2
    md = m.to(DEV)
    q = quantize_two_ways(md, amax_two_ways(md), row=RowWay("stochastic", codes=codes),
                          col=ColWay("stochastic", decoded=True, codes=codes), seed_row=1234,
                          seed_col=987654)
    mt = _col_ref(m)
    rr = quantize_reference(m, rounding="stochastic", rand=sr_uniforms(m.shape, 1234))
    rc = quantize_reference(mt, rounding="stochastic", rand=sr_uniforms(mt.shape, 987654))
    rc.dtype = m.dtype
    want_row, want_col = decode_to_bf16(rr), decode_to_bf16(rc)
    _same_bf16(q.row_decoded, want_row)
    _same_bf16(q.col_decoded, want_col)
    if codes:
        _same_q(q.row_q, rr)
        _same_q(q.col_q, rc)
    else:
        assert q.row_q is None and q.col_q is None
    # the signed zeros were exercised: -0 where a negative rounded to 0, +0 for the -0.0 input
    r1 = want_row[1].view(torch.int16)
    assert int(r1[0]) == 0 and bool((want_row.view(torch.int16) == -32768).any())


def test_weight_16x16_codes_and_decoded():
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import RowWay, amax_two_ways, quantize_two_ways
    w = _m(48, 64, 5)
    wd = w.to(DEV)
    q = quantize_two_ways(wd, amax_two_ways(wd, col=False), row=RowWay(tile=(16, 16), codes=True))
    r = quantize_reference(w, tile=(16, 16))
    _same_q(q.row_q, r)
    _same_bf16(q.row_decoded, decode_to_bf16(r))
    assert q.col_q is None and q.col_decoded is None


def test_given_amax_sets_the_tensor_scales():
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import ColWay, RowWay, amax_two_ways, quantize_two_ways
    m = _m(32, 64, 6)
    md = m.to(DEV)
    ga, gb = torch.tensor(80.0), torch.tensor(3.0 * float(_col_ref(m).abs().amax()))
    q = quantize_two_ways(md, amax_two_ways(md), row=RowWay(), col=ColWay(),
                          amax_row=ga.to(DEV), amax_col=gb.to(DEV))
    _same_bf16(q.row_decoded, decode_to_bf16(quantize_reference(m, global_amax=ga)))
    rc = quantize_reference(_col_ref(m), global_amax=gb)
    rc.dtype = m.dtype
    _same_q(q.col_q, rc)


@pytest.mark.parametrize("where", ["input_nan", "input_inf", "amax_nan", "amax_negative"])
def test_non_finite_poisons_tensor_scales_or_raises(where):
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import ColWay, RowWay, amax_two_ways, quantize_two_ways
    m = _m(32, 64, 7)
    given = None
    if where == "input_nan":
        m[9, 9] = float("nan")
    elif where == "input_inf":
        m[9, 9] = float("-inf")
    else:
        given = torch.tensor(float("nan") if where == "amax_nan" else -1.0, device=DEV)
    md = m.to(DEV)
    obs = amax_two_ways(md)
    kw = dict(row=RowWay(), col=ColWay(decoded=True), amax_row=given, amax_col=given)
    q = quantize_two_ways(md, obs, **kw)
    assert torch.isnan(q.row_scale.cpu()) and torch.isnan(q.col_scale.cpu())
    assert torch.isnan(q.col_q.dequantize()).all()
    with pytest.raises(ValueError):
        quantize_two_ways(md, obs, check_finite=True, **kw)


def test_bad_arguments_give_one_clear_error():
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import ColWay, RowWay, amax_two_ways, quantize_two_ways
    m = _m(24, 64, 8).to(DEV)
    obs = amax_two_ways(m)
    with pytest.raises(ValueError, match="seed"):
        quantize_two_ways(m, obs, col=ColWay("stochastic"))
    with pytest.raises(ValueError, match="decoded operand, its codes"):
        quantize_two_ways(m, obs, row=RowWay(decoded=False))
    with pytest.raises(ValueError, match="16 values"):
        quantize_two_ways(m, obs, col=ColWay(), rht_signs=(1.0,) * 15)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_two_ways(m, obs, row=RowWay(tile=(16, 16)))
    with pytest.raises(ValueError, match="2-D"):
        amax_two_ways(m.reshape(2, 12, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        amax_two_ways(m[:, :40])


def test_other_rht_signs():
    """The signs are compile-time in the kernel: a sign vector other than TE's gives
    ``hadamard16(pad(m)ᵀ, signs)`` too (amax and codes)."""
    from fullstack_fp4.nvfp4.kernels.quantize_two_ways import ColWay, amax_two_ways, quantize_two_ways
    signs = tuple(float(v) for v in torch.tensor([1, -1] * 8))
    m = _m(24, 64, 9)
    md = m.to(DEV)
    obs = amax_two_ways(md, row=False, rht_signs=signs)
    mt = hadamard16(F.pad(m.float(), (0, 0, 0, 8)).t(), signs)
    assert int(obs.cpu()[1]) == _bits(mt.abs().amax())
    q = quantize_two_ways(md, obs, col=ColWay(), rht_signs=signs)
    r = quantize_reference(mt)
    r.dtype = m.dtype
    _same_q(q.col_q, r)


@pytest.mark.parametrize("i64", [False, True])
def test_int64_offsets_and_element_reads(i64, monkeypatch):
    """A BF16 view with an odd row stride is read per element instead of as int32 words; the
    int64 offsets / ``tl.randint4x`` counters (what the host picks past 2^31) give the same bits."""
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    monkeypatch.setattr(tqd, "_needs_i64", lambda t, c, stride: i64)
    big = torch.zeros(24, 81, dtype=torch.bfloat16)
    big[:, :64] = _m(24, 64, 10)
    m = big[:, :64]                                   # row stride 81: no word view
    md = big.to(DEV)[:, :64]
    assert tqd._x_args(md)[2] is False
    q = tqd.quantize_two_ways(md, tqd.amax_two_ways(md), row=tqd.RowWay("stochastic", codes=True),
                              col=tqd.ColWay("stochastic", decoded=True, codes=True),
                              seed_row=5, seed_col=6)
    mt = _col_ref(m)
    rr = quantize_reference(m, rounding="stochastic", rand=sr_uniforms(m.shape, 5))
    rc = quantize_reference(mt, rounding="stochastic", rand=sr_uniforms(mt.shape, 6))
    rc.dtype = m.dtype
    _same_q(q.row_q, rr)
    _same_bf16(q.row_decoded, decode_to_bf16(rr))
    _same_q(q.col_q, rc)
    _same_bf16(q.col_decoded, decode_to_bf16(rc))
