"""Launch configurations of the NVFP4 linear's operand kernels, timed on the GPU.

``_quantize_two_ways_kernel`` and ``_amax_two_ways_kernel`` (fullstack_fp4/nvfp4/kernels/
quantize_two_ways.py, amax.py) run one lane per (16-channel block, quad) with 16 tokens a lane, so a
thread's registers do not depend on how many blocks a program takes (NB) — only the CTA size
and so the number of CTAs that fit an SM do. What this sweeps, per kernel and per linear shape:

* NB (blocks per program) with ``num_warps = NB / 8`` (the layout's one lane per thread):
  8/1, 16/2, 32/4 (the default), 64/8;
* a register cap (``maxnreg``) where the default's registers limit the resident warps
  (sm_90 compiles on the CPU, benchmarks/sass_two_ways.py: dY 128 regs → 96 spills 96 B;
  x 106 → 96 without spills; W 219 → 128 spills 236 B).

Every configuration is first checked bit for bit against the default configuration's outputs
(the default is itself tested against the reference). Times are device times per call from a
CUDA graph of 20 calls replayed (no host time), median of 7 replays, with the bytes each call
moves and the GB/s beside a device-to-device copy of the same input.

Compiles go first, in parallel worker processes that fill the shared Triton cache
(``TRITON_CACHE_DIR``): the dY kernel takes ~20 s to compile, and there are ~25 variants.

``--dy``: only dY's call (both ways stochastic, decoded), its rounding form against its register
cap (``quantize_two_ways.SR_DIRECT`` / ``WIDE_MAXNREG``: through the nibble, or straight to
the decoded value, uncapped or capped at 128), at 8192 × 3072 and 8192 × 8192; each checked bit
for bit against the nibble form; the fastest (summed over both shapes) is printed and, with
``$OUT`` set, written to ``$OUT/dy_choice.json``.

``--amax``: the amax pass (``quantize_two_ways.AMAX_BLOCK`` words a program,
``AMAX_TBS`` token blocks a program, ``AMAX_WARPS``) at the linear's shapes, both ways (x, dY)
and the row way alone (W), each result checked bit for bit against PyTorch's max of ``|m|`` and
of ``|hadamard16(pad(m)ᵀ)|`` (the reference function, on the GPU), timed against a
device-to-device copy of the same input (the pass reads what the copy reads and writes nothing).

``--tbs``: x's call (row decoded + column codes) with 1, 2 or 4 token blocks a program
(``quantize_two_ways.COL_CODES_TBS``: a channel's codes and scales of the program's token
blocks stored as one run each), uncapped and capped at 128 registers, at 8192 × 3072 and
8192 × 8192, each checked bit for bit against one token block a program.

Usage (GPU): ``python benchmarks/profile/sweep_two_ways.py [--jobs 8] [--dy | --tbs | --amax]``.
"""

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import capture_graph, median_ms  # noqa: E402

T = 8192
CODES = 0.5 + 1 / 16           # bytes an element of packed codes + E4M3 scales


def modes():
    """name -> (shapes, row way, col way, bytes written an element, [(NB, warps, maxnreg)])."""
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    R, C = tqd.RowWay, tqd.ColWay
    base = [(32, 4, None), (16, 2, None), (64, 8, None), (8, 1, None)]
    return {
        "x: row dec + col codes": ([(T, 3072)], R("nearest"), C("nearest"), 2 + CODES,
                                   base + [(32, 4, 96), (16, 2, 96)]),
        "W 16x16: dec + codes": ([(3072, 3072), (8192, 3072)], R("nearest", (16, 16), codes=True),
                                 None, 2 + CODES, base + [(32, 4, 168), (16, 2, 128)]),
        "dY: row SR dec + col SR dec": ([(T, 3072), (T, 8192)], R("stochastic"),
                                        C("stochastic", decoded=True, codes=False), 4,
                                        base + [(32, 4, 96), (16, 2, 96)]),
    }


