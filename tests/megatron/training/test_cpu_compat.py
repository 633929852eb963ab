"""cpu_compat: megatron-core's CUDA calls go to the CPU while enabled — and nothing else changes.

The isolation oracle is torch itself: plain torch modules (factories on the default device, a
buffer computed with `device=...`, a model built under `with torch.device("meta")`) and a
Hugging Face Llama are built before, while and after `enable()` / `disable()` and compared bit
for bit, in this process and in fresh interpreters where `enable()` comes first (torch caches
its set of factory functions at the first `torch.device(...)` context: a process-wide patch
there breaks every later model build, even after `disable()`).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from megatron.training import cpu_compat
from tests.megatron.training import helpers

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cpu_compat is a no-op with CUDA")


@pytest.fixture
def clean():
    """Start from the disabled state; leave the state as we found it."""
    was = cpu_compat.enabled()
    cpu_compat.disable()
    yield
    cpu_compat.disable()
    if was:
        cpu_compat.enable()


def _megatron_core_globals():
    """A copy of a megatron-core module's globals: code exec'd in it runs as megatron-core's."""
    cpu_compat.import_megatron_core()
    from megatron.core import utils

    return dict(vars(utils))


MCORE_CALLS = """
out = {
  "zeros": torch.zeros(2, device="cuda"), "ones": torch.ones(2, device="cuda:0"), "empty": torch.empty(3, device=0),
  "tensor": torch.tensor([1.0, 2.0], device=torch.device("cuda")), "full": torch.full((2,), 3.0, device="cuda"),
  "arange": torch.arange(4, device="cuda"), "zeros_like": torch.zeros_like(x, device="cuda"),
  "empty_like": torch.empty_like(x, device="cuda"),
  "cur": torch.cuda.current_device(), "sync": torch.cuda.synchronize(),
  "cuda_self": x.cuda() is x, "type": x.type(), "type_half": x.half().type(),
  "converted": x.type(torch.float64), "meta": torch.zeros(2, device="meta"),
}
"""


def test_megatron_core_calls_land_on_cpu_only_while_enabled(clean):
    g = _megatron_core_globals()
    g["x"] = torch.ones(2)
    with pytest.raises((RuntimeError, AssertionError)):   # disabled: megatron-core sees real CUDA calls
        exec(MCORE_CALLS, dict(g))
    cpu_compat.enable()
    try:
        g = _megatron_core_globals()
        g["x"] = torch.ones(2)
        exec(MCORE_CALLS, g)
        out = g["out"]
    finally:
        cpu_compat.disable()
    for k in ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "empty_like"):
        assert out[k].device.type == "cpu", k
    assert torch.equal(out["zeros"], torch.tensor([0.0, 0.0])) and out["full"].tolist() == [3.0, 3.0]
    assert torch.equal(out["arange"], torch.tensor([0, 1, 2, 3]))
    assert torch.device(out["cur"]).type == "cpu" and out["sync"] is None and out["cuda_self"]
    assert out["type"] == "torch.cuda.FloatTensor" and out["type_half"] == "torch.cuda.HalfTensor"
    assert out["converted"].dtype == torch.float64 and torch.equal(out["converted"], torch.ones(2, dtype=torch.float64))
    assert out["meta"].device.type == "meta"
    # and disable() gave the module back the real torch
    from megatron.core import utils

    assert utils.torch is torch


def test_torch_itself_is_untouched_while_enabled(clean):
    before = {n: getattr(torch, n) for n in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like",
                                             "empty_like")}
    cuda_fns = (torch.cuda.current_device, torch.cuda.synchronize)
    x = torch.ones(2)
    assert cpu_compat.enable() is True
    try:
        assert cpu_compat.enable() is False   # idempotent
        assert {n: getattr(torch, n) for n in before} == before
        assert (torch.cuda.current_device, torch.cuda.synchronize) == cuda_fns
        # this module is not megatron-core: its calls behave as without cpu_compat
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")
        with pytest.raises((RuntimeError, AssertionError)):
            x.cuda()
        assert x.type() == "torch.FloatTensor"
        assert x.type(torch.float64).dtype == torch.float64
    finally:
        cpu_compat.disable()
    assert not cpu_compat.enabled()
    assert torch.Tensor.type(x) == "torch.FloatTensor"


class Plain(torch.nn.Module):
    """Factories on the default device, a buffer computed with `device=...`, seeded init."""

    def __init__(self, device=None):
        super().__init__()
        self.lin = torch.nn.Linear(8, 6)
        self.emb = torch.nn.Parameter(torch.empty(5, 4, device=device))
        torch.nn.init.normal_(self.emb)
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.int64, device=device).float() / 8))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("ones", torch.ones(3, device=device) * torch.full((3,), 0.5, device=device))
        self.register_buffer("pos", torch.arange(7, device=device))
        self.register_buffer("z", torch.zeros_like(torch.empty(2, 2, device=device)))


def _digest(module) -> dict:
    out = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        t = t.detach()
        out[name] = (str(t.dtype), str(t.device), hashlib.sha256(t.contiguous().view(torch.uint8).numpy()
                                                                  .tobytes()).hexdigest())
    return out


def _build() -> dict:
    torch.manual_seed(0)
    plain = _digest(Plain())
    torch.manual_seed(0)
    explicit = _digest(Plain(device="cpu"))
    with torch.device("meta"):
        meta = Plain()
    devices = sorted({t.device.type for t in list(meta.parameters()) + list(meta.buffers())})
    return {"plain": plain, "explicit": explicit, "meta_devices": devices}


def test_plain_torch_modules_are_bit_identical_before_during_after(clean):
    before = _build()
    assert before["meta_devices"] == ["meta"]
    cpu_compat.enable()
    try:
        during = _build()
    finally:
        cpu_compat.disable()
    after = _build()
    assert during == before
    assert after == before


