"""The layout-free form of the FP4 state, and back (tensor arithmetic only; reshard.py reads
and writes). See reshard.py for the design and the argument.

* `SavedRank`: one saved TP rank's FP32 master copies and moments by parameter name, decoded
  from its optimizer object(s) (Q-AdamW's 4-bit moments through `decode_param_state`; the
  pieces of a distributed optimizer joined into the rank's whole local tensor).
* `lora_to_whole` / `lora_from_whole`: fold the saved shards of one LoRA-SVD linear into its
  dense weight and dense moments in the TP = 1 shape, and split them again for one shard of
  the new layout (the realignment's split and moment routing).
* `encode_piece`: this run's Q-AdamW state of one inner parameter (a whole local tensor or a
  distributed-optimizer piece) from FP32 moments.
"""
from __future__ import annotations

import zlib

import torch

from megatron.training.tp_layout import from_canonical, to_canonical

__all__ = ["SavedRank", "payload_names", "lora_to_whole", "lora_from_whole", "encode_piece",
           "key_generator"]


def key_generator(device, *parts) -> torch.Generator:
    """A generator seeded from ``parts`` only: every rank that computes the same thing draws
    the same numbers."""
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))
    return gen


class SavedRank:
    """One saved TP rank: ``masters[name]`` (flat FP32; ``masters is None`` when the optimizer
    held no copies — megatron's FP32Optimizer, whose masters are the model params) and
    ``states[name] = (m, v, step)`` (flat FP32 moments and the step tensor)."""

    def __init__(self):
        self.masters: dict | None = {}
        self.states: dict = {}

    def add(self, payload: dict, names: list, device) -> None:
        """Take in one optimizer object of this rank (the plain optimizer's, or one DP piece of
        the distributed optimizer's: `layout["q_adamw_places"]` = ``[key, offset, whole numel,
        chunk phase]`` per inner param)."""
        from fullstack_fp4.optim.q_adamw.codecs import CHUNK
        from fullstack_fp4.optim.q_adamw.state import check_codec_version, decode_param_state

        layout, inner = payload["layout"], payload["inner"]
        numels = layout["numels"]
        # 4-bit moments of another codec version would decode to wrong values: refuse them
        # (a ValueError, which load_resharded reports as the checkpoint's)
        check_codec_version(inner, dict(enumerate(numels)))
        places = layout.get("q_adamw_places") or [None] * len(numels)
        mains = payload.get("main_params")
        if mains is None:
            self.masters = None
        for k, (name, n, pl) in enumerate(zip(names, numels, places)):
            _, off, full, phase = pl if pl is not None else (None, 0, n, 0)
            if self.masters is not None:
                buf = self.masters.setdefault(name, torch.zeros(full, device=device))
                buf[off:off + n] = mains[k].detach().reshape(-1).to(device, torch.float32)
            st = inner["state"].get(k)
            if st is None:
                continue
            st = {kk: vv.to(device) if torch.is_tensor(vv) else vv for kk, vv in st.items()}
            m, v = decode_param_state(st, n, (phase + off) % CHUNK)
            if name not in self.states:
                self.states[name] = (torch.zeros(full, device=device),
                                     torch.zeros(full, device=device), st["step"].clone().cpu())
            self.states[name][0][off:off + n] = m
            self.states[name][1][off:off + n] = v


def payload_names(payload: dict, model_names: list, names_now: list, wrapper_kind: str) -> list:
    """Parameter names of a saved optimizer object's inner params: saved with it (checkpoints
    since resharding), else from the distributed optimizer's placement keys (the model
    parameter's index), else — an older plain-optimizer object — this run's order when this
    run's wrapper is of the same kind (megatron builds the same param groups at any TP size)."""
    if payload.get("param_names"):
        return list(payload["param_names"])
    places = payload["layout"].get("q_adamw_places")
    if places:
        return [model_names[pl[0]] for pl in places]
    if payload["layout"].get("wrapper") == wrapper_kind and \
            len(payload["layout"]["numels"]) == len(names_now):
        return list(names_now)
    raise ValueError("its optimizer state names no parameters (saved before resharding existed) "
                     "and this run's optimizer is built differently")


