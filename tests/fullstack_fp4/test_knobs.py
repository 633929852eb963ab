"""``fullstack_fp4/knobs.py``: the kernel environment variables are read once, parsed and
validated there, and the ones that would change numbers are not read at all."""
import os
import subprocess
import sys

import pytest

from fullstack_fp4 import knobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_KNOB_VARS = ("FULLSTACK_FP4_LEAN_LAUNCH", "FP4_TWO_WAYS_RCP", "FP4_DEQUANT_NBP",
              "FP4_DEQUANT_WARPS", "FP4_QATTN_PROLOGUE", "FP4_QATTN_SAVE_V_VIEW",
              "FP4_QATTN_FWD", "FP4_QATTN_BWD")


def _knobs_under(env: dict) -> subprocess.CompletedProcess:
    """Import knobs in a fresh process under ``env`` (on top of a clean knob environment)."""
    base = {k: v for k, v in os.environ.items() if k not in _KNOB_VARS}
    code = ("from fullstack_fp4 import knobs as k; print(k.LEAN_LAUNCH, sorted(k.TWO_WAYS_RCP), "
            "k.DEQUANT_NBP, k.DEQUANT_WARPS, k.QATTN_PROLOGUE, k.QATTN_SAVE_V_VIEW, k.QATTN_FWD, "
            "k.QATTN_BWD)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": ROOT, **env}, timeout=120)


def test_defaults():
    r = _knobs_under({})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "['W']", "None", "None", "None", "False", "None", "None"]


def test_values_are_parsed_once_at_import():
    r = _knobs_under({"FULLSTACK_FP4_LEAN_LAUNCH": "verify", "FP4_TWO_WAYS_RCP": "x,dY",
                      "FP4_DEQUANT_NBP": "512", "FP4_DEQUANT_WARPS": "4",
                      "FP4_QATTN_PROLOGUE": "32,4", "FP4_QATTN_SAVE_V_VIEW": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "verify ['dY', 'x'] 512 4 (32, 4) True None None"


def test_accumulation_order_tilings_are_not_environment_variables():
    # they change FP32 accumulation order, so only code (a benchmark sweep) may set them
    r = _knobs_under({"FP4_QATTN_FWD": "64,32,4,3", "FP4_QATTN_BWD": "8,2,8,2,1,1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["None", "None"]


@pytest.mark.parametrize("env,word", [({"FP4_TWO_WAYS_RCP": "W,z"}, "FP4_TWO_WAYS_RCP"),
                                      ({"FP4_DEQUANT_NBP": "300"}, "FP4_DEQUANT_NBP"),
                                      ({"FP4_DEQUANT_WARPS": "3"}, "FP4_DEQUANT_WARPS"),
                                      ({"FP4_QATTN_PROLOGUE": "24,4"}, "FP4_QATTN_PROLOGUE"),
                                      ({"FP4_QATTN_PROLOGUE": "16"}, "FP4_QATTN_PROLOGUE")])
def test_a_malformed_value_names_its_variable(env, word):
    r = _knobs_under(env)
    assert r.returncode != 0 and "ValueError" in r.stderr and word in r.stderr, r.stderr


def test_unknown_lean_launch_mode_warns_and_keeps_the_default():
    r = _knobs_under({"FULLSTACK_FP4_LEAN_LAUNCH": "fast"})
    assert r.returncode == 0 and r.stdout.split()[0] == "1"
    assert "FULLSTACK_FP4_LEAN_LAUNCH='fast'" in r.stderr


def test_code_overrides_are_checked_where_they_are_used():
    with pytest.raises(ValueError, match="QATTN_FWD"):
        knobs.check_qattn_fwd((64, 48, 4, 3))            # BLOCK_N must divide BLOCK_M
    with pytest.raises(ValueError, match="QATTN_BWD"):
        knobs.check_qattn_bwd((8, 2, 8, 2, 3, 1))        # rn must be 1 or 2
    knobs.check_qattn_fwd((128, 64, 8, 3))
    knobs.check_qattn_bwd((8, 2, 8, 2))
    assert knobs.parse_ints("QATTN_BWD", " ", (4, 6)) is None
