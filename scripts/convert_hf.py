#!/usr/bin/env python3
"""Hugging Face Llama in and out: export our checkpoints, import Llama-architecture models.

    python scripts/convert_hf.py export --src runs/x/checkpoints --out runs/x/hf [--dtype auto] [--check]
    python scripts/convert_hf.py import --src path/to/hf_llama --out runs/base [--check]

**export**: a checkpoint of ours (an `iter_NNNNNNN/` directory or a save_dir: its newest
complete checkpoint; any recipe, any TP/PP layout it was saved with) becomes a folder that
`transformers.LlamaForCausalLM.from_pretrained` (and `lm_eval --model hf --model_args
pretrained=DIR`, vLLM, ...) reads: `model.safetensors`, `config.json`, `generation_config.json`
and the tokenizer the run trained with (a SentencePiece `.model` as `tokenizer.model` with a
`LlamaTokenizer` `tokenizer_config.json`; a Hugging Face `tokenizer.json` copied with its
config files; a TikToken vocabulary has no Llama tokenizer form and is left out, with a line
saying so). The model tensors are read through megatron-core `dist_checkpointing` into one
unsharded (TP = PP = 1) model built from the saved config, which reassembles any TP/PP layout.
LoRA-SVD linears are merged into their dense `W = W_res + β L2 L1`; the NVFP4 recipes' weights
are already dense (their quantization happens in the forward, which `transformers` runs in
plain precision). Optimizer states are not exported.

`--dtype auto` writes the tensors in the run's parameter dtype (BF16 in a BF16 run: lossless),
except a merged LoRA-SVD weight, which is not a BF16 number: FP32 (`--dtype bfloat16` rounds
it once).

**import**: a Hugging Face folder of a Llama-architecture model (`config.json` with
`model_type` llama or mistral without sliding window; weights in `*.safetensors` or
`pytorch_model*.bin`, sharded or not) becomes a checkpoint of ours at iteration 0, written by the
trainer's own save function (`OUT/iter_0000000/`), plus `OUT/config.yaml` (the resolved config
built from the HF config, with `checkpoint.load: OUT` and `checkpoint.load_mode: weights_only`)
and the tokenizer files under `OUT/tokenizer/` (`data.tokenizer` names them). Train from it with

    python pretrain_gpt.py --config OUT/config.yaml data.path=[...] checkpoint.save_dir=runs/ft

(weights only: a fresh optimizer of any kind, iteration 0, the lr schedule of this config; any
TP/PP layout, resharded by the loader). The checkpoint also holds an AdamW state (zero moments
at step 1: megatron-core saves no step 0), which `checkpoint.load_mode=full` would resume, its
first updates damped by that step count; weights-only is the fresh start. Refused, in one `error:` line
and exit code 2: tied embeddings, biases, RoPE scaling, another activation, a head dimension other
than hidden/heads, a non-integer RoPE base, a tensor of another shape than config.json says.

Name map (megatron-core local spec, `megatron/training/model.py`):

| ours | Hugging Face Llama |
| --- | --- |
| `embedding.word_embeddings.weight` | `model.embed_tokens.weight` |
| `decoder.layers.i.input_layernorm.weight` | `model.layers.i.input_layernorm.weight` |
| `decoder.layers.i.self_attention.linear_qkv.weight` | `q_proj`, `k_proj`, `v_proj` (below) |
| `decoder.layers.i.self_attention.linear_proj.weight` | `model.layers.i.self_attn.o_proj.weight` |
| `decoder.layers.i.pre_mlp_layernorm.weight` | `model.layers.i.post_attention_layernorm.weight` |
| `decoder.layers.i.mlp.linear_fc1.weight` = `[gate; up]` | `mlp.gate_proj`, `mlp.up_proj` |
| `decoder.layers.i.mlp.linear_fc2.weight` | `model.layers.i.mlp.down_proj.weight` |
| `decoder.final_layernorm.weight` | `model.norm.weight` |
| `output_layer.weight` | `lm_head.weight` |

`linear_qkv`'s rows are grouped per query group g (megatron's `get_query_key_value_tensors`):
`[q heads g·r .. g·r+r-1; k_g; v_g]` with r = heads / groups, each block `head_dim` rows. Hugging
Face's GQA lets query head i read kv head i // r: the same pairing. RoPE: both rotate halves
(megatron's non-interleaved rotary, HF's `rotate_half`) with `inv_freq = base^(-2j/d)`. The
vocabulary is the padded one of the checkpoint (`config.json` `vocab_size` = embedding rows).

`--out` (both directions) must be a new or an empty folder: one that exists as a file or holds
anything is refused before any work, in one `error:` line (exit 2). The result is written into a
folder of its own beside it (`OUT.partial-PID`) and renamed to OUT once complete; any failure on
the way (bad input found late, a full disk, Ctrl-C) removes that folder, so OUT is either whole
or absent (tests/scripts/test_convert_hf.py::test_failed_export_leaves_nothing_behind).

`--check` runs both sides on one batch of random tokens (FP32, the Hugging Face model in a fresh
process) and prints the max |logit difference|; it exits 1 above `--tolerance`. Our side is the
checkpoint's model in FP32 with its recipe's unquantized forward: BF16 spec as is, LoRA-SVD with
exact matmuls (`W_res x + β L2 L1 x`, not the merged W), NVFP4 / Q-Attn checkpoints through the
BF16 spec (their quantized forward differs by the quantization noise, which no dense model
has). Export also compares the exported tokenizer's ids with ours on a sample text.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


class ConvertError(Exception):
    """Bad input; main() prints it as one `error:` line and exits 2."""


SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SAMPLE_TEXT = "The quick brown fox, said the king, jumps over 12 lazy dogs.\n\nA second paragraph."


# ----------------------------------------------------------------------------- the name map
def _shape(cfg) -> dict:
    m = cfg.model
    return {"layers": m.num_layers, "hidden": m.hidden_size, "ffn": m.ffn_hidden_size,
            "heads": m.num_attention_heads, "groups": m.num_query_groups,
            "head_dim": m.hidden_size // m.num_attention_heads}


def to_hf(state: dict, s: dict) -> dict:
    """Our TP=1 state dict (dense linears) -> Hugging Face Llama tensor names."""
    r, d, h, f = s["heads"] // s["groups"], s["head_dim"], s["hidden"], s["ffn"]
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"],
           "lm_head.weight": state["output_layer.weight"]}
    for i in range(s["layers"]):
        a, b = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = state[a + "self_attention.linear_qkv.weight"].reshape(s["groups"], r + 2, d, h)
        out[b + "self_attn.q_proj.weight"] = qkv[:, :r].reshape(s["heads"] * d, h)
        out[b + "self_attn.k_proj.weight"] = qkv[:, r].reshape(s["groups"] * d, h)
        out[b + "self_attn.v_proj.weight"] = qkv[:, r + 1].reshape(s["groups"] * d, h)
        out[b + "self_attn.o_proj.weight"] = state[a + "self_attention.linear_proj.weight"]
        fc1 = state[a + "mlp.linear_fc1.weight"]
        out[b + "mlp.gate_proj.weight"], out[b + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
        out[b + "mlp.down_proj.weight"] = state[a + "mlp.linear_fc2.weight"]
        out[b + "input_layernorm.weight"] = state[a + "input_layernorm.weight"]
        out[b + "post_attention_layernorm.weight"] = state[a + "pre_mlp_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def expected_hf_shapes(s: dict, vocab: int) -> dict:
    d, h, f = s["head_dim"], s["hidden"], s["ffn"]
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(s["layers"]):
        b = f"model.layers.{i}."
        out.update({b + "self_attn.q_proj.weight": (s["heads"] * d, h),
                    b + "self_attn.k_proj.weight": (s["groups"] * d, h),
                    b + "self_attn.v_proj.weight": (s["groups"] * d, h),
                    b + "self_attn.o_proj.weight": (h, s["heads"] * d),
                    b + "mlp.gate_proj.weight": (f, h), b + "mlp.up_proj.weight": (f, h),
                    b + "mlp.down_proj.weight": (h, f),
                    b + "input_layernorm.weight": (h,), b + "post_attention_layernorm.weight": (h,)})
    return out


def from_hf(hf: dict, s: dict) -> dict:
    """Hugging Face Llama tensors -> our TP=1 state dict names (inverse of `to_hf`)."""
    import torch

    r, d, h = s["heads"] // s["groups"], s["head_dim"], s["hidden"]
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": hf["lm_head.weight"]}
    for i in range(s["layers"]):
        a, b = f"decoder.layers.{i}.", f"model.layers.{i}."
        q = hf[b + "self_attn.q_proj.weight"].reshape(s["groups"], r, d, h)
        k = hf[b + "self_attn.k_proj.weight"].reshape(s["groups"], 1, d, h)
        v = hf[b + "self_attn.v_proj.weight"].reshape(s["groups"], 1, d, h)
        out[a + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, h)
        out[a + "self_attention.linear_proj.weight"] = hf[b + "self_attn.o_proj.weight"]
        out[a + "mlp.linear_fc1.weight"] = torch.cat([hf[b + "mlp.gate_proj.weight"],
                                                      hf[b + "mlp.up_proj.weight"]], 0)
        out[a + "mlp.linear_fc2.weight"] = hf[b + "mlp.down_proj.weight"]
        out[a + "input_layernorm.weight"] = hf[b + "input_layernorm.weight"]
        out[a + "pre_mlp_layernorm.weight"] = hf[b + "post_attention_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------- our side
def _saved_vocab(dist_dir: str) -> int:
    """Rows of the saved embedding (the padded vocabulary), from the checkpoint's metadata."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(dist_dir)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in meta:
            return int(meta[key].global_shape[0])
    raise ConvertError(f"checkpoint {dist_dir} holds no embedding or output layer tensor")


