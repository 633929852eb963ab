"""The typed schema of a run config: one dataclass per YAML section.

Every key a user can type lives here, with its default and a one-line meaning. Cross-field
rules ("hidden size divisible by heads", "global batch divisible by micro batch x DP") live in
`config_validate.py`; loading, composition and overrides in `config.py`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class ModelConfig:
    preset: Optional[str] = None  # tiny | 125m | 350m | 1b | 3b: fills the fields below left unset
    num_layers: Optional[int] = None  # transformer blocks
    hidden_size: Optional[int] = None  # model width h
    ffn_hidden_size: Optional[int] = None  # SwiGLU inner width (gate and up each)
    num_attention_heads: Optional[int] = None  # query heads
    num_query_groups: Optional[int] = None  # GQA: number of KV heads
    seq_length: Optional[int] = None  # tokens per sample
    vocab_size: Optional[int] = None  # None: taken from the tokenizer (data.tokenizer)
    make_vocab_size_divisible_by: int = 128  # pad the vocabulary (times TP size) for fast GEMMs
    rotary_base: int = 10000  # RoPE base
    norm_epsilon: float = 1e-5  # RMSNorm epsilon
    init_method_std: float = 0.02  # std of the normal weight init
    position_embedding: str = "rope"  # rope | learned


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1  # TP: heads and FFN split over this many GPUs
    pipeline_model_parallel_size: int = 1  # PP: layers split into this many stages
    use_distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks
    overlap_grad_reduce: bool = False  # overlap DP grad all-reduce with backward (GPU only)
    gradient_accumulation_fusion: bool = True  # NVFP4 / LoRA-SVD linears add their wgrad straight into megatron's grad buffer (main_grad), rounded once, instead of returning dW for DDP to add in a second pass; megatron's BF16 linears stay unfused (theirs needs apex); fullstack_fp4/integration/nvfp4_linear_layers.py
    grad_reduce_in_fp32: bool = True  # keep FP32 grad buffers (4 B/param); false: BF16 grad buffer, which q_adamw reads in place; other optimizers get megatron's FP32 copies (fullstack_fp4/optim/q_adamw/README.md)


@dataclass
class TrainConfig:
    iters: int = 1000  # optimizer steps of the whole run (the schedule follows this)
    continue_with: list[str] = field(default_factory=list)  # resuming with changed settings, stated: extend (train.iters / optimizer.decay_iters: the rest of the lr decay stretched to the new length, no jump) | new_data (data blend, seq length, seed) | new_batch_size | new_precision (fp4.bf16_from, linear_scale_rule, unquantized_operands); unstated changes are refused (megatron/training/continuation.py)
    exit_interval: Optional[int] = None  # stop, with a checkpoint, after the next step that is a multiple of it (Megatron-LM --exit-interval)
    global_batch_size: int = 32  # samples per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 4  # samples per forward/backward on one rank
    seed: int = 1234  # weights init and data order
    precision: str = "bf16"  # bf16 | fp32
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    eval_interval: int = 100  # validate every N steps (and at the end)
    eval_iters: int = 10  # global batches per validation (the same batches every time)
    log_interval: int = 10  # log every N steps
    skip_nonfinite: bool = True  # skip the update when the loss or grad norm is NaN/Inf
    max_consecutive_skips: int = 5  # then save and stop (0: never stop)
    loss_spike_factor: Optional[float] = None  # skip when loss > factor x mean of recent good losses
    manual_gc: bool = False  # Python's cyclic garbage collector off during training and run at set points instead (Megatron-LM's --manual-gc): no collector pause lands inside a step; megatron/training/gc_policy.py
    manual_gc_interval: int = 0  # with manual_gc: also collect every N steps (0: only around validation and checkpoints)


@dataclass
class QAdamWConfig:
    min_numel: int = 4096  # parameters smaller than this keep FP32 moments
    approx_division: bool = False  # GPU kernel: the update's m/d as m * rcp.approx(d) (faster; p within 2^-22 of the update, states unchanged; docs/perf/q-adamw.md)


@dataclass
class OrthogonalConfig:
    momentum: float = 0.95  # Muon / Root momentum
    ns_steps: int = 5  # Newton-Schulz iterations
    coefficients: str = "auto"  # auto (muon->muon, root->root table) | muon | root | fitted
    clip_percentile: Optional[float] = None  # None: the recipe's default
    lr_scale: float = 1.0  # multiplies optimizer.lr for the orthogonalised matrices
    nvfp4_terms: int = 2  # q_root / q_muon: NVFP4 operands per NS matrix (1: faster, ~9% final error; 2: ~1%)
    cuda_graph: bool = True  # on CUDA, run each Newton-Schulz as a CUDA graph captured once per matrix shape: same kernels and values, one launch instead of ~55-80 per NVFP4 NS step (fullstack_fp4/optim/newton_schulz.py: newton_schulz_graphed); costs the captured graph's buffers, one set per matrix shape (BENCHMARKS.md#newtonschulz-root-and-muon)
    tp_mode: str = "duplicated"  # TP>1: duplicated (gather each TP-split matrix, every rank runs NS on the whole: same numbers as 1 GPU) | blockwise (NS on the local shard only: cheaper, a different algorithm)


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | q_adamw | root | q_root | muon | q_muon
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # final learning rate of the decay
    weight_decay: float = 0.1  # decoupled; not applied to norms and biases
    beta1: float = 0.9  # Adam beta1
    beta2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_iters: int = 100  # linear warmup steps
    decay_iters: Optional[int] = None  # None: train.iters
    wsd_decay_fraction: float = 0.2  # wsd: last fraction of decay_iters spent decaying
    q_adamw: QAdamWConfig = field(default_factory=QAdamWConfig)
    orthogonal: OrthogonalConfig = field(default_factory=OrthogonalConfig)


@dataclass
class LoRASVDConfig:
    rank: int = 64  # r of the BF16 branch L2 L1
    beta: float = 0.25  # W = W_res + beta L2 L1, L2 orthonormal: beta = the branch's extra in-subspace step (docs/lora-svd.md)
    realign_interval: int = 2048  # re-split W by randomized SVD every N steps
    oversample: int = 8  # randomized SVD oversampling
    power_iters: int = 2  # randomized SVD power iterations
    clip_dense_norm: bool = False  # true: grad clipping / logged grad norm use beta*g_L1, the dense gradient's norm (measured worse, docs/lora-svd.md)
    route: str = "dense"  # dense: W_res gets the whole NVFP4 wgrad, the branch is held between realignments (GPU ablation +0.30% vs BF16); projected: W_res gets (I-QQ^T)G, L1 the in-subspace part (the paper's routing, +2.3%; docs/lora-svd.md)
    unquantized: bool = False  # diagnostic: W_res GEMMs unquantized, the reparametrisation without NVFP4 (separates its dynamics from quantization; docs/lora-svd.md)


@dataclass
class LinearScaleRuleConfig:
    """Also accepts one value for all three operands (`fp4.linear_scale_rule: 4over6`)."""
    x: str = "6"  # (one value sets all three: fp4.linear_scale_rule=4over6) 6 | 4over6: block scale rule of the activations (fprop x and the wgrad's RHT(x^T)); 4over6: per block the lower-error of block max -> 6 or -> 4, tensor-scale bound 256 instead of 448 (fullstack_fp4/nvfp4/reference.py)
    w: str = "6"  # 6 | 4over6: the weight's 16x16 tiles (W_res under lora_svd), one quantization for fprop and dgrad; a trained W's tiles gain nothing from 4over6 (BENCHMARKS.md, NVFP4 loss levers)
    dy: str = "6"  # 6 | 4over6: the output gradient (dgrad dY and the wgrad's RHT(dY^T), stochastic rounding after the choice)

    @classmethod
    def from_scalar(cls, value) -> "LinearScaleRuleConfig":
        return cls(x=str(value), w=str(value), dy=str(value))


@dataclass
class FP4Config:
    linear: str = "bf16"  # bf16 | nvfp4 | lora_svd
    attention: str = "bf16"  # bf16 | q_attn
    bf16_first_layers: int = 0  # keep the first N transformer blocks in BF16 (shorthand for keep_bf16 patterns decoder.layers.<i>.*)
    bf16_last_layers: int = 0  # keep the last N transformer blocks in BF16 (shorthand, as bf16_first_layers)
    keep_bf16: list[str] = field(default_factory=list)  # fnmatch patterns over FP4 module names (decoder.layers.<i>.self_attention.linear_qkv / linear_proj / core_attention, decoder.layers.<i>.mlp.linear_fc1 / linear_fc2; global layer index): matched modules keep BF16, e.g. ["decoder.layers.0.*", "*.linear_fc2"]; a pattern matching none is an error (megatron/training/precision.py)
    bf16_from: Optional[Union[int, float]] = None  # precision schedule: from this point every FP4 recipe of the linear (nvfp4, lora_svd) and Q-Attn runs in BF16; an integer S >= 1: after S steps; a float f in (0, 1]: after floor(f * train.iters) steps (e.g. 0.9: the last 10% in BF16); null: never (megatron/training/precision.py)
    linear_scale_rule: LinearScaleRuleConfig = field(default_factory=LinearScaleRuleConfig)
    unquantized_operands: list[str] = field(default_factory=list)  # diagnostic, fp4.linear=nvfp4: operands of x, w, dy left unquantized (FP64 GEMMs; which operand costs the loss, docs/lora-svd.md)
    fallback: str = "off"  # off | warn | bf16: per-module BF16 fallback on sustained quantization error (needs logging.quant_stats_interval > 0 and an FP4 recipe; docs/telemetry.md)
    fallback_threshold: float = 0.25  # NVFP4 linears: worst of x, w, dy, wgrad_x, wgrad_dy rel_err above this is a bad interval (~2.5x the 9.5% Gaussian round trip)
    fallback_threshold_lora_svd: float = 0.25  # LoRA-SVD linears: worst of x, w_res, dy, wgrad_x, wgrad_dy rel_err (switch: W_res GEMM unquantized)
    fallback_threshold_attention: float = 0.35  # Q-Attn: worst of s, ds rel_err (S has two quantized operands: ~13% expected); switch: SDPA
    fallback_threshold_optimizer: float = 1.0  # Q-AdamW update / Q-Muon-Root ns_step rel_err: WARN only (no BF16 path for optimizers)
    fallback_intervals: int = 3  # K consecutive bad telemetry intervals trigger the fallback
    lora_svd: LoRASVDConfig = field(default_factory=LoRASVDConfig)


@dataclass
class DataConfig:
    path: list[str] = field(default_factory=list)  # indexed-dataset prefixes (no .bin/.idx)
    weights: Optional[list[float]] = None  # blend weights, one per path
    split: str = "98,2,0"  # train,valid,test proportions of the documents in path
    valid_path: Optional[list[str]] = None  # if set: validation reads these instead of a split
    tokenizer: Optional[str] = None  # SentencePiece .model
    cache_dir: Optional[str] = None  # megatron-core dataset index cache (default: next to the data)
    num_workers: int = 0  # reserved for loader worker processes
    mock: bool = False  # synthetic random tokens (benchmarks, dry runs): no files needed
    reset_position_ids: bool = False  # restart positions after each end-of-document token
    reset_attention_mask: bool = False  # (megatron-core GPTDataset option)
    eod_mask_loss: bool = False  # no loss on end-of-document tokens


@dataclass
class CheckpointConfig:
    save_dir: Optional[str] = None  # where iter_NNNNNNN/ checkpoints and `latest` go
    save_interval: Optional[int] = None  # checkpoint every N steps
    load: str = "auto"  # auto | none | <path to a checkpoint dir or a save_dir>
    load_mode: str = "full"  # full: resume model, optimizer, data position, lr schedule | weights_only: the model weights of checkpoint.load only, fresh optimizer at iteration 0 (fine-tuning, an imported model); a checkpoint already in save_dir is resumed in full (megatron/training/continuation.py)
    override_scheduler: bool = False  # resuming: take this config's lr schedule (optimizer.lr, min_lr, schedule, warmup_iters, decay_iters, weight_decay, train.iters) from the checkpoint's iteration on, reached from the current lr over optimizer.warmup_iters steps, instead of refusing a changed one
    keep_last: int = 3  # older complete checkpoints are deleted (never a damaged one, nor the newest one from before the last applied step)
    allow_fresh_start: bool = False  # load=auto with checkpoints in save_dir but none loadable: start from iteration 0 instead of stopping with an error (the damaged directories are kept)
    save_on_exit: bool = True  # final checkpoint at train.iters / exit_interval / SIGTERM


@dataclass
class LoggingConfig:
    dir: Optional[str] = None  # metrics.jsonl, TensorBoard, resolved config
    tensorboard: bool = True  # write <dir>/tensorboard
    wandb: bool = False  # log to wandb (pip install -e .[wandb])
    wandb_project: str = "fullstack-fp4"  # wandb project name
    wandb_mode: str = "offline"  # offline | online | disabled
    quant_stats_interval: int = 0  # quantization telemetry every N steps (quant/... metrics, docs/telemetry.md); 0: off, no hooks
    quant_stats_blocks: int = 64  # telemetry sample size: quantization blocks (or tiles) per tensor and micro-batch


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    fp4: FP4Config = field(default_factory=FP4Config)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# Model presets: Llama-style shapes (SwiGLU FFN, GQA). `3b` is the paper's efficiency shape.
PRESETS: dict[str, dict] = {
    "tiny": dict(num_layers=4, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                 num_query_groups=2, seq_length=128),
    "125m": dict(num_layers=12, hidden_size=768, ffn_hidden_size=2048, num_attention_heads=12,
                 num_query_groups=4, seq_length=2048),
    "350m": dict(num_layers=24, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                 num_query_groups=4, seq_length=2048),
    "1b": dict(num_layers=24, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
               num_query_groups=4, seq_length=4096),
    "3b": dict(num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
               num_query_groups=8, seq_length=4096),
}


def to_dict(cfg) -> dict:
    """The config as nested plain dicts (what meta.json and the run's config.yaml hold)."""
    return dataclasses.asdict(cfg)
