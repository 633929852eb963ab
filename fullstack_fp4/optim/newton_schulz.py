"""Quintic Newton–Schulz orthogonalisation in FP64 / FP32 / BF16 / NVFP4.

``newton_schulz(G)`` approximates the polar factor ``U·Vᵀ`` of ``G = U·Σ·Vᵀ``:

    X₀ = G / (‖G‖_F + 1e-7)            (σ_max(X₀) ≤ 1, inside the quintic's basin)
    X ← a·X + (b·A + c·A²)·X,  A = X·Xᵀ (one (a, b, c) per step, see ns_coefficients.py)

A tall ``G`` (rows > cols) is transposed first so that ``A`` is the *smaller* Gram matrix
(``min × min``): the products then cost ``4·m²·n + 2·m³`` FLOPs with m = min dim.

NVFP4 precision (``precision="nvfp4"``): every matrix product takes NVFP4 operands
(E2M1 + E4M3 per 1×16 block along the product's reduction dimension + FP32 tensor scale) and
accumulates in FP32; everything that is not a product (scalings, sums) is FP32. Two variants:

``nvfp4_form="naive"`` — the textbook step with each operand quantized:
    Xr = q(X)                   rows of X, K = n; reused as BOTH operands of A = Xr·Xrᵀ
    A  = Xr·Xrᵀ;  Aq = q(A);    A² = Aq·Aqᵀ  (A symmetric: one quantized view, used twice)
    X ← a·X + q(bA + cA²)·q_col(X)   q_col: X quantized along its rows' index (K = m)
It diverges on full-rank Gaussian inputs (measured): near convergence ``B = bA + cA²`` ≈
``(b + c)·I`` ≈ −2.7·I for Muon's triple, so the ~10 % NVFP4 error of ``q_col(X)`` enters the
output multiplied by 2.7 while the exact output ``(a + b + c)·X`` is only ≈ 0.7·X.

``nvfp4_form="shifted"`` (default, ours) — take the identity out of every quantized operand:
    A  = Xr·Xrᵀ;  τ = trace(A)/m;  D = A − τ·I          (D small once X is near-orthogonal)
    D² = q(D)·q(D)ᵀ                                      (one quantized view, used twice)
    A² = τ²·I + 2τ·D + D²  ⇒  bA + cA² = β·I + B',  β = bτ + cτ²,  B' = (b + 2cτ)·D + c·D²
    X ← (a + β)·X + q(B')·q_col(X)
Algebraically identical to the exact step; the identity parts (``τ``, ``β``, ``(a + β)·X``) are
exact FP32 scalars/axpys, so quantization noise scales with ‖D‖ and ‖B'‖, which shrink as X
converges, instead of with ‖A‖ and ‖B‖, which do not. Cost: 4 quantizations (Xr, q(D), q(B'),
q_col(X)) and 3 GEMMs per step, the same as naive. The remaining dominant error is the
quantization of X inside ``A = Xr·Xrᵀ`` (first order, ∝ sqrt(m/n)); the fitted coefficient
schedules (``coefficients="fp4"``) damp it by ending with convergent steps.

``clip_percentile=p``: before each quantization, the operand's entries are clamped to the p-th
percentile of that operand's |entries| (each operand separately: X, D, B', since their
outliers are unrelated). Measured (benchmarks/studies/ns_error_table.py): in NS it *hurts* — clamping
changes the matrix, not only its encoding, and on heavy-tailed inputs it pushes singular values
out of the basin — so it is off by default; it exists to reproduce the paper's ablation.

Backends for the NVFP4 products: "reference" quantizes with ``fullstack_fp4.nvfp4.quantize`` and
multiplies with ``nvfp4_matmul`` (the oracle path); "triton" uses ``triton_ns`` (one fused
kernel per operand: amax-scaled quantize + decode to the exact BF16 operand, no NVFP4Tensor
round trip) and a BF16 GEMM with FP32 output; "auto" = triton on CUDA when importable.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .ns_coefficients import Triple, resolve_schedule

__all__ = ["newton_schulz", "newton_schulz_graphed", "graphable", "clear_ns_graphs", "ns_step",
           "abs_quantile", "abs_sample", "NVFP4Products", "step_nvfp4"]

_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16,
           "nvfp4": torch.float32}


# The two-term step on the Triton backend takes the lean path (_step_nvfp4_two_term_lean):
# the same numbers as the composition in _step_nvfp4_split with fewer memory passes. False
# runs the composition (the tests compare the two; benchmarks can time both).
LEAN_TWO_TERM = True

QUANTILE_SAMPLE = 1 << 16
_SAMPLE_IDX: dict = {}


def abs_sample(x: torch.Tensor, n_max: int = QUANTILE_SAMPLE) -> torch.Tensor:
    """|x| as a flat FP32 vector: every entry when ``x.numel() <= n_max``, else a FIXED
    sample of ``n_max`` distinct entries (no copy of ``x``, any strides, no host sync).

    Why a sample: torch's CUDA kthvalue/quantile run ONE thread block per slice, so a single
    25M-entry slice (a 3072×8192 gradient) takes ~50–100 ms and torch.quantile refuses > 16M
    entries; with 2 kthvalue per logical block and 28 blocks, Root's step would take seconds.
    The sample is the Weyl sequence ``idx_i = i·P mod n`` with P coprime to n and P/n ≈ 0.618 (golden
    ratio): distinct indices spread evenly over rows AND columns (a plain stride n/N shares
    factors with the row length and would see only a few columns, e.g. 64 of 8192).

    Accuracy (a level for a soft threshold / clamp, not a statistic anyone reports): the rank
    of the sample's q-quantile in the full matrix has std sqrt(q(1−q)/N) = 0.0012 at q = 0.9,
    0.0004 at q = 0.99 (N = 65536); for Gaussian-like |entries| that is a relative error of
    the level of ≈ 0.35 % (q = 0.9) and ≈ 0.5 % (q = 0.99), far below anything the
    threshold's effect can resolve. Small matrices (≤ 65536 entries, every CPU test) are exact.
    """
    n = x.numel()
    if n <= n_max:
        return x.detach().abs().flatten().float()
    key = (n, n_max, x.device)
    idx = _SAMPLE_IDX.get(key)
    if idx is None:
        import math  # noqa: PLC0415
        p = int(n * 0.6180339887498949)
        while math.gcd(p, n) != 1:
            p += 1
        idx = (torch.arange(n_max, dtype=torch.int64) * p) % n
        idx = idx.to(x.device)
        _SAMPLE_IDX[key] = idx
    if x.ndim == 2:
        cols = x.shape[1]
        v = x.detach()[idx // cols, idx % cols]        # gather through the strides, no copy
    else:
        v = x.detach().reshape(-1)[idx]
    return v.abs().float()


def abs_quantile(x: torch.Tensor, q: float, n_max: int = QUANTILE_SAMPLE) -> torch.Tensor:
    """q-quantile of |x| with torch.quantile's linear interpolation, on ``abs_sample(x)``
    (exact for ≤ ``n_max`` entries). One sort of ≤ 64K values; 0-dim FP32 device tensor."""
    s = abs_sample(x, n_max).sort().values
    n = s.numel()
    pos = q * (n - 1)
    lo = int(pos)
    frac = pos - lo
    if frac == 0 or lo + 1 >= n:
        return s[lo]
    return s[lo] + frac * (s[lo + 1] - s[lo])


def _clip(x: torch.Tensor, percentile: Optional[float]) -> torch.Tensor:
    """Clamp entries to the ``percentile``-th percentile of |x|: the k-th smallest of
    ``abs_sample(x)``, k = round(p/100 · N) (exact for ≤ 65536 entries; a fixed 64K sample
    above, see abs_sample)."""
    if percentile is None:
        return x
    flat = abs_sample(x)
    k = max(1, min(flat.numel(), int(round(percentile / 100.0 * flat.numel()))))
    t = flat.kthvalue(k).values
    return x.clamp(-t, t)


class NVFP4Products:
    """NVFP4 operands and products for one backend. ``op(x)`` quantizes ``x`` along its last
    dim; ``mm(p, q)`` = ``p @ q.T`` with FP32 accumulation and FP32 output."""

    def __init__(self, backend: str, clip: Optional[float], rounding: str,
                 generator: Optional[torch.Generator], device: torch.device):
        if backend == "auto":
            backend = "triton" if device.type == "cuda" and _triton_available() else "reference"
        if backend not in ("reference", "triton"):
            raise ValueError(f"backend must be auto | reference | triton, got {backend!r}")
        self.backend, self.clip, self.rounding, self.generator = backend, clip, rounding, generator

    def op(self, x: torch.Tensor, amax=None, scale=None):
        """Quantized ``x · scale`` (``scale``: optional 1-element device tensor; ``amax``:
        optional max |x · scale|, triton only — the reference computes its own, identically)."""
        if self.clip is not None:
            if scale is not None:
                x, scale = x * scale, None
            x, amax = _clip(x, self.clip), None
        if self.backend == "triton":
            from .triton_ns import quantize_decode  # noqa: PLC0415 (optional, CUDA only)
            if self.rounding != "nearest":
                raise ValueError("the triton NS backend implements nearest rounding only")
            return quantize_decode(x, amax=amax, scale=scale)  # strided views read in place
        from fullstack_fp4.nvfp4 import quantize  # noqa: PLC0415 (keep import cheap)
        if scale is not None:
            x = x * scale
        return quantize(x.contiguous(), rounding=self.rounding, generator=self.generator)

    def deq(self, t) -> torch.Tensor:
        """FP32 value of an ``op`` result (what the product sees): the residual of a two-term
        split is ``x − deq(op(x))``."""
        if self.backend == "triton":
            dec, ts = t
            return dec.float() * ts
        return t.dequantize(torch.float32)

    def amax(self, x: torch.Tensor):
        """max |x| (1-element FP32) for the triton backend, else None (reference recomputes)."""
        if self.backend == "triton" and self.clip is None:
            from .triton_ns import abs_max  # noqa: PLC0415
            return abs_max(x)
        return None

    def mm(self, p, q) -> torch.Tensor:
        if self.backend == "triton":
            from .triton_ns import decoded_matmul  # noqa: PLC0415
            return decoded_matmul(p, q)
        from fullstack_fp4.nvfp4.gemm import nvfp4_matmul  # noqa: PLC0415
        return nvfp4_matmul(p, q, out_dtype=torch.float32)

    def mm_unscaled(self, p, q):
        """``(acc, s)`` with ``p @ q.T = acc · s`` (s: 0-dim tensor, or 1.0 for the reference),
        so the caller folds ``s`` into its next elementwise op instead of a separate pass."""
        if self.backend == "triton":
            from .triton_ns import decoded_matmul_unscaled  # noqa: PLC0415
            return decoded_matmul_unscaled(p, q)
        return self.mm(p, q), None


class _PlainProducts:
    """Adapter giving an ``op(x)`` / ``mm(p, q)`` object the fused-step interface."""

    def __init__(self, inner):
        self.inner = inner

    def op(self, x, amax=None, scale=None):
        return self.inner.op(x if scale is None else x * scale)

    def amax(self, x):
        return None

    def mm_unscaled(self, p, q):
        return self.inner.mm(p, q), None


def _axpy(x: torch.Tensor, alpha, acc: torch.Tensor, s) -> torch.Tensor:
    """``alpha·x + s·acc`` in two kernels (alpha: 0-dim tensor; s: 0-dim tensor, a Python
    float, or None = 1)."""
    y = x * alpha
    if s is None:
        return y.add_(acc)
    if isinstance(s, torch.Tensor):
        return y.addcmul_(acc, s)
    return y.add_(acc, alpha=s)


def _triton_available() -> bool:
    try:
        from . import triton_ns  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _repelling_point_sq(abc: Triple):
    """σ*² of the quintic's repelling fixed point above 1 (f(σ) = σ ⇔ a−1 + bσ² + cσ⁴ = 0,
    larger root), or None when there is none (then the quintic has no such edge)."""
    a, b, c = abc
    if c <= 0:
        return None
    disc = b * b - 4 * c * (a - 1)
    if disc < 0:
        return None
    root = (-b + disc ** 0.5) / (2 * c)
    return root if root > 1 else None


def _guard_scale(A: torch.Tensor, abc: Triple):
    """The basin guard's factor s (0-dim device tensor) for ``A``, or None when the triple
    has no repelling point. See ``step_nvfp4``."""
    edge2 = _repelling_point_sq(abc)
    if edge2 is None:
        return None
    v = torch.ones(A.shape[0], 1, dtype=A.dtype, device=A.device)
    for _ in range(5):
        v = A @ (A @ v)
        v = v / (torch.linalg.vector_norm(v) + 1e-30)
    lam = (v.mT @ (A @ v)).reshape(())
    return torch.clamp((0.99 ** 2) * edge2 / (lam + 1e-30), max=1.0)


def _split(P, x: torch.Tensor, terms: int) -> list:
    """``terms`` NVFP4 operands whose dequantized sum approximates ``x``: q(x), then
    q(x − deq(q(x))), ... (each with its own tensor and block scales). Two terms: the
    residual's NVFP4 error is ~10 % of ~10 %, i.e. ~1 % of x."""
    out, r = [], x
    for i in range(terms):
        t = P.op(r)
        out.append(t)
        if i + 1 < terms:
            r = r - P.deq(t)
    return out