def unsharded_config(saved: dict):
    """The saved run's config for one unsharded process (TP = PP = 1, same padded vocabulary)."""
    from megatron.training.config import from_dict
    from megatron.training.config_schema import RunConfig

    cfg = from_dict(RunConfig, copy.deepcopy(saved), prefix="")
    cfg.model.make_vocab_size_divisible_by *= cfg.parallel.tensor_model_parallel_size
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    cfg.parallel.use_distributed_optimizer = False
    cfg.data.mock, cfg.checkpoint.load, cfg.checkpoint.save_dir = True, "none", None
    cfg.logging.dir, cfg.logging.tensorboard, cfg.logging.wandb = None, False, False
    return cfg


def read_our_checkpoint(src: str):
    """(state dict of the unsharded model in its parameter dtype, unsharded cfg, saved cfg, meta,
    path, padded vocab)."""
    from megatron.training import checkpointing, cpu_compat

    cpu_compat.import_megatron_core()
    from megatron.core import dist_checkpointing

    from megatron.training.config import from_dict
    from megatron.training.config_schema import RunConfig
    from megatron.training.initialize import initialize
    from megatron.training.model import build_model

    if not os.path.isdir(src):
        raise ConvertError(f"--src {src}: no such checkpoint directory")
    path = checkpointing.resolve_load_path(src, None)
    meta = checkpointing.check_complete(path)
    saved = from_dict(RunConfig, copy.deepcopy(meta["config"]), prefix="")
    if saved.model.position_embedding != "rope":
        raise ConvertError(f"checkpoint {path} uses model.position_embedding={saved.model.position_embedding}: "
                           "a Llama model has RoPE only")
    if saved.fp4.linear == "lora_svd" and saved.parallel.tensor_model_parallel_size > 1:
        raise ConvertError(f"checkpoint {path} is a LoRA-SVD run saved at TP={saved.parallel.tensor_model_parallel_size}: "
                           "its subspace is block-diagonal per TP rank; resume it once with "
                           "parallel.tensor_model_parallel_size=1 (the loader converts it) and export that checkpoint")
    cfg = unsharded_config(meta["config"])
    dist_dir = os.path.join(path, "dist")
    vocab = _saved_vocab(dist_dir)
    initialize(cfg)
    gpt = build_model(cfg, vocab, use_cpu_initialization=True)
    try:
        state = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, dist_dir)
        gpt.load_state_dict(state["model"])
    except Exception as e:
        raise ConvertError(f"checkpoint {path} could not be read: {type(e).__name__}: "
                           f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}") from None
    return gpt, cfg, saved, meta, path, vocab


