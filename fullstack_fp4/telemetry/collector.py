"""TelemetryCollector: sampled quantization statistics of every FP4 recipe, every ``interval`` steps.

Usage (trainer, see docs/telemetry.md § Wiring)::

    tel = TelemetryCollector(interval=cfg.logging.quant_stats_interval, blocks=64, seed=cfg.train.seed)
    tel.begin_step(model, iteration, optimizer)   # installs hooks only if tel.enabled(iteration)
    ... forward / backward / optimizer.step() ...
    rec.update(tel.end_step())                    # removes hooks; {"quant/<path>/<tensor>/<stat>": float}

Zero cost when off: on a step where ``enabled(iteration)`` is False no hook exists (nothing is
installed and ``end_step`` returns ``{}`` without touching a tensor). On an enabled step:

* NVFP4 linears (``_nvfp4_forward_impl``): a forward hook samples ``x`` (1×16 blocks, nearest,
  the fprop operand), ``w`` (16×16 tiles, nearest; once per step) and the wgrad copy of x
  ``wgrad_x`` (RHT-16 of xᵀ, 1×16 along tokens, nearest); a tensor hook on the output samples
  ``dy`` (1×16, stochastic, the dgrad operand) and ``wgrad_dy`` (RHT-16 of dYᵀ, stochastic).
* LoRA-SVD linears (``_lora_forward_impl``, not in ``lora_exact`` mode): the same x / dy /
  wgrad operands of the W_res GEMM, ``w_res`` (W_res, 16×16 tiles) and ``lora_energy``
  (‖β L2 L1‖² / ‖W_res + β L2 L1‖², a fraction, not an error), on sampled 16×16 tiles.
* Block-scale rules: every operand of a linear is quantized with the rule the module quantizes
  it with (``module_scale_rules``: the NVFP4 linear's ``scale_rule``, LoRA-SVD's
  ``lora_scale_rule``, each a ``ScaleRules``; ``"6"`` for a module without one): x's rule for
  ``x`` and ``wgrad_x``, w's for ``w`` / ``w_res``, dy's for ``dy`` and ``wgrad_dy``. Under
  ``"4over6"`` the tensor scale and the per-block (per-tile) 4-or-6 choice are the
  reference's, so the errors, and the fallback they drive, are those of the run's quantizer.
* Q-Attn core attention (class ``QAttnCoreAttention``): per call, one uniformly drawn
  (batch, head): ``s`` (S = QKᵀ on ``attn_rows`` sampled query rows) in the forward hook, and
  ``ds`` (dS of one sampled 64-query tile row, quantized as the dQ GEMM takes it) from a tensor
  hook on the output gradient.
* Q-AdamW (``QAdamW``, also inside megatron's wrapper / the SplitOptimizer): a step *pre*-hook,
  i.e. after grad clipping and before the update, samples ``opt_chunks`` 1024-entry chunks per
  quantized parameter: ``m``, ``v``, ``update`` rel_err and ``v_clamped`` (fraction of v
  entries raised by the decode guard), under ``quant/optimizer/<param name>/...``.
* Q-Muon / Q-Root (``ns_precision == "nvfp4"``): a step pre-hook draws ``ns_matrices`` matrices
  (one orthogonalised block each) and records ``ns_step`` (worst one-step NS error),
  ``ns_orth`` and ``ns_orth_fp32`` (‖XXᵀ − I‖/‖I‖ of the NVFP4 and of the FP32 iteration).
  Whole 2-D params only: under the distributed optimizer the optimizer holds 1-D pieces of the
  matrices, and no NS statistics are recorded (not built).

The hooks only *gather* the sampled blocks of the linears (and their tensor amax); ``end_step``
quantizes all samples of one kind (tile, rounding, RHT, scale rule) in one batched call with a
per-row tensor scale (``batched_qdq.qdq_rows``, the reference arithmetic bit for bit) and adds
each sample's sums to its name: ~15 launches per operand in the hooks instead of ~100, and a few
dozen per kind at the end (the per-sample calls made the host, not the GPU, the telemetry
step's cost; `BENCHMARKS.md#telemetry`). The stochastic-rounding uniforms are drawn there, from the
step's generator, in the order the samples were gathered.

Sums of squared errors and of squares (or counts) are accumulated per name over micro-batches
(and activation recomputation) on the device; ``end_step`` does the one host sync and turns
``*/rel_err`` sums into ``sqrt(Σe²/Σx²)``, ``*/frac`` and ``lora_energy/frac`` into ratios.

Not measured (docs/telemetry.md): TP-reduced amax (local amax is used: on TP > 1 the tensor
scale may differ slightly from the recipe's); the NS statistics use the optimizer's
``_momentum`` / ``_pre_ns`` methods on a *copy* of the state (no public API gives the NS input).

Which modules: found by duck typing (no megatron import here); modules in BF16 fallback
(``fp4_fallback_bf16``) are skipped. ``predicate`` (default ``is_nvfp4_linear``) selects the
NVFP4 linears as before. Q-Attn's S / dS are measured with the 6 rule (Q-Attn quantizes with
no other) and the optimizers' statistics with their own codecs / NS call.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from fullstack_fp4.linear.nvfp4_linear import scale_rules

from . import recipe_stats as rs
from .batched_qdq import qdq_rows
from .stats import sample_blocks, to_device

__all__ = ["TelemetryCollector", "is_nvfp4_linear", "is_lora_svd_linear", "is_q_attn",
           "module_recipe", "module_path", "main_param_names", "module_scale_rules"]


def is_nvfp4_linear(m: torch.nn.Module) -> bool:
    return hasattr(m, "_nvfp4_forward_impl") and not getattr(m, "fp4_fallback_bf16", False)


def is_lora_svd_linear(m: torch.nn.Module) -> bool:
    return (hasattr(m, "_lora_forward_impl") and hasattr(m, "lora_l1")
            and not getattr(m, "fp4_fallback_bf16", False) and not getattr(m, "lora_exact", False))


def is_q_attn(m: torch.nn.Module) -> bool:
    return type(m).__name__ == "QAttnCoreAttention" and not getattr(m, "fp4_fallback_bf16", False)


def module_recipe(m) -> Optional[str]:
    """"linear" | "lora_svd" | "attention" for an FP4 module (in fallback or not), else None."""
    if m is None:
        return None
    if hasattr(m, "_lora_forward_impl") and hasattr(m, "lora_l1"):
        return "lora_svd"
    if hasattr(m, "_nvfp4_forward_impl"):
        return "linear"
    if type(m).__name__ == "QAttnCoreAttention":
        return "attention"
    return None


def module_scale_rules(m, attr: str = "scale_rule") -> tuple:
    """``(x, w, dy)`` block-scale rules (``"6"`` / ``"4over6"``) of a linear: its attribute
    ``attr`` (``"scale_rule"`` for the NVFP4 linear, ``"lora_scale_rule"`` for LoRA-SVD's W_res
    GEMMs) as ``fullstack_fp4.linear.nvfp4_linear.scale_rules`` reads it (a ``ScaleRules``, one
    string for all three, or a mapping); ``("6", "6", "6")`` where the module has none."""
    rule = getattr(m, attr, None)
    return ("6", "6", "6") if rule is None else tuple(scale_rules(rule))


def module_path(name: str) -> str:
    """Strip wrapper prefixes (DDP / Float16Module ``module.``) from a named_modules() path."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers doing the update, through megatron's wrappers and SplitOptimizer."""
    if optimizer is None:
        return []
    out = []
    for w in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(w, "optimizer", w)
        out.extend(getattr(inner, "subs", None) or [inner])
    return [o for o in out if isinstance(o, torch.optim.Optimizer)]