def _mm_terms(P, S: list, T: list, symmetric: bool = False) -> torch.Tensor:
    """Σ_{i+j < terms} S_i·T_jᵀ (FP32): the split product to first order in the residuals
    (the residual×residual terms, ~1 % of ~1 %, are dropped). ``symmetric`` (S is T, one
    matrix on both sides): S₀S₀ᵀ + C + Cᵀ with C = S₀S₁ᵀ, 2 GEMMs instead of 3."""
    n = max(len(S), len(T))
    if symmetric and n == 2:
        C = P.mm(S[0], T[1])
        return P.mm(S[0], T[0]).add_(C).add_(C.mT)
    out = None
    for i, s_ in enumerate(S):
        for j, t_ in enumerate(T):
            if i + j < n:
                y = P.mm(s_, t_)
                out = y if out is None else out.add_(y)
    return out


def _step_nvfp4_split(X: torch.Tensor, m: int, abc: Triple, P, terms: int,
                      guard: bool = True) -> torch.Tensor:
    """Shifted step with every quantized operand split into ``terms`` NVFP4 operands
    (``_split``): the same four operands (X rows, D, B', X columns), every GEMM still takes
    NVFP4 operands with FP32 accumulation; two terms cost 2 GEMMs for each of the symmetric
    products (A = X·Xᵀ, D²) and 3 for B'·X instead of 1."""
    a, b, c = abc
    Xr = _split(P, X, terms)
    A = _mm_terms(P, Xr, Xr, symmetric=True)
    if guard:
        s = _guard_scale(A, abc)
        if s is not None:
            A.mul_(s)
            X = X * s.sqrt()
    tau = torch.diagonal(A)[:m].sum() / m
    D = A
    torch.diagonal(D)[:m] -= tau
    Dq = _split(P, D, terms)
    DD = _mm_terms(P, Dq, Dq, symmetric=True)
    Bp = D.mul_(tau * (2 * c) + b).add_(DD, alpha=c)          # (b + 2cτ)·D + c·D²
    out = _mm_terms(P, _split(P, Bp, terms), _split(P, X.t(), terms))
    return (X * (tau * (b + c * tau) + a)).add_(out)


