"""scripts/convert_hf.py: our checkpoints to Hugging Face Llama and back, checked by `transformers`.

- Export: a tiny model trained a few steps (BF16, and LoRA-SVD merged) is exported; the oracle
  is `transformers.LlamaForCausalLM.from_pretrained` on the exported folder, against our model
  loaded by the trainer's own resume path (FP32; LoRA-SVD with its unquantized `W_res x + β L2 L1 x`,
  not the merged weight): max |logit difference| <= 1e-5. The exported tokenizer gives the
  SentencePiece model's own ids.
- Import: a randomly initialised tiny `LlamaForCausalLM` (GQA, non-unit norms, another RoPE base
  and epsilon), saved with `save_pretrained`, is imported; our logits from the written
  checkpoint equal its logits, and training starts from it.
- Bad input is one `error:` line, exit code 2.

Each side runs in its own process: megatron/training/cpu_compat.py patches torch process-wide
once enabled, and a Hugging Face model built after it computes wrong RoPE buffers.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONVERT = os.path.join(REPO, "scripts", "convert_hf.py")
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
sys.path.insert(0, os.path.join(REPO, "scripts"))

TINY = ["model.preset=tiny", "model.num_layers=2", "model.seq_length=32", "model.vocab_size=400",
        "data.mock=true", "train.global_batch_size=4", "train.micro_batch_size=2", "train.iters=3",
        "train.eval_iters=1", "train.log_interval=1", "logging.tensorboard=false",
        "optimizer.warmup_iters=1", "optimizer.lr=3e-3", "optimizer.min_lr=3e-4", "checkpoint.load=none"]

OURS = r"""
import contextlib, json, sys, torch
from megatron.training import cpu_compat
cpu_compat.import_megatron_core()
from megatron.training.config import load_config
from megatron.training.trainer import Trainer
a = json.loads(sys.argv[1])
cfg = load_config(a["config"], a["overrides"])
tr = Trainer(cfg, verbose=False)                 # the trainer's own resume path
assert tr.iteration == a["iteration"], tr.iteration
gpt = tr.gpt.float().eval()
tokens = torch.load(a["tokens"])
pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
ctx = contextlib.nullcontext()
if cfg.fp4.linear == "lora_svd":
    from fullstack_fp4.integration.lora_svd_layers import exact_matmuls
    ctx = exact_matmuls([gpt])
with torch.no_grad(), ctx:
    torch.save(gpt(tokens, pos, None).float(), a["out"])
"""

HF = r"""
import json, sys, torch
from transformers import AutoTokenizer, LlamaForCausalLM
a = json.loads(sys.argv[1])
m = LlamaForCausalLM.from_pretrained(a["dir"], dtype=torch.float32).eval()
tokens = torch.load(a["tokens"])
with torch.no_grad():
    torch.save(m(input_ids=tokens).logits.float(), a["out"])
if a.get("text") is not None:
    tok = AutoTokenizer.from_pretrained(a["dir"])
    json.dump(tok(a["text"], add_special_tokens=False)["input_ids"], open(a["out"] + ".ids.json", "w"))
"""

MAKE_HF = r"""
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
a = json.loads(sys.argv[1])
torch.manual_seed(0)
c = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False, initializer_range=0.08)
m = LlamaForCausalLM(c).float().eval()
with torch.no_grad():   # norms away from 1, so that a swapped or dropped norm shows
    for n, p in m.named_parameters():
        if "norm" in n:
            p.uniform_(0.5, 1.5)
m.save_pretrained(a["dir"])
tokens = torch.load(a["tokens"])
with torch.no_grad():
    torch.save(m(input_ids=tokens).logits.float(), a["out"])