def lora_to_whole(w_res: list, l1: list, l2: list, beta: float, axis: int, glu: bool,
                  states=None) -> dict:
    """Fold the saved shards of one LoRA-SVD linear into its layout-free form.

    ``w_res[i]``, ``l1[i]``, ``l2[i]``: shard i's W_res / L1 / L2 (local order, any float
    dtype); ``states[i]``: ``(st_res, st_l1)``, AdamW-layout FP32 states of W_res and L1, or
    ``states=None``. Returns FP32 ``{"w": W}``, the whole dense weight (``W_res_i + β L2_i L1_i``
    of every shard — the merge of the realignment — joined along ``axis`` in TP = 1 order),
    plus with states the whole dense moments ``exp_avg`` / ``exp_avg_sq`` / ``exp_avg_sq_res``
    (`dense_moments`)."""
    from fullstack_fp4.integration.lora_svd_layers import dense_moments
    from fullstack_fp4.linear.lora_svd import merge

    out = {"w": to_canonical([merge(w, a, b, beta, torch.float32)
                              for w, a, b in zip(w_res, l1, l2)], axis, glu=glu)}
    if states is not None:
        dense = [dense_moments(sr, s1, b, beta) for (sr, s1), b in zip(states, l2)]
        for k in dense[0]:
            out[k] = to_canonical([d[k] for d in dense], axis, glu=glu)
    return out


def lora_from_whole(whole: dict, tp: int, rank: int, axis: int, glu: bool, *, rank_r: int,
                    beta: float, factor_dtype, oversample: int, power_iters: int, generator,
                    route: str = "dense"):
    """Shard ``rank`` (of ``tp``) of a folded LoRA-SVD linear: ``(w_res, l2, l1, states)``.

    W_res, L2 (rounded to ``factor_dtype``, returned in FP32) and L1 come from the
    realignment's split of the shard's dense weight (randomized SVD, ``W_res = W − β L2 L1``
    after rounding L2); the moments are routed into it (`route_moments`; ``states =
    (st_res, st_l1)``, or None when ``whole`` has none). ``route="dense"`` (the layer's
    ``fp4.lora_svd.route``): W_res got the whole gradient, so the dense moments go to W_res
    unchanged and L1's are 0, as the realignment does for that route."""
    from fullstack_fp4.integration.lora_svd_layers import route_moments
    from fullstack_fp4.linear.lora_svd import lora_svd_split, subspace_basis

    w = from_canonical(whole["w"], axis, tp, rank, glu=glu)
    w_res, l2, l1 = lora_svd_split(w, rank_r, beta, oversample=oversample,
                                   power_iters=power_iters, generator=generator,
                                   factor_dtype=factor_dtype)
    states = None
    if "exp_avg" in whole:
        dense = {k: from_canonical(whole[k], axis, tp, rank, glu=glu)
                 for k in ("exp_avg", "exp_avg_sq", "exp_avg_sq_res")}
        if route == "dense":
            states = ({"exp_avg": dense["exp_avg"], "exp_avg_sq": dense["exp_avg_sq"]},
                      {"exp_avg": torch.zeros_like(l1), "exp_avg_sq": torch.zeros_like(l1)})
        else:
            states = route_moments(dense, l2, subspace_basis(l2.to(factor_dtype)), beta)
    return w_res, l2, l1, states


def encode_piece(m: torch.Tensor, v: torch.Tensor, step, *, shape, offset: int,
                 full_numel: int, chunk_phase: int, min_numel: int, generator) -> dict:
    """The Q-AdamW state of one inner parameter of this run: entries ``[offset, offset + n)``
    (``n = prod(shape)``) of the whole local moments ``m``, ``v`` (flat FP32), quantized when
    the whole tensor has ``full_numel >= min_numel`` (QAdamW's rule), on the chunk grid at
    ``chunk_phase``; the first moment's stochastic rounding draws from ``generator``."""
    from fullstack_fp4.optim.q_adamw.codecs import padded_numel
    from fullstack_fp4.optim.q_adamw.state import encode_param_state

    n = torch.Size(shape).numel()
    quantized = full_numel >= min_numel
    rand = torch.rand(padded_numel(n), device=m.device, generator=generator) if quantized else None
    st = encode_param_state(m.reshape(-1)[offset:offset + n], v.reshape(-1)[offset:offset + n],
                            quantized=quantized, shape=shape, phase=chunk_phase, rand=rand)
    st["step"] = step.clone()
    return st
