"""megatron-core column- and row-parallel LoRA-SVD linears, realignment and merged export.

`LoRASVDColumnParallelLinear` / `LoRASVDRowParallelLinear` subclass megatron-core's
`ColumnParallelLinear` / `RowParallelLinear`, so weight sharding and initialisation, the TP
communication around the local GEMM and `sharded_state_dict` are megatron-core's. `weight`
holds **W_res** (trained through the NVFP4 path); two extra parameters hold the BF16 branch:

    lora_l2  [out_local, r]   requires_grad=False (frozen between realignments, see
                              fullstack_fp4/linear/lora_svd.py for the routing argument)
    lora_l1  [r, in_local]    trainable (dense route, the default: a zero gradient, so only
                              weight decay moves it; projected route: the in-subspace part)

Initial split: in `__init__`, right after megatron-core initialised `weight` with the dense
init, the local shard is split by randomized SVD with a generator seeded from the shard's
shape and TP rank only (deterministic, and it does not consume the global RNG, so every other
weight of the model is initialised exactly as in a BF16 / NVFP4 run with the same seed).
With `perform_initialization=False` (meta-device dry runs, loading) the factors stay zero.

Tensor parallelism: each rank splits and realigns **its own shard** (no gather of the full
matrix). The effective principal subspace is therefore block-diagonal across shards: for a
column-parallel layer ``W = [W_0; W_1; ...]`` (rows split) each block ``W_i`` has its own
``L2_i L1_i``, i.e. the global branch is ``blockdiag(L2_i) · [L1_0; L1_1; ...]`` of rank
``tp·r``; for a row-parallel layer (columns split) it is ``[L2_0, L2_1, ...] · blockdiag(L1_i)``.
Every factor is distinct per rank, so both carry TP attributes (`tensor_model_parallel=True`,
counted once per rank in the grad norm) and are saved as TP-sharded tensors: column-parallel
``lora_l2 [out, r]`` / ``lora_l1 [tp·r, in]`` (both along axis 0), row-parallel
``lora_l2 [out, tp·r]`` / ``lora_l1 [r, in]`` (both along axis 1). A checkpoint resumes at the
same TP size; at another TP size the tensors load but describe a different block structure.
The NVFP4 amax of W_res and of the activations is all-reduced over TP as in the NVFP4 layers.

Gradient-accumulation fusion (`fuse_wgrad_accumulation`, from `parallel.gradient_accumulation_fusion`):
as in the NVFP4 layers (fullstack_fp4/integration/nvfp4_linear_layers.py, `MainGradAccumulator`),
W_res's wgrad is added straight into `weight.main_grad` inside megatron-core's DDP — under the
dense route (the default), where W_res's gradient is the NVFP4 wgrad itself. The projected route
rewrites the wgrad (`G_q − Q QᵀG_q`) and stays unfused (fullstack_fp4/linear/lora_svd.py). L1's
gradient is never fused (a thin BF16 tensor, zero under the dense route).

Realignment (`realign_model`, called by `recipes.after_optimizer_step` when
``iteration % realign_interval == 0``): per module, from the FP32 master copies,
``W = W_res + β L2 L1`` is rebuilt, re-split by randomized SVD (generator seeded from
``(train.seed, iteration, module name, TP rank)``: a resumed run repeats it exactly), and
written back to the master copies *and* the model parameters. Optimizer state across it
(AdamW layout ``exp_avg``/``exp_avg_sq``/``step``; :func:`transfer_moments`):

* **First moments: re-routed exactly.** Adam's ``m`` is a linear EMA of the gradients, and
  the routed gradients of every past step sum to that step's dense gradient of W, so
  ``M = m_res + β L2_old m_L1`` *is* the first moment of the dense W (exactly, in the
  unquantized limit; with NVFP4, W_res's part carries the quantized wgrad). The new split
  routes ``M`` like a gradient: ``m_L1 ← (1/β) R⁻¹ QᵀM``, ``m_res ← (I − QQᵀ) M`` with the new
  ``L2 = QR``. So the momentum of W is unchanged by the realignment and each piece is what it
  would have been had the new subspace been used all along.
* **Second moments: ``v_res`` kept, ``v_L1`` propagated.** ``v`` is not linear; treating the
  elements of the dense gradient as independent, ``V = v_res + β²(L2_old∘L2_old) v_L1`` is
  its elementwise variance and the new L1 gradient ``A G`` (``A = R⁻¹Qᵀ/β``) has variance
  ``(A∘A) V``. This keeps the per-input-feature scale of ``v`` (which a reset to ``mean(v)``
  would lose). ``v_res`` keeps its elementwise statistics (same basis; the complement moved
  by at most 2r directions).
* **step** kept (megatron-core needs one count for all parameters; the bias corrections stay
  consistent with the carried moments). No state for W_res yet: L1 falls back to
  ``m ← 0, v ← mean(v)`` (:func:`reset_factor_moments`). Other layouts (e.g. quantized
  moments of q_adamw) are left unchanged — a known limitation.
* ``L2``: frozen, no optimizer state.
* **Dense route** (``fp4.lora_svd.route: dense``, fullstack_fp4/linear/lora_svd.py): W_res got
  the whole gradient, so its moments are the dense W's elementwise moments whatever the split:
  they stay as they are; L1 (zero gradients) gets zero moments (:func:`zero_factor_moments`).

BF16 switch (the telemetry fallback and the precision schedule `fp4.bf16_from`): `lora_exact`,
W_res's GEMMs unquantized beside the BF16 branch, not a merge into one dense W (the parameter
set and the optimizer state keep their layout; megatron/training/precision.py argues it).

Supported optimizer wrappers: megatron-core's `FP32Optimizer` (fp32 runs: the params are
their own masters), `Float16OptimizerWithFloat16Params` (bf16 runs: masters via
``param.main_param``), and the **distributed optimizer** (masters and moments sharded over DP
ranks in flat buffers that ignore parameter boundaries), also inside a `ChainedOptimizer`.
With the distributed optimizer every DP rank assembles the whole FP32 masters and moments of
W_res and L1 of a module (each rank writes the slice it owns into a zero buffer, one
all-reduce SUM over the DP group: bit-identical on every rank), computes the same split (same
inputs, same generator), writes the whole model parameters and its own slices of masters and
moments. Cost per realignment: all-reduces of 3× the FP32 size of every W_res and L1
(master and two moments), i.e. about three FP32 gradient all-reduces of the model, once every
``realign_interval`` steps. Tested with 2 gloo processes against the 1-process plain optimizer
(tests/fullstack_fp4/integration/test_lora_svd_distributed.py). The precision-aware
distributed optimizer (scaled states) is refused at the realignment.
"""
from __future__ import annotations

