"""Q-Attn on megatron's ``[s, b, h, d]`` layout: the Triton path reads and writes it in place and
gives the numbers of contiguous inputs bit for bit (``fullstack_fp4/attention/layout.py``).

Layouts tested, all with the same values:
  * ``bhsd``: contiguous ``[B, H, S, D]`` (what the kernels were written for);
  * ``sbhd``: ``[B, H, S, D]`` views of dense ``[S, B, H, D]`` storage (RoPE's output);
  * ``fused``: q, k, v split from one ``[S, B, Hkv, (H/Hkv + 2)·D]`` buffer as megatron's
    ``get_query_key_value_tensors`` does (q reshaped, k and v strided views into the buffer).

Oracle: the contiguous run (itself pinned to the previous commit's kernels: this change was
checked bit-identical against them under the interpreter, docs/perf/q-attn.md). Device: CUDA when
present, else CPU under ``TRITON_INTERPRET=1`` (conftest.py); ``backend="triton"`` forces the
kernels on CPU.
"""

import pytest
import torch

from fullstack_fp4.attention import q_attention
from fullstack_fp4.attention.layout import (bhs_strides, dim_order, empty_in_order,
                                            kernel_operand, owns_its_storage)
from tests.fullstack_fp4.attention.kernel_inputs import DEV
from tests.fullstack_fp4.attention.kernel_inputs import inputs as _inputs

SBHD = (2, 0, 1, 3)       # dim_order of a [B, H, S, D] view of [S, B, H, D] storage


def _to_sbhd(x):
    """the same values as a ``[B, H, S, D]`` view of dense ``[S, B, H, D]`` storage"""
    return x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def _fused_leaf(q, k, v):
    """megatron's QKV split: ``(buffer, q, k, v)`` with the buffer a leaf that requires grad and
    q, k, v non-leaf ``[B, H, S, D]`` views (q through the split's reshape)"""
    b, h, s, d = q.shape
    hk = k.shape[1]
    g = h // hk
    buf = torch.cat([q.permute(2, 0, 1, 3).reshape(s, b, hk, g * d), k.permute(2, 0, 1, 3),
                     v.permute(2, 0, 1, 3)], dim=3).detach().requires_grad_()
    query, key, value = torch.split(buf, [g * d, d, d], dim=3)
    query = query.reshape(s, b, h, d)
    return buf, [x.permute(1, 2, 0, 3) for x in (query, key, value)]


def _run(q, k, v, do, layout, **kw):
    """O, LSE and the gradients reaching q, k, v (captured by hooks, before any accumulation)."""
    if layout == "sbhd":
        leaves = [_to_sbhd(x).requires_grad_() for x in (q, k, v)]
        qkv = leaves
        do = _to_sbhd(do)
    elif layout == "fused":
        _, qkv = _fused_leaf(q, k, v)
        do = _to_sbhd(do)
    else:
        qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = {}
    for name, x in zip("qkv", qkv):
        x.register_hook(lambda g, name=name: grads.__setitem__(name, g))
    o, lse = q_attention(*qkv, return_lse=True, backend="triton", **kw)
    o.backward(do)
    return o.detach(), lse, grads


CASES = [dict(b=2, h=4, hk=2, s=50, d=64, causal=True),                  # GQA, ragged
         dict(b=2, h=2, hk=1, s=70, d=64, causal=False, ds_rounding="stochastic",
              generator_seed=3),
         dict(b=1, h=2, hk=2, s=64, d=128, causal=True),
         dict(b=2, h=2, hk=2, s=40, d=64, causal=True, paths={"qk": "bf16"})]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", ["sbhd", "fused"])
def test_megatron_layouts_bit_identical_and_stored_like_the_inputs(case, layout):
    case = dict(case)
    b, h, hk, s, d = (case.pop(n) for n in ("b", "h", "hk", "s", "d"))
    seed = case.pop("generator_seed", None)
    q, k, v, do = _inputs(b, h, hk, s, d, seed=1)

    def kw():
        return dict(case, generator=torch.Generator().manual_seed(seed)) if seed else case
    o_ref, lse_ref, g_ref = _run(q, k, v, do, "bhsd", **kw())
    o, lse, g = _run(q, k, v, do, layout, **kw())
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    for name in "qkv":
        assert torch.equal(g[name], g_ref[name]), name
    # O stored [s, b, h, d]: megatron's [s, b, h·d] of it is a view
    assert o.permute(*SBHD).is_contiguous()
    assert o.permute(*SBHD).reshape(s, b, h * d).data_ptr() == o.data_ptr()
    # dQ, dK, dV reach the split's backward as dense [s, b, h, d] tensors
    for name in "qkv":
        assert g[name].permute(*SBHD).is_contiguous(), (name, g[name].stride())


