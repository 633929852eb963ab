"""The training loop: build everything from a validated config, then step, log, eval, save.

Read top to bottom: `Trainer.__init__` builds (distributed state, data, model, optimizer,
checkpoint resume); `train()` is the loop; `train_step()` one optimizer step over the
micro-batches of one global batch through megatron-core's forward-backward schedule (which
also runs the pipeline when `pipeline_model_parallel_size > 1`).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from fullstack_fp4.telemetry import (FallbackPolicy, TelemetryCollector, fallback_state,
                                     restore_fallback_state)
from megatron.training import checkpointing, continuation, recipes, save_lock
from megatron.training.batches import MockTokens, micro_batches
from megatron.training.config import dump_yaml, to_dict
from megatron.training.errors import DataError
from megatron.training.gc_policy import GarbageCollection
from megatron.training.guards import StepGuard, guarded_optimizer_step
from megatron.training.initialize import initialize
from megatron.training.metrics import MetricsLogger, format_train_line, from_last_stage
from megatron.training.model import build_model, flops_per_token
from megatron.training.optimizer import apply_schedule, build_optimizer
from megatron.training.precision import PrecisionSchedule
from megatron.training.precision import switch_to_bf16 as _switch_to_bf16

# Dense BF16 tensor-core peak (datasheet), for MFU. Unknown devices report no MFU.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "B200": 2250.0, "GB200": 2500.0}


def peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


class Trainer:
    def __init__(self, cfg, *, verbose: bool = True):
        self.cfg, self.verbose = cfg, verbose
        self.device = initialize(cfg)
        self.rank = dist.get_rank()
        save_lock.prepare_run_dirs(cfg)  # one run per save_dir; refuses file-for-dir paths; stale .tmp
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.is_logger = (ps.is_pipeline_last_stage() and self.dp_rank == 0
                          and ps.get_tensor_model_parallel_rank() == 0)
        self.iteration, self.consumed_samples = 0, 0
        self.stop_requested = False

        self.vocab_size, self.train_ds, self.valid_ds = self._build_data()
        self.gpt = build_model(cfg, self.vocab_size, pre_process=ps.is_pipeline_first_stage(),
                               post_process=ps.is_pipeline_last_stage())
        self.gpt.to(self.device)
        self.model = self._wrap(self.gpt)
        self.optimizer = build_optimizer(cfg, [self.model])
        self.flops_per_token = flops_per_token(cfg, self.vocab_size)
        t = cfg.train
        self.guard = StepGuard(skip_nonfinite=t.skip_nonfinite, max_consecutive_skips=t.max_consecutive_skips,
                               loss_spike_factor=t.loss_spike_factor)
        self.last_skip = None
        # Quantization telemetry (no hooks at all when logging.quant_stats_interval=0) and the
        # per-module BF16 fallback it feeds (docs/telemetry.md).
        self.telemetry = TelemetryCollector(cfg.logging.quant_stats_interval, blocks=cfg.logging.quant_stats_blocks,
                                            seed=t.seed)
        self.quant_stats = {}
        self.fallback = None
        if cfg.fp4.fallback != "off":
            f = cfg.fp4
            self.fallback = FallbackPolicy(
                f.fallback, f.fallback_threshold, f.fallback_intervals, switch_fn=_switch_to_bf16,
                thresholds={"linear": f.fallback_threshold, "lora_svd": f.fallback_threshold_lora_svd,
                            "attention": f.fallback_threshold_attention,
                            "optimizer": f.fallback_threshold_optimizer})
        # fp4.bf16_from: every FP4 module of the linear and attention to BF16 from a step on
        self.precision = PrecisionSchedule(cfg, log=self.rank == 0)
        # the lr schedule (segments) and wandb run id; a resume replaces it (continuation.py)
        self.run_state = continuation.RunState.fresh(cfg)
        self._load_checkpoint()
        # opened once the checkpoint has loaded: a refused resume leaves no new file behind
        self.metrics = MetricsLogger(cfg, enabled=self.is_logger)
        self.metrics.start_wandb(self.run_state.wandb_run_id)
        self._write_run_info()

    # ---------------------------------------------------------------- build
    def _build_data(self):
        cfg = self.cfg
        t, d = cfg.train, cfg.data
        n_train = t.iters * t.global_batch_size
        n_valid = max(1, t.eval_iters) * t.global_batch_size
        self.tokenizer_identity = None  # {"vocab_size", "crc32"} of the tokenizer file; checked on resume
        if d.mock:
            v = cfg.model.vocab_size
            return (v, MockTokens(n_train, cfg.model.seq_length, v, t.seed),
                    MockTokens(n_valid, cfg.model.seq_length, v, t.seed + 1))
        from megatron.training.data import build_datasets
        from megatron.training.tokenizer import load_tokenizer

        try:
            tok = load_tokenizer(d.tokenizer)
            train, valid, _ = build_datasets(d, tokenizer=tok, seq_length=cfg.model.seq_length, seed=t.seed,
                                             train_samples=n_train, valid_samples=n_valid)
        except (ValueError, OSError) as e:
            raise DataError(str(e)) from None
        self.tokenizer_identity = checkpointing.tokenizer_identity(d.tokenizer, tok.vocab_size)
        if cfg.model.vocab_size is not None and cfg.model.vocab_size < tok.vocab_size:
            raise DataError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                            f"vocabulary ({tok.vocab_size})")
        return cfg.model.vocab_size or tok.vocab_size, train, valid

    def _wrap(self, gpt):
        cfg = self.cfg
        module = Float16Module(gpt.config, gpt) if cfg.train.precision == "bf16" else gpt
        distopt = cfg.parallel.use_distributed_optimizer
        ddp_config = DistributedDataParallelConfig(
            # false: BF16 grad buffers (megatron's default); q_adamw then reads them in place
            # (fullstack_fp4/integration/bf16_grads.py), the others get megatron's FP32 copies.
            grad_reduce_in_fp32=cfg.parallel.grad_reduce_in_fp32,
            overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
            use_distributed_optimizer=distopt,
            # Q-AdamW's 4-bit state (q_adamw; q_root's non-matrix params) is cut into 1024-entry chunks of each parameter's global index;
            # megatron's high-busbw padding puts every DP shard boundary on a 2^16 multiple, hence on
            # a chunk boundary, so the state (and the run) does not depend on the DP size.
            pad_buckets_for_high_nccl_busbw=distopt and cfg.optimizer.name in ("q_adamw", "q_root"))
        model = DistributedDataParallel(gpt.config, ddp_config, module)
        gpt.config.no_sync_func = model.no_sync
        gpt.config.finalize_model_grads_func = finalize_model_grads
        return model

    def _load_checkpoint(self):
        c = self.cfg.checkpoint
        path, weights_only = continuation.resolve_load(c)
        if path is None:
            return
        if weights_only:   # fine-tuning: fresh optimizer, iteration 0, no schedule / data check
            continuation.load_weights(path, model=self.gpt, optimizer=self.optimizer, cfg=self.cfg,
                                      tokenizer=self.tokenizer_identity)
            return
        # a changed schedule, length, batch or data must be stated (one error line otherwise)
        self.run_state, notes = continuation.check_resume(path, self.cfg, self.run_state)
        meta = checkpointing.load_checkpoint(path, model=self.gpt, optimizer=self.optimizer, cfg=self.cfg,
                                             tokenizer=self.tokenizer_identity, verified=True)
        continuation.print_notes(notes)   # the stated changes, once the resume really happens
        self.iteration, self.consumed_samples = meta["iteration"], meta["consumed_samples"]
        extra = meta["extra"]
        self.guard.load_state_dict(extra.get("guard", {}))
        if meta.get("config", {}).get("optimizer") != json.loads(json.dumps(to_dict(self.cfg)["optimizer"])):
            self.guard.reset()  # its window and skip count described the old optimizer settings
            if self.rank == 0:
                print("[guard] optimizer settings differ from the checkpoint's: the divergence guard "
                      "starts a fresh window", flush=True)
        # the schedule first: what it switches (a pure function of the step) is not a fallback
        scheduled = set(self.precision.apply([self.model], self.iteration))
        switched = restore_fallback_state([self.model], extra.get("fp4_fallback"), _switch_to_bf16)
        switched = [p for p in switched if p not in scheduled]
        if self.fallback and extra.get("fallback_policy"):
            self.fallback.load_state_dict(extra["fallback_policy"])
        if switched and self.rank == 0:
            print(f"[fp4.fallback] resumed with {len(switched)} module(s) in BF16: {', '.join(switched)}", flush=True)
        if self.rank == 0:
            print(f"[checkpoint] resumed from {path} at iteration {self.iteration}", flush=True)

    def _write_run_info(self):
        if self.rank != 0:
            return
        text = dump_yaml(self.cfg)
        if self.verbose:
            print("---- resolved config ----\n" + text + "-------------------------", flush=True)
        for d in {self.cfg.logging.dir, self.cfg.checkpoint.save_dir} - {None}:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "config.yaml"), "w") as f:
                f.write(text)
        if self.cfg.logging.dir:
            try:
                commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
            except OSError:
                commit = ""
            with open(os.path.join(self.cfg.logging.dir, "run_info.json"), "w") as f:
                # device_name: the hardware that trained the run, for tables made elsewhere from
                # its files (benchmarks/ablation.py --report-only)
                name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
                json.dump({"git_commit": commit, "argv": sys.argv, "world_size": dist.get_world_size(),
                           "torch": torch.__version__, "device": str(self.device), "device_name": name}, f, indent=1)

    # ---------------------------------------------------------------- steps
    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return losses, partial(self._loss, batch["loss_mask"])

    @staticmethod
    def _loss(loss_mask, losses):
        loss = (losses.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        # clone: the schedule divides the returned loss by num_microbatches in place
        return loss, {"lm loss": loss.detach().clone()}

    def _run_schedule(self, dataset, start_sample: int, forward_only: bool) -> float | None:
        t = self.cfg.train
        mbs = micro_batches(dataset, start_sample=start_sample, global_batch=t.global_batch_size,
                            micro_batch=t.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size,
                            device=self.device)
        out = get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=iter(mbs), model=[self.model],
            num_microbatches=len(mbs), seq_length=self.cfg.model.seq_length,
            micro_batch_size=t.micro_batch_size, forward_only=forward_only)
        if not ps.is_pipeline_last_stage():
            return None
        loss = torch.stack([o["lm loss"] for o in out]).mean()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        return (loss / self.dp_size).item()

    def train_step(self) -> tuple[float | None, float]:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # No-op off-interval. On a telemetry step: module hooks for the forward/backward and
        # step pre-hooks on the FP4 optimizers (they see the clipped grads and the old state).
        self.telemetry.begin_step([self.model], self.iteration + 1, self.optimizer)
        loss = self._run_schedule(self.train_ds, self.consumed_samples, forward_only=False)
        # The guard decides between megatron-core's grad preparation and the update itself, so
        # a NaN/Inf (or spiking) step never touches the parameters or the optimizer state.
        applied, grad_norm, reason = guarded_optimizer_step(self.optimizer, self.guard, loss)
        self.quant_stats = self.telemetry.end_step()  # {} off-interval; removes every hook
        self.last_skip = None if applied else reason
        return loss, float(grad_norm) if grad_norm is not None else float("nan")

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.cfg.train.eval_iters == 0:
            return None
        self.model.eval()
        losses = [self._run_schedule(self.valid_ds, i * self.cfg.train.global_batch_size, forward_only=True)
                  for i in range(self.cfg.train.eval_iters)]
        self.model.train()
        return None if losses[0] is None else sum(losses) / len(losses)

    def save(self):
        c = self.cfg.checkpoint
        if not c.save_dir:
            return None
        path = checkpointing.save_checkpoint(
            c.save_dir, self.iteration, model=self.gpt, optimizer=self.optimizer, cfg=self.cfg,
            keep_last=c.keep_last, train_state={"consumed_samples": self.consumed_samples,
                                                "tokenizer": self.tokenizer_identity,
                                                **self.run_state.record()},
            extra=self._checkpoint_extra(),
            protect_before=self.iteration - self.guard.consecutive_skips)  # the last applied step
        if self.rank == 0:
            print(f"[checkpoint] saved {path}", flush=True)
        return path

    def _checkpoint_extra(self) -> dict:
        # telemetry fallbacks only: what fp4.bf16_from switched follows from the step and the
        # schedule of the run that resumes (a longer run switches later)
        fallback = fallback_state([self.model])
        scheduled = set(self.precision.switched)
        fallback["bf16_modules"] = [p for p in fallback["bf16_modules"] if p not in scheduled]
        extra = {"guard": self.guard.state_dict(), "fp4_fallback": fallback}
        if self.fallback:
            extra["fallback_policy"] = self.fallback.state_dict()
        return extra

    # ---------------------------------------------------------------- telemetry
    def _agreed_stats(self, stats: dict) -> dict:
        """MAX over the ranks that hold the same modules (the tensor- and data-parallel ranks of
        this pipeline stage), in a fixed key order, so they all take the same fallback decisions.
        Each pipeline stage decides for its own modules (and keeps them in its own extra file)."""
        if dist.get_world_size() == 1 or not stats:
            return stats
        groups = (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group())
        # The name sets can differ between ranks (the distributed optimizer: a rank holds
        # shards of some parameters only), so agree on their union first; a name a rank lacks
        # enters the MAX as -inf. Only on telemetry steps: two small object all-gathers.
        keys = set(stats)
        for group in groups:
            if dist.get_world_size(group) > 1:
                lists = [None] * dist.get_world_size(group)
                dist.all_gather_object(lists, sorted(keys), group=group)
                keys = set().union(*map(set, lists))
        keys = sorted(keys)
        vals = torch.tensor([stats.get(k, -math.inf) for k in keys], dtype=torch.float64, device=self.device)
        for group in groups:
            dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(keys, vals.tolist()))

    def _handle_quant_stats(self):
        """Log this step's telemetry (if any) and let the fallback policy act on it."""
        if not self.quant_stats:
            return
        stats = self._agreed_stats(self.quant_stats)
        rec = {"iter": self.iteration, **stats}
        if self.fallback:
            f = self.cfg.fp4
            for ev in self.fallback.observe([self.model], stats):
                rec[f"fallback/{ev['module']}"] = 1
                if self.rank == 0:
                    print(f"[fp4.fallback] iteration {self.iteration}: {ev['module']}: {ev['recipe']} "
                          f"{ev['tensor']} rel_err {ev['rel_err']:.3g} > {ev['threshold']} for "
                          f"{f.fallback_intervals} interval(s) -> {ev['action'].upper()}", flush=True)
        self.metrics.log(rec)

    # ---------------------------------------------------------------- loop
    def _on_signal(self, signum, frame):
        self.stop_requested = True

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same iteration
        return bool(flag.item())

    def train(self) -> dict:
        collector = GarbageCollection.from_config(self.cfg.train)
        collector.start()
        try:
            return self._train(collector)
        finally:
            collector.stop()

    def _train(self, collector: GarbageCollection) -> dict:
        cfg, t = self.cfg, self.cfg.train
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        tokens_per_step = t.global_batch_size * cfg.model.seq_length
        peak = peak_tflops()
        last_val, start_iter = None, self.iteration
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        while self.iteration < t.iters:
            lr = self.run_state.lr(self.iteration)
            apply_schedule(self.optimizer, lr, cfg.optimizer.weight_decay)
            start = time.perf_counter()
            loss, grad_norm = self.train_step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_s = time.perf_counter() - start
            self.iteration += 1
            self.consumed_samples += t.global_batch_size
            self.precision.apply([self.model], self.iteration)   # fp4.bf16_from reached: BF16 on
            collector.after_step(self.iteration)
            recipes.after_optimizer_step([self.model], self.optimizer, cfg, self.iteration)
            if self.last_skip and self.rank == 0:  # the batch is consumed all the same
                print(f"[guard] iteration {self.iteration}: update skipped ({self.last_skip})", flush=True)
            self._handle_quant_stats()
            if self.is_logger and (self.iteration % t.log_interval == 0 or self.iteration == 1):
                tps = tokens_per_step / step_s
                tflops = tps * self.flops_per_token / dist.get_world_size() / 1e12
                rec = {"iter": self.iteration, "consumed_samples": self.consumed_samples, "loss": loss,
                       "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps, "step_ms": 1e3 * step_s,
                       "tflops": tflops, "mfu": tflops / peak if peak else None,
                       "skipped": int(self.last_skip is not None), "total_skips": self.guard.total_skips,
                       "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
                       if torch.cuda.is_available() else None}
                self.metrics.log(rec, stdout=format_train_line(rec, t.iters))
            if self.guard.exhausted:  # the parameters are those of the destructive step: not saved
                last_applied = self.iteration - self.guard.consecutive_skips
                good = checkpointing.set_aside_diverged(cfg.checkpoint.save_dir, last_applied)
                raise self.guard.error(self.iteration, good, cfg.checkpoint.save_dir)
            if self.iteration % t.eval_interval == 0 or self.iteration == t.iters:
                collector.checkpoint()
                last_val = self.evaluate()
                if last_val is not None:
                    self.metrics.log({"iter": self.iteration, "val_loss": last_val},
                                     stdout=f" validation loss at iteration {self.iteration}: {last_val:.6E} |")
            stop = self._should_stop()
            # Megatron-LM's --exit-interval: stop after a step that is a multiple of it (a run
            # resumed at 90 with exit_interval=60 stops at 120, not after its first step)
            exit_now = t.exit_interval is not None and self.iteration % t.exit_interval == 0
            periodic = cfg.checkpoint.save_interval and self.iteration % cfg.checkpoint.save_interval == 0
            if periodic or ((stop or exit_now) and cfg.checkpoint.save_on_exit):
                collector.checkpoint()
                self.save()
            if stop or exit_now:
                if self.rank == 0:
                    why = "signal received" if stop else f"train.exit_interval={t.exit_interval}"
                    print(f"[train] stopping at iteration {self.iteration} ({why})", flush=True)
                break
        else:
            if self.iteration > start_iter and cfg.checkpoint.save_on_exit and cfg.checkpoint.save_dir and not (
                    cfg.checkpoint.save_interval and self.iteration % cfg.checkpoint.save_interval == 0):
                self.save()
        self.metrics.close()
        # the validation loss of the last stage on every stage: global rank 0 prints the job's one `[train] done`
        return {"iteration": self.iteration, "val_loss": from_last_stage(last_val, self.device), "rank": self.rank}