def _step_nvfp4_two_term_lean(X: torch.Tensor, m: int, abc: Triple,
                              guard: bool = True) -> torch.Tensor:
    """``_step_nvfp4_split`` with two terms on the Triton backend, bit for bit (tested), in
    fewer passes over memory: each split operand in three kernels without FP32 temporaries
    (``triton_ns.split2``); the guard's √s fused into the quantize kernels and the final pass
    instead of ``X·√s`` in memory; the symmetric products summed in one pass
    (``sym_two_term``); the three products of q(B')·q_col(X) scaled, summed and added to the
    scaled X in one pass (``cross_two_term_axpy``). Same operations, same order, same
    roundings as the composition in ``_step_nvfp4_split``."""
    from .triton_ns import abs_max, cross_two_term_axpy, split2, sym_two_term  # noqa: PLC0415
    a, b, c = abc
    amax_x = abs_max(X)
    A = sym_two_term(split2(X, amax=amax_x))
    rs = None
    if guard:
        s = _guard_scale(A, abc)
        if s is not None:
            A.mul_(s)
            rs = s.sqrt()
    tau = torch.diagonal(A)[:m].sum() / m
    D = A
    torch.diagonal(D)[:m] -= tau
    DD = sym_two_term(split2(D))
    Bp = D.mul_(tau * (2 * c) + b).add_(DD, alpha=c)          # (b + 2cτ)·D + c·D²
    Xc = split2(X.t(), amax=amax_x if rs is None else amax_x * rs,
                scale=None if rs is None else rs.reshape(1))
    return cross_two_term_axpy(X, rs, tau * (b + c * tau) + a, split2(Bp), Xc)