def main_param_names(optimizer, model_chunks) -> Dict[int, str]:
    """id(param the inner optimizer updates) -> model parameter name (wrapper prefixes stripped).

    Float16 wrappers keep FP32 main copies: paired with their model params through the
    wrapper's ``float16_groups`` / ``fp32_from_float16_groups`` (megatron-core) or
    ``param.main_param``; FP32 wrappers update the model params themselves."""
    models = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    names = {}
    for chunk in models:
        for n, p in chunk.named_parameters():
            names[id(p)] = module_path(n)
            mp = getattr(p, "main_param", None)
            if mp is not None:
                names[id(mp)] = module_path(n)
    pairs = (("float16_groups", "fp32_from_float16_groups"),              # Float16 wrapper
             ("model_float16_groups", "shard_fp32_from_float16_groups"),  # distributed optimizer:
             ("model_fp32_groups", "shard_fp32_groups"))                  # shards keep the name
    for w in getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer else []):
        for model_attr, main_attr in pairs:
            for gm, gs in zip(getattr(w, model_attr, None) or [], getattr(w, main_attr, None) or []):
                for p, m in zip(gm, gs):
                    if id(p) in names and m is not None:
                        names[id(m)] = names[id(p)]
    return names


class TelemetryCollector:
    """Registry name -> value of sampled quantization statistics (see module docstring)."""

    def __init__(self, interval: int, *, blocks: int = 64, seed: int = 0,
                 predicate: Callable[[torch.nn.Module], bool] = is_nvfp4_linear,
                 wgrad: bool = True, attn_rows: int = 16, opt_chunks: int = 2,
                 ns_matrices: int = 1):
        if interval < 0 or blocks < 1 or attn_rows < 1 or opt_chunks < 1 or ns_matrices < 0:
            raise ValueError("interval >= 0, blocks, attn_rows, opt_chunks >= 1, ns_matrices >= 0")
        self.interval, self.blocks, self.seed, self.predicate = interval, blocks, seed, predicate
        self.wgrad, self.attn_rows, self.opt_chunks, self.ns_matrices = wgrad, attn_rows, opt_chunks, ns_matrices
        self.registry: Dict[str, float] = {}
        self._sums: Dict[str, list] = {}
        self._direct: Dict[str, torch.Tensor] = {}
        self._pending: Dict[tuple, list] = {}   # (tile, rounding, rht, rule) -> [(name, sample, amax)]
        self._handles: list = []
        self._gen: Optional[torch.Generator] = None
        self._done_w: set = set()
        self._names: Dict[int, str] = {}

    def enabled(self, iteration: int) -> bool:
        return self.interval > 0 and iteration % self.interval == 0

    @property
    def active(self) -> bool:
        return bool(self._handles)

    # -------------------------------------------------------------- accumulation
    def _acc(self, key: str, num, den) -> None:
        acc = self._sums.get(key)
        if acc is None:
            self._sums[key] = [num, den]
        else:
            acc[0] = acc[0] + num
            acc[1] = acc[1] + den

    def _add(self, path: str, tensor: str, t: torch.Tensor, tile, rounding: str, rule: str = "6"):
        if t.shape[-1] % 16 or (tile[0] == 16 and t.reshape(-1, t.shape[-1]).shape[0] % 16):
            return
        t = t.detach()
        gamax = t.abs().amax().float()
        smp, _ = sample_blocks(t, blocks=self.blocks, generator=self._gen, tile=tile)
        self._defer(f"quant/{path}/{tensor}/rel_err", smp, gamax, tuple(tile), rounding, False, rule)

    def _add_wgrad(self, path: str, tensor: str, t: torch.Tensor, rounding: str, rule: str = "6"):
        if not self.wgrad or t.shape[-1] % 16:
            return
        smp, gamax = rs.wgrad_operand_sample(t, blocks=self.blocks, generator=self._gen)
        self._defer(f"quant/{path}/{tensor}/rel_err", smp, gamax, (1, 16), rounding, True, rule)

    def _defer(self, key: str, sample: torch.Tensor, gamax: torch.Tensor, tile, rounding: str,
               rht: bool, rule: str = "6") -> None:
        """Keep a sample (``[n·th, 16]`` FP32) and its tensor amax for ``_quantize_pending``;
        ``rule``: the operand's block-scale rule (samples of one rule are quantized together)."""
        self._pending.setdefault((tile, rounding, rht, rule), []).append((key, sample, gamax.reshape(1)))

    def _quantize_pending(self) -> None:
        """Quantize every gathered sample, one ``qdq_rows`` call per kind, and add each
        sample's (Σ err², Σ x²) to its name (no host sync)."""
        from fullstack_fp4.nvfp4 import DEFAULT_SIGNS

        for (tile, rounding, rht, rule), items in self._pending.items():
            rows = [it[1].shape[0] for it in items]
            x = torch.cat([it[1] for it in items])
            dev = x.device
            counts = to_device(torch.tensor(rows), dev)
            gam = torch.cat([it[2] for it in items]).repeat_interleave(counts, output_size=x.shape[0])
            rand = None
            if rounding == "stochastic":
                rand = to_device(torch.rand(x.shape, generator=self._gen), dev)
            e = x - qdq_rows(x, gam, tile=tile, rounding=rounding, rand=rand,
                             rht_signs=DEFAULT_SIGNS if rht else None, scale_rule=rule)
            seg = torch.arange(len(items), device=dev).repeat_interleave(counts, output_size=x.shape[0])
            e2 = torch.zeros(len(items), device=dev).index_add_(0, seg, e.pow(2).sum(-1))
            x2 = torch.zeros(len(items), device=dev).index_add_(0, seg, x.pow(2).sum(-1))
            for i, it in enumerate(items):
                self._acc(it[0], e2[i], x2[i])
        self._pending = {}

    def record(self, name: str, value: float) -> None:
        """Record any other scalar statistic in this interval's registry."""
        self.registry[name] = float(value)

    # -------------------------------------------------------------- hooks
    def begin_step(self, model, iteration: int, optimizer=None) -> bool:
        """Install hooks on every matching module (and the optimizer's step pre-hooks) if
        ``enabled(iteration)``; returns whether it did."""
        self.end_step() if self.active else None
        if not self.enabled(iteration):
            return False
        self._gen = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
        self._done_w = set()
        models = model if isinstance(model, (list, tuple)) else [model]
        for chunk in models:
            for name, m in chunk.named_modules():
                path = module_path(name)
                if self.predicate(m):
                    self._handles.append(m.register_forward_hook(self._linear_hook(path, "w")))
                elif is_lora_svd_linear(m):
                    self._handles.append(m.register_forward_hook(self._linear_hook(path, "w_res")))
                elif is_q_attn(m):
                    self._handles.append(m.register_forward_hook(self._attn_hook(path), with_kwargs=True))
        inner = _inner_optimizers(optimizer)
        if inner:
            self._names = main_param_names(optimizer, models)
            self._install_optimizer_hooks(inner)
        return True

    def _linear_hook(self, path: str, wname: str):
        attr = "scale_rule" if wname == "w" else "lora_scale_rule"

        def hook(module, args, output):
            rx, rw, rdy = module_scale_rules(module, attr)
            x = args[0] if args else None
            with torch.no_grad():
                if torch.is_tensor(x):
                    self._add(path, "x", x, (1, 16), "nearest", rx)
                    self._add_wgrad(path, "wgrad_x", x, "nearest", rx)
                w = getattr(module, "weight", None)
                if torch.is_tensor(w) and path not in self._done_w:
                    self._done_w.add(path)
                    if wname == "w":
                        self._add(path, "w", w, (16, 16), "nearest", rw)
                    else:
                        st = rs.lora_svd_sample(w, module.lora_l1, module.lora_l2, module.lora_beta,
                                                tiles=self.blocks, generator=self._gen)
                        self._defer(f"quant/{path}/w_res/rel_err", st["w_res_tiles"],
                                    st["w_res_amax"], (16, 16), "nearest", False, rw)
                        self._acc(f"quant/{path}/lora_energy/frac", *st["energy"])
            y = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(y) and y.requires_grad:
                def grad_hook(g):
                    with torch.no_grad():
                        self._add(path, "dy", g, (1, 16), "stochastic", rdy)
                        self._add_wgrad(path, "wgrad_dy", g, "stochastic", rdy)
                y.register_hook(grad_hook)
        return hook

    def _attn_hook(self, path: str):
        def hook(module, args, kwargs, output):
            names = ("query", "key", "value")
            qkv = [args[i] if len(args) > i else kwargs.get(n) for i, n in enumerate(names)]
            if not all(torch.is_tensor(t) for t in qkv) or not torch.is_tensor(output):
                return
            q, k, v = qkv                                   # [s, b, heads, d], [s, b, groups, d]
            mask_type = kwargs.get("attn_mask_type") or getattr(module, "attn_mask_type", None)
            causal = "causal" in str(mask_type)
            sq, b, h, d = q.shape
            g = h // k.shape[2]
            bi = int(torch.randint(b, (1,), generator=self._gen))
            hi = int(torch.randint(h, (1,), generator=self._gen))
            # copies of one head (S×D each), not views: a view would keep the whole Q/K/V of
            # every layer alive until its backward on a telemetry step
            qh, kh, vh = (t.detach().clone() for t in (q[:, bi, hi], k[:, bi, hi // g], v[:, bi, hi // g]))
            with torch.no_grad():
                rows = torch.randint(sq, (self.attn_rows,), generator=self._gen)
                self._acc(f"quant/{path}/s/rel_err", *rs.attn_s_sums(qh, kh, rows, causal=causal))
            if output.requires_grad:
                oh = output[:, bi, hi * d:(hi + 1) * d].detach().clone()
                tile_row = int(torch.randint(-(-sq // 64), (1,), generator=self._gen))
                scale = float(module.softmax_scale)

                def grad_hook(grad):
                    with torch.no_grad():
                        doh = grad[:, bi, hi * d:(hi + 1) * d]
                        self._acc(f"quant/{path}/ds/rel_err",
                                  *rs.attn_ds_sums(qh, kh, vh, oh, doh, tile_row, scale=scale,
                                                   causal=causal))
                output.register_hook(grad_hook)
        return hook

    # -------------------------------------------------------------- optimizer
    def _install_optimizer_hooks(self, inner: list) -> None:
        from fullstack_fp4.optim import QAdamW
        from fullstack_fp4.optim.muon import OrthogonalOptimizer

        for opt in inner:
            if isinstance(opt, QAdamW):
                self._handles.append(opt.register_step_pre_hook(self._q_adamw_hook))
            elif isinstance(opt, OrthogonalOptimizer) and self.ns_matrices and any(
                    g.get("ns_precision") == "nvfp4" for g in opt.param_groups):
                self._handles.append(opt.register_step_pre_hook(self._ns_hook))

    def _pname(self, p, gi: int, pi: int) -> str:
        return self._names.get(id(p), f"group{gi}.param{pi}")

    @torch.no_grad()
    def _q_adamw_hook(self, opt, args, kwargs):
        from fullstack_fp4.optim.q_adamw.optimizer import grad_of

        # one batched call per param group (rs.q_adamw_group_sums): the sampled chunks of every
        # quantized parameter are decoded / encoded together; no host sync (the step counts are
        # QAdamW's CPU tensors, the chunk draws come from the CPU generator)
        for gi, group in enumerate(opt.param_groups):
            b1, b2 = group["betas"]
            items, names = [], []
            for pi, p in enumerate(group["params"]):
                st = opt.state.get(p, {})
                place = getattr(p, "q_adamw_place", None)   # a piece of a larger tensor
                full = place.full_numel if place is not None else p.numel()
                g = grad_of(p)   # the BF16 grad buffer's view under grad_reduce_in_fp32=false
                if g is None or "exp_avg" in st or (not st and full < group["min_numel"]):
                    continue   # FP32 moments: nothing is quantized
                phase = place.chunk_phase() if place is not None else 0
                items.append((st, g, phase))
                names.append(self._pname(p, gi, pi))
            if not items:
                continue
            all_sums = rs.q_adamw_group_sums(items, beta1=b1, beta2=b2, eps=group["eps"],
                                             chunks=self.opt_chunks, generator=self._gen)
            for name, sums in zip(names, all_sums):
                for t in ("m", "v", "update"):
                    self._acc(f"quant/optimizer/{name}/{t}/rel_err", *sums[t])
                self._acc(f"quant/optimizer/{name}/v_clamped/frac", *sums["v_clamped"])

    @torch.no_grad()
    def _ns_hook(self, opt, args, kwargs):
        from fullstack_fp4.optim.muon import split_blocks

        cands = [(gi, pi, group, p) for gi, group in enumerate(opt.param_groups)
                 if group.get("ns_precision") == "nvfp4"
                 for pi, p in enumerate(group["params"])
                 if p.grad is not None and p.ndim == 2]   # not the distributed optimizer's 1-D pieces
        if not cands:
            return
        pick = torch.randperm(len(cands), generator=self._gen)[: self.ns_matrices].tolist()
        for j in pick:
            gi, pi, group, p = cands[j]
            g = p.grad
            st = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state.get(p, {}).items()}
            d = opt._momentum(g, st, group)          # on a copy: the real state is untouched
            perm = getattr(p, "ns_row_perm", None)
            if perm is not None:
                perm = perm.to(d.device)
                d = d.index_select(0, perm)
            blocks = split_blocks(d, p)
            d_b = blocks[int(torch.randint(len(blocks), (1,), generator=self._gen))]
            x = opt._pre_ns(d_b, group)
            def ns_fn(m, k, sched, prec, group=group):   # the optimizer's own NS call
                # eager: a graph per (k, schedule) would be captured and kept for a sample
                return opt.orthogonalize(m, {**group, "ns_steps": k, "ns_coefficients": sched,
                                             "ns_precision": prec}, cuda_graph=False)

            out = rs.ns_stats(x, steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                              precision=group["ns_precision"], ns_fn=ns_fn)
            name = self._pname(p, gi, pi)
            for k, v in out.items():
                self._direct[f"quant/optimizer/{name}/{k}/rel_err"] = v

    def end_step(self) -> Dict[str, float]:
        """Remove hooks; return {name: value} of this step (one host sync), also in ``registry``."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._pending:
            self._quantize_pending()
        if not self._sums and not self.registry and not self._direct:
            return {}
        keys = list(self._sums) + list(self._direct)
        vals = [(e / x).sqrt() if k.endswith("/rel_err") else e / x for k, (e, x) in self._sums.items()]
        vals += list(self._direct.values())
        flat = []
        if vals:
            dev = vals[0].device
            flat = torch.stack([v.float().reshape(()).to(dev) for v in vals]).tolist()  # one sync
        out = dict(zip(keys, flat))
        self._sums, self._direct = {}, {}
        out.update(self.registry)
        self.registry = {}
        self.last = out
        return out
