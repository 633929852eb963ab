"""The NVFP4 linear's per-operand block-scale rule (``scale_rule``: ``"6"`` | ``"4over6"``).

Oracles: a hand computation of the 4/6 choice on small blocks (through the linear's output);
the composition reference quantizer -> FP64 GEMM, with every operand the linear's GEMMs receive
compared bit for bit (codes, block scales, tensor scale) against ``quantize_reference`` of the
same tensor with the same rule, generator draws and (TP) global amax.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from fullstack_fp4.linear import nvfp4_linear
from fullstack_fp4.linear.nvfp4_linear import ScaleRules, scale_rules
from fullstack_fp4.linear.partial_nvfp4 import partial_nvfp4_linear
from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16, quantize_reference
from fullstack_fp4.nvfp4.e2m1 import e2m1_decode, unpack_codes

# the module (the package's attribute of that name is the function)
nl = importlib.import_module("fullstack_fp4.linear.nvfp4_linear")


# ------------------------------------------------------------------ hand computation
def _hand_blocks():
    """Three 1x16 blocks sharing the tensor amax 3 (so with 4over6, enc = 256·6/3 = 512):

    * [3, 2.25, 0…]: map-to-6 scale e4m3(3·512/6) = 256, factor 512/256 = 2: 2.25·2 = 4.5 -> 4,
      decoded 2.0 (error 0.25); map-to-4 scale e4m3(3·512/4) = 384, factor 4/3: 2.25 -> 3 exactly,
      decoded 2.25 (error 0). 4 wins: scale 384.
    * [3, 0.25, 0…]: 6: 0.25·2 = 0.5 exact (error 0); 4: 0.25·4/3 = 0.33 -> 0.5, decoded 0.375
      (error 0.125). 6 wins: scale 256.
    * [3, 2.5, 0…]: 6: 5 -> 4 (tie to even), decoded 2.0 (error 0.5); 4: 3.33 -> 3, decoded 2.25
      (error 0.25). 4 wins: scale 384.

    With the 6 rule alone (enc = 448·6/3 = 896, scale e4m3(448) = 448, factor 2): the first and
    last blocks decode 2.25 and 2.5 to 2.0."""
    x = torch.zeros(3, 16)
    x[:, 0] = 3.0
    x[0, 1], x[1, 1], x[2, 1] = 2.25, 0.25, 2.5
    return x


def test_block_choice_matches_a_hand_computation():
    x = _hand_blocks()
    q = quantize_reference(x, scale_rule="4over6")
    assert q.block_scale.float().flatten().tolist() == [384.0, 256.0, 384.0]
    assert float(q.tensor_scale) == 1 / 512
    q6 = quantize_reference(x, scale_rule="6")
    assert q6.block_scale.float().flatten().tolist() == [448.0, 448.0, 448.0]


@pytest.mark.parametrize("rule, second", [("4over6", [2.25, 0.25, 2.25]), ("6", [2.0, 0.25, 2.0])])
def test_linear_output_matches_the_hand_computation(rule, second):
    # W = I: 16x16 tile with amax 1 -> decoded exactly 1 under the 6 rule, so y is x's decoding
    x, w = _hand_blocks(), torch.eye(16)
    y = nvfp4_linear(x, w, scale_rule={"x": rule, "w": "6", "dy": "6"})
    want = torch.zeros(3, 16)
    want[:, 0] = 3.0
    want[:, 1] = torch.tensor(second)
    # 4over6: dec = 1/512, exact; 6: dec = 1/896 is rounded to FP32, hence the tolerance
    torch.testing.assert_close(y, want, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ against the composition
def _decode64(q) -> torch.Tensor:
    """Decoded values in FP64: e2m1 · block scale (per 16 along the last dim) · tensor scale."""
    codes = e2m1_decode(unpack_codes(q.data)).to(torch.float64)
    bs = q.block_scale.to(torch.float32).to(torch.float64).repeat_interleave(16, dim=-1)
    return codes * bs * q.tensor_scale.to(torch.float64)


def _same(a, b, what):
    assert torch.equal(a.data, b.data), f"{what}: codes differ"
    assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8)), f"{what}: scales"
    assert torch.equal(a.tensor_scale.float().reshape(()), b.tensor_scale.float().reshape(())), what
    assert tuple(a.tile) == tuple(b.tile), what


def _spy(monkeypatch):
    """The NVFP4 operands of the linear's three GEMMs, as they reach them."""
    seen = {}
    real_nn, real_nt = nl.nvfp4_matmul, nl.nvfp4_matmul_nt

    def nn(a, b, **kw):
        seen["wgrad" if "fprop" in seen else "fprop"] = (a, b)
        return real_nn(a, b, **kw)

    def nt(a, b, **kw):
        seen["dgrad"] = (a, b)
        return real_nt(a, b, **kw)

    monkeypatch.setattr(nl, "nvfp4_matmul", nn)
    monkeypatch.setattr(nl, "nvfp4_matmul_nt", nt)
    return seen


