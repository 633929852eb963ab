"""Q-Attn on the GPU: correctness check, then time and memory vs torch SDPA (every backend), BF16.

1. Correctness at a small shape (1×4×200×128, GQA 2, causal, K-smoothing on):
   * the Triton prologue's views equal the PyTorch reference's bit for bit;
   * forward O and LSE, and dQ/dK/dV given the same (O, LSE), within the test suite's
     tolerances (O 1e-2, dQ/dK 2e-2 on the GPU: MMA accumulation order can flip a few dS
     codes, dV 1e-2);
   * the autograd function (which saves the views as 4-bit codes and decodes them for the
     backward) gives O and dQ/dK/dV bit-identical to the BF16-view path (all four views kept
     as BF16 values, the kernels run on them directly).
   Aborts on failure.
2. Timing at 1×24×4096×128 and 4×24×2048×128, causal: forward and forward+backward, median
   of CUDA-event timings after warm-up, Q-Attn (default paths: NVFP4 QKᵀ and dS, emulated on
   Hopper with BF16 tensor cores on exactly-representable dequantized values) vs
   ``F.scaled_dot_product_attention`` with each backend torch has (its default choice, flash =
   FlashAttention-2 in torch, cuDNN, memory-efficient); the device time without host gaps is
   benchmarks/profile/profile_q_attn.py's kernel sum. On the H200 (torch 2.11) the flash
   backend is ~2x slower than torch's default choice (cuDNN); the ratios are printed against
   both. Memory saved for backward: the bytes
   of the distinct storages autograd holds for the backward, *measured* with
   ``torch.autograd.graph.saved_tensors_hooks`` for each; the hand count of Q-Attn's (V, O,
   LSE, the packed views and decode scales: ``packed.py``) is printed beside as a check.
3. Stage breakdown at 1×24×4096×128 (prologue, forward kernel, decode of the saved views,
   backward incl. its delta pre-pass). With ``--sweep`` every ``QATTN_FWD`` /
   ``QATTN_BWD`` config in FWD_SWEEP / BWD_SWEEP is timed and printed as a table (the
   default first), so the next default can be read off.

Prints markdown tables; writes ``q_attn_bench.json`` into ``$OUT`` if set.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import median_ms  # noqa: E402
from fullstack_fp4 import knobs  # noqa: E402
from fullstack_fp4.attention import q_attention  # noqa: E402
from fullstack_fp4.attention import reference  # noqa: E402
from fullstack_fp4.attention.packed import padded_seq  # noqa: E402
from fullstack_fp4.attention.paths import resolve_paths  # noqa: E402
from fullstack_fp4.attention.prologue import make_views, prepare_views  # noqa: E402
from fullstack_fp4.attention.triton_bwd import attention_backward, bwd_config  # noqa: E402
from fullstack_fp4.attention.triton_fwd import fwd_config  # noqa: E402
from fullstack_fp4.attention.triton_fwd import attention_forward  # noqa: E402
from fullstack_fp4.attention.triton_prologue import prologue_config  # noqa: E402

BF = torch.bfloat16


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def correctness():
    torch.manual_seed(0)
    b, h, hk, s, d = 1, 4, 2, 200, 128
    q = (torch.randn(b, h, s, d, device="cuda") * 1.5).to(BF)
    k = (torch.randn(b, hk, s, d, device="cuda") + torch.randn(1, hk, 1, d, device="cuda")).to(BF)
    v = torch.randn(b, hk, s, d, device="cuda").to(BF)
    do = torch.randn(b, h, s, d, device="cuda").to(BF)
    scale = d ** -0.5
    vt = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="triton")
    vr = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="reference")
    views_equal = all(torch.equal(getattr(vt, n).float(), getattr(vr, n).float())
                      for n in ("q_hd", "k_hd", "q_sq", "k_sq"))
    o, lse = attention_forward(vt, v, causal=True, scale=scale)
    o_r, lse_r = reference.forward(v, vr, causal=True, scale=scale, paths=resolve_paths(None))
    g = attention_backward(do, o, lse, v, vt, causal=True, scale=scale)
    g_r = reference.backward(do, o, v, vr, causal=True, scale=scale, paths=resolve_paths(None))
    # the autograd path (4-bit saved views) vs the BF16-view path, bit for bit
    g_bf = attention_backward(do, o, lse, v, vt, causal=True, scale=scale, out_dtypes=(BF,) * 3)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o2 = q_attention(qq, kk, vv, causal=True)
    o2.backward(do)
    packed_equal = torch.equal(o2, o) and all(
        torch.equal(a, w) for a, w in zip((qq.grad, kk.grad, vv.grad), g_bf))
    res = {"views_bit_exact": views_equal, "O": rel(o, o_r),
           "lse_maxabs": (lse - lse_r).abs().max().item(),
           "dQ": rel(g[0], g_r[0]), "dK": rel(g[1], g_r[1]), "dV": rel(g[2], g_r[2]),
           "packed_saved_bit_identical": packed_equal}
    ok = (views_equal and packed_equal and res["O"] < 1e-2 and res["lse_maxabs"] < 1e-3
          and res["dQ"] < 2e-2 and res["dK"] < 2e-2 and res["dV"] < 1e-2)
    res["ok"] = ok
    return res


def saved_bytes(fn, *args):
    """Bytes of the distinct storages autograd saves for the backward while ``fn`` runs."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(seen.values())


