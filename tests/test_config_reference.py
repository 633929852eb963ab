"""docs/config-reference.md is what scripts/config_reference.py generates from the schema."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_reference_is_current():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "config_reference.py")],
                         capture_output=True, text=True, check=True).stdout
    with open(os.path.join(ROOT, "docs", "config-reference.md")) as f:
        committed = f.read()
    assert out == committed, "docs/config-reference.md is stale: run scripts/config_reference.py > docs/config-reference.md"
    assert "`train.iters`" in out and "`fp4.lora_svd.rank`" in out and "`checkpoint.load`" in out
