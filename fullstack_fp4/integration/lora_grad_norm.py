"""Gradient clipping of a LoRA-SVD model by the norm of the dense-equivalent gradient.

A LoRA-SVD linear trains ``W = W_res + β L2 L1`` (``L2 = QR`` frozen between realignments,
``Q`` orthonormal columns, ``R ≈ I``). Its backward routes the dense gradient ``G = dL/dW``
(fullstack_fp4/linear/lora_svd.py):

    g_Wres = (I − QQᵀ) G                 (the part outside the subspace)
    g_L1   = (1/β) R⁻¹ Qᵀ G               (least-squares: β L2 g_L1 = QQᵀG)

so the parameter gradients megatron-core sees have the norm

    ‖g_Wres‖² + ‖g_L1‖²  =  ‖(I − QQᵀ)G‖² + ‖R⁻¹QᵀG‖² / β²,

i.e. the in-subspace part counted 1/β times (4× at the default β = 0.25). Where the gradient
lives mostly in the top singular directions (it does early in training), the reported norm is
up to 1/β times the BF16 model's, and `train.grad_clip` clips a LoRA-SVD run harder than the
BF16 run it is compared with. Measured on the H200 ablation model (docs/lora-svd.md,
"Gradient clipping"): the LoRA-SVD grad norm stayed above the clip 1.0 until step ~100 while
BF16's fell below it by step 50 — the steps where the loss gap opened.

The fix: the norm megatron-core computes for clipping (and logs) uses ``β·g_L1`` for the L1
factors, which gives

    ‖g_Wres‖² + β²‖g_L1‖²  =  ‖(I − QQᵀ)G‖² + ‖R⁻¹QᵀG‖²  =  ‖G‖²   when R = I,

the norm of the dense gradient the BF16 model would clip by. The clipping coefficient then
scales every gradient (L1 included) as usual; Adam is invariant to L1's constant factor, so
only the clip changes. ``R`` is not exactly ``I``: L2 is an orthonormal ``U_r`` rounded to the
parameter dtype, so ``‖R − I‖₂ ≲`` a few units of that dtype's rounding (≈ 1e-2 relative in
BF16 at most, ~1e-3 typical) and the in-subspace term is off by that relative amount — far
below what the choice of a clip threshold resolves. Using ``β·g`` instead of ``β·R·g`` keeps the
weighting a per-element scale, which also works on the distributed optimizer's flat shards
(where a shard holds a slice of L1's rows and ``R`` mixes rows).

Measured, and why it is off by default (`fp4.lora_svd.clip_dense_norm: false`): on the H200
ablation model LoRA-SVD with the dense-norm clip ended at +3.18% validation loss against BF16,
against +2.41% with the parameter-gradient norm, in two runs whose BF16 baselines agree to
0.02% (docs/lora-svd.md). Clipping harder helped this recipe: it is the more
sensitive one to large steps (the CPU runs of docs/lora-svd.md showed the same without any
clipping). So the hypothesis that the inflated norm caused the gap is rejected; the option
stays for experiments, and the default keeps megatron's parameter-gradient norm.
"""
from __future__ import annotations

import types

import torch


def lora_l1_betas(model_chunks) -> dict[int, float]:
    """id(model param ``lora_l1``) -> β of its LoRA-SVD linear."""
    out = {}
    for chunk in model_chunks:
        for mod in chunk.modules():
            l1 = getattr(mod, "lora_l1", None)
            beta = getattr(mod, "lora_beta", None)
            if isinstance(l1, torch.nn.Parameter) and beta is not None:
                out[id(l1)] = float(beta)
    return out


def _main_params_of(wrapper) -> dict[int, torch.Tensor]:
    """id(model param) -> the main param (or the distributed optimizer's main shard) whose
    `.grad` the norm reads (`wrappers.model_main_pairs`)."""
    from fullstack_fp4.integration.wrappers import model_main_pairs

    return {id(mp): main for mp, main in model_main_pairs(wrapper)}


def _grad_of(param):
    # the same attribute megatron-core's get_main_grads_for_grad_norm reads
    if hasattr(param, "decoupled_grad"):
        return param.decoupled_grad
    return param.grad


def clip_by_dense_norm(optimizer, model_chunks) -> int:
    """Make every megatron wrapper in ``optimizer`` compute its grad norm with the LoRA-SVD L1
    gradients weighted by β (module docstring). Returns the number of L1 params weighted here
    (0: no LoRA-SVD linear, nothing changed)."""
    from fullstack_fp4.integration.wrappers import megatron_wrappers

    betas = lora_l1_betas(model_chunks)
    if not betas:
        return 0
    weighted = 0
    for wrapper in megatron_wrappers(optimizer):
        if not hasattr(wrapper, "get_main_grads_for_grad_norm"):
            continue
        mains = _main_params_of(wrapper)
        mine = [(mains[pid], beta) for pid, beta in betas.items() if pid in mains]
        if not mine:
            continue
        weighted += len(mine)
        original = wrapper.get_main_grads_for_grad_norm

        def get_main_grads_for_grad_norm(self, _original=original, _mine=mine):
            grads = _original()
            # this step's grad tensors of the L1 main params, by identity: megatron's filters
            # (shared params, tensor-parallel duplicates) stay megatron's
            scale = {}
            for p, beta in _mine:
                g = _grad_of(p)
                if g is not None:
                    scale[id(g)] = beta
            # in FP32: a BF16 grad read in place (bf16_grads.py) would round β·g to BF16; the
            # FP32 product of L1's grads (a small rank × in factor) is a small temporary
            return [g.float() * scale[id(g)] if id(g) in scale else g for g in grads]

        wrapper.get_main_grads_for_grad_norm = types.MethodType(get_main_grads_for_grad_norm, wrapper)
    return weighted