def our_logits(gpt, cfg, tokens):
    """FP32 logits of our model (the state of `gpt`) with the recipe's unquantized forward."""
    import torch

    from megatron.training.model import build_model

    c = copy.deepcopy(cfg)
    c.train.precision = "fp32"
    lora = c.fp4.linear == "lora_svd"
    if not lora:
        c.fp4.linear = "bf16"
    c.fp4.attention = "bf16"
    model = build_model(c, gpt.embedding.word_embeddings.weight.shape[0] if gpt.pre_process
                        else gpt.output_layer.weight.shape[0], use_cpu_initialization=True)
    state = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
             for k, v in gpt.state_dict().items()}
    model.load_state_dict(state)
    model.eval()
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        if lora:
            from fullstack_fp4.integration.lora_svd_layers import exact_matmuls

            with exact_matmuls([model]):
                return model(tokens, pos, None).float()
        return model(tokens, pos, None).float()


def dense_state(gpt, cfg) -> dict:
    """Our state dict with every linear dense (LoRA-SVD merged in FP32), tensors only."""
    import torch

    if cfg.fp4.linear == "lora_svd":
        from fullstack_fp4.integration.lora_svd_layers import merged_state_dict

        state = merged_state_dict(gpt, torch.float32)
    else:
        state = gpt.state_dict()
    return {k: v for k, v in state.items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


# ----------------------------------------------------------------------------- the HF side
def hf_logits(folder: str, tokens):
    """FP32 logits of `transformers.LlamaForCausalLM.from_pretrained(folder)`, in a fresh Python
    process: megatron/training/cpu_compat.py patches torch process-wide once it is enabled (a
    Hugging Face model built after it gets wrong RoPE buffers), so the two never share one."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        torch.save(tokens, os.path.join(tmp, "tokens.pt"))
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "_hf_logits", folder, tmp],
                           capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ConvertError(f"transformers could not run {folder}: {tail}")
        out = torch.load(os.path.join(tmp, "logits.pt"))
        info = json.load(open(os.path.join(tmp, "info.json")))
    return out, info


def _hf_logits_child(folder: str, tmp: str) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    import transformers

    tokens = torch.load(os.path.join(tmp, "tokens.pt"))
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager", **{dtype_kw: torch.float32})
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    torch.save(logits, os.path.join(tmp, "logits.pt"))
    info = {}
    if any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(folder)
        info["sample_ids"] = tok(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    json.dump(info, open(os.path.join(tmp, "info.json"), "w"))
    return 0


def _check_tokens(vocab: int, seq: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, min(seq, 64)), generator=g)


# ----------------------------------------------------------------------------- the --out folder
def check_out(out: str) -> None:
    """Refuse an --out that cannot take the result, before any work: one that exists and is not an
    empty directory (a file, a link to one, a folder with anything in it), or whose nearest
    existing parent is not a directory."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ConvertError(f"--out {out} exists and is not a directory: give the path of a new folder")
    if os.path.isdir(out) and os.listdir(out):   # never prune or overwrite another run's files
        raise ConvertError(f"--out {out} exists and is not empty: choose another folder or remove it")
    d = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise ConvertError(f"--out {out}: {d} is not a directory")


@contextlib.contextmanager
def staged_out(out: str):
    """Yield a fresh folder beside --out to write into; renamed to --out once the body completes.
    On any failure (bad input found on the way, a full disk, an interrupt) the folder, and any
    parent folder made for it, is removed: --out is either complete or absent. A file-system
    error becomes a ConvertError (one `error:` line)."""
    final = os.path.abspath(out)
    made, d = [], os.path.dirname(final)
    while not os.path.lexists(d):
        made.append(d)
        d = os.path.dirname(d)
    tmp = None
    try:
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            for n in range(1000):   # a name of its own: never one holding someone's files
                try:
                    tmp = f"{final}.partial-{os.getpid()}" + (f"-{n}" if n else "")
                    os.mkdir(tmp)
                    break
                except FileExistsError:
                    tmp = None
            if tmp is None:
                raise ConvertError(f"--out {out}: no free name for its temporary folder beside it")
            yield tmp
            check_out(out)   # still free: nothing appeared there while we worked
            if os.path.isdir(final):
                os.rmdir(final)
            os.replace(tmp, final)
            tmp = None
        except OSError as e:
            raise ConvertError(f"could not write --out {out}: {e}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            for d in made:   # deepest first; only while empty
                try:
                    os.rmdir(d)
                except OSError:
                    break


# ----------------------------------------------------------------------------- export
def _dtype(name: str, cfg):
    import torch

    if name == "auto":
        if cfg.fp4.linear == "lora_svd" or cfg.train.precision == "fp32":
            return torch.float32
        return torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _write_tokenizer(cfg, tokenizer_path: str | None, out: str, seq: int) -> dict:
    """Tokenizer files for the export; returns {bos, eos, pad, kind} ids (or notes)."""
    from megatron.training.tokenizer import TokenizerError, load_tokenizer, tokenizer_kind

    path = tokenizer_path or cfg.data.tokenizer
    if not path:
        print("[convert] the run names no tokenizer (data.tokenizer): none written; pass --tokenizer", flush=True)
        return {}
    try:
        library, file = tokenizer_kind(path)
        tok = load_tokenizer(path)
    except TokenizerError as e:
        if tokenizer_path:
            raise
        print(f"[convert] the run's tokenizer is not usable here ({e}): none written; pass --tokenizer", flush=True)
        return {}
    ids = {"bos": tok.bos if tok.bos >= 0 else None, "eos": tok.eod, "pad": tok.pad if tok.pad >= 0 else None}
    if library == "sentencepiece":
        shutil.copyfile(file, os.path.join(out, "tokenizer.model"))
        sp = tok._sp
        piece = lambda i: sp.id_to_piece(i) if i is not None and i >= 0 else None  # noqa: E731
        conf = {"tokenizer_class": "LlamaTokenizer", "bos_token": piece(sp.bos_id()),
                "eos_token": piece(sp.eos_id()), "unk_token": piece(sp.unk_id()),
                "pad_token": piece(sp.pad_id()),
                # our documents were tokenized without BOS/EOS: the tokenizer must not add them
                "add_bos_token": False, "add_eos_token": False, "legacy": True,
                "clean_up_tokenization_spaces": False, "model_max_length": seq}
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({k: v for k, v in conf.items() if v is not None}, f, indent=1)
    elif library == "huggingface":
        src_dir = os.path.dirname(file)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(src_dir, name)):
                shutil.copyfile(os.path.join(src_dir, name), os.path.join(out, name))
        if not os.path.isfile(os.path.join(src_dir, "tokenizer_config.json")):
            inv = tok.inv_vocab
            conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": inv.get(tok.eod),
                    "model_max_length": seq, "clean_up_tokenization_spaces": False}
            with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
                json.dump(conf, f, indent=1)
    else:
        print(f"[convert] {file} is a TikToken vocabulary, which has no Llama tokenizer form: "
              "no tokenizer written", flush=True)
        return {**ids, "ours": None}
    return {**ids, "ours": tok.tokenize(SAMPLE_TEXT)}


