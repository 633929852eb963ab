"""The telemetry step's cheap computation paths against the reference compositions they replace
(fullstack_fp4.nvfp4's hadamard16 / inverse_hadamard16, the transposed-and-padded wgrad operand,
the recipe's own ``quantize_wgrad_operand``): bit-for-bit, not to a tolerance."""
from __future__ import annotations

import collections
import math

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, dequantize, hadamard16, inverse_hadamard16, quantize
from fullstack_fp4.telemetry import recipe_stats as rs
from fullstack_fp4.telemetry import stats

ALL = 10**9


def _wide(shape, seed, dtype=torch.float32):
    """Values over ~40 binades with random signs: additions in the butterfly round."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    return x.to(dtype)


def _operand(m):
    """pad(m)ᵀ as quantize_wgrad_operand builds it: [C, T_pad] FP32."""
    m2 = m.reshape(-1, m.shape[-1]).float()
    return torch.nn.functional.pad(m2, (0, 0, 0, (-m2.shape[0]) % 16)).t().contiguous()


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.c = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.c[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_wht16_along_any_dim_is_the_butterfly_bit_for_bit():
    from fullstack_fp4.nvfp4.hadamard import butterfly

    x = _wide((5, 16, 7), 0)
    want = butterfly(x.transpose(1, 2).contiguous(), 16).transpose(1, 2)
    assert torch.equal(stats.wht16(x, 1), want)
    y = _wide((3, 64), 1)
    assert torch.equal(stats.inverse_rht16(y), inverse_hadamard16(y, DEFAULT_SIGNS))
    s = (1.0,) * 8 + (-1.0,) * 8
    assert torch.equal(stats.inverse_rht16(y, s), inverse_hadamard16(y, s))
    with pytest.raises(ValueError):
        stats.rht_signs_on("cpu", (1.0, 2.0) * 8)


@pytest.mark.parametrize("shape,dtype,chunk", [((40, 32), torch.float32, 1 << 24),
                                               ((123, 48), torch.bfloat16, 16 * 48 * 2),  # 4 chunks + tail
                                               ((4, 8, 32), torch.bfloat16, 1 << 24),     # [s, b, C]
                                               ((64, 16), torch.float16, 16 * 16)])
def test_rht16_tokens_amax_is_the_reference_amax_bit_for_bit(shape, dtype, chunk):
    m = _wide(shape, 3, dtype) if dtype != torch.float16 else torch.randn(shape).to(dtype)
    want = hadamard16(_operand(m), DEFAULT_SIGNS).abs().amax()
    got = rs.rht16_tokens_amax(m, chunk_elems=chunk)
    assert got.dtype == torch.float32 and torch.equal(got, want), (float(got), float(want))


@pytest.mark.parametrize("shape,dtype", [((40, 32), torch.float32), ((123, 48), torch.bfloat16),
                                         ((4, 8, 32), torch.bfloat16), ((64, 16), torch.float16)])
def test_rht16_tokens_amax_kernel_path_is_the_reference_amax_bit_for_bit(shape, dtype):
    # the Triton pass CUDA tensors take (here under TRITON_INTERPRET=1 on CPU tensors)
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton path needs a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    m = _wide(shape, 5, dtype) if dtype != torch.float16 else torch.randn(shape).to(dtype)
    want = hadamard16(_operand(m), DEFAULT_SIGNS).abs().amax()
    got = rs.rht16_tokens_amax(m.to(dev), kernel=True)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert torch.equal(got.cpu(), want), (float(got), float(want))
    assert torch.equal(got.cpu(), rs.rht16_tokens_amax(m, kernel=False))


def test_rht16_tokens_amax_reads_m_in_place():
    """No transpose, padding, cat or host read of the full operand; one FP32 pass per chunk."""
    m = torch.randn(256, 64).bfloat16()
    with _Ops() as ops:
        rs.rht16_tokens_amax(m)
    for bad in ("t", "transpose", "constant_pad_nd", "cat", "_local_scalar_dense", "clone"):
        assert ops.c[bad] == 0, (bad, dict(ops.c))


def test_wgrad_operand_blocks_are_the_blocks_of_the_padded_transpose():
    m = _wide((37, 32), 4, torch.bfloat16)                 # 37 tokens: 3 blocks per channel
    op = _operand(m).reshape(-1, 16)                       # row-major [C, T_pad/16] blocks
    idx = torch.tensor([0, 1, 2, 3, 5, 95, 47, 2])
    assert torch.equal(rs.wgrad_operand_blocks(m, idx), op[idx])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("blocks", [ALL, 7])
def test_wgrad_operand_sums_equal_the_reference_composition(rounding, blocks):
    """The former implementation, from public functions: FP32 copy, pad, transpose, hadamard16
    of the whole operand for the amax, then ``sampled_sums`` with the same generator."""
    m = _wide((45, 48), 5, torch.bfloat16)
    op = _operand(m)
    gamax = hadamard16(op, DEFAULT_SIGNS).abs().amax()
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    qdq = stats.nvfp4_qdq(global_amax=gamax, tile=(1, 16), rounding=rounding,
                          generator=g1 if rounding == "stochastic" else None, rht_signs=DEFAULT_SIGNS)
    we, wx, _, _ = stats.sampled_sums(op, qdq, blocks=blocks, generator=g1, tile=(1, 16))
    ge, gx = rs.wgrad_operand_sums(m, rounding=rounding, blocks=blocks, generator=g2)
    # the same blocks in the same order, summed in the same [n, 16] shape: equal, not close
    assert torch.equal(ge, we) and torch.equal(gx, wx)
    assert torch.equal(g1.get_state(), g2.get_state())     # the same draws, in the same order


def test_wgrad_operand_quantized_exactly_as_the_recipe():
    """Against the recipe's quantize_wgrad_operand: the same tensor scale, and every block
    dequantized to the same numbers (so Σ err² differs only by the FP32 summation order)."""
    from fullstack_fp4.linear.nvfp4_linear import quantize_wgrad_operand

    m = _wide((40, 32), 6, torch.bfloat16)
    q = quantize_wgrad_operand(m, rounding="nearest")
    amax = rs.rht16_tokens_amax(m)
    mine = quantize(rs.wgrad_operand_blocks(m, torch.arange(32 * 3)), global_amax=amax,
                    rht_signs=DEFAULT_SIGNS, check_finite=False)
    assert torch.equal(mine.tensor_scale, q.tensor_scale)
    assert torch.equal(dequantize(mine).float(), dequantize(q).float().reshape(-1, 16))


def test_to_device_keeps_cpu_tensors_and_values():
    t = torch.arange(5)
    assert stats.to_device(t, "cpu") is t
    if torch.cuda.is_available():
        d = stats.to_device(t, "cuda")
        assert d.is_cuda and torch.equal(d.cpu(), t)


@pytest.mark.parametrize("rows,n,zero_from", [(64, 256, None), (64, 200, 128), (17, 130, None), (64, 256, 64)])
def test_ds_row_tile_dequant_is_tile_dequant(rows, n, zero_from):
    from fullstack_fp4.attention.quant import tile_dequant

    ds = _wide((rows, n), 7) * 1e-20                      # tiny values: dS-like magnitudes
    ds[:, 64:128] = 0                                      # an all-zero tile in the middle
    if zero_from is not None:
        ds[:, zero_from:] = 0                              # above the causal diagonal
    want = tile_dequant(ds[None, None], "keys", "nearest")[0, 0]
    got = rs.ds_row_tile_dequant(ds, zero_from=zero_from)
    assert torch.equal(got, want)


def test_attn_ds_sums_fast_path_equals_tile_dequant_path():
    from fullstack_fp4.attention.quant import tile_dequant

    g = torch.Generator().manual_seed(8)
    q, k, v, o, do = (torch.randn(150, 32, generator=g) for _ in range(5))
    for causal in (True, False):
        for tile_row in (0, 1, 2):
            got = rs.attn_ds_sums(q, k, v, o, do, tile_row, scale=32 ** -0.5, causal=causal)
            # the same statistic with tile_dequant itself (stochastic=False path forced by hand)
            import fullstack_fp4.telemetry.recipe_stats as mod
            orig = mod.ds_row_tile_dequant
            mod.ds_row_tile_dequant = lambda ds, zero_from=None: tile_dequant(ds[None, None], "keys", "nearest")[0, 0]
            try:
                want = rs.attn_ds_sums(q, k, v, o, do, tile_row, scale=32 ** -0.5, causal=causal)
            finally:
                mod.ds_row_tile_dequant = orig
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _qadamw_params(shapes, steps=1):
    from fullstack_fp4.optim import QAdamW

    g = torch.Generator().manual_seed(11)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = QAdamW(ps, lr=1e-3, betas=(0.9, 0.99), eps=1e-8)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return opt, ps


@pytest.mark.parametrize("phase", [0, 512])
def test_q_adamw_group_sums_equal_the_per_parameter_sums(phase):
    """Batched chunks (whole ones) and lone ones (cut by the tensor's end or the grid phase):
    the per-parameter path with the same generator gives the same numbers, up to the FP32
    order of a 1024-entry sum (rel 1e-6; the v_clamped counts exactly)."""
    opt, ps = _qadamw_params([(64, 64), (48, 40), (32, 96), (16, 16)])
    items = [(opt.state[p], p.grad, phase if i == 1 else 0) for i, p in enumerate(ps)]
    items.append(({}, torch.randn(3000), 0))                          # fresh state: zero moments
    for chunks in (2, ALL):
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        want = [rs.q_adamw_sample_sums(st, gr, beta1=0.9, beta2=0.99, eps=1e-8, chunks=chunks,
                                       generator=g1, phase=ph) for st, gr, ph in items]
        got = rs.q_adamw_group_sums(items, beta1=0.9, beta2=0.99, eps=1e-8, chunks=chunks, generator=g2)
        assert torch.equal(g1.get_state(), g2.get_state())
        for w, o in zip(want, got):
            assert set(w) == set(o)
            for k in w:
                for a, b in zip(w[k], o[k]):
                    if k == "v_clamped":
                        assert float(a) == float(b)
                    else:
                        assert float(b) == pytest.approx(float(a), rel=1e-6, abs=0.0), k


def test_q_adamw_hook_runs_the_codecs_once_per_group():
    """The hook's codec calls do not grow with the number of parameters."""
    from fullstack_fp4.optim.q_adamw import codecs
    from fullstack_fp4.telemetry import TelemetryCollector

    counts = []
    for n_params in (2, 6):
        opt, ps = _qadamw_params([(64, 64)] * n_params)
        holder = torch.nn.Module()
        for i, p in enumerate(ps):
            holder.register_parameter(f"p{i}", p)
        tel = TelemetryCollector(interval=1, opt_chunks=2)
        tel.begin_step(holder, 1, optimizer=opt)
        calls = collections.Counter()
        orig = {f: getattr(codecs, f) for f in ("_quantize_chunked", "_decode_chunked")}
        try:
            for f, fn in orig.items():
                setattr(codecs, f, (lambda fn, f: lambda *a, **k: (calls.update([f]), fn(*a, **k))[1])(fn, f))
            tel._q_adamw_hook(opt, (), {})
        finally:
            for f, fn in orig.items():
                setattr(codecs, f, fn)
        out = tel.end_step()
        assert len(out) == 4 * n_params and all(math.isfinite(v) for v in out.values())
        counts.append(dict(calls))
    assert counts[0] == counts[1], counts