def configure(nb, nw, maxnreg):
    """Point quantize_two_ways's launches at one configuration (plain JITFunction.run
    launches, so the register cap is part of each compile's key)."""
    from fullstack_fp4.nvfp4.kernels import launch as triton_launch
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    triton_launch.set_mode("0")
    tqd._config = lambda nblk, wide=False: (min(nb, triton_launch.next_pow2(max(nblk, 1))),
                                max(1, min(nb, triton_launch.next_pow2(max(nblk, 1))) // 8))

    def launch(fn, grid, *a, **kw):
        if maxnreg is not None:
            kw["maxnreg"] = maxnreg
        return triton_launch.launch(fn, grid, *a, **kw)
    tqd.launch = launch
    assert nw == max(1, nb // 8)


def call(name, m, cfg):
    """One call of the mode's kernel; returns its outputs (a tuple of tensors)."""
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    _, row, col, _, _ = modes()[name]
    obs = cfg["obs"]
    q = tqd.quantize_two_ways(m, obs, row=row, col=col, seed_row=11, seed_col=12)
    outs = [q.row_decoded, q.col_decoded]
    for nq in (q.row_q, q.col_q):
        if nq is not None:
            outs += [nq.data, nq.block_scale.view(torch.uint8)]
    outs.append(q.row_scale if q.row_scale is not None else q.col_scale)
    return tuple(o for o in outs if o is not None)


def _input(shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    m = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    m[3, 5] = 40.0                                  # an outlier
    return m


def apply(setting):
    """``("launch", NB, warps, maxnreg)``: :func:`configure`; ``("dy", SR_DIRECT, cap)``:
    :func:`dy_form`; ``("tbs", COL_CODES_TBS, maxnreg)``: :func:`tbs_form`."""
    {"launch": configure, "dy": dy_form, "tbs": tbs_form}[setting[0]](*setting[1:])


def warm(job):
    """Worker: compile (by running once) one ``(mode, shape, setting)``."""
    name, shape, setting = job
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/tc")
    apply(setting)
    m = _input(shape)
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    call(name, m, {"obs": tqd.amax_two_ways(m)})
    torch.cuda.synchronize()
    return job


def warm_all(jobs, procs):
    """Compile every job in ``procs`` spawned processes (they fill the shared Triton cache)."""
    import multiprocessing as mp
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(warm, jobs))


def same(got, ref) -> bool:
    return len(got) == len(ref) and all(torch.equal(x, y) for x, y in zip(got, ref))


def graph_ms(fn, n=20, reps=7):
    """Device ms per call: median over ``reps`` replays of a graph of ``n`` calls."""
    return median_ms(capture_graph(fn, n).replay, iters=reps, warmup=1) / n


DY_FORMS = [(False, None), (True, None), (True, 128)]     # (SR_DIRECT, WIDE_MAXNREG)
DY_NAME = "dY: row SR dec + col SR dec"


def dy_form(direct, cap):
    from fullstack_fp4.nvfp4.kernels import launch as triton_launch
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    triton_launch.set_mode("0")
    tqd.SR_DIRECT, tqd.WIDE_MAXNREG = direct, cap


def time_forms(name, m, forms, set_form):
    """Each form of one call on ``m``: (form, bits equal to the first form's, device ms); the
    amax both ways is taken once, under the first form."""
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    set_form(*forms[0])
    cfg = {"obs": tqd.amax_two_ways(m)}
    ref = [o.clone() for o in call(name, m, cfg)]
    rows = []
    for f in forms:
        set_form(*f)
        rows.append((f, same(call(name, m, cfg), ref), graph_ms(lambda: call(name, m, cfg))))
    return rows


def dy_main(jobs):
    import json
    warm_all([(DY_NAME, (T, 3072), ("dy",) + f) for f in DY_FORMS], jobs)
    total = {f: 0.0 for f in DY_FORMS}
    print("| dY call, shape | SR_DIRECT | maxnreg | bits = nibble form | ms | GB/s |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for shape in ((T, 3072), (T, 8192)):
        m = _input(shape)
        for f, ok, t in time_forms(DY_NAME, m, DY_FORMS, dy_form):
            total[f] += t if ok else float("inf")
            print(f"| {shape[0]}x{shape[1]} | {f[0]} | {f[1] or '-'} | {ok} | {t:.4f} | "
                  f"{m.numel() * 6 / t / 1e6:.0f} |", flush=True)
    best = min(DY_FORMS, key=lambda f: total[f])
    print(f"fastest: SR_DIRECT={best[0]} WIDE_MAXNREG={best[1]} ({total[best]:.4f} ms summed)")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "dy_choice.json"), "w") as fh:
            json.dump({"SR_DIRECT": best[0], "WIDE_MAXNREG": best[1],
                       "summed_ms": {f"{k[0]},{k[1]}": v for k, v in total.items()}}, fh)


TBS_FORMS = [(1, None), (2, None), (4, None), (2, 128), (4, 128)]   # (COL_CODES_TBS, maxnreg)
X_NAME = "x: row dec + col codes"


def tbs_form(tbs, maxnreg):
    """x's call with ``tbs`` token blocks a program (``COL_CODES_TBS``) and a register cap."""
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    configure(32, 4, maxnreg)
    tqd.COL_CODES_TBS = tbs


def tbs_main(jobs):
    """x's call (row decoded + column codes) at each (token blocks a program, register cap),
    bit for bit against one token block a program, timed."""
    warm_all([(X_NAME, (T, 3072), ("tbs",) + f) for f in TBS_FORMS], jobs)
    print("| x call, shape | token blocks a program | maxnreg | bits = 1 block | ms | / copy |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for shape in ((T, 3072), (T, 8192)):
        m = _input(shape)
        dst = torch.empty_like(m)
        t_copy = graph_ms(lambda: dst.copy_(m))
        for f, ok, t in time_forms(X_NAME, m, TBS_FORMS, tbs_form):
            print(f"| {shape[0]}x{shape[1]} | {f[0]} | {f[1] or '-'} | {ok} | {t:.4f} | "
                  f"{t / t_copy:.2f} |", flush=True)


AMAX_FORMS = [(128, 4, 4), (128, 2, 4), (128, 8, 4), (256, 4, 4), (256, 4, 8), (64, 4, 2),
              (256, 8, 8), (128, 16, 4)]                   # (AMAX_BLOCK, AMAX_TBS, AMAX_WARPS)
AMAX_SHAPES = [((T, 3072), True), ((T, 8192), True), ((3072, 3072), False), ((T, 3072), False)]


def amax_form(block, tbs, warps):
    from fullstack_fp4.nvfp4.kernels import launch as triton_launch
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    triton_launch.set_mode("0")
    tqd.AMAX_BLOCK, tqd.AMAX_TBS, tqd.AMAX_WARPS = block, tbs, warps


def _amax_want(m, col):
    """PyTorch's amax bits of ``m`` and (``col``) of ``hadamard16(pad(m)ᵀ)``, as amax_two_ways
    returns them."""
    import torch.nn.functional as F
    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16
    bits = (lambda v: v.float().reshape(1).view(torch.int32))
    row = bits(m.float().abs().amax())
    if not col:
        return torch.cat([row, torch.zeros_like(row)])
    pad = F.pad(m.float(), (0, 0, 0, (-m.shape[0]) % 16))
    return torch.cat([row, bits(hadamard16(pad.t(), DEFAULT_SIGNS).abs().amax())])


def amax_main():
    """The amax pass at each (words a program, token blocks a program, warps), bit for bit
    against PyTorch, timed against a copy of its input."""
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    print("| amax, shape | ways | BLOCK / TBS / warps | bits = PyTorch | ms | GB/s read | copy ms "
          "| / copy |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for shape, col in AMAX_SHAPES:
        m = _input(shape)
        want = _amax_want(m, col)
        dst = torch.empty_like(m)
        t_copy = graph_ms(lambda: dst.copy_(m))
        for f in AMAX_FORMS:
            amax_form(*f)
            fn = (lambda: tqd.amax_two_ways(m, col=col))
            ok = torch.equal(fn(), want)
            t = graph_ms(fn)
            print(f"| {shape[0]}x{shape[1]} | {'both' if col else 'row'} | {f[0]} / {f[1]} / "
                  f"{f[2]} | {ok} | {t:.4f} | {m.numel() * 2 / t / 1e6:.0f} | {t_copy:.4f} | "
                  f"{t / t_copy:.2f} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--dy", action="store_true")
    ap.add_argument("--tbs", action="store_true")
    ap.add_argument("--amax", action="store_true")
    a = ap.parse_args()
    if a.amax:
        return amax_main()
    if a.dy:
        return dy_main(a.jobs)
    if a.tbs:
        return tbs_main(a.jobs)
    jobs = [(name, shape, ("launch",) + c) for name, (shapes, _, _, _, cfgs) in modes().items()
            for shape in shapes[:1] for c in cfgs]
    warm_all(jobs, a.jobs)
    print(f"compiled {len(jobs)} variants", flush=True)
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    print("| kernel | shape | NB/warps | maxnreg | bits = default | ms | GB/s | copy ms | / copy |")
    print("| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for name, (shapes, row, col, wbytes, cfgs) in modes().items():
        for shape in shapes:
            m = _input(shape)
            dst = torch.empty_like(m)
            t_copy = graph_ms(lambda: dst.copy_(m))
            configure(32, 4, None)
            cfg = {"obs": tqd.amax_two_ways(m)}
            ref = [o.clone() for o in call(name, m, cfg)]
            for nb, nw, mr in cfgs:
                configure(nb, nw, mr)
                try:
                    ok = same(call(name, m, cfg), ref)
                    t = graph_ms(lambda: call(name, m, cfg))
                except Exception as e:   # noqa: BLE001 -- report the variant, go on
                    print(f"| {name} | {shape[0]}x{shape[1]} | {nb}/{nw} | {mr} | ERROR "
                          f"{type(e).__name__}: {str(e)[:80]} | | | | |", flush=True)
                    continue
                gbs = m.numel() * (2 + wbytes) / t / 1e6
                print(f"| {name} | {shape[0]}x{shape[1]} | {nb}/{nw} | {mr or '-'} | {ok} | "
                      f"{t:.4f} | {gbs:.0f} | {t_copy:.4f} | {t / t_copy:.2f} |", flush=True)


if __name__ == "__main__":
    main()