def export(src: str, out: str, *, dtype: str = "auto", tokenizer: str | None = None) -> dict:
    check_out(out)   # before any work
    gpt, cfg, saved, meta, path, vocab = read_our_checkpoint(src)
    s = _shape(cfg)
    target = _dtype(dtype, cfg)
    hf = {k: v.to(target) for k, v in to_hf(dense_state(gpt, cfg), s).items()}
    with staged_out(out) as tmp:
        tok = _write_files(tmp, hf, cfg, s, vocab, target, tokenizer)
    print(f"[convert] exported {path} (iteration {meta['iteration']}, fp4.linear={saved.fp4.linear}"
          f"{', merged' if saved.fp4.linear == 'lora_svd' else ''}) to {out} "
          f"({sum(v.numel() for v in hf.values()):,} parameters, {str(target).replace('torch.', '')})", flush=True)
    return {"gpt": gpt, "cfg": cfg, "vocab": vocab, "out": out, "tokenizer_ids": tok.get("ours"),
            "iteration": meta["iteration"], "linear": saved.fp4.linear}


def _write_files(tmp: str, hf: dict, cfg, s: dict, vocab: int, target, tokenizer: str | None) -> dict:
    """The Hugging Face folder's files, into tmp; returns the tokenizer's ids (_write_tokenizer)."""
    from safetensors.torch import save_file

    save_file(hf, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)   # safetensors writes 0600; the folder's other files follow the umask: so does it
    os.chmod(os.path.join(tmp, "model.safetensors"), 0o666 & ~mask)
    tok = _write_tokenizer(cfg, tokenizer, tmp, cfg.model.seq_length)
    m = cfg.model
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups, "head_dim": s["head_dim"],
        "max_position_embeddings": m.seq_length, "rms_norm_eps": m.norm_epsilon,
        "rope_theta": float(m.rotary_base), "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "initializer_range": m.init_method_std,
        "bos_token_id": tok.get("bos"), "eos_token_id": tok.get("eos"), "pad_token_id": tok.get("pad"),
        "torch_dtype": str(target).replace("torch.", ""), "use_cache": True,
    }
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok.get("bos"), "eos_token_id": tok.get("eos"),
                   "pad_token_id": tok.get("pad"), "do_sample": False}, f, indent=1)
    return tok


