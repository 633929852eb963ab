"""The 4-bit saved views: exact decode, a backward bit-identical to the BF16-view path, and the
saved-for-backward bytes.

Oracles:
  * the BF16-view path: the prologue writing all four views as BF16 values (``make_views``) and
    the kernels run on them directly — what the autograd function did before it saved codes;
  * ``quant.per_head_view`` (the PyTorch reference quantizer) for the decoded values;
  * the saved bytes computed by hand from the shapes (module docstring of ``packed.py``), against
    what ``torch.autograd.graph.saved_tensors_hooks`` sees autograd keep.

Device: CUDA when present, else CPU with the Triton interpreter (conftest.py).
"""

import pytest
import torch

from fullstack_fp4.attention import q_attention
from fullstack_fp4.attention.prologue import make_views, prepare_views
from fullstack_fp4.attention.quant import per_head_view, smooth_k

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF = torch.bfloat16


def _inputs(b, h, hk, s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g) * torch.exp(0.5 * torch.randn(1, 1, 1, d, generator=g))
    k = torch.randn(b, hk, s, d, generator=g) + torch.randn(1, hk, 1, d, generator=g)
    q[:, :, 3] *= 10.0
    k[:, :, 1, :16] = 0.0                            # an all-zero block (zero block scale)
    v = torch.randn(b, hk, s, d, generator=g)
    do = torch.randn(b, h, s, d, generator=g)
    return [x.to(device=DEV, dtype=BF) for x in (q, k, v, do)]


PATHS = [None, {"qk": "bf16"}, {"ds": "bf16"}]


@pytest.mark.parametrize("paths", PATHS)
def test_saved_views_decode_to_the_bf16_views(paths):
    """unpack(saved) == the prologue's BF16 views == the reference quantizer, bit for bit."""
    q, k, _, _ = _inputs(1, 4, 2, 40, 64)
    qk4 = not paths or paths.get("qk") != "bf16"
    ds4 = not paths or paths.get("ds") != "bf16"
    kw = dict(qk_fp4=qk4, ds_fp4=ds4, smooth=True)
    got = prepare_views(q, k, backend="triton", **kw)[1].unpack("triton")
    want = make_views(q, k, backend="triton", **kw)
    # reference on the same device: K-smoothing's mean is one torch reduction shared by both
    ref = prepare_views(q, k, backend="reference", **kw)[1].unpack("reference")
    ks = smooth_k(k)[0]
    for name in ("q_hd", "k_hd", "q_sq", "k_sq", "dec_q_hd", "dec_k_hd", "dec_q_sq", "dec_k_sq"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
        assert torch.equal(a.float(), getattr(ref, name)), name
    if qk4 and ds4:
        assert torch.equal(ref.k_sq, per_head_view(ks, "seq")[0])
        assert torch.equal(ref.q_hd, per_head_view(q, "head_dim")[0])


CASES = [(1, 4, 2, 130, 64, True, None),          # GQA, causal, ragged, 3 blocks
         (1, 2, 1, 70, 64, False, None),          # non-causal, ragged keys
         (1, 2, 2, 64, 128, True, {"ds": "bf16"})]


@pytest.mark.parametrize("b,h,hk,s,d,causal,paths", CASES)
def test_backward_bit_identical_to_bf16_view_path(b, h, hk, s, d, causal, paths):
    from fullstack_fp4.attention.paths import resolve_paths
    from fullstack_fp4.attention.triton_bwd import attention_backward
    from fullstack_fp4.attention.triton_fwd import attention_forward
    q, k, v, do = _inputs(b, h, hk, s, d, seed=1)
    pr = resolve_paths(paths)
    views = make_views(q, k, qk_fp4=pr["qk"] == "nvfp4", ds_fp4=pr["ds"] == "nvfp4", smooth=True,
                       backend="triton")
    o, lse = attention_forward(views, v, causal=causal, scale=d ** -0.5)
    want = attention_backward(do, o, lse, v, views, causal=causal, scale=d ** -0.5,
                              ds_fp4=pr["ds"] == "nvfp4", out_dtypes=(BF, BF, BF))
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o2, lse2 = q_attention(qq, kk, vv, causal=causal, paths=paths, backend="triton",
                           return_lse=True)
    o2.backward(do)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)
    for name, got, w in zip("QKV", (qq.grad, kk.grad, vv.grad), want):
        assert got.dtype == BF and torch.equal(got, w), name


def _saved_bytes(fn):
    """Bytes of the distinct storages autograd saves while ``fn`` runs (and what fn returns)."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("paths", [None, {"qk": "bf16"}])
def test_saved_bytes_match_hand_count(backend, paths):
    b, h, hk, s, d = 1, 4, 2, 40, 64
    sp = 48                                        # seq padded to 16-blocks (seq views)
    q, k, v, _ = _inputs(b, h, hk, s, d)
    if backend == "reference":
        q, k, v = q.cpu(), k.cpu(), v.cpu()
    args = [x.clone().requires_grad_() for x in (q, k, v)]
    got, o = _saved_bytes(lambda: q_attention(*args, causal=True, paths=paths, backend=backend))
    hd = lambda heads: b * heads * s * (d // 2 + d // 16)      # noqa: E731  codes + scales
    sq = lambda heads: b * heads * (sp // 2 + sp // 16) * d    # noqa: E731
    want = (2 * b * hk * s * d                     # V (BF16)
            + 2 * b * h * s * d                    # O (BF16, the output itself)
            + 4 * b * h * s                        # LSE (FP32)
            + sq(h) + sq(hk)                       # seq views, packed
            + 4 * (b * h + b * hk))                # decode scales (FP32)
    if paths is None:
        want += hd(h) + hd(hk)                     # head_dim views, packed
    else:
        want += 2 * b * h * s * d + 2 * b * hk * s * d   # qk path BF16: Q, K themselves
    assert got == want, (got, want)
    sdpa = 2 * (2 * b * h * s * d + 2 * b * hk * s * d) + 4 * b * h * s   # Q, K, V, O, LSE
    bf16_views = want - hd(h) - hd(hk) - sq(h) - sq(hk) + 2 * 2 * (b * h + b * hk) * s * d
    if paths is None:
        assert got < sdpa < bf16_views             # below SDPA's Q, K, V, O; was above it
    o.float().sum().backward()                     # the saved tensors suffice for a backward
    assert all(torch.isfinite(a.grad).all() for a in args)