def q_attn_saved_formula(b, h, hk, s, d):
    """Hand count of Q-Attn's saved bytes (default paths, BF16 inputs): V, O (BF16), LSE (FP32),
    head_dim views S·D/2 + S·D/16, seq views (Sp/2 + Sp/16)·D, decode scales (FP32)."""
    sp = padded_seq(s)
    views = (b * h + b * hk) * (s * (d // 2 + d // 16) + (sp // 2 + sp // 16) * d)
    return 2 * b * hk * s * d + 2 * b * h * s * d + 4 * b * h * s + views + 4 * (b * h + b * hk)


def host_ms(fn, iters=20):
    """Host time per call of ``fn`` (launches queued back to back, the GPU waited on once at the
    end): if it is near the CUDA-event time, the host sets the pace, not the kernels."""
    import time
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e3


SDPA_BACKENDS = ("default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def sdpa_fn(backend):
    """SDPA causal with one backend forced, or torch's own choice (``"default"``)."""
    def fn(q, k, v):
        if backend == "default":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return fn


def bench(b, h, s, d):
    """Q-Attn beside every SDPA backend torch offers on this GPU (flash = FlashAttention-2 in
    torch): eager fwd, eager fwd+bwd, host time, saved bytes. A backend that cannot run is recorded as such."""
    q, k, v = [torch.randn(b, h, s, d, device="cuda", dtype=BF, requires_grad=True)
               for _ in range(3)]
    do = torch.randn(b, h, s, d, device="cuda", dtype=BF)

    def qattn(q, k, v):
        return q_attention(q, k, v, causal=True)

    out = {}
    arms = [("sdpa_" + be.split("_")[0].lower(), sdpa_fn(be)) for be in SDPA_BACKENDS]
    for name, fn in arms + [("q_attn", qattn)]:
        try:
            with torch.no_grad():
                f_ms = median_ms(lambda: fn(q, k, v))

            def fb():
                o = fn(q, k, v)
                o.backward(do)
            fb_ms = median_ms(fb)
            out[name] = {"fwd_ms": f_ms, "fwd_bwd_ms": fb_ms,
                         "saved_bytes": saved_bytes(fn, q, k, v), "host_fwd_bwd_ms": host_ms(fb)}
        except Exception as e:  # noqa: BLE001 -- a backend this torch/GPU cannot run
            out[name] = {"failed": f"{type(e).__name__}: {str(e)[:160]}"}
            continue
        finally:
            q.grad = k.grad = v.grad = None
    out["q_attn"]["saved_bytes_formula"] = q_attn_saved_formula(b, h, h, s, d)   # also if failed
    ok = {n: r for n, r in out.items() if n.startswith("sdpa_") and "failed" not in r}
    out["fastest_sdpa"] = min(ok, key=lambda n: ok[n]["fwd_bwd_ms"])
    flops = 4 * b * h * s * s * d / 2 * 3.5          # causal fwd (2 GEMMs) + bwd (5 GEMMs)
    qa = out["q_attn"]
    if "failed" in qa:
        return out
    for peer in ("sdpa_flash", out["fastest_sdpa"]):
        if peer in ok:
            out[f"ratio_fwd_bwd_vs_{peer}"] = qa["fwd_bwd_ms"] / ok[peer]["fwd_bwd_ms"]
            out[f"ratio_fwd_vs_{peer}"] = qa["fwd_ms"] / ok[peer]["fwd_ms"]
    out["q_attn_tflops_fwd_bwd"] = flops / qa["fwd_bwd_ms"] / 1e9
    return out


# QATTN_FWD = "BLOCK_M,BLOCK_N,warps,stages"; QATTN_BWD = "w_kv,st_kv,w_q,st_q,rn,rm"
# (rn/rm: 64-row groups per dkdv / dq program). '' = the built-in default.
FWD_SWEEP = ("", "128,64,8,3", "64,64,4,2", "64,64,4,4", "64,32,4,3", "64,64,8,3", "32,32,4,3")
BWD_SWEEP = ("", "8,2,8,2,2,2", "8,4,8,4,2,2", "8,3,8,2,2,2", "8,2,8,3,2,2", "4,3,4,3,1,1")
# QATTN_PROLOGUE = "rows,warps" of the views kernel (triton_prologue.prologue_config)
PROLOGUE_SWEEP = ("", "64,8", "32,8", "32,4", "16,8", "16,4", "16,2")


def same_saved(a, b) -> bool:
    """Two ``SavedViews`` hold the same codes, scale bytes and decode scales."""
    ok = torch.equal(a.dec_q, b.dec_q) and torch.equal(a.dec_k, b.dec_k)
    for name in a._FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        ok = ok and torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales)
    return ok


def breakdown(b, h, s, d, sweep):
    """Per-stage times at one shape (ms): the prologue as the autograd function runs it
    (amax, K mean, views incl. the 4-bit saved ones), the forward kernel, the decode of the
    saved views, the backward (delta pre-pass + two kernels + dK projection). With ``sweep``
    each QATTN_FWD / QATTN_BWD variant is timed ('' = the built-in default)."""
    torch.manual_seed(0)
    q, k, v, do = [torch.randn(b, h, s, d, device="cuda", dtype=BF) for _ in range(4)]
    scale = d ** -0.5
    kw = dict(qk_fp4=True, ds_fp4=True, smooth=True, backend="triton")
    rows = {}
    fwd_views, saved = prepare_views(q, k, **kw)
    rows["decode saved views"] = median_ms(lambda: saved.unpack("triton"))
    views = saved.unpack("triton")
    o, lse = attention_forward(fwd_views, v, causal=True, scale=scale)
    sweeps = {}
    for name, env, cfgs, fn in (
            ("prologue (amax, K mean, views)", "QATTN_PROLOGUE", PROLOGUE_SWEEP,
             lambda: prepare_views(q, k, **kw)),
            ("forward kernel", "QATTN_FWD", FWD_SWEEP,
             lambda: attention_forward(fwd_views, v, causal=True, scale=scale)),
            ("backward (delta + kernels)", "QATTN_BWD", BWD_SWEEP,
             lambda: attention_backward(do, o, lse, v, views, causal=True, scale=scale,
                                        out_dtypes=(BF,) * 3))):
        table = []
        for cfg in (cfgs if sweep else ("",)):
            saved_knob = getattr(knobs, env)            # a fullstack_fp4.knobs attribute
            setattr(knobs, env, knobs.parse_ints(env, cfg, {"QATTN_PROLOGUE": 2,
                                                           "QATTN_FWD": 4}.get(env, (4, 6))))
            try:
                (wk, sk, rn), (wq, sq, rm) = bwd_config(d)
                dflt = {"QATTN_FWD": fwd_config(d, False),
                        "QATTN_PROLOGUE": prologue_config(d)}.get(env, (wk, sk, wq, sq, rn, rm))
                shown = cfg or "default " + ",".join(map(str, dflt))
                if env == "QATTN_PROLOGUE" and not same_saved(prepare_views(q, k, **kw)[1], saved):
                    table.append((shown, "differs from the default tiling's views: not timed"))
                    continue
                table.append((shown, median_ms(fn)))
            except Exception as e:  # noqa: BLE001 -- a config that fails to compile/launch
                table.append((cfg, f"failed: {type(e).__name__}: {str(e)[:80]}"))
            finally:
                setattr(knobs, env, saved_knob)
        rows[name] = table[0][1]
        sweeps[name] = table
    return rows, sweeps


def main():
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    sweep = "--sweep" in sys.argv
    c = correctness()
    print("correctness vs reference:", json.dumps(c))
    if not c["ok"]:
        raise SystemExit("correctness check failed; not benchmarking")
    results = {"device": torch.cuda.get_device_name(), "correctness": c,
               "note": "NVFP4 GEMMs emulated on Hopper (BF16 MMA on exact dequantized values)"}
    print("\nper arm, causal, BF16 inputs (ms; host = host time per eager fwd+bwd; the device time "
          "without host gaps: benchmarks/profile/profile_q_attn.py):\n")
    print("| shape | arm | fwd | fwd+bwd | host | saved MiB (hooks) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in ((1, 24, 4096, 128), (4, 24, 2048, 128)):
        r = bench(*shape)
        tag = "x".join(map(str, shape))
        results[tag] = r
        for name, a in r.items():
            if not isinstance(a, dict):
                continue
            if "failed" in a:
                print(f"| {tag} | {name} | failed: {a['failed']} | | | |")
                continue
            print(f"| {tag} | {name} | {a['fwd_ms']:.3f} | {a['fwd_bwd_ms']:.3f} | "
                  f"{a['host_fwd_bwd_ms']:.3f} | {a['saved_bytes'] / 2**20:.1f} |")
        print(f"  Q-Attn saved bytes by formula: {r['q_attn']['saved_bytes_formula'] / 2**20:.1f} MiB;"
              f" fastest SDPA backend here: {r['fastest_sdpa']}")
        for key in sorted(k for k in r if k.startswith("ratio_")):
            print(f"  {key}: {r[key]:.2f}")
    for shape in ((1, 24, 4096, 128),):
        rows, sweeps = breakdown(*shape, sweep)
        tag = "x".join(map(str, shape))
        results["breakdown_" + tag] = rows
        results["sweep_" + tag] = {k: [list(x) for x in v] for k, v in sweeps.items()}
        print(f"\nstage times at {tag} causal (ms, default configs):\n")
        print("| stage | ms |\n| --- | --- |")
        for key, val in rows.items():
            print(f"| {key} | {val if isinstance(val, str) else f'{val:.3f}'} |")
        if sweep:
            for stage, env in (("prologue (amax, K mean, views)", "QATTN_PROLOGUE  (rows,warps)"),
                               ("forward kernel", "QATTN_FWD  (BLOCK_M,BLOCK_N,warps,stages)"),
                               ("backward (delta + kernels)",
                                "QATTN_BWD  (w_kv,st_kv,w_q,st_q,rn,rm)")):
                print(f"\nsweep: {stage} at {tag} — {env}\n")
                print("| config | ms | vs default |\n| --- | --- | --- |")
                base = sweeps[stage][0][1]
                for cfg, ms in sweeps[stage]:
                    ratio = "" if isinstance(ms, str) or isinstance(base, str) else f"{ms / base:.2f}"
                    print(f"| {cfg} | {ms if isinstance(ms, str) else f'{ms:.3f}'} | {ratio} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "q_attn_bench.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