"""


def env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=REPO + os.pathsep + e.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def run(args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def script(code, **kw):
    p = run(["-c", code, json.dumps(kw)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def tokens_file(path, vocab, seq, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.save(torch.randint(0, vocab, (2, seq), generator=g), path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    rng = random.Random(3)
    words = "the king queen lord lady night honour sword crown river gold silent gentle 1603".split()
    (d / "text.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(9)).capitalize() + "."
                                          for _ in range(400)) + "\n")
    return train_tokenizer.train([str(d / "text.txt")], 400, str(d / "tokenizer"), threads=1)


def train_and_export(tmp_path, tokenizer, extra, dtype_args=()):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: tiny\n")
    ckpt = str(tmp_path / "ckpt")
    overrides = TINY + extra + [f"data.tokenizer={tokenizer}", f"checkpoint.save_dir={ckpt}"]
    p = run([PRETRAIN, "--config", str(cfg), *overrides])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = str(tmp_path / "hf")
    p = run([CONVERT, "export", "--src", ckpt, "--out", out, "--check", "--tolerance", "1e-5", *dtype_args])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    check = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    assert check["max_abs_logit_diff"] <= 1e-5 and check["tokenizer_ids_equal"] is True
    return str(cfg), overrides, ckpt, out


def compare_export(tmp_path, cfg, overrides, ckpt, out, tokenizer):
    import sentencepiece
    import torch

    toks = tokens_file(str(tmp_path / "tokens.pt"), 400, 32)
    text = "The king, the queen and 1603 gentle lords.\n\nSilent river gold."
    script(HF, dir=out, tokens=toks, out=str(tmp_path / "hf.pt"), text=text)
    # a full resume of the finished 3-step run, stated as an extension (one that trained nothing
    # more would be refused: megatron/training/continuation.py); only the weights are used
    script(OURS, config=cfg, overrides=overrides + [f"checkpoint.load={ckpt}", "checkpoint.save_dir=null",
                                                    "train.iters=6", "train.continue_with=[extend]"],
           iteration=3, tokens=toks, out=str(tmp_path / "ours.pt"))
    hf, ours = torch.load(str(tmp_path / "hf.pt")), torch.load(str(tmp_path / "ours.pt"))
    assert hf.shape == ours.shape == (2, 32, 512)  # the padded vocabulary of the checkpoint
    diff = (hf - ours).abs().max().item()
    assert ours.abs().max().item() > 0.3  # logits of a size where a wrong map would show
    assert diff <= 1e-5, diff
    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
    assert json.load(open(str(tmp_path / "hf.pt") + ".ids.json")) == sp.encode(text)
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["num_key_value_heads"] == 2 and conf["num_attention_heads"] == 4
    assert conf["intermediate_size"] == 384 and conf["vocab_size"] == 512
    assert conf["tie_word_embeddings"] is False and conf["eos_token_id"] == sp.eos_id()
    return conf


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, tokenizer):
    """A tiny BF16 run, trained and exported once for the tests of this module:
    (config, overrides, checkpoint save_dir, exported folder)."""
    return train_and_export(tmp_path_factory.mktemp("bf16"), tokenizer, ["train.precision=bf16"])


def test_export_bf16_run_matches_transformers(tmp_path, tokenizer, bf16_run):
    cfg, overrides, ckpt, out = bf16_run
    conf = compare_export(tmp_path, cfg, overrides, ckpt, out, tokenizer)
    assert conf["torch_dtype"] == "bfloat16"  # a BF16 run's weights, losslessly
    mask = os.umask(0)
    os.umask(mask)   # readable as the user's other files are (safetensors alone writes 0600)
    for name in ("model.safetensors", "config.json"):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o666 & ~mask, name


@pytest.mark.long   # several training runs end to end (make test-all)
def test_export_lora_svd_merged_matches_transformers(tmp_path, tokenizer):
    cfg, overrides, ckpt, out = train_and_export(
        tmp_path, tokenizer, ["train.precision=bf16", "fp4.linear=lora_svd", "fp4.lora_svd.rank=8"])
    conf = compare_export(tmp_path, cfg, overrides, ckpt, out, tokenizer)
    assert conf["torch_dtype"] == "float32"  # the merged W is no BF16 number


@pytest.mark.long
def test_import_random_llama_matches_and_trains(tmp_path):
    import torch

    src, out = str(tmp_path / "hf"), str(tmp_path / "imported")
    toks = tokens_file(str(tmp_path / "tokens.pt"), 320, 48)
    script(MAKE_HF, dir=src, tokens=toks, out=str(tmp_path / "hf.pt"))
    p = run([CONVERT, "import", "--src", src, "--out", out])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert os.path.isfile(os.path.join(out, "iter_0000000", "meta.json"))
    config = os.path.join(out, "config.yaml")
    script(OURS, config=config, overrides=["data.mock=true"], iteration=0, tokens=toks,
           out=str(tmp_path / "ours.pt"))
    hf, ours = torch.load(str(tmp_path / "hf.pt")), torch.load(str(tmp_path / "ours.pt"))
    assert ours.shape == hf.shape == (2, 48, 320)
    assert hf.abs().max().item() > 0.3
    diff = (hf - ours).abs().max().item()
    assert diff <= 1e-5, diff
    # training starts from it (the imported config, mock tokens in its vocabulary)
    p = run([PRETRAIN, "--config", config, "data.mock=true", "train.iters=2", "train.global_batch_size=2",
             "train.micro_batch_size=2", "train.eval_iters=1", "train.log_interval=1",
             "logging.tensorboard=false"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"weights loaded from {out}/iter_0000000" in p.stdout
    losses = [float(ln.split("lm loss:")[1].split("|")[0]) for ln in p.stdout.splitlines() if "lm loss:" in ln]
    assert len(losses) == 2 and all(0 < v < 20 for v in losses)


def _bad_hf(tmp_path, name, config, weights=None):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file({k: torch.zeros(s) for k, s in weights.items()}, str(d / "model.safetensors"))
    return str(d)


def test_bad_input_is_one_error_line(tmp_path):
    import convert_hf

    llama = dict(model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=8, tie_word_embeddings=False)
    s = {"layers": 1, "hidden": 16, "ffn": 32, "heads": 2, "groups": 1, "head_dim": 8}
    good = convert_hf.expected_hf_shapes(s, 8)
    wrong = dict(good, **{"model.layers.0.mlp.up_proj.weight": (31, 16)})
    cases = [
        (["import", "--src", str(tmp_path / "missing")], "no such directory"),
        (["import", "--src", _bad_hf(tmp_path, "gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})],
         "not a Llama-architecture"),
        (["import", "--src", _bad_hf(tmp_path, "tied", dict(llama, tie_word_embeddings=True), good)],
         "tied input and output embeddings"),
        (["import", "--src", _bad_hf(tmp_path, "scaled", dict(llama, rope_scaling={"rope_type": "llama3", "factor": 8.0}), good)],
         "RoPE scaling"),
        (["import", "--src", _bad_hf(tmp_path, "shapes", llama, wrong)],
         "model.layers.0.mlp.up_proj.weight: (31, 16), config.json says (32, 16)"),
        (["import", "--src", _bad_hf(tmp_path, "noweights", llama)], "no *.safetensors"),
        (["export", "--src", str(tmp_path / "nockpt")], "no such checkpoint directory"),
    ]
    for argv, message in cases:
        p = run([CONVERT, *argv, "--out", str(tmp_path / "out")], timeout=120)
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert p.returncode == 2 and len(errors) == 1 and message in errors[0], (argv, p.stderr[-2000:])
        assert "Traceback" not in p.stderr
    # an --out that holds another run's checkpoints is refused, and left as it was
    busy = tmp_path / "busy"
    (busy / "iter_0000500").mkdir(parents=True)
    p = run([CONVERT, "import", "--src", _bad_hf(tmp_path, "good", llama, good), "--out", str(busy)], timeout=120)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "exists and is not empty" in errors[0], p.stderr[-2000:]
    assert sorted(os.listdir(busy)) == ["iter_0000500"]


def test_name_map_round_trip():
    """to_hf and from_hf are inverse, and the q/k/v split follows megatron's per-group rows."""
    import convert_hf
    import torch

    s = {"layers": 1, "hidden": 8, "ffn": 12, "heads": 4, "groups": 2, "head_dim": 2}
    g = torch.Generator().manual_seed(0)
    ours = {"embedding.word_embeddings.weight": torch.randn(10, 8, generator=g),
            "decoder.final_layernorm.weight": torch.randn(8, generator=g),
            "output_layer.weight": torch.randn(10, 8, generator=g)}
    a = "decoder.layers.0."
    # rows: group 0 = [q0, q1, k0, v0], group 1 = [q2, q3, k1, v1], each head_dim=2 rows
    qkv = torch.arange(2 * 4 * 2 * 8, dtype=torch.float32).reshape(16, 8)
    ours.update({a + "self_attention.linear_qkv.weight": qkv,
                 a + "self_attention.linear_proj.weight": torch.randn(8, 8, generator=g),
                 a + "mlp.linear_fc1.weight": torch.randn(24, 8, generator=g),
                 a + "mlp.linear_fc2.weight": torch.randn(8, 12, generator=g),
                 a + "input_layernorm.weight": torch.randn(8, generator=g),
                 a + "pre_mlp_layernorm.weight": torch.randn(8, generator=g)})
    hf = convert_hf.to_hf(ours, s)
    b = "model.layers.0.self_attn."
    assert torch.equal(hf[b + "q_proj.weight"], torch.cat([qkv[0:4], qkv[8:12]]))
    assert torch.equal(hf[b + "k_proj.weight"], torch.cat([qkv[4:6], qkv[12:14]]))
    assert torch.equal(hf[b + "v_proj.weight"], torch.cat([qkv[6:8], qkv[14:16]]))
    assert torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], ours[a + "mlp.linear_fc1.weight"][:12])
    assert {k: tuple(v.shape) for k, v in hf.items()} == convert_hf.expected_hf_shapes(s, 10)
    back = convert_hf.from_hf(hf, s)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


