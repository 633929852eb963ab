"""Static SASS count of the fused Q-AdamW kernel (sm_90 cubin, no GPU): docs/perf/q-adamw.md's yardstick.

Compiles the default launch (``triton_step.launch`` on a 4096-entry FP32 parameter: HAS_U=False,
CPP_C=1, FAST_DEC, divisibility-16 args, maxnreg = ``triton_step.MAXNREG``) exactly as
``tests/triton_compile_gate.py`` records it, disassembles the cubin with Triton's
bundled ``cuobjdump -sass`` and counts the instructions of the main path (up to the first EXIT: the
div_rn / sqrt_rn slow-path subroutines sit after it) = per thread = per 16 entries. The
per-parameter kernel has two bodies (docs/perf/q-adamw.md): the main path is the one for a program
whose rows are all real (every program but a tensor's first and last one or two); the
"bounded path", counted to its own EXIT, is the masked body those others run.
These are static counts, not timings.

``python benchmarks/sass_q_adamw.py [--sass PATH] [--model-out] [--rand] [--u16] [--rounds N]
[--fast-div] [--multi] [--v-rule 4over6]``
(``--v-rule 4over6``: v's encoder with the 4/6 rule, m's ``encode46`` with nearest rounding, put in
place of the kernel's own for this count only — the alternative that codec version 2's "4"
rule was counted against; not a kernel the optimizer runs)
(``--u16``: the 16-bit uniforms of ``launch(u8=False)`` instead of the default 8-bit ones);
run with the GPU image's triton first on PYTHONPATH to count for 3.6.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _sass  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402  (the jit below: its annotations resolve here)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", default=None, help="write the SASS listing here")
    ap.add_argument("--model-out", action="store_true")
    ap.add_argument("--rand", action="store_true", help="the HAS_U variant (uniforms given)")
    ap.add_argument("--u16", action="store_true",
                    help="16-bit uniforms from two Philox calls a block (launch(u8=False))")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--fast-div", action="store_true",
                    help="Adam's m'/d as m' * rcp.approx(d) (launch(fast_div=True))")
    ap.add_argument("--multi", action="store_true",
                    help="the multi-tensor kernel (triton_multi.launch_multi) over two params")
    ap.add_argument("--v-rule", choices=("4", "4over6"), default="4",
                    help="v's block-scale rule: the kernel's (4) or, to count it, 4/6")
    a = ap.parse_args(argv)
    gate = _sass.gate()
    if a.v_rule == "4over6":
        _use_v_encoder_46()
    import torch
    from fullstack_fp4.optim.q_adamw.codecs import padded_numel
    from fullstack_fp4.optim.q_adamw.optimizer import kernel_hyper, kernel_views
    from fullstack_fp4.optim.q_adamw.state import init_state
    from fullstack_fp4.optim.q_adamw.triton_step import launch

    n = 4096
    hyper = kernel_hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 3, "cpu")
    if a.multi:
        from fullstack_fp4.optim.q_adamw.triton_multi import Item, launch_multi
        items = [Item(torch.randn(k), torch.randn(k), kernel_views(init_state(k, "cpu")), k,
                      padded_numel(k), 0, 0, 5,
                      torch.empty(k, dtype=torch.bfloat16).view(torch.int16)
                      if a.model_out else None) for k in (n, n // 2)]
        launch_multi(items, t=3, u8=not a.u16, rounds=a.rounds, fast_div=a.fast_div, **hyper)
    else:
        launch(torch.randn(n), torch.randn(n), kernel_views(init_state(n, "cpu")), n,
               padded_numel(n), seed=11, rand=torch.rand(n) if a.rand else None,
               model_out=torch.empty(n, dtype=torch.bfloat16) if a.model_out else None,
               u8=not a.u16, rounds=a.rounds, fast_div=a.fast_div, **hyper)
    (job,) = gate.build_jobs()
    r = _sass.count(job)
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(r["sass"])
    second = f", bounded path {r['second']}" if r["second"] else ""
    print(f"triton {r['triton']}: SASS main path {r['main']} per 16 entries "
          f"({r['main'] / 16:.1f}/entry){second}, total {r['total']}, regs {r['regs']}, "
          f"stack {r['stack']}, spills {r['spills']}, sha1 {r['sha1']}")
    print("  " + " ".join(f"{o}:{c}" for o, c in r["top"]))
    return 0


def _use_v_encoder_46() -> None:
    """Swap the kernel's v encoder for the 4/6 one before anything compiles: Triton resolves the
    callee from triton_step's globals when it first compiles (and hashes) the kernel."""
    from fullstack_fp4.optim.q_adamw import triton_step
    from fullstack_fp4.optim.q_adamw.triton_rows import encode46

    @triton.jit
    def _encode_v46(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                    rtab_ptr, R: tl.constexpr):
        return encode46(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                        rtab_ptr, R, False)

    triton_step._encode_v = _encode_v46


if __name__ == "__main__":
    sys.exit(main())
