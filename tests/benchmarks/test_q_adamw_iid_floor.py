"""benchmarks/studies/q_adamw_iid_floor.py: its re-implementation of the v codec is the codec, and its
byte count is the codec's.

Oracles: `codecs.encode_exp_avg_sq` / `decode_exp_avg_sq` (the optimizer's own codec) on the
same moments, with the same scale rule and tile; `codecs.state_bytes_per_param`.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "studies"))

import q_adamw_iid_floor as floor  # noqa: E402
from fullstack_fp4.optim.q_adamw.codecs import state_bytes_per_param  # noqa: E402


def _sqrt_err(v, vh):
    s = v.double().clamp(min=0).sqrt()
    return float((vh.clamp(min=0).sqrt() - s).norm() / s.norm())


@pytest.mark.parametrize("structured", [False, True])
def test_reimplemented_codecs_reconstruct_as_the_codec(structured):
    """The re-implementation of codec version 1 (``D``: 6-rule, tile 32) and of the default
    (``V2``: "4" rule, tile 64) against codecs.py with the same rule and tile."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        _, v = floor.synthetic_moments(8192, steps=40, seed=0, structured=structured)
    # the same codes almost everywhere: FP64 against the codec's FP32 arithmetic moves a value
    # across a rounding boundary now and then, never the error
    for var, ref in ((floor.D, floor.codec(v, scale_rule="6", tile=32)),
                     (floor.V2, floor.codec(v))):
        mine = floor.roundtrip_v(v, var)
        assert abs(_sqrt_err(v, mine) / _sqrt_err(v, ref) - 1) < 0.01, var.name
        assert float((mine - ref).abs().gt(1e-6 * ref.abs().max()).float().mean()) < 0.01, \
            var.name
    # and the two codecs are not the same: the knobs turned do something
    assert float((floor.codec(v) - floor.codec(v, scale_rule="6", tile=32)).abs().gt(
        1e-6 * v.max()).float().mean()) > 0.1


def test_bytes_are_the_codecs():
    assert floor.D.bytes_per_param() == pytest.approx(state_bytes_per_param(1 << 20, tile=32),
                                                      abs=1e-3)
    assert floor.V2.bytes_per_param() == pytest.approx(state_bytes_per_param(1 << 20), abs=1e-3)