def check_export(res: dict, tolerance: float) -> dict:
    tokens = _check_tokens(res["vocab"], res["cfg"].model.seq_length)
    ours = our_logits(res["gpt"], res["cfg"], tokens)
    theirs, info = hf_logits(res["out"], tokens)
    out = {"max_abs_logit_diff": (ours - theirs).abs().max().item(), "tokens": list(tokens.shape),
           "max_abs_logit": ours.abs().max().item()}
    if res["tokenizer_ids"] is not None and "sample_ids" in info:
        out["tokenizer_ids_equal"] = info["sample_ids"] == res["tokenizer_ids"]
    return out


# ----------------------------------------------------------------------------- import
def _read_hf_config(src: str) -> dict:
    if not os.path.isdir(src):
        raise ConvertError(f"--src {src}: no such directory")
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{src} has no config.json: not a Hugging Face model folder")
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path} is unreadable ({e})") from None
    mt = c.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConvertError(f"{src} is a {mt!r} model ({', '.join(c.get('architectures') or [])}), "
                           f"not a Llama-architecture one (model_type {' or '.join(SUPPORTED_MODEL_TYPES)})")
    problems = []
    if c.get("tie_word_embeddings", False):
        problems.append("tied input and output embeddings (tie_word_embeddings=true; our models are untied)")
    if c.get("attention_bias") or c.get("mlp_bias"):
        problems.append("linear biases (attention_bias / mlp_bias)")
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"activation {c.get('hidden_act')!r} (ours: SwiGLU with silu)")
    rope = c.get("rope_scaling") or {}
    rp = c.get("rope_parameters") or {}
    if rope or rp.get("rope_type", "default") != "default":
        problems.append(f"RoPE scaling {rope or rp}")
    if c.get("sliding_window") and mt == "mistral":
        problems.append(f"sliding-window attention (sliding_window={c['sliding_window']})")
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(c.get(k), int):
            problems.append(f"no integer {k}")
    if problems:
        raise ConvertError(f"{src} cannot be imported: " + "; ".join(problems))
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads) or c["hidden_size"] % heads:
        raise ConvertError(f"{src} cannot be imported: head_dim {c.get('head_dim')} is not hidden_size / "
                           f"num_attention_heads = {c['hidden_size'] / heads:g} (ours derives it)")
    theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConvertError(f"{src} cannot be imported: rope_theta {theta} is not an integer (model.rotary_base)")
    return c


