"""QAttnCoreAttention inside a tiny megatron-core GPTModel (forward + backward): on the CPU with
the Triton interpreter; on a GPU the Triton cases run there (compiled kernels need CUDA tensors)."""

import os

import pytest
import torch

megatron = pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def parallel():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no TCP port
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123, inference_rng_tracker=True)
    yield


def _triton_device() -> str:
    """Where the Triton-backend cases run: the GPU when there is one and the interpreter is off
    (a compiled kernel refuses CPU tensors), else the CPU under the interpreter."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    return "cpu"


def _model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from fullstack_fp4.integration.q_attn_core_attention import QAttnCoreAttention
    cfg = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4,
                            num_query_groups=2, kv_channels=32 * 2, ffn_hidden_size=256,
                            use_cpu_initialization=True, attention_dropout=0.0,
                            hidden_dropout=0.0)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = QAttnCoreAttention
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64,
                     max_sequence_length=64, position_embedding_type="learned_absolute")
    return model


@pytest.mark.parametrize("backend", [None, "triton"])
def test_gpt_forward_backward_uses_q_attn(parallel, backend):
    """The whole model, on the reference (CPU dispatch) and on the Triton kernels (interpreter
    on CPU): megatron's own [s, b, h, d] q, k, v views go in, gradients reach the QKV weight."""
    from fullstack_fp4.integration.q_attn_core_attention import QAttnCoreAttention
    torch.manual_seed(0)
    dev = _triton_device() if backend == "triton" else "cpu"
    model = _model().to(dev)
    cores = [m for m in model.modules() if isinstance(m, QAttnCoreAttention)]
    assert len(cores) == 2
    for core in cores:
        core.backend = backend
    tokens = torch.randint(0, 64, (2, 48)).to(dev)
    pos = torch.arange(48).unsqueeze(0).expand(2, -1).to(dev)
    labels = torch.randint(0, 64, (2, 48)).to(dev)
    loss = model(tokens, pos, None, labels=labels).mean()
    assert torch.isfinite(loss)
    loss.backward()
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all() and qkv.grad.abs().sum() > 0


def test_core_attention_matches_q_attention_and_refuses(parallel):
    from megatron.core.transformer.enums import AttnMaskType
    from fullstack_fp4.attention import q_attention
    from fullstack_fp4.integration.q_attn_core_attention import QAttnCoreAttention
    model = _model()
    core = [m for m in model.modules() if isinstance(m, QAttnCoreAttention)][0]
    q = torch.randn(32, 2, 4, 64)
    k = torch.randn(32, 2, 2, 64)
    v = torch.randn(32, 2, 2, 64)
    out = core(q, k, v, None)
    ref = q_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), causal=True)
    assert out.shape == (32, 2, 4 * 64)
    assert torch.equal(out, ref.permute(2, 0, 1, 3).reshape(32, 2, 256))
    with pytest.raises(ValueError, match="attention_bias"):
        core(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="packed"):
        core(q, k, v, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="dropout"):
        QAttnCoreAttention(core.config, 1, AttnMaskType.causal, None, attention_dropout=0.1)
    with pytest.raises(ValueError, match="causal and no_mask"):
        core(q, k, v, None, attn_mask_type=AttnMaskType.padding)


def _megatron_qkv(s, b, groups, heads_per_group, d, seed=0, device="cpu"):
    """``(mixed, query, key, value)`` as megatron's ``get_query_key_value_tensors`` builds them:
    a leaf ``[s, b, groups, (heads_per_group + 2)·d]`` (the QKV projection output), split along
    the last dim; query reshaped to ``[s, b, heads, d]``, key / value strided views."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(s, b, groups, (heads_per_group + 2) * d, generator=g)
    mixed = mixed.to(torch.bfloat16).to(device).requires_grad_()
    query, key, value = torch.split(mixed, [heads_per_group * d, d, d], dim=3)
    return mixed, query.reshape(s, b, groups * heads_per_group, d), key, value


def test_core_attention_megatron_layout_without_copies(parallel, monkeypatch):
    """On the Triton path the module hands megatron back the kernels' own tensors: the output
    [s, b, h·d] is a view of the O the forward kernel stored, dO reaches the backward as the
    gradient megatron passed, dQ, dK, dV arrive at the query/key/value views as the tensors the
    backward returned (contiguous [s, b, h, d], no copy between), and the prologue reads query
    and key in place. V, a view into the QKV buffer, is compacted once before it is saved
    (function._kernel_v). Numbers: bit-identical to q_attention on contiguous copies. GQA."""
    from fullstack_fp4.attention import q_attention, triton_bwd, triton_fwd, triton_prologue
    from fullstack_fp4.attention.layout import owns_its_storage
    from fullstack_fp4.integration.q_attn_core_attention import QAttnCoreAttention
    dev = _triton_device()
    core = [m for m in _model().to(dev).modules() if isinstance(m, QAttnCoreAttention)][0]
    core.backend = "triton"
    seen = {}

    def spy(module, name, record):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            record(args, out)
            return out
        monkeypatch.setattr(module, name, wrapper)
    spy(triton_prologue, "quantize_views",
        lambda a, out: seen.setdefault("prologue_in", []).append(a[0]))
    spy(triton_fwd, "attention_forward", lambda a, out: seen.update(v_in=a[1], o=out[0]))
    spy(triton_bwd, "attention_backward", lambda a, out: seen.update(do_in=a[0], grads=out))

    s, b, d = 32, 2, 64
    mixed, query, key, value = _megatron_qkv(s, b, 2, 2, d, device=dev)   # 4 heads, 2 groups
    grads = {}
    for name, x in (("q", query), ("k", key), ("v", value)):
        x.register_hook(lambda g, name=name: grads.__setitem__(name, g))
    out = core(query, key, value, None)
    out.register_hook(lambda g: grads.__setitem__("out", g))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(dout)

    assert [x.data_ptr() for x in seen["prologue_in"]] == [query.data_ptr(), key.data_ptr()]
    assert out.is_contiguous() and out.data_ptr() == seen["o"].data_ptr()
    assert not owns_its_storage(value)             # the fused-buffer view ...
    assert seen["v_in"].permute(2, 0, 1, 3).is_contiguous()        # ... compacted, [s, b, h, d]
    assert seen["do_in"].data_ptr() == grads["out"].data_ptr()
    for name, g in zip("qkv", seen["grads"]):
        assert grads[name].data_ptr() == g.data_ptr(), name
        assert grads[name].is_contiguous(), (name, grads[name].stride())

    ref_in = [x.detach().permute(1, 2, 0, 3).contiguous().requires_grad_()
              for x in (query, key, value)]
    ref = q_attention(*ref_in, causal=True, backend="triton")
    ref.backward(dout.reshape(s, b, 4, d).permute(1, 2, 0, 3))
    assert torch.equal(out, ref.detach().permute(2, 0, 1, 3).reshape(s, b, 4 * d))
    for name, x in zip("qkv", ref_in):
        assert torch.equal(grads[name], x.grad.permute(2, 0, 1, 3)), name
