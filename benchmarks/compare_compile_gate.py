"""Registers and spill bytes of two compile-gate runs, kernel variant by kernel variant.

``python tests/triton_compile_gate.py --json A.json`` at one commit, ``--json B.json`` at another
(the GPU image's triton first on PYTHONPATH to compile for 3.6, as the H200 runs), then
``python benchmarks/compare_compile_gate.py A.json B.json`` prints every variant whose registers or
spill bytes (stores, loads) differ, and the counts. A variant is its kernel, constexprs,
signature, warps, stages, specialisation and the launches that made it (docs/perf/q-attn.md,
"Signed zeros", came from this comparison).
"""

from __future__ import annotations

import json
import sys


def _key(r: dict) -> tuple:
    return (r["name"], r["desc"], r["sig"], r["num_warps"], r["num_stages"], str(r["spec1"]),
            str(sorted(r["labels"])))


def _resources(r: dict) -> tuple:
    return r["regs"], r["spill_stores"], r["spill_loads"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        old, new = ({_key(r): r for r in json.load(open(p))["results"]} for p in argv)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read the compile-gate reports {argv}: {e}", file=sys.stderr)
        return 2
    differ = 0
    for k, r in new.items():
        if k in old and _resources(old[k]) != _resources(r):
            differ += 1
            print(f"{r['name'].rsplit('.', 1)[-1]} [{r['desc']}]: "
                  f"regs/spills {_resources(old[k])} -> {_resources(r)}")
    only = len(new.keys() - old.keys()), len(old.keys() - new.keys())
    print(f"{len(new)} variants, {differ} differ; {only[0]} only in the second, "
          f"{only[1]} only in the first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
