"""`fp4.unquantized_operands` (the NVFP4 linear with operands left unquantized, a diagnostic)
inside megatron-core, in process on CPU (tiny GPTModel, gloo, one process).

Oracles: `partial_nvfp4_linear` called on the layer's own weight and input (the layer must be
that function, with the trainer's gradient-accumulation fusion: main_grad before + the function's
FP64 dW, rounded once); the config's refusals by their messages.
"""
from __future__ import annotations

import functools

import pytest
import torch

from fullstack_fp4.linear.partial_nvfp4 import partial_nvfp4_linear
from megatron.training.config import ConfigError, load_config
from tests.megatron.training import helpers

TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "checkpoint.load=none", "train.iters=4",
        "optimizer.lr=3e-3", "optimizer.warmup_iters=0", "train.precision=fp32"]
KEEP_W = ["fp4.linear=nvfp4", "fp4.unquantized_operands=[w]"]

_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)


@functools.lru_cache(maxsize=None)
def _trainer():
    from megatron.training.trainer import Trainer

    cfg = load_config(None, TINY + KEEP_W)
    cfg.logging.dir = None
    return Trainer(cfg, verbose=False)


def test_config_refusals():
    assert load_config(None, TINY + KEEP_W).fp4.unquantized_operands == ["w"]
    assert load_config(None, TINY).fp4.unquantized_operands == []
    with pytest.raises(ConfigError, match="diagnostic of fp4.linear=nvfp4"):
        load_config(None, TINY + ["fp4.linear=lora_svd", "fp4.unquantized_operands=[w]"])
    with pytest.raises(ConfigError, match="distinct names from x, w, dy"):
        load_config(None, TINY + ["fp4.linear=nvfp4", "fp4.unquantized_operands=[weight]"])
    with pytest.raises(ConfigError, match="distinct names from x, w, dy"):
        load_config(None, TINY + ["fp4.linear=nvfp4", "fp4.unquantized_operands=[w, w]"])


@pytest.mark.parametrize("suffix", ["mlp.linear_fc1", "self_attention.linear_proj"])
def test_layer_is_the_partial_linear_with_fused_main_grad(suffix):
    tr = _trainer()
    layer = next(m for n, m in tr.model.named_modules() if n.endswith(f"decoder.layers.1.{suffix}"))
    assert layer.unquantized_operands == {"w"}
    out_f, in_f = layer.weight.shape
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(8, 2, in_f, generator=g), torch.randn(8, 2, out_f, generator=g)
    tr.model.zero_grad_buffer()
    mg = layer.weight.main_grad
    mg.copy_(torch.randn(mg.shape, generator=g) * 1e-2)
    before = mg.clone()
    torch.manual_seed(3)                     # the layer's SR draws come from the global RNG
    y, _ = layer(x.clone().requires_grad_())
    y.backward(dy)
    w = layer.weight.detach().clone().requires_grad_()
    torch.manual_seed(3)
    y_ref = partial_nvfp4_linear(x.clone().requires_grad_(), w, keep=["w"])   # dX too: its draw comes first
    y_ref.backward(dy)
    assert torch.equal(y, y_ref)
    assert layer.weight.grad_added_to_main_grad
    ref = (before.double() + w.grad.double()).float()   # w.grad: the FP64 dW rounded to FP32
    assert torch.allclose(mg, ref, rtol=1e-6, atol=1e-7)
    assert not torch.equal(mg, before)


def test_trains():
    tr = _trainer()
    steps = [tr.train_step() for _ in range(3)]      # (loss, grad norm)
    assert all(torch.isfinite(torch.tensor(s)).all() for s in steps)
    assert tr.last_skip is None