def step_nvfp4(X: torch.Tensor, m: int, abc: Triple, P: NVFP4Products, form: str,
               guard: bool = True, terms: int = 1):
    """One NVFP4 step on the padded ``X`` (``m`` = true row count; padding rows are zero).
    ``terms`` > 1 (shifted form only): two-term operands, ``_step_nvfp4_split`` (on the Triton
    backend without clipping, its lean equivalent ``_step_nvfp4_two_term_lean``)."""
    a, b, c = abc
    if terms > 1:
        if form != "shifted":
            raise ValueError("nvfp4_terms > 1 is implemented for the shifted form only")
        if terms == 2 and LEAN_TWO_TERM and isinstance(P, NVFP4Products) \
                and P.backend == "triton" and P.clip is None and P.rounding == "nearest" \
                and X.dtype == torch.float32:        # else the composition (or its errors)
            return _step_nvfp4_two_term_lean(X, m, abc, guard)
        return _step_nvfp4_split(X, m, abc, P, terms, guard)
    if form == "naive":
        Xr = P.op(X)                   # rows of X, K = n: both operands of X·Xᵀ
        A = P.mm(Xr, Xr)
        Xc = P.op(X.t())               # X quantized along dim 0 (K = m) for (·)·X
        Aq = P.op(A)                   # A symmetric: q(A) serves as A and as Aᵀ
        B = b * A + c * P.mm(Aq, Aq)
        return a * X + P.mm(P.op(B), Xc)
    # Launch- and traffic-lean (the NS is launch-bound at 3b shapes; a plain composition takes
    # ~120 launches and ~19 m×n FP32 passes per step). No host sync anywhere; the guard's scale enters the
    # quantize kernel and the scalar coefficients instead of rescaling X and A in memory;
    # one amax of X serves both of X's quantized views; D = A − τI is formed in place; the
    # GEMMs' tensor-scale products are folded into the following axpy.
    if not hasattr(P, "mm_unscaled"):     # a duck-typed products object (op / mm only)
        P = _PlainProducts(P)
    amax_x = P.amax(X)
    Xr = P.op(X, amax=amax_x)          # rows of X, K = n: both operands of X·Xᵀ
    A, sA = P.mm_unscaled(Xr, Xr)
    if sA is not None:
        A.mul_(sA)
    rs = None                          # sqrt of the guard's scale (X's implicit factor)
    if guard:
        # Basin guard: Muon-like quintics have a repelling fixed point σ* just above 1
        # (Muon's: 1.264) and NVFP4 noise can kick σ_max past it, after which it explodes.
        # Estimate λ_max(A) = σ_max² by power iteration (10 m×m mat-vecs, normalised every
        # second one: same estimate, half the launches) and scale X (and A by the square) so
        # σ_max ≤ 0.99·σ*. Inactive in exact arithmetic for Muon's and our fitted triples
        # (max f on [0, 1] < 0.99·σ*, checked); ROOT's (2048, 2048) and (2048, 3072) triples
        # overshoot their own σ* even in exact arithmetic (max f 1.2246 > σ* 1.2236), so there
        # it also acts. No branch, no sync.
        s = _guard_scale(A, abc)
        if s is not None:
            rs = s.sqrt().reshape(1)
            A.mul_(s)
    tau = torch.diagonal(A)[:m].sum() / m
    D = A                              # A is ours (fresh GEMM output): shift it in place
    torch.diagonal(D)[:m] -= tau       # padded block stays exactly 0 (no −τ on it)
    Dq = P.op(D)                       # D symmetric: one view for D and Dᵀ
    # X (after the guard: X·rs) quantized along dim 0 (K = m), read in place as X.t().
    Xc = P.op(X.t(), amax=None if amax_x is None or rs is None else amax_x * rs,
              scale=rs) if rs is not None else P.op(X.t(), amax=amax_x)
    DD, sD = P.mm_unscaled(Dq, Dq)
    k1 = tau * (2 * c) + b
    Bp = _axpy(D, k1, DD, c if sD is None else sD * c)     # (b + 2cτ)·D + c·D²
    ab = tau * (b + c * tau) + a       # a + β, β = bτ + cτ²
    if rs is not None:
        ab = ab * rs.reshape(())
    out, sO = P.mm_unscaled(P.op(Bp), Xc)
    return _axpy(X, ab, out, sO)