import contextlib
import zlib

import torch
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from fullstack_fp4.integration.nvfp4_linear_layers import _amax_reducer, main_grad_accumulator
from fullstack_fp4.linear.lora_svd import (BasisCache, lora_svd_linear, lora_svd_split, merge,
                                          subspace_basis)
from fullstack_fp4.linear.nvfp4_linear import scale_rules

__all__ = ["LoRASVDColumnParallelLinear", "LoRASVDRowParallelLinear", "lora_svd_modules",
           "realign_model", "exact_matmuls", "merged_state_dict", "reset_factor_moments",
           "zero_factor_moments",
           "transfer_moments", "dense_moments", "route_moments"]

_INIT_SEED = 0x5EED_1075


def _tp_rank(tp_group) -> int:
    if tp_group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(tp_group) if dist.is_initialized() else 0


class _LoRASVDMixin:
    _lora_axis: int  # TP sharding axis of weight and both factors

    def _lora_init(self, rank, beta, oversample, power_iters, exact=False, route="dense",
                   fuse_wgrad_accumulation=True, scale_rule="6"):
        if self.sequence_parallel:
            raise ValueError(f"{type(self).__name__} does not support sequence parallelism")
        out_f, in_f = self.weight.shape
        if not 0 < rank < min(out_f, in_f):
            raise ValueError(f"LoRA-SVD rank {rank} must lie in (0, {min(out_f, in_f)}) for a "
                             f"{out_f}x{in_f} shard")
        self.lora_rank, self.lora_beta = int(rank), float(beta)
        self.lora_oversample, self.lora_power_iters = int(oversample), int(power_iters)
        self.lora_exact = bool(exact)   # W_res GEMMs unquantized (exact_matmuls, `unquantized`)
        if route not in ("projected", "dense"):
            raise ValueError(f"LoRA-SVD route must be 'projected' or 'dense', got {route!r}")
        self.lora_route = route         # backward routing (fullstack_fp4/linear/lora_svd.py)
        # W_res's wgrad into megatron's main_grad (dense route only; module docstring)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.lora_scale_rule = scale_rules(scale_rule)   # W_res GEMMs' rules (fp4.linear_scale_rule)
        self._lora_basis = BasisCache()  # (Q, R⁻¹) of L2, recomputed only when L2 is rewritten
        w = self.weight
        self.lora_l2 = torch.nn.Parameter(torch.zeros(out_f, rank, dtype=w.dtype, device=w.device),
                                          requires_grad=False)
        self.lora_l1 = torch.nn.Parameter(torch.zeros(rank, in_f, dtype=w.dtype, device=w.device))
        for p in (self.lora_l1, self.lora_l2):
            set_tensor_model_parallel_attributes(p, True, self._lora_axis, 1)
        if self.config.perform_initialization and w.device.type != "meta":
            gen = torch.Generator(device=w.device)
            gen.manual_seed(_INIT_SEED + 1000003 * _tp_rank(self.tp_group) + out_f * 7919 + in_f)
            self._lora_resplit(gen, w.detach().float())

    @torch.no_grad()
    def _lora_resplit(self, generator, w_fp32, masters=None):
        """Split dense ``w_fp32`` into (W_res, L2, L1); write params (and FP32 masters)."""
        w_res, l2, l1 = lora_svd_split(w_fp32, self.lora_rank, self.lora_beta,
                                       oversample=self.lora_oversample,
                                       power_iters=self.lora_power_iters, generator=generator,
                                       factor_dtype=self.lora_l2.dtype)
        self.lora_l2.copy_(l2)
        for p, v in ((self.weight, w_res), (self.lora_l1, l1)):
            p.copy_(v)
            m = masters.get(p) if masters else None
            if m is not None and m is not p:
                m.copy_(v)

    def merge(self, dtype=None) -> torch.Tensor:
        """The dense local weight ``W_res + β L2 L1`` (BF16 in a BF16 model)."""
        return merge(self.weight, self.lora_l1, self.lora_l2, self.lora_beta, dtype)

    def _lora_forward_impl(self, input, weight, bias=None, *, allreduce_dgrad=False,
                           sequence_parallel=False, **unused):
        if sequence_parallel:
            raise ValueError("LoRA-SVD linears do not support sequence parallelism")
        if allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=self.tp_group)
        # (Q, R⁻¹) only where the backward projects (the dense route does not)
        basis = (self._lora_basis.get(self.lora_l2)
                 if torch.is_grad_enabled() and self.lora_route == "projected" else None)
        fuse = self.fuse_wgrad_accumulation and self.lora_route == "dense"
        return lora_svd_linear(input, weight, self.lora_l1, self.lora_l2, self.lora_beta, bias,
                               exact=self.lora_exact, route=self.lora_route,
                               amax_reduce=_amax_reducer(self.tp_group),
                               basis=basis, wgrad_accumulator=main_grad_accumulator(weight, fuse),
                               scale_rule=self.lora_scale_rule)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        axes = {"weight": self._lora_axis, "lora_l1": self._lora_axis, "lora_l2": self._lora_axis}
        if self._lora_axis == 0:
            axes["bias"] = 0
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, axes, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


