"""The NVFP4 linear's three two-way quantize calls with their block scales' element factor
``1/(s·dec)`` from ``div_rn`` (a branch a scale) or branch-free (``_candidate_nb``), on the GPU.

For each call (x: row decoded + column codes; W: 16×16 decoded + codes; dY: both ways
stochastic, decoded) at the linear's shapes, every output of the branch-free form is compared
bit for bit with the ``div_rn`` form (which the tests hold against the reference), then both
are timed: device ms per call from a CUDA graph of 20 calls, median of 7 replays. x is also
timed branch-free under a 168-register cap (its branch-free form compiles to 198 registers,
8 warps an SM against 12; scripts/sass_two_ways.py).

Usage (GPU): ``python scripts/gpu/rcp_variants.py``.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import capture_graph, median_ms  # noqa: E402

from fullstack_fp4.nvfp4 import triton_quantize_decode as tqd  # noqa: E402

T = 8192


def outputs(q):
    out = []
    for name in ("row_decoded", "col_decoded", "row_scale", "col_scale", "row_alpha",
                 "col_alpha"):
        v = getattr(q, name)
        if v is not None:
            out.append(v.reshape(-1).view(torch.int16 if v.dtype == torch.bfloat16 else torch.int32))
    for qq in (q.row_q, q.col_q):
        if qq is not None:
            out += [qq.data.reshape(-1), qq.block_scale.view(torch.uint8).reshape(-1)]
    return [o.clone() for o in out]


def main() -> int:
    R, C = tqd.RowWay, tqd.ColWay
    real_launch = tqd.launch
    landed = tqd.RCP_NO_BRANCH
    ok = True
    rows = []
    for fout in (3072, 8192):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(fout, 3072, device="cuda", dtype=torch.bfloat16, generator=g) / 55
        dy = torch.randn(T, fout, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
        one = torch.ones(1, device="cuda")
        calls = {
            "x": (x, dict(row=R("nearest"), col=C("nearest"))),
            "W": (w, dict(row=R("nearest", (16, 16), codes=True), row_peer_scale=one)),
            "dY": (dy, dict(row=R("stochastic"), col=C("stochastic", decoded=True, codes=False),
                            seed_row=11, seed_col=12, row_peer_scale=one, col_peer_scale=one)),
        }
        for kind, (m, kw) in calls.items():
            obs = tqd.amax_two_ways(m, row=True, col=kw.get("col") is not None)
            variants = [("div_rn", frozenset(), None), ("branch-free", frozenset({kind}), None)]
            if kind == "x":
                variants.append(("branch-free, 168 regs", frozenset({kind}), 168))
            base = None
            for label, rcp, cap in variants:
                tqd.RCP_NO_BRANCH = rcp

                def launch(fn, grid, *a, _cap=cap, **k):
                    if _cap is not None and fn.__name__ == "_quantize_two_ways_kernel":
                        k["maxnreg"] = _cap
                    return real_launch(fn, grid, *a, **k)
                tqd.launch = launch
                try:
                    fn = (lambda: tqd.quantize_two_ways(m, obs, **kw))
                    got = outputs(fn())
                    if base is None:
                        base, same = got, True
                    else:
                        same = len(got) == len(base) and all(torch.equal(a, b)
                                                              for a, b in zip(got, base))
                    ok &= same
                    graph = capture_graph(fn, 20)
                    ms = median_ms(graph.replay, iters=7, warmup=2) / 20
                finally:
                    tqd.launch = real_launch
                rows.append((f"{tuple(m.shape)}", kind, label, same, ms))
                print(f"| {tuple(m.shape)} | {kind} | {label} | {same} | {ms:.4f} |", flush=True)
    tqd.RCP_NO_BRANCH = landed
    print("(columns: input, call, element factor, bits equal to div_rn's, device ms a call)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