def _matmul(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``p @ q`` in their dtype: an FP32-accumulated product rounded once to that dtype.

    On a CPU, BF16 operands go through an FP32 GEMM and one rounding to BF16. That is the
    arithmetic of a BF16 GEMM (a BF16×BF16 product is exact in FP32; the sum accumulates in
    FP32; one rounding at the end), up to the order of the sum. But x86 CPUs without BF16
    instructions run torch's BF16 GEMM 20-35× slower than its FP32 GEMM (torch 2.13, one
    thread: 128×384 operands, X·Xᵀ, A·A, ·X took 7.9 ms against 0.41 ms), and Muon / Root on a
    CPU spend most of their step here. CUDA keeps its native BF16 GEMM."""
    if p.dtype == torch.bfloat16 and p.device.type == "cpu":
        return (p.float() @ q.float()).to(torch.bfloat16)
    return p @ q


def ns_step(X: torch.Tensor, abc: Triple) -> torch.Tensor:
    """One exact step in X's dtype (used by the dense paths and as the oracle in scripts)."""
    a, b, c = abc
    A = _matmul(X, X.mT)
    return a * X + _matmul(b * A + c * _matmul(A, A), X)


def newton_schulz(
    G: torch.Tensor,
    *,
    steps: int = 5,
    coefficients: Union[str, Triple, Sequence[Triple]] = "muon",
    precision: str = "fp32",
    clip_percentile: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    rounding: str = "nearest",
    nvfp4_form: str = "shifted",
    backend: str = "auto",
    eps: float = 1e-7,
    nvfp4_terms: Union[None, int, Sequence[int]] = None,
) -> torch.Tensor:
    """Orthogonalise the 2-D ``G``; returns the same shape, dtype per ``precision``
    (fp64 → float64, bf16 → bfloat16, fp32 / nvfp4 → float32).

    coefficients: "muon" | "root" (ROOT's shape table) | "fp4" (our fitted table) | a triple |
    a per-step list. The table lookup uses ``G``'s own shape (before transposition).
    generator / rounding: only for ``precision="nvfp4"`` with ``rounding="stochastic"``.
    nvfp4_terms: NVFP4 operands per quantized matrix (1: q(x); 2: q(x) + q(x − q(x)), see
    ``_split``), one int for every step or one per step; default 2 for the shifted form
    (ours), 1 for the naive form. Two terms bring the error within the targets (mean iteration
    error ≤ 3 %, final error ≤ 5 %) at ~2.4× the GEMM FLOPs of one term (ORTHOGONAL.md); 1 is
    the fast, less accurate choice.
    """
    if G.ndim != 2:
        raise ValueError(f"newton_schulz expects a 2-D matrix, got shape {tuple(G.shape)}")
    if precision not in _DTYPES:
        raise ValueError(f"precision must be one of {sorted(_DTYPES)}, got {precision!r}")
    if nvfp4_form not in ("shifted", "naive"):
        raise ValueError(f"nvfp4_form must be shifted | naive, got {nvfp4_form!r}")
    if nvfp4_terms is None:
        nvfp4_terms = 2 if nvfp4_form == "shifted" else 1
    schedule = resolve_schedule(coefficients, G.shape, steps)
    terms = [nvfp4_terms] * steps if isinstance(nvfp4_terms, int) else list(nvfp4_terms)
    if len(terms) < steps or any(t not in (1, 2, 3) for t in terms[:steps]):
        raise ValueError(f"nvfp4_terms must be 1, 2 or 3 (or one per step), got {nvfp4_terms!r}")
    X = G.to(_DTYPES[precision])
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.mT
    X = X / (X.norm() + eps)
    if precision != "nvfp4":
        for abc in schedule:
            X = ns_step(X, abc)
    else:
        m, n = X.shape
        # NVFP4 blocks are 16 wide along every reduction dim (n for X·Xᵀ, m for the others):
        # zero padding changes no product, and the shifted form keeps the padded block at 0.
        pm, pn = -m % 16, -n % 16
        if pm or pn:
            X = torch.nn.functional.pad(X, (0, pn, 0, pm))
        P = NVFP4Products(backend, clip_percentile, rounding, generator, X.device)
        for abc, t in zip(schedule, terms):
            X = step_nvfp4(X, m, abc, P, nvfp4_form, terms=t)
        X = X[:m, :n]
    return X.mT.contiguous() if transposed else X.contiguous()


