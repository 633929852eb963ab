"""The typed schema of a run config: one dataclass per YAML section.

Every key a user can type lives here, with its default and a one-line meaning. Cross-field
rules ("hidden size divisible by heads", "global batch divisible by micro batch x DP") live in
`config_validate.py`; loading, composition and overrides in `config.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelConfig:
    preset: Optional[str] = None  # tiny | 125m | 350m | 1b | 3b: fills the fields below left unset
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None  # GQA: number of KV heads
    seq_length: Optional[int] = None
    vocab_size: Optional[int] = None  # None: taken from the tokenizer (data.tokenizer)
    make_vocab_size_divisible_by: int = 128
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    position_embedding: str = "rope"  # rope | learned


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False


@dataclass
class TrainConfig:
    iters: int = 1000
    exit_interval: Optional[int] = None  # stop after this iteration with a checkpoint
    global_batch_size: int = 32
    micro_batch_size: int = 4
    seed: int = 1234
    precision: str = "bf16"  # bf16 | fp32
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_iters: int = 10
    log_interval: int = 10


@dataclass
class QAdamWConfig:
    min_numel: int = 4096  # parameters smaller than this keep FP32 moments


@dataclass
class OrthogonalConfig:
    momentum: float = 0.95
    ns_steps: int = 5
    coefficients: str = "auto"  # auto (muon->muon, root->root table) | muon | root | fitted
    clip_percentile: Optional[float] = None  # None: the recipe's default
    lr_scale: float = 1.0


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | q_adamw | root | q_root | muon | q_muon
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_iters: int = 100
    decay_iters: Optional[int] = None  # None: train.iters
    wsd_decay_fraction: float = 0.2  # wsd: last fraction of decay_iters spent decaying
    q_adamw: QAdamWConfig = field(default_factory=QAdamWConfig)
    orthogonal: OrthogonalConfig = field(default_factory=OrthogonalConfig)


@dataclass
class LoRASVDConfig:
    rank: int = 64
    beta: float = 1.0
    realign_interval: int = 2048
    oversample: int = 8
    power_iters: int = 2


@dataclass
class FP4Config:
    linear: str = "bf16"  # bf16 | nvfp4 | lora_svd
    attention: str = "bf16"  # bf16 | q_attn
    bf16_first_layers: int = 0  # keep the first N transformer blocks in BF16
    bf16_last_layers: int = 0  # keep the last N transformer blocks in BF16
    fallback: str = "off"  # off | warn | bf16
    lora_svd: LoRASVDConfig = field(default_factory=LoRASVDConfig)


@dataclass
class DataConfig:
    path: list[str] = field(default_factory=list)  # indexed-dataset prefixes (no .bin/.idx)
    weights: Optional[list[float]] = None  # blend weights, one per path
    split: str = "98,2,0"
    valid_path: Optional[list[str]] = None  # if set: validation reads these instead of a split
    tokenizer: Optional[str] = None  # SentencePiece .model
    cache_dir: Optional[str] = None
    num_workers: int = 0
    mock: bool = False  # synthetic random tokens (benchmarks, dry runs): no files needed
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class CheckpointConfig:
    save_dir: Optional[str] = None
    save_interval: Optional[int] = None
    load: str = "auto"  # auto | none | <path to a checkpoint dir or a save_dir>
    keep_last: int = 3
    save_on_exit: bool = True  # final checkpoint at train.iters / exit_interval / SIGTERM


@dataclass
class LoggingConfig:
    dir: Optional[str] = None  # metrics.jsonl, TensorBoard, resolved config
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "fullstack-fp4"
    wandb_mode: str = "offline"  # offline | online | disabled
    quant_stats_interval: int = 0  # 0: off


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