def test_prologue_reads_strided_input_in_place():
    """The prologue on an [s, b, h, d] view: the same views, codes, scales and decode scales as
    on the contiguous tensor (K-smoothing mean included), written contiguous."""
    from fullstack_fp4.attention.quant import seq_mean
    from fullstack_fp4.attention.triton_prologue import quantize_views
    x = _inputs(2, 2, 2, 40, 64, seed=2)[1]
    xs = _to_sbhd(x)
    flags = dict(hd_bf16=True, sq_bf16=True, pack_hd=True, pack_sq=True)
    r = quantize_views(x, seq_mean(x), **flags)
    rs = quantize_views(xs, seq_mean(xs), **flags)
    for name in ("dec", "hd", "sq"):
        assert torch.equal(r[name], rs[name]), name
        assert rs[name].is_contiguous(), name
    for name in ("hd_packed", "sq_packed"):
        assert torch.equal(r[name].codes, rs[name].codes), name
        assert torch.equal(r[name].scales, rs[name].scales), name


def test_head_dim_stride_not_one_falls_back_to_a_copy():
    q, k, v, do = _inputs(1, 2, 1, 33, 64, seed=4)
    transposed = [x.transpose(2, 3).contiguous().transpose(2, 3) for x in (q, k, v)]
    assert transposed[0].stride(3) != 1
    assert kernel_operand(transposed[0]).stride(3) == 1
    o_ref = q_attention(q, k, v, backend="triton")
    assert torch.equal(q_attention(*transposed, backend="triton"), o_ref)


@pytest.mark.parametrize("save_view", [False, True])
def test_v_view_into_the_fused_buffer_is_compacted_before_saving(save_view, monkeypatch):
    """Saving megatron's V (a view into the QKV buffer) would keep the whole buffer alive: it
    is saved as a compact copy unless knobs.QATTN_SAVE_V_VIEW (FP4_QATTN_SAVE_V_VIEW=1); the
    numbers are the same."""
    from fullstack_fp4 import knobs
    monkeypatch.setattr(knobs, "QATTN_SAVE_V_VIEW", save_view)
    q, k, v, do = _inputs(2, 2, 1, 40, 64, seed=5)
    buf, qkv = _fused_leaf(q, k, v)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o = q_attention(*qkv, backend="triton")
    pins_buffer = any(t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                      for t in saved)
    assert pins_buffer == save_view
    o.backward(_to_sbhd(do))
    o_ref, _, g_ref = _run(q, k, v, do, "bhsd")
    assert torch.equal(o.detach(), o_ref)
    g_ref_buf = torch.cat([g_ref["q"].permute(*SBHD).reshape(40, 2, 1, 128),
                           g_ref["k"].permute(*SBHD), g_ref["v"].permute(*SBHD)], dim=3)
    assert torch.equal(buf.grad, g_ref_buf)


def test_layout_helpers():
    x = torch.empty(3, 2, 5, 16)                       # [s, b, h, d]
    view = x.permute(1, 2, 0, 3)
    assert dim_order(view) == SBHD
    assert dim_order(torch.empty(2, 5, 3, 16)) == (0, 1, 2, 3)
    assert bhs_strides(view) == (80, 16, 160)
    e = empty_in_order((2, 5, 3, 16), SBHD, torch.bfloat16, "cpu")
    assert e.shape == (2, 5, 3, 16) and e.permute(*SBHD).is_contiguous()
    assert kernel_operand(view) is view
    assert owns_its_storage(view)
    assert not owns_its_storage(torch.empty(3, 2, 5, 48)[..., 16:32].permute(1, 2, 0, 3))
    with pytest.raises(ValueError, match="head_dim stride 1"):
        bhs_strides(view.transpose(2, 3))
    huge = torch.empty(1, device="meta").as_strided((2, 1, 1, 16), (2 ** 31, 1, 1, 1))
    with pytest.raises(ValueError, match="int32"):
        bhs_strides(huge)