# ----------------------------------------------------------------------------- CUDA graphs
# Why: an NVFP4 NS step issues ~55 small kernels (one-term operands; ~80 with two) and the
# optimizer runs 5 steps on each of 7 logical matrices per 3b block, so Python and the launch
# path, not the GPU, set the optimizer step's time at these shapes (ORTHOGONAL.md, "Speed").
# Every NS path below is free of host synchronisation (by design: the tensor scales, the
# guard's scale and τ are device scalars), so it can be captured once per (shape, arguments)
# and replayed: one launch per NS instead of hundreds.
_GRAPHS: dict = {}
_GRAPH_POOLS: dict = {}


def graphable(G: torch.Tensor, precision: str = "fp32", backend: str = "auto",
              generator: Optional[torch.Generator] = None, rounding: str = "nearest") -> bool:
    """Whether ``newton_schulz_graphed`` captures this call (else it runs ``newton_schulz``).

    Capturable: any call on a CUDA tensor except the NVFP4 reference backend (its quantizer
    checks for NaN/Inf with a host synchronisation) and stochastic rounding (a host-side
    generator; the Triton backend rounds to nearest only)."""
    if not G.is_cuda:
        return False
    if precision != "nvfp4":
        return True
    if generator is not None or rounding != "nearest":
        return False
    return backend == "triton" or (backend == "auto" and _triton_available())