def _read_hf_weights(src: str) -> dict:
    import torch

    names = sorted(os.listdir(src))
    st = [n for n in names if n.endswith(".safetensors")]
    bins = [n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
    out = {}
    try:
        if st:
            from safetensors.torch import load_file

            for n in st:
                out.update(load_file(os.path.join(src, n)))
        elif bins:
            for n in bins:
                out.update(torch.load(os.path.join(src, n), map_location="cpu", weights_only=True))
        else:
            raise ConvertError(f"{src} holds no *.safetensors or pytorch_model*.bin weights")
    except ConvertError:
        raise
    except Exception as e:
        raise ConvertError(f"the weights in {src} are unreadable: {type(e).__name__}: {e}") from None
    return out


def _vocab_multiple(vocab: int) -> int:
    """make_vocab_size_divisible_by that keeps the padded vocabulary = the model's: the largest
    power of two <= 128 dividing it."""
    m = 128
    while vocab % m:
        m //= 2
    return m


def import_hf(src: str, out: str, *, precision: str = "auto", seq_length: int | None = None) -> dict:
    out = os.path.abspath(out)
    check_out(out)   # before any work
    c = _read_hf_config(src)
    hf = _read_hf_weights(src)
    groups = c.get("num_key_value_heads") or c["num_attention_heads"]
    s = {"layers": c["num_hidden_layers"], "hidden": c["hidden_size"], "ffn": c["intermediate_size"],
         "heads": c["num_attention_heads"], "groups": groups, "head_dim": c["hidden_size"] // c["num_attention_heads"]}
    if "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf:
        raise ConvertError(f"{src} has no lm_head.weight: its output layer is tied to the embedding, "
                           "which our untied models cannot represent")
    want = expected_hf_shapes(s, c["vocab_size"])
    bad = [f"{k}: missing" for k in want if k not in hf]
    bad += [f"{k}: {tuple(hf[k].shape)}, config.json says {want[k]}" for k in want
            if k in hf and tuple(hf[k].shape) != want[k]]
    if bad:
        raise ConvertError(f"{src}: tensors do not match config.json: " + "; ".join(bad[:4])
                           + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""))
    state = from_hf(hf, s)

    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core()
    from megatron.training.config import dump_yaml, from_dict
    from megatron.training.config_schema import RunConfig

    dtype = str(c.get("torch_dtype") or c.get("dtype") or "float32")
    prec = precision if precision != "auto" else ("fp32" if dtype == "float32" else "bf16")
    max_pos = int(c.get("max_position_embeddings") or 4096)
    seq = seq_length or min(max_pos, 4096)
    if seq != max_pos:
        print(f"[convert] model.seq_length={seq} (max_position_embeddings is {max_pos}; --seq-length sets it)",
              flush=True)
    if dtype == "float16" and prec == "bf16":
        print("[convert] FP16 weights are stored as BF16 (train.precision=bf16): 3 mantissa bits fewer",
              flush=True)
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    tok_dir = None
    tok_names = [n for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                             "special_tokens_map.json") if os.path.isfile(os.path.join(src, n))]
    if any(n in tok_names for n in ("tokenizer.json", "tokenizer.model")):
        tok_dir = os.path.join(out, "tokenizer")   # where it will be: the config names the final paths
    else:
        print(f"[convert] {src} has no tokenizer.json or tokenizer.model: set data.tokenizer yourself", flush=True)
    cfg = from_dict(RunConfig, {
        "model": {"num_layers": s["layers"], "hidden_size": s["hidden"], "ffn_hidden_size": s["ffn"],
                  "num_attention_heads": s["heads"], "num_query_groups": groups, "seq_length": seq,
                  "vocab_size": c["vocab_size"], "make_vocab_size_divisible_by": _vocab_multiple(c["vocab_size"]),
                  "rotary_base": int(theta), "norm_epsilon": float(c.get("rms_norm_eps", 1e-5)),
                  "init_method_std": float(c.get("initializer_range", 0.02))},
        "train": {"precision": prec},
        "data": {"tokenizer": tok_dir},
        "checkpoint": {"load": out, "load_mode": "weights_only"},
    }, prefix="")
    with staged_out(out) as tmp:   # written beside --out, renamed to it when complete
        if tok_dir:
            os.makedirs(os.path.join(tmp, "tokenizer"))
            for n in tok_names:
                shutil.copyfile(os.path.join(src, n), os.path.join(tmp, "tokenizer", n))
        saved = _save_imported(tmp, cfg, state)
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(dump_yaml(cfg))
    saved = os.path.join(out, os.path.basename(saved))
    print(f"[convert] imported {src} ({sum(v.numel() for v in state.values()):,} parameters, "
          f"train.precision={prec}) to {saved}; config: {os.path.join(out, 'config.yaml')}", flush=True)
    return {"out": out, "checkpoint": saved, "cfg": cfg, "src": src, "vocab": c["vocab_size"]}


