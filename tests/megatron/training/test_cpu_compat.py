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
