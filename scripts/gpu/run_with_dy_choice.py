"""Run a script with dY's quantize form set from ``sweep_two_ways.py --dy``'s choice.

``python scripts/gpu/run_with_dy_choice.py CHOICE_JSON SCRIPT [ARGS...]``: sets
``triton_quantize_decode.SR_DIRECT`` / ``WIDE_MAXNREG`` from CHOICE_JSON (if the file exists;
else the module's defaults stay), prints them, then runs SCRIPT as ``__main__`` with ARGS — so
one device call can measure the linear with the form its own sweep found fastest.
"""

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fullstack_fp4.nvfp4 import triton_quantize_decode as tqd  # noqa: E402

choice, script = sys.argv[1], sys.argv[2]
if os.path.exists(choice):
    with open(choice) as f:
        c = json.load(f)
    tqd.SR_DIRECT, tqd.WIDE_MAXNREG = bool(c["SR_DIRECT"]), c["WIDE_MAXNREG"]
print(f"dY form: SR_DIRECT={tqd.SR_DIRECT} WIDE_MAXNREG={tqd.WIDE_MAXNREG}", flush=True)
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