def _save_imported(save_dir: str, cfg, state: dict) -> str:
    """Build the model of cfg, load `state` into it and save it as iteration 0 into save_dir with
    the trainer's own save function; returns the checkpoint's directory."""
    import torch

    from megatron.training import checkpointing
    from megatron.training.trainer import Trainer

    build = copy.deepcopy(cfg)
    build.data.mock, build.data.tokenizer = True, None
    build.checkpoint.load, build.checkpoint.save_dir = "none", None
    build.logging.dir, build.logging.tensorboard, build.logging.wandb = None, False, False
    build.train.iters = 1
    trainer = Trainer(build, verbose=False)
    gpt = trainer.gpt
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:  # the name map and the model builder disagree: a bug, not bad input
        raise RuntimeError(f"name map mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    # the mixed-precision optimizer's FP32 master copies were made from the random init: refresh
    # them from the imported weights (a full load resumes them; FP32 runs: a no-op)
    trainer.optimizer.reload_model_params()
    # An AdamW state to save beside the weights (the checkpoint format holds one): zero moments
    # at step 1 (megatron-core saves no step 0). checkpoint.load_mode=weights_only discards it.
    for sub in getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]:
        sub.init_state_fn(sub.optimizer, sub.config)
        for st in sub.optimizer.state.values():
            st["step"] = torch.tensor(1.0)
    return checkpointing.save_checkpoint(save_dir, 0, model=gpt, optimizer=trainer.optimizer, cfg=cfg,
                                         keep_last=1, train_state={"consumed_samples": 0})