class LoRASVDColumnParallelLinear(_LoRASVDMixin, ColumnParallelLinear):
    _lora_axis = 0

    def __init__(self, *args, lora_rank=64, lora_beta=1.0, lora_oversample=8, lora_power_iters=2,
                 lora_exact=False, lora_route="dense", fuse_wgrad_accumulation=True,
                 lora_scale_rule="6", **kwargs):
        super().__init__(*args, **kwargs)
        self._lora_init(lora_rank, lora_beta, lora_oversample, lora_power_iters, lora_exact,
                        lora_route, fuse_wgrad_accumulation, lora_scale_rule)

    def _forward_impl(self, input, weight, *args, **kwargs):
        return self._lora_forward_impl(input, weight, **kwargs)


class LoRASVDRowParallelLinear(_LoRASVDMixin, RowParallelLinear):
    _lora_axis = 1

    def __init__(self, *args, lora_rank=64, lora_beta=1.0, lora_oversample=8, lora_power_iters=2,
                 lora_exact=False, lora_route="dense", fuse_wgrad_accumulation=True,
                 lora_scale_rule="6", **kwargs):
        super().__init__(*args, **kwargs)
        self._lora_init(lora_rank, lora_beta, lora_oversample, lora_power_iters, lora_exact,
                        lora_route, fuse_wgrad_accumulation, lora_scale_rule)

    def _forward_impl(self, input, weight, *args, **kwargs):
        kwargs["allreduce_dgrad"] = False  # the input is already split along K
        return self._lora_forward_impl(input, weight, **kwargs)