def _rotated(m):
    """RHT16 over tokens of ``[T, C]``: ``[C, T_pad]`` (the wgrad layout)."""
    pad = (-m.shape[0]) % 16
    return hadamard16(F.pad(m, (0, 0, 0, pad)).t().contiguous(), DEFAULT_SIGNS)


RULES = [ScaleRules("4over6", "4over6", "4over6"), ScaleRules("4over6", "6", "4over6"),
         ScaleRules("6", "4over6", "6"), ScaleRules("6", "6", "4over6")]


@pytest.mark.parametrize("rules", RULES, ids=lambda r: "-".join(r))
@pytest.mark.parametrize("tp", [False, True], ids=["local_amax", "reduced_amax"])
def test_linear_matches_reference_quantize_then_fp64_gemm(monkeypatch, rules, tp):
    g = torch.Generator().manual_seed(7)
    t, k, n = 40, 64, 48                       # 40 tokens: the wgrad pads to 48
    x = torch.randn(t, k, generator=g) * torch.logspace(-2, 1, k)   # uneven columns
    w = torch.randn(n, k, generator=g) * 0.1
    dy = torch.randn(t, n, generator=g) * torch.logspace(1, -3, t)[:, None]
    x.requires_grad_(True)
    w.requires_grad_(True)
    # a TP amax reduction: every operand's amax as the group's max, here 1.25x the local one
    reduce = (lambda a: a * 1.25) if tp else None

    def gamax(m):
        return None if reduce is None else reduce(m.abs().amax().float())

    seen = _spy(monkeypatch)
    torch.manual_seed(123)
    gen = torch.Generator().manual_seed(99)
    y = nvfp4_linear(x, w, generator=gen, amax_reduce=reduce, scale_rule=rules._asdict())
    y.backward(dy)

    ref_gen = torch.Generator().manual_seed(99)
    xt, dyt = _rotated(x.detach()), _rotated(dy)
    ref = {
        "x": quantize_reference(x.detach(), scale_rule=rules.x, global_amax=gamax(x.detach())),
        "w": quantize_reference(w.detach(), tile=(16, 16), scale_rule=rules.w, global_amax=gamax(w.detach())),
        "xt": quantize_reference(xt, scale_rule=rules.x, global_amax=gamax(xt)),
        # SR draws from the generator in the linear's order: dY's way, then RHT(dYᵀ)'s
        "dy": quantize_reference(dy, rounding="stochastic", scale_rule=rules.dy, generator=ref_gen,
                                 global_amax=gamax(dy)),
    }
    ref["dyt"] = quantize_reference(dyt, rounding="stochastic", scale_rule=rules.dy, generator=ref_gen,
                                    global_amax=gamax(dyt))
    _same(seen["fprop"][0], ref["x"], "x")
    _same(seen["fprop"][1], ref["w"], "w")
    _same(seen["dgrad"][0], ref["dy"], "dy")
    _same(seen["dgrad"][1], ref["w"], "w (dgrad)")
    _same(seen["wgrad"][0], ref["dyt"], "RHT(dYᵀ)")
    _same(seen["wgrad"][1], ref["xt"], "RHT(xᵀ)")

    # the GEMMs: the FP64 products of the decoded reference operands, up to FP32 accumulation
    d = {key: _decode64(q) for key, q in ref.items()}
    close = dict(rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(y.detach().double(), d["x"] @ d["w"].T, **close)
    torch.testing.assert_close(x.grad.double(), d["dy"] @ d["w"], **close)
    torch.testing.assert_close(w.grad.double(), d["dyt"] @ d["xt"].T, **close)

    # the rule took effect: where an operand is 4over6, some blocks chose 4 and some 6
    for key, rule, args in (("x", rules.x, {}), ("w", rules.w, {"tile": (16, 16)})):
        if rule == "4over6":
            src = x.detach() if key == "x" else w.detach()
            six = quantize_reference(src, scale_rule="6", global_amax=gamax(src), **args)
            assert not torch.equal(ref[key].data, six.data)
            m = 256.0 * 6
            enc = m / float(src.abs().amax() if gamax(src) is None else gamax(src))
            bamax = src.abs().reshape(-1, 16).amax(-1) if key == "x" else None
            if bamax is not None:      # 1x16: the chosen scale is the map-to-6 or map-to-4 one
                s = ref[key].block_scale.float().flatten()
                s6 = (bamax * (enc / 6)).clamp(max=448).to(torch.float8_e4m3fn).float()
                s4 = (bamax * (enc / 4)).clamp(max=448).to(torch.float8_e4m3fn).float()
                assert bool(((s == s6) | (s == s4)).all())
                assert bool((s == s4).any()) and bool(((s == s6) & (s6 != s4)).any())


def test_partial_linear_takes_the_rules_too():
    # the diagnostic with W unquantized: x's and dY's operands as the NVFP4 linear's, rule included
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 32, generator=g, requires_grad=True)
    w = torch.randn(16, 32, generator=g, requires_grad=True)
    rules = {"x": "4over6", "dy": "4over6"}
    y_p = partial_nvfp4_linear(x, w, keep=["w"], scale_rule=rules)
    want = _decode64(quantize_reference(x.detach(), scale_rule="4over6")) @ w.detach().double().T
    torch.testing.assert_close(y_p.double(), want, rtol=1.2e-7, atol=0)    # y's FP32 rounding
    six = _decode64(quantize_reference(x.detach(), scale_rule="6")) @ w.detach().double().T
    assert not torch.allclose(y_p.double(), six, rtol=1e-4, atol=0)


