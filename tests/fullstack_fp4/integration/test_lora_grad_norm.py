"""LoRA-SVD clips by the dense gradient's norm (fullstack_fp4/integration/lora_grad_norm.py).

Oracle: the BF16-spec model with the same seed has exactly the same initial weights as the
LoRA-SVD model's merged weights (fp32 run; test_lora_svd_megatron checks that), so with exact
(unquantized) matmuls its megatron grad norm on the same batch is ‖G‖ of the dense model — what
the LoRA-SVD model must report with `clip_dense_norm` on. Off (the default), the norm is the parameter-gradient
norm ‖g_Wres‖² + ‖g_L1‖², which counts the in-subspace part 1/β times.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.training.config import load_config
from tests.megatron.training import helpers

RANK = 4
# the weighted norm concerns the projected route (the dense route's L1 gradient is 0)
LORA = ["fp4.linear=lora_svd", f"fp4.lora_svd.rank={RANK}", "fp4.lora_svd.realign_interval=1000",
        "fp4.lora_svd.route=projected"]


def _trainer(*overrides):
    from megatron.core import parallel_state as ps
    from megatron.training.trainer import Trainer

    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() != 1:
        pytest.skip("another test initialised tensor parallelism in this process")
    torch.set_num_threads(1)
    cfg = load_config(None, helpers.TINY + ["checkpoint.load=none", "train.iters=4", *overrides])
    cfg.logging.dir = None
    return Trainer(cfg, verbose=False)


def _norm_after_backward(t):
    """Megatron's grad norm of one exact forward/backward on the first global batch."""
    from fullstack_fp4.integration.lora_svd_layers import exact_matmuls

    t.model.zero_grad_buffer()
    t.optimizer.zero_grad()
    with exact_matmuls([t.model], True):
        t._run_schedule(t.train_ds, 0, forward_only=False)
    assert not t.optimizer.prepare_grads()
    return float(t.optimizer.get_grad_norm())


def _l1_sq_norm(t):
    from fullstack_fp4.integration.lora_svd_layers import lora_svd_modules

    return sum(float(m.lora_l1.main_grad.double().pow(2).sum()) if hasattr(m.lora_l1, "main_grad")
               else float(m.lora_l1.grad.double().pow(2).sum()) for _, m in lora_svd_modules([t.model]))


def test_clip_norm_is_the_dense_gradient_norm():
    dense = _norm_after_backward(_trainer())
    on = _trainer(*LORA, "fp4.lora_svd.clip_dense_norm=true")
    n_on = _norm_after_backward(on)
    # fp32 factors: L2 orthonormal to fp32 rounding, so R = I and the weighting is exact
    assert math.isclose(n_on, dense, rel_tol=2e-4), (n_on, dense)

    off = _trainer(*LORA)  # the default: megatron's parameter-gradient norm
    assert off.cfg.fp4.lora_svd.clip_dense_norm is False
    n_off = _norm_after_backward(off)
    beta = off.cfg.fp4.lora_svd.beta
    l1 = _l1_sq_norm(off)
    assert l1 > 0
    # the parameter-gradient norm counts the in-subspace part 1/β times: exactly
    # ‖G‖² + (1 − β²)‖g_L1‖² (‖g_Wres‖² + β²‖g_L1‖² = ‖G‖²)
    assert math.isclose(n_off ** 2, dense ** 2 + (1 - beta ** 2) * l1, rel_tol=5e-4), (n_off, dense, l1)
    assert n_off > n_on * 1.001


def test_only_lora_models_are_touched():
    from fullstack_fp4.integration.lora_grad_norm import clip_by_dense_norm

    t = _trainer()
    assert clip_by_dense_norm(t.optimizer, [t.model]) == 0
    assert "get_main_grads_for_grad_norm" not in vars(t.optimizer)


@pytest.mark.parametrize("extra", [["train.precision=bf16"],
                                   ["train.precision=bf16", "parallel.use_distributed_optimizer=true"]],
                         ids=["float16_wrapper", "distributed_optimizer"])
def test_weighting_reaches_the_main_params_of_every_wrapper(extra):
    # bf16 master-weight wrapper and the distributed optimizer (1 rank: its shard is the whole
    # param): the weighted norm is the class's unweighted one less (1 − β²)‖g_L1‖², with g_L1
    # read from the model params' own FP32 main_grad buffers (not through the mapping under test)
    from fullstack_fp4.integration.wrappers import megatron_wrappers
    from fullstack_fp4.integration.lora_svd_layers import lora_svd_modules

    t = _trainer(*LORA, "fp4.lora_svd.clip_dense_norm=true", *extra)
    _norm_after_backward(t)
    beta = t.cfg.fp4.lora_svd.beta
    l1 = sum(float(m.lora_l1.main_grad.double().pow(2).sum()) for _, m in lora_svd_modules([t.model]))
    assert l1 > 0
    for w in megatron_wrappers(t.optimizer):
        assert "get_main_grads_for_grad_norm" in vars(w)
        weighted = sum(float(g.double().pow(2).sum()) for g in w.get_main_grads_for_grad_norm())
        plain = sum(float(g.double().pow(2).sum()) for g in type(w).get_main_grads_for_grad_norm(w))
        assert math.isclose(weighted, plain - (1 - beta ** 2) * l1, rel_tol=1e-6), (weighted, plain, l1)