# ----------------------------------------------------------------------------- the --out folder
def _one_error(p, *parts):
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert all(x in errors[0] for x in parts), errors[0]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return errors[0]


def _listing(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


def test_export_out_that_is_a_file_or_not_empty_is_refused_before_any_work(tmp_path, bf16_run):
    ckpt = bf16_run[2]
    readme = tmp_path / "README.md"
    readme.write_text("# my notes\n")
    busy = tmp_path / "busy"
    (busy / "iter_0000500").mkdir(parents=True)
    before = _listing(tmp_path)
    for out, message in ((readme, "exists and is not a directory"), (busy, "exists and is not empty"),
                         (readme / "hf", f"{readme} is not a directory")):
        _one_error(run([CONVERT, "export", "--src", ckpt, "--out", str(out)], timeout=120), f"--out {out}", message)
        assert _listing(tmp_path) == before, out       # no README.md.partial/, nothing else either
        # before any work: the checkpoint is not even looked at
        _one_error(run([CONVERT, "export", "--src", str(tmp_path / "nockpt"), "--out", str(out)], timeout=120),
                   f"--out {out}", message)
    assert readme.read_text() == "# my notes\n"


EXPORT_FAILING = r"""
import errno, sys
sys.path.insert(0, sys.argv[1])
import convert_hf
def full_disk(cfg, tokenizer, out, seq):   # after model.safetensors is written: a failure mid-export
    assert sorted(__import__("os").listdir(out)) == ["model.safetensors"]
    raise OSError(errno.ENOSPC, "No space left on device")
convert_hf._write_tokenizer = full_disk
sys.exit(convert_hf.main(sys.argv[2:]))
"""


@pytest.mark.long   # several exports end to end (make test-all)
def test_failed_export_leaves_nothing_behind(tmp_path, bf16_run):
    ckpt = bf16_run[2]
    bad_tok = tmp_path / "bad.model"
    bad_tok.write_bytes(b"not a sentencepiece model")
    empty = tmp_path / "empty"
    empty.mkdir()
    before = _listing(tmp_path)
    # bad input found mid-export (a --tokenizer that does not load): one line, no hf/ nor hf.partial*
    p = run([CONVERT, "export", "--src", ckpt, "--out", str(tmp_path / "new" / "hf"), "--tokenizer", str(bad_tok)])
    _one_error(p)
    assert _listing(tmp_path) == before
    # a full disk mid-export, into an existing empty folder: it stays as it was
    p = run(["-c", EXPORT_FAILING, os.path.join(REPO, "scripts"), "export", "--src", ckpt, "--out", str(empty)])
    _one_error(p, f"could not write --out {empty}", "No space left on device")
    assert _listing(tmp_path) == before
    # and the same export, undisturbed, fills the empty folder
    p = run([CONVERT, "export", "--src", ckpt, "--out", str(empty)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert {"model.safetensors", "config.json", "tokenizer.model"} <= set(os.listdir(empty))
    assert _listing(tmp_path) == sorted(before + [os.path.join("empty", n) for n in os.listdir(empty)])


IMPORT_FAILING = r"""
import errno, os, sys
sys.path.insert(0, sys.argv[1])
import convert_hf
def full_disk(save_dir, cfg, state):   # the tokenizer is copied, the checkpoint half written
    assert os.listdir(os.path.join(save_dir, "tokenizer")) == ["tokenizer.json"]
    os.makedirs(os.path.join(save_dir, "iter_0000000.tmp"))
    raise OSError(errno.ENOSPC, "No space left on device")
convert_hf._save_imported = full_disk
sys.exit(convert_hf.main(sys.argv[2:]))
"""


def test_import_out_is_checked_first_and_a_failed_import_leaves_nothing_behind(tmp_path):
    import convert_hf

    llama = dict(model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=8, tie_word_embeddings=False,
                 max_position_embeddings=32)
    s = {"layers": 1, "hidden": 16, "ffn": 32, "heads": 2, "groups": 1, "head_dim": 8}
    src = _bad_hf(tmp_path, "good", llama, convert_hf.expected_hf_shapes(s, 8))
    (tmp_path / "good" / "tokenizer.json").write_text("{}")
    readme = tmp_path / "README.md"
    readme.write_text("# my notes\n")
    before = _listing(tmp_path)
    _one_error(run([CONVERT, "import", "--src", src, "--out", str(readme)], timeout=120),
               f"--out {readme} exists and is not a directory")
    # before any work: the source is not even looked at
    _one_error(run([CONVERT, "import", "--src", str(tmp_path / "missing"), "--out", str(readme)], timeout=120),
               f"--out {readme} exists and is not a directory")
    p = run(["-c", IMPORT_FAILING, os.path.join(REPO, "scripts"), "import", "--src", src,
             "--out", str(tmp_path / "new" / "imported")], timeout=120)
    _one_error(p, "could not write --out", "No space left on device")
    assert _listing(tmp_path) == before and readme.read_text() == "# my notes\n"
