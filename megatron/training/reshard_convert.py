"""The layout-free form of a LoRA-SVD linear, and back: the saved shards joined along the
partition axis, this run's shard cut (tp_layout.py), each shard folded or split by the
recipe (fullstack_fp4/integration/reshard_state.py). See reshard.py for the design and the
argument.

* `lora_to_whole`: fold the saved shards of one LoRA-SVD linear into its dense weight and
  dense moments in the TP = 1 shape;
* `lora_from_whole`: split them again for one shard of the new layout (the realignment's
  split and moment routing).
"""
from __future__ import annotations

from megatron.training.tp_layout import from_canonical, to_canonical

__all__ = ["lora_to_whole", "lora_from_whole"]


def lora_to_whole(w_res: list, l1: list, l2: list, beta: float, axis: int, glu: bool,
                  states=None) -> dict:
    """Fold the saved shards of one LoRA-SVD linear into its layout-free form.

    ``w_res[i]``, ``l1[i]``, ``l2[i]``: shard i's W_res / L1 / L2 (local order, any float
    dtype); ``states[i]``: ``(st_res, st_l1)``, AdamW-layout FP32 states of W_res and L1, or
    ``states=None``. Returns FP32 ``{"w": W}``, the whole dense weight (``W_res_i + β L2_i L1_i``
    of every shard — the merge of the realignment — joined along ``axis`` in TP = 1 order),
    plus with states the whole dense moments ``exp_avg`` / ``exp_avg_sq`` / ``exp_avg_sq_res``
    (`fold_lora_shard`)."""
    from fullstack_fp4.integration.reshard_state import fold_lora_shard

    folded = [fold_lora_shard(w, a, b, beta, None if states is None else states[i])
              for i, (w, a, b) in enumerate(zip(w_res, l1, l2))]
    return {k: to_canonical([f[k] for f in folded], axis, glu=glu) for k in folded[0]}


def lora_from_whole(whole: dict, tp: int, rank: int, axis: int, glu: bool, *, rank_r: int,
                    beta: float, factor_dtype, oversample: int, power_iters: int, generator,
                    route: str = "dense"):
    """Shard ``rank`` (of ``tp``) of a folded LoRA-SVD linear: ``(w_res, l2, l1, states)``.

    The shard's dense weight and dense moments are cut from ``whole`` and split by
    `split_lora_shard` (the realignment's randomized SVD and moment routing; ``states =
    (st_res, st_l1)``, or None when ``whole`` has no moments)."""
    from fullstack_fp4.integration.reshard_state import split_lora_shard

    w = from_canonical(whole["w"], axis, tp, rank, glu=glu)
    dense = None
    if "exp_avg" in whole:
        dense = {k: from_canonical(whole[k], axis, tp, rank, glu=glu)
                 for k in ("exp_avg", "exp_avg_sq", "exp_avg_sq_res")}
    return split_lora_shard(w, dense, rank_r=rank_r, beta=beta, factor_dtype=factor_dtype,
                            oversample=oversample, power_iters=power_iters, generator=generator,
                            route=route)