def check_import(res: dict, tolerance: float) -> dict:
    gpt, cfg, _, _, _, vocab = read_our_checkpoint(res["checkpoint"])
    tokens = _check_tokens(res["vocab"], cfg.model.seq_length)
    ours = our_logits(gpt, cfg, tokens)[..., :res["vocab"]]
    theirs, _ = hf_logits(res["src"], tokens)
    return {"max_abs_logit_diff": (ours - theirs).abs().max().item(), "tokens": list(tokens.shape),
            "max_abs_logit": ours.abs().max().item()}


# ----------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_hf_logits"]:  # internal: the Hugging Face side of --check (hf_logits)
        return _hf_logits_child(*argv[1:3])
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="our checkpoint -> Hugging Face Llama folder")
    e.add_argument("--src", required=True, help="checkpoint dir (iter_N) or save_dir (its newest)")
    e.add_argument("--out", required=True, help="the Hugging Face folder to write")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--tokenizer", help="tokenizer to export (default: the run's data.tokenizer)")
    i = sub.add_parser("import", help="Hugging Face Llama folder -> our checkpoint at iteration 0")
    i.add_argument("--src", required=True, help="Hugging Face model folder (config.json + weights)")
    i.add_argument("--out", required=True, help="save_dir to write iter_0000000/ and config.yaml into")
    i.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="train.precision of the checkpoint (auto: fp32 for FP32 weights, else bf16)")
    i.add_argument("--seq-length", type=int, help="model.seq_length (default: max_position_embeddings, at most 4096)")
    for q in (e, i):
        q.add_argument("--check", action="store_true", help="compare FP32 logits of both sides on a batch")
        q.add_argument("--tolerance", type=float, default=1e-4, help="--check fails above this max |diff|")
    a = p.parse_args(argv)
    from megatron.training.errors import UserError

    try:
        if a.cmd == "export":
            res = export(a.src, a.out, dtype=a.dtype, tokenizer=a.tokenizer)
            result = check_export(res, a.tolerance) if a.check else None
        else:
            res = import_hf(a.src, a.out, precision=a.precision, seq_length=a.seq_length)
            result = check_import(res, a.tolerance) if a.check else None
    except (ConvertError, UserError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        if "megatron.training.initialize" in sys.modules:
            sys.modules["megatron.training.initialize"].shutdown()
    if result is None:
        return 0
    print(json.dumps(result), flush=True)
    ok = result["max_abs_logit_diff"] <= a.tolerance and result.get("tokenizer_ids_equal", True)
    print(f"[check] max |logit difference| {result['max_abs_logit_diff']:.3e} (tolerance {a.tolerance:g})"
          + ("" if "tokenizer_ids_equal" not in result else
             f", tokenizer ids {'equal' if result['tokenizer_ids_equal'] else 'DIFFER'}")
          + (": ok" if ok else ": FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