BUILD_SCRIPT = r"""
import hashlib, json, sys, tempfile, torch
sys.path.insert(0, ".")
from tests.megatron.training.test_cpu_compat import _build
mode = sys.argv[1]
hf = None
try:
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_dir = tempfile.mkdtemp()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(hf_dir)
except ImportError:
    hf_dir = None

def hf_build():
    if hf_dir is None:
        return None
    m = LlamaForCausalLM.from_pretrained(hf_dir)
    inv = m.model.rotary_emb.inv_freq
    sd = {k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
          for k, v in m.state_dict().items()}
    return {"inv_freq": inv.tolist(), "state": sd}

out = {}
if mode == "enable_first":
    from megatron.training import cpu_compat
    cpu_compat.import_megatron_core()
    assert cpu_compat.enable()
    out["during"] = {"torch": _build(), "hf": hf_build()}
    cpu_compat.disable()
    out["after"] = {"torch": _build(), "hf": hf_build()}
else:
    out["plain"] = {"torch": _build(), "hf": hf_build()}
print("RESULT " + json.dumps(out))
"""


def _fresh(mode: str) -> dict:
    p = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, mode], cwd=helpers.REPO, env=helpers.env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.long
def test_fresh_process_enable_first_builds_the_same_models_including_hugging_face():
    reference = _fresh("plain")["plain"]
    got = _fresh("enable_first")
    assert reference["torch"]["meta_devices"] == ["meta"]
    assert got["during"] == reference
    assert got["after"] == reference
    if reference["hf"] is not None:   # transformers installed (the `hf` extra): RoPE's closed form
        expected = (1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.int64).float() / 8))).tolist()
        assert reference["hf"]["inv_freq"] == expected


def test_megatron_core_modules_imported_while_enabled_are_redirected_too():
    out = _fresh_python(
        "import sys, torch\n"
        "from megatron.training import cpu_compat\n"
        "cpu_compat.import_megatron_core()\n"
        "assert 'megatron.core.energy_monitor' not in sys.modules\n"
        "cpu_compat.enable()\n"
        "from megatron.core import energy_monitor as em\n"   # its device='cuda' literals
        "t = em.torch.tensor([1], dtype=torch.int64, device='cuda')\n"
        "print(em.torch is not torch, t.device.type)\n"
        "cpu_compat.disable()\n"
        "print(em.torch is torch, any(type(f).__name__ == '_Finder' for f in sys.meta_path))\n")
    assert out.split("\n")[:2] == ["True cpu", "True False"], out


def test_known_megatron_core_warnings_are_filtered_and_others_are_not():
    p = subprocess.run([sys.executable, "-W", "default", "-c",
                        "import warnings\n"
                        "from megatron.training import cpu_compat\n"
                        "cpu_compat.import_megatron_core()\n"
                        "from megatron.core.models.gpt import gpt_layer_specs\n"
                        "from megatron.core.optimizer import clip_grads\n"
                        "from megatron.core.transformer.transformer_config import TransformerConfig\n"
                        "TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)\n"
                        "warnings.warn('an unrelated warning')\n"],
                       cwd=helpers.REPO, env={**helpers.env(), "PYTHONWARNINGS": "default"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "an unrelated warning" in p.stderr
    for text in ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated"):
        assert text not in p.stderr, p.stderr[-3000:]


def _fresh_python(code: str) -> str:
    """Run `code` in a new interpreter (a fresh import state) from the repo root; its stdout."""
    out = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO, env=helpers.env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_megatron_core_is_imported_with_the_no_op_jit_fuser_and_torch_compile_restored():
    out = _fresh_python(
        "import sys, torch\n"
        "real = torch.compile\n"
        "from megatron.training import cpu_compat\n"
        "cpu_compat.import_megatron_core()\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_swiglu as f\n"  # imported after: takes jit's no-op
        "print(torch.compile is real, jit.jit_fuser is jit.noop_decorator,\n"
        "      type(f.swiglu).__name__, 'torch._inductor.compile_fx' in sys.modules)\n"
        "cpu_compat.import_megatron_core()\n"  # a second call changes nothing
        "print(torch.compile is real, jit.jit_fuser is jit.noop_decorator)\n")
    assert out.split("\n")[:2] == ["True True function False", "True True"], out


def test_a_synchronous_checkpoint_save_starts_no_process():
    # megatron-core's writer would start a spawned Manager for its results queue; ours is in-process.
    out = _fresh_python(
        "import multiprocessing, os, queue, tempfile, torch, torch.distributed as dist\n"
        "from megatron.training import cpu_compat\n"
        "cpu_compat.import_megatron_core(); cpu_compat.enable()\n"
        "from megatron.core import dist_checkpointing\n"
        "from megatron.core.dist_checkpointing import ShardedTensor\n"
        "from megatron.core.dist_checkpointing.strategies import filesystem_async\n"
        "from megatron.training.checkpointing import _in_process_results_queue\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "d = tempfile.mkdtemp(); w = torch.arange(12.0).reshape(3, 4)\n"
        "_in_process_results_queue()\n"
        "dist_checkpointing.save({'w': ShardedTensor.from_rank_offsets('w', w)}, d)\n"
        "back = dist_checkpointing.load({'w': ShardedTensor.from_rank_offsets('w', torch.zeros(3, 4))}, d)\n"
        "print(type(filesystem_async._results_queue) is queue.Queue, torch.equal(back['w'], w),\n"
        "      [p.name for p in multiprocessing.active_children()])\n"
        "dist.destroy_process_group()\n")
    assert out.split("\n")[0] == "True True []", out