class _GraphedNS:
    """One captured ``newton_schulz`` call: a static input the caller's matrix is copied into,
    the graph, and its static output (owned by the graph's memory pool)."""

    def __init__(self, G: torch.Tensor, kwargs: dict):
        self.inp = torch.empty(G.shape, dtype=G.dtype, device=G.device)
        self.inp.copy_(G)
        # Warm up on a side stream (PyTorch's capture recipe): compiles the Triton kernels,
        # creates cuBLAS handles and workspaces and the module-level caches (the ones tensor,
        # the sample index) outside the capture.
        side = torch.cuda.Stream(device=G.device)
        side.wait_stream(torch.cuda.current_stream(G.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                newton_schulz(self.inp, **kwargs)
        torch.cuda.current_stream(G.device).wait_stream(side)
        pool = _GRAPH_POOLS.get(G.device)
        if pool is None:
            pool = _GRAPH_POOLS[G.device] = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        # One pool for every NS graph of a device: their scratch is reused across graphs (they
        # never run concurrently: replays are ordered on the current stream). The price: a
        # graph's output may lie in another graph's scratch, hence the copy in __call__.
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = newton_schulz(self.inp, **kwargs)

    def __call__(self, G: torch.Tensor) -> torch.Tensor:
        self.inp.copy_(G)
        self.graph.replay()
        # A copy: the graph's own output may lie in another graph's scratch (the shared pool)
        # and is rewritten by the next replay, so handing it out would make every caller's
        # result depend on what runs next. One pass over the output (~0.5% of a q_root step).
        return self.out.clone()


def clear_ns_graphs() -> int:
    """Drop every captured NS graph and its memory pool (e.g. between benchmark arms of one
    process, so one optimizer's graphs do not count in the next one's memory); returns how many
    there were. The next ``newton_schulz_graphed`` call captures again."""
    n = len(_GRAPHS)
    _GRAPHS.clear()
    _GRAPH_POOLS.clear()
    return n


def _freeze(v):
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def newton_schulz_graphed(G: torch.Tensor, **kwargs) -> torch.Tensor:
    """``newton_schulz(G, **kwargs)`` replayed from a CUDA graph captured on the first call
    with this shape, dtype, device and arguments (two eager warm-up runs, then the capture).

    The result is a fresh tensor (a copy of the graph's output). It is bit-identical to
    ``newton_schulz`` on a contiguous copy of ``G`` (the same kernels in the same order on the
    same values; checked on the GPU by ``benchmarks/bench_newton_schulz.py`` before it times
    anything). On a strided ``G`` the eager path's first norm may sum in another order, so the
    two can differ in the last bits there.
    Calls that cannot be captured (``graphable``) run eagerly. A graph holds its input, its
    output and its scratch (shared by all NS graphs of the device) for the process's life, or
    until ``clear_ns_graphs``: for Root at the 3b shapes that adds ~0.5 GiB to the
    optimizer-phase peak (``benchmarks/bench_blocks.py --arms root`` reports it)."""
    if not graphable(G, kwargs.get("precision", "fp32"), kwargs.get("backend", "auto"),
                     kwargs.get("generator"), kwargs.get("rounding", "nearest")):
        return newton_schulz(G, **kwargs)
    key = (tuple(G.shape), G.dtype, G.device, tuple(sorted((k, _freeze(v)) for k, v in kwargs.items())))
    with torch.cuda.device(G.device):     # capture and replay on G's device, whatever is current
        g = _GRAPHS.get(key)
        if g is None:
            g = _GRAPHS[key] = _GraphedNS(G, kwargs)
        return g(G)