def test_scale_rules_parsing():
    assert scale_rules("4over6") == ScaleRules("4over6", "4over6", "4over6")
    assert scale_rules(None) == ScaleRules()
    assert scale_rules({"w": "4over6"}) == ScaleRules("6", "4over6", "6")
    with pytest.raises(ValueError, match="unknown operand"):
        scale_rules({"weight": "4over6"})
    with pytest.raises(ValueError, match="must be '6' or '4over6'"):
        scale_rules({"dy": "4"})


# ------------------------------------------------------------------ the kernel path
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEV = "cuda" if (torch.cuda.is_available() and not _INTERPRET) else "cpu"


@pytest.mark.skipif(not (_INTERPRET or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("rules", [ScaleRules("4over6", "4over6", "4over6"), ScaleRules("6", "4over6", "4over6")],
                         ids=lambda r: "-".join(r))
def test_kernel_path_forward_backward_bit_identical_to_reference_composition(monkeypatch, rules):
    """Where a rule is 4over6 the linear takes the composed path, every operand through the
    general Triton quantizer (on a GPU for CUDA tensors; on the CPU forced with
    ``backend="triton"`` under the interpreter): y, dX and dW equal, bit for bit, the GEMMs of
    ``quantize_reference``'s operands with the rule, stochastic rounding fed the uniforms of the
    seeds the kernel draws (``sr_stream.sr_uniforms``; dY's first, then RHT(dYᵀ)'s), the GEMMs
    run on the same device in the same layouts."""
    from fullstack_fp4.nvfp4 import NVFP4Tensor
    from fullstack_fp4.nvfp4.gemm import nvfp4_matmul, nvfp4_matmul_nt
    from fullstack_fp4.nvfp4.sr_stream import sr_uniforms

    if DEV == "cpu":
        real = nl.quantize
        # (contiguous: what the path does for CUDA tensors before the kernel reads rows)
        monkeypatch.setattr(nl, "quantize", lambda t, **kw: real(t.contiguous(), backend="triton", **kw))
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(40, 64, generator=g) * torch.logspace(-1, 1, 64)).bfloat16()  # 40 tokens: padded to 48
    w = (torch.randn(48, 64, generator=g) / 8).bfloat16()
    dy = torch.randn(40, 48, generator=g).bfloat16()
    xd, wd = x.to(DEV).requires_grad_(True), w.to(DEV).requires_grad_(True)
    y = nvfp4_linear(xd, wd, generator=torch.Generator().manual_seed(11), scale_rule=rules._asdict())
    y.backward(dy.to(DEV))

    sg = torch.Generator().manual_seed(11)
    seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=sg).item()) for _ in range(2)]

    def on_dev(q):
        return NVFP4Tensor(q.data.to(DEV), q.block_scale.to(DEV), q.tensor_scale.to(DEV), q.shape, q.dtype, q.tile)

    qx = quantize_reference(x, scale_rule=rules.x)
    qw = quantize_reference(w, tile=(16, 16), scale_rule=rules.w)
    qxt = quantize_reference(_rotated(x.float()), scale_rule=rules.x)
    qdy = quantize_reference(dy, rounding="stochastic", scale_rule=rules.dy, rand=sr_uniforms(dy.shape, seeds[0]))
    dyt = _rotated(dy.float())
    qdyt = quantize_reference(dyt, rounding="stochastic", scale_rule=rules.dy, rand=sr_uniforms(dyt.shape, seeds[1]))
    want = {"y": nvfp4_matmul(on_dev(qx), on_dev(qw), out_dtype=x.dtype),
            "dx": nvfp4_matmul_nt(on_dev(qdy), on_dev(qw), out_dtype=x.dtype),
            "dw": nvfp4_matmul(on_dev(qdyt), on_dev(qxt), out_dtype=w.dtype)}
    for name, got in (("y", y.detach()), ("dx", xd.grad), ("dw", wd.grad)):
        ref = want[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert torch.equal(got.cpu().view(torch.int16), ref.cpu().view(torch.int16)), name
