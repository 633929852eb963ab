"""QAttnCoreAttention inside a tiny megatron-core GPTModel on CPU (forward + backward)."""


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


def test_gpt_forward_backward_uses_q_attn(parallel):
    from fullstack_fp4.integration.q_attn_core_attention import QAttnCoreAttention
    torch.manual_seed(0)
    model = _model()
    cores = [m for m in model.modules() if isinstance(m, QAttnCoreAttention)]
    assert len(cores) == 2
    tokens = torch.randint(0, 64, (2, 48))
    pos = torch.arange(48).unsqueeze(0).expand(2, -1)
    labels = torch.randint(0, 64, (2, 48))
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
