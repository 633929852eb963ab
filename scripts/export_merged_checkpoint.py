"""Export a `fp4.linear=lora_svd` checkpoint as a plain dense checkpoint of ours (`fp4.linear=bf16`).

For a Hugging Face `LlamaForCausalLM` folder (safetensors, any recipe, LoRA-SVD merged the same
way) use `scripts/convert_hf.py export`.

    python scripts/export_merged_checkpoint.py --src runs/x/checkpoints [--out runs/x/merged]
        [--check]

Every LoRA-SVD linear's ``W_res + β L2 L1`` is merged into one dense weight (in the model's
parameter dtype: BF16 in a BF16 run, FP32 in an FP32 run), the factors are dropped, every
other tensor is copied unchanged, and the result is written in our checkpoint format
(`megatron/training/checkpointing.py`) with the run's config, `fp4.linear=bf16` and the
`fp4.lora_svd` section reset to its defaults, at the same iteration / consumed samples. A model
of the same preset with `fp4.linear: bf16` loads it with `checkpoint.load=<out>`.

Optimizer state: the dense model has other parameters than the LoRA-SVD one, so the export
carries a freshly initialised optimizer state (zero moments, step counter = the run's
iteration, which megatron-core requires to be common to all parameters); the checkpoint is meant for
evaluation and fine-tuning, not for continuing the same run bit-exactly.

What "evaluates to the same loss" means: the merged dense model computes ``x Wᵀ`` with
``W = W_res + β L2 L1``, i.e. the LoRA-SVD model's forward **without** the NVFP4 quantization
of the W_res GEMM. Its loss equals the LoRA-SVD model's loss evaluated with exact matmuls
(`fullstack_fp4.integration.lora_svd_layers.exact_matmuls`), up to floating-point rounding
(the merged weight is rounded once to the parameter dtype). The loss of the LoRA-SVD model
with its NVFP4 forward differs from both by the effect of the quantization noise.
`--check` evaluates the three validation losses (needs the run's validation data, or a mock
data run) and prints them.

Single process (TP = PP = 1 checkpoints; a TP-sharded checkpoint's subspace is
block-diagonal per rank and is merged rank by rank only under the same torchrun layout).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trainer(cfg, load):
    from megatron.training.trainer import Trainer

    c = copy.deepcopy(cfg)
    c.checkpoint.load, c.checkpoint.save_dir, c.checkpoint.save_interval = load, None, None
    c.logging.dir, c.logging.tensorboard, c.logging.wandb = None, False, False
    return Trainer(c, verbose=False)


def export(src: str, out: str, *, check: bool = False) -> dict:
    import torch
    from megatron.training import checkpointing
    from megatron.training.config import from_dict
    from megatron.training.config_schema import LoRASVDConfig, RunConfig
    from megatron.training.errors import CheckpointError
    from fullstack_fp4.integration.lora_svd_layers import exact_matmuls, merged_state_dict

    path = checkpointing.resolve_load_path(src, None)
    meta = checkpointing.check_complete(path)
    cfg = from_dict(RunConfig, meta["config"], prefix="")
    if cfg.fp4.linear != "lora_svd":
        raise CheckpointError(f"{path} is a fp4.linear={cfg.fp4.linear} checkpoint, not lora_svd: its weights "
                              "are dense already (a Hugging Face folder: scripts/convert_hf.py export)")
    if cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size != 1:
        raise CheckpointError("the export runs in one process: TP = PP = 1 checkpoints only")
    lora = _trainer(cfg, path)
    state = merged_state_dict(lora.gpt)

    dense_cfg = copy.deepcopy(cfg)
    dense_cfg.fp4.linear = "bf16"
    dense_cfg.fp4.lora_svd = LoRASVDConfig()
    dense = _trainer(dense_cfg, "none")
    dense.gpt.load_state_dict(state, strict=True)
    # the mixed-precision optimizer's FP32 master copies were made from the random init: refresh
    # them from the merged weights, which a resume of the export reads back as the model
    dense.optimizer.reload_model_params()
    # Zero moments (the load side expects every state tensor) and megatron-core's common step
    # counter (it must be shared by all parameters): the run's iteration.
    for sub in getattr(dense.optimizer, "chained_optimizers", None) or [dense.optimizer]:
        sub.init_state_fn(sub.optimizer, sub.config)
        for st in sub.optimizer.state.values():
            st["step"] = torch.tensor(float(max(1, meta["iteration"])))
    dense.iteration, dense.consumed_samples = meta["iteration"], meta["consumed_samples"]
    saved = checkpointing.save_checkpoint(
        out, meta["iteration"], model=dense.gpt, optimizer=dense.optimizer, cfg=dense_cfg,
        keep_last=1, train_state={"consumed_samples": meta["consumed_samples"]})
    result = {"src": path, "out": saved}
    if check:
        result["val_loss_lora_nvfp4"] = lora.evaluate()
        with exact_matmuls([lora.model]):
            result["val_loss_lora_exact"] = lora.evaluate()
        result["val_loss_merged"] = _trainer(dense_cfg, saved).evaluate()
    return result


def main(argv=None) -> int:
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="a lora_svd checkpoint dir (iter_N) or its save_dir")
    p.add_argument("--out", default=None, help="save_dir of the export (default: <src save_dir>/merged)")
    p.add_argument("--check", action="store_true", help="evaluate lora (NVFP4 / exact) and merged losses")
    a = p.parse_args(argv)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.src.rstrip("/"))), "merged") \
        if os.path.isfile(os.path.join(a.src, "meta.json")) else (a.out or os.path.join(a.src, "merged"))
    from megatron.training.errors import UserError

    try:
        result = export(a.src, out, check=a.check)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        from megatron.training.initialize import shutdown

        shutdown()
    for k, v in result.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