# ------------------------------------------------------------------ model-level helpers
def lora_svd_modules(model_chunks):
    """``(name, module)`` of every LoRA-SVD linear, in a deterministic order."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    out = []
    for i, chunk in enumerate(model_chunks):
        for name, mod in chunk.named_modules():
            if isinstance(mod, _LoRASVDMixin):
                out.append((f"{i}.{name}", mod))
    return out


@contextlib.contextmanager
def exact_matmuls(model_chunks, exact: bool = True):
    """Run the W_res GEMMs unquantized inside the block (evaluation of the merged model)."""
    mods = [m for _, m in lora_svd_modules(model_chunks)]
    before = [m.lora_exact for m in mods]
    for m in mods:
        m.lora_exact = exact
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.lora_exact = b


def _inner_optimizers(optimizer):
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]


def _master(p):
    m = getattr(p, "main_param", None)
    if m is not None and getattr(p, "main_param_sharded", False):
        raise NotImplementedError("LoRA-SVD realignment does not support the distributed optimizer")
    return m if m is not None else p


def _state_of(optimizer, master):
    for inner in _inner_optimizers(optimizer):
        if master in inner.state:
            return inner, inner.state[master]
    return None, None


_ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}
_SGD_KEYS = {"momentum_buffer"}


def zero_factor_moments(state: dict) -> dict:
    """L1's state at a realignment under the dense route: every moment 0, step kept. (L1 gets
    zero gradients there, so its moments are 0 already; this makes it so whatever came before,
    e.g. a checkpoint of a projected-route run.) Unknown layouts are left unchanged."""
    if not set(state) <= _ADAM_KEYS | _SGD_KEYS:
        return state
    return {k: (torch.zeros_like(v) if k != "step" else v) for k, v in state.items()}


def reset_factor_moments(state: dict) -> dict:
    """Fallback policy for L1's state when W_res's state cannot be combined with it (no state
    for W_res yet, or an SGD-style layout): ``m ← 0``, ``v ← mean(v)``, step kept."""
    known = _ADAM_KEYS | _SGD_KEYS
    if not set(state) <= known:
        return state  # unknown layout (e.g. quantized moments): left unchanged, see docstring
    new = dict(state)
    for k in ("exp_avg", "momentum_buffer"):
        if k in new:
            new[k] = torch.zeros_like(new[k])
    if "exp_avg_sq" in new:
        v = new["exp_avg_sq"]
        new["exp_avg_sq"] = torch.full_like(v, float(v.float().mean()))
    return new


@torch.no_grad()
def transfer_moments(st_res: dict, st_l1: dict, l2_old, basis_old, l2_new, basis_new,
                     beta: float):
    """Re-express the Adam moments of ``(W_res, L1)`` in the new split (module docstring).

    First moments (linear in the gradients): the moment of the dense W,
    ``M = m_res + β L2_old m_L1`` (exact: the routed gradients of every past step sum to that
    step's dense gradient), is routed again with the new basis, like a gradient:
    ``m_L1 ← (1/β) R⁻¹ QᵀM``, ``m_res ← M − QQᵀM``; so ``m_res + β L2_new m_L1 = M``.
    Second moments (not linear): ``v_res`` kept; ``v_L1`` by propagating the elementwise
    variances of the dense-gradient estimate ``V = v_res + β²(L2_old∘L2_old) v_L1`` through the
    new routing matrix ``A = R⁻¹Qᵀ/β``: ``v_L1 ← (A∘A) V`` (independent elements assumed); it
    keeps the per-input-feature structure of v. Step counts are kept. Returns the new
    ``(st_res, st_l1)``; layouts other than AdamW's / SGD momentum are returned unchanged.
    """
    keys_r, keys_1 = set(st_res), set(st_l1)
    if not (keys_r == keys_1 and (keys_r <= _ADAM_KEYS or keys_r <= _SGD_KEYS)):
        return st_res, reset_factor_moments(st_l1) if keys_1 <= _ADAM_KEYS | _SGD_KEYS else st_l1
    q, rinv = basis_new
    a = (rinv @ q.T) / beta                                  # [r, out]: M ↦ m_L1
    l2o = l2_old.float()
    new_r, new_1 = dict(st_res), dict(st_l1)
    for k in ("exp_avg", "momentum_buffer"):
        if k in st_res:
            m = st_res[k].float() + beta * (l2o @ st_l1[k].float())
            m1 = a @ m
            new_1[k] = m1.to(st_l1[k].dtype)
            new_r[k] = (m - beta * (l2_new.float() @ m1)).to(st_res[k].dtype)
    if "exp_avg_sq" in st_res:
        v = st_res["exp_avg_sq"].float() + beta ** 2 * ((l2o * l2o) @ st_l1["exp_avg_sq"].float())
        new_1["exp_avg_sq"] = ((a * a) @ v).to(st_l1["exp_avg_sq"].dtype)
    return new_r, new_1


@torch.no_grad()
def dense_moments(st_res: dict, st_l1: dict, l2, beta: float) -> dict:
    """The moments of the dense ``W = W_res + β L2 L1`` that a ``(W_res, L1)`` AdamW-layout
    state describes — the first half of :func:`transfer_moments`, for carrying the state to
    another split *shape* (a checkpoint resumed at another TP size, reshard_state.py):
    ``exp_avg``: ``M = m_res + β L2 m_L1`` (exactly the dense first moment, see the module
    docstring); ``exp_avg_sq``: ``V = v_res + β²(L2∘L2) v_L1`` (elementwise variances of the
    dense gradient, independent elements assumed); ``exp_avg_sq_res``: ``v_res`` (the routing
    keeps it). FP32 tensors of W's shape; row/column blocks of them may be cut and re-joined
    like W itself."""
    l2o = l2.detach().float()
    return {"exp_avg": st_res["exp_avg"].float() + beta * (l2o @ st_l1["exp_avg"].float()),
            "exp_avg_sq": st_res["exp_avg_sq"].float()
            + beta ** 2 * ((l2o * l2o) @ st_l1["exp_avg_sq"].float()),
            "exp_avg_sq_res": st_res["exp_avg_sq"].float()}


@torch.no_grad()
def route_moments(dense: dict, l2_new, basis_new, beta: float):
    """The second half of :func:`transfer_moments`: route the dense moments of
    :func:`dense_moments` into a new split ``L2_new = Q R`` (``basis_new = (Q, R⁻¹)``):
    ``m_L1 = A M``, ``m_res = M − β L2_new m_L1``, ``v_L1 = (A∘A) V``, ``v_res`` kept, with
    ``A = R⁻¹Qᵀ/β``. ``transfer_moments(...) == route_moments(dense_moments(...), ...)`` for
    FP32 states (tested). Returns FP32 ``(st_res, st_l1)`` without ``step``."""
    q, rinv = basis_new
    a = (rinv @ q.T) / beta
    m = dense["exp_avg"]
    m1 = a @ m
    return ({"exp_avg": m - beta * (l2_new.detach().float() @ m1),
             "exp_avg_sq": dense["exp_avg_sq_res"]},
            {"exp_avg": m1, "exp_avg_sq": (a * a) @ dense["exp_avg_sq"]})


def _realign_generator(device, seed: int, iteration: int, name: str, tp_rank: int):
    gen = torch.Generator(device=device)
    key = zlib.crc32(f"{seed}/{iteration}/{name}/{tp_rank}".encode())
    gen.manual_seed(key)
    return gen


def _distributed_optimizer_of(optimizer, param):
    """The megatron-core `DistributedOptimizer` (inside a `ChainedOptimizer` or not) that owns
    ``param``, or None."""
    if optimizer is None:
        return None
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        # not `model_param_gbuf_map`: it lists only the params this DP rank owns a piece of
        if any(param in b.param_index_map for b in getattr(sub, "buffers", None) or ()) \
                and hasattr(sub, "model_param_gbuf_map"):
            return sub
    return None


_MOMENTS = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def _gather_sharded(dopt, param):
    """Whole FP32 master and Adam moments of ``param`` from the DP shards of the distributed
    optimizer: each rank writes the slice it owns into a zero buffer, one all-reduce (SUM) over
    the DP group assembles it (``x + 0 = x``: bit-identical on every rank). Returns
    ``(full [1 or 3, *shape], adam, (range, tensors) of this rank or None)``."""
    import torch.distributed as dist

    if getattr(dopt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        raise NotImplementedError("LoRA-SVD realignment: the precision-aware distributed "
                                  "optimizer keeps scaled states; not supported")
    try:
        rng = dopt._get_model_param_range_map(param)["param"]
        tensors = dopt._get_main_param_and_optimizer_states(param)
    except KeyError:  # this DP rank owns no piece of the parameter
        rng, tensors = None, None
    # moments are re-expressed only for AdamW's layout, decided identically on every rank
    adam = torch.ones(1, dtype=torch.int32, device=param.device)
    if tensors is not None and not (set(tensors) - {"param"} == {"step", *_MOMENTS}):
        adam.zero_()
    dist.all_reduce(adam, op=dist.ReduceOp.MIN, group=dopt.data_parallel_group)
    keys = ("param", *_MOMENTS) if int(adam) else ("param",)
    full = torch.zeros(len(keys), param.numel(), dtype=torch.float32, device=param.device)
    if tensors is not None and rng.size > 0:
        for i, k in enumerate(keys):
            full[i, rng.start:rng.end] = tensors[k].detach().float().view(-1)
    dist.all_reduce(full, group=dopt.data_parallel_group)
    return full.view(len(keys), *param.shape), bool(int(adam)), (
        (rng, tensors) if tensors is not None else None)


@torch.no_grad()
def _scatter_sharded(mine, values: dict) -> None:
    """Write this rank's slices of the whole tensors ``values`` (key -> full) back."""
    if mine is None:
        return
    rng, tensors = mine
    for k, v in values.items():
        tensors[k].copy_(v.reshape(-1)[rng.start:rng.end].to(tensors[k].dtype))


@torch.no_grad()
def _realign_module_distributed(mod, optimizer, generator) -> None:
    """Realignment under megatron-core's distributed optimizer (masters sharded over DP).

    Every DP rank gathers the whole FP32 masters and moments of W_res and L1 (one all-reduce
    each), computes the same split (same inputs, same generator: identical on every rank),
    writes the model parameters (whole, like the param all-gather after a step would) and its
    own slices of the masters and moments. Same result as the non-distributed path."""
    d_w = _distributed_optimizer_of(optimizer, mod.weight)
    d_1 = _distributed_optimizer_of(optimizer, mod.lora_l1)
    if d_w is None or d_1 is None:
        raise NotImplementedError("LoRA-SVD: W_res and L1 must both be in the distributed optimizer")
    full_w, adam_w, mine_w = _gather_sharded(d_w, mod.weight)
    full_1, adam_1, mine_1 = _gather_sharded(d_1, mod.lora_l1)
    l2_old = mod.lora_l2.detach().float().clone()
    w = merge(full_w[0], full_1[0], mod.lora_l2, mod.lora_beta, torch.float32)
    w_res, l2, l1 = lora_svd_split(w, mod.lora_rank, mod.lora_beta,
                                   oversample=mod.lora_oversample,
                                   power_iters=mod.lora_power_iters, generator=generator,
                                   factor_dtype=mod.lora_l2.dtype)
    mod.lora_l2.copy_(l2)
    mod.weight.copy_(w_res)
    mod.lora_l1.copy_(l1)
    new_w, new_1 = {"param": w_res}, {"param": l1}
    if adam_w and adam_1 and mod.lora_route == "dense":
        # W_res's moments are the dense W's (it got the whole gradient): they stay; L1 got zeros
        new_1.update({k: torch.zeros_like(full_1[i + 1]) for i, k in enumerate(_MOMENTS)})
    elif adam_w and adam_1:
        st_r = {k: full_w[i + 1] for i, k in enumerate(_MOMENTS)}
        st_1 = {k: full_1[i + 1] for i, k in enumerate(_MOMENTS)}
        st_r, st_1 = transfer_moments(st_r, st_1, l2_old, subspace_basis(l2_old),
                                      mod.lora_l2.detach().float(),
                                      subspace_basis(mod.lora_l2.detach()), mod.lora_beta)
        new_w.update(st_r)
        new_1.update(st_1)
    _scatter_sharded(mine_w, new_w)
    _scatter_sharded(mine_1, new_1)


@torch.no_grad()
def realign_module(mod, optimizer, generator) -> None:
    if _distributed_optimizer_of(optimizer, mod.weight) is not None:
        return _realign_module_distributed(mod, optimizer, generator)
    masters = {p: _master(p) for p in (mod.weight, mod.lora_l1)} if optimizer is not None else {}
    w_res = masters.get(mod.weight, mod.weight)
    l1 = masters.get(mod.lora_l1, mod.lora_l1)
    l2_old = mod.lora_l2.detach().float().clone()
    w = merge(w_res, l1, mod.lora_l2, mod.lora_beta, torch.float32)
    mod._lora_resplit(generator, w, masters)
    if optimizer is None:
        return
    inner1, st1 = _state_of(optimizer, masters[mod.lora_l1])
    if st1 is None:
        return
    inner_r, st_r = _state_of(optimizer, masters[mod.weight])
    if mod.lora_route == "dense":
        # W_res's moments are the dense W's (it got the whole gradient) and stay
        inner1.state[masters[mod.lora_l1]] = zero_factor_moments(st1)
        return
    if st_r is None:
        inner1.state[masters[mod.lora_l1]] = reset_factor_moments(st1)
        return
    new_r, new_1 = transfer_moments(st_r, st1, l2_old, subspace_basis(l2_old),
                                    mod.lora_l2.detach().float(),
                                    subspace_basis(mod.lora_l2.detach()), mod.lora_beta)
    inner_r.state[masters[mod.weight]] = new_r
    inner1.state[masters[mod.lora_l1]] = new_1


def realign_model(model_chunks, optimizer, *, seed: int, iteration: int) -> int:
    """Re-split every LoRA-SVD linear; returns how many were realigned."""
    mods = lora_svd_modules(model_chunks)
    for name, mod in mods:
        gen = _realign_generator(mod.weight.device, seed, iteration, name, _tp_rank(mod.tp_group))
        realign_module(mod, optimizer, gen)
    return len(mods)


@torch.no_grad()
def merged_state_dict(model, dtype=None) -> dict:
    """``model.state_dict()`` with every LoRA-SVD linear's ``weight`` replaced by its merged
    dense weight and the factors dropped: the state dict of the same model with plain linears."""
    merged = {name: mod.merge(dtype) for name, mod in lora_svd_modules([model])}
    out = {}
    for k, v in model.state_dict().items():
        owner, _, leaf = k.rpartition(".")
        key = f"0.{owner}"
        if key in merged:
            if leaf in ("lora_l1", "lora_l2"):
                continue
            if leaf == "weight":
                v = merged[key]
        out[k] = v
    return out


def lora_svd_layer_specs(lcfg, fuse_wgrad_accumulation: bool = True, scale_rule="6"):
    """(column, row) `ModuleSpec`s carrying the `fp4.lora_svd` settings (and
    `parallel.gradient_accumulation_fusion`, `fp4.linear_scale_rule`) into the layers."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    params = dict(lora_rank=lcfg.rank, lora_beta=lcfg.beta, lora_oversample=lcfg.oversample,
                  lora_power_iters=lcfg.power_iters, lora_exact=lcfg.unquantized,
                  lora_route=lcfg.route, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                  lora_scale_rule=scale_rules(scale_rule))
    return (ModuleSpec(module=LoRASVDColumnParallelLinear, params=dict(params)),
            ModuleSpec(module=LoRASVDRowParallelLinear, params=dict(params)))


def check_supported(cfg) -> None:
    """Refuse configurations the realignment cannot handle (a config error, before training)."""
    from fullstack_fp4.errors import ConfigError

    if cfg.fp4.lora_svd.beta <= 0:
        raise ConfigError("fp4.lora_svd.beta must be > 0")
