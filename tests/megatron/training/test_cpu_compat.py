"""cpu_compat: the CUDA entry points megatron-core uses go to the CPU only while enabled, and
disable() puts every original attribute back."""
from __future__ import annotations

import pytest
import torch

from megatron.training import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cpu_compat is a no-op with CUDA")

# Every attribute the module documents as redirected (an independent list, not cpu_compat's).
ATTRS = [(torch.cuda, "current_device"), (torch.cuda, "synchronize"), (torch.Tensor, "cuda"),
         (torch.Tensor, "type")] + [(torch, n) for n in ("tensor", "zeros", "empty", "ones", "full", "arange",
                                                          "zeros_like", "empty_like")]


@pytest.fixture
def clean():
    """Start from the unpatched state; leave the state as we found it."""
    was = cpu_compat.enabled()
    cpu_compat.disable()
    yield
    cpu_compat.disable()
    if was:
        cpu_compat.enable()


def snapshot():
    return {(owner.__name__, name): getattr(owner, name) for owner, name in ATTRS}


def test_enable_disable_restores_every_attribute(clean):
    before = snapshot()
    assert cpu_compat.enable() is True
    assert cpu_compat.enabled()
    during = snapshot()
    changed = {k for k in before if during[k] is not before[k]}
    assert changed == set(before), f"not patched: {set(before) - changed}"
    assert cpu_compat.enable() is False  # idempotent: no second layer of patches
    assert snapshot() == during
    cpu_compat.disable()
    assert not cpu_compat.enabled()
    after = snapshot()
    for k in before:
        assert after[k] is before[k], k


def test_cuda_factories_land_on_cpu_only_while_enabled(clean):
    cpu_compat.enable()
    try:
        for t in (torch.zeros(2, device="cuda"), torch.ones(2, device="cuda:0"), torch.empty(3, device=0),
                  torch.tensor([1.0, 2.0], device=torch.device("cuda")), torch.full((2,), 3.0, device="cuda"),
                  torch.arange(4, device="cuda"), torch.zeros_like(torch.ones(2), device="cuda"),
                  torch.empty_like(torch.ones(2), device="cuda")):
            assert t.device.type == "cpu"
        z = torch.zeros(2, device="cuda")
        assert torch.equal(z, torch.tensor([0.0, 0.0]))
        assert torch.equal(torch.arange(4, device="cuda"), torch.tensor([0, 1, 2, 3]))
        assert torch.full((2,), 3.0, device="cuda").tolist() == [3.0, 3.0]
        x = torch.ones(3)
        assert x.cuda() is x
        assert torch.device(torch.cuda.current_device()).type == "cpu"
        torch.cuda.synchronize()  # a no-op, not an error
        # meta and cpu requests are untouched
        assert torch.zeros(2, device="meta").device.type == "meta"
    finally:
        cpu_compat.disable()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")


def test_tensor_type_reports_cuda_only_while_enabled(clean):
    x, h = torch.ones(2), torch.ones(2, dtype=torch.float16)
    assert x.type() == "torch.FloatTensor"
    cpu_compat.enable()
    try:
        assert x.type() == "torch.cuda.FloatTensor"
        assert h.type() == "torch.cuda.HalfTensor"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        # the conversion form still converts
        y = x.type(torch.float64)
        assert y.dtype == torch.float64 and torch.equal(y, torch.ones(2, dtype=torch.float64))
        assert x.type("torch.DoubleTensor").dtype == torch.float64
    finally:
        cpu_compat.disable()
    assert x.type() == "torch.FloatTensor"
    assert h.type() == "torch.HalfTensor"


def _fresh_python(code: str) -> str:
    """Run `code` in a new interpreter (a fresh import state) from the repo root; its stdout."""
    import subprocess
    import sys

    from tests.megatron.training import helpers

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
