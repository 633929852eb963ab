"""Q-AdamW FAST_IEEE (triton_rows._sqrt_fast / _div_fast): equal to IEEE sqrt / division.

On the CPU interpreter the MUFU approximations are emulated and perturbed (±2 ulps from a hash,
or a fixed ±1..8 ulps here: 8 ulps = 2^-20 relative, the tolerance the proofs assume, beyond
the documented 2^-22.9 / ~1 ulp), so exactness here tests the refinement logic itself against an
independent oracle (FP64 then one rounding: correctly rounded for sqrt and division). The GPU's
own MUFU is checked by scripts/gpu/check_fast_ieee.py (exhaustive sqrt, 1e9 division pairs).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from fullstack_fp4.optim.q_adamw import triton_rows as tr  # noqa: E402
from fullstack_fp4.optim.q_adamw.codecs import padded_numel  # noqa: E402
from fullstack_fp4.optim.q_adamw.optimizer import (_hyper, _init_state,  # noqa: E402
                                                   _kernel_views, q_adamw_step_reference)

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")
DEV = "cpu" if INTERP else "cuda"


def _check_mod():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "gpu",
                        "check_fast_ieee.py")
    spec = importlib.util.spec_from_file_location("check_fast_ieee", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bits(x):
    return x.view(torch.int32)


@pytest.mark.parametrize("ulps", [0, -8, -2, -1, 1, 2, 8])
def test_sqrt_div_fast_exact_under_perturbed_approximations(monkeypatch, ulps):
    if not INTERP:
        pytest.skip("the perturbation is the interpreter's emulation")
    monkeypatch.setattr(tr, "_PERTURB_ULPS", triton.language.constexpr(ulps))
    c = _check_mod()
    gen = torch.Generator().manual_seed(100 + ulps)
    # sqrt: random bit patterns over the domain, the domain's ends, zero, squares and their
    # neighbours (the exact cases), 1-ulp neighbours of midpoints' squares
    e = torch.randint(-100 + 127, 128 + 127, (20000,), generator=gen)
    x = ((e << 23) | torch.randint(0, 1 << 23, (20000,), generator=gen)).to(torch.int32)
    x = x.view(torch.float32)
    sq = torch.randint(1, 1 << 12, (2000,), generator=gen).float() ** 2
    mids = ((torch.randint(1 << 23, 1 << 24, (2000,), generator=gen).double() + 0.5) ** 2).float()
    extra = torch.tensor([0.0, 2.0 ** -100, 3.4028234663852886e38, 1.0, 2.0, 4.0, 0.25])
    x = torch.cat([x, sq, mids, extra])
    x = torch.cat([x] + [(_bits(x) + o).view(torch.float32) for o in (-1, 1)])
    x = x[(x == 0) | ((x >= 2.0 ** -100) & (x <= 3.4028234663852886e38))]
    fast, ieee = torch.empty_like(x), torch.empty_like(x)
    c._sqrt_kernel[(triton.cdiv(x.numel(), 1024),)](x, fast, ieee, x.numel(), BLOCK=1024)
    ref = x.double().sqrt().float()
    assert torch.equal(_bits(fast), _bits(ref)), int((_bits(fast) != _bits(ref)).sum())
    # division: random in-domain pairs, corners, near-midpoint and exact quotients
    m = c._rand_f32(20000, -76, 63, "cpu", gen)
    d = c._rand_f32(20000, -60, 44, "cpu", gen, signed=False)
    hm, hd = c._hard_pairs(2000, "cpu", gen)
    cm, cd = c._corners("cpu")
    m, d = torch.cat([m, hm, cm]), torch.cat([d, hd, cd])
    keep = c._in_div_domain(m, d)
    m, d = m[keep], d[keep]
    fast, ieee = torch.empty_like(m), torch.empty_like(m)
    c._div_kernel[(triton.cdiv(m.numel(), 1024),)](m, d, fast, ieee, m.numel(), BLOCK=1024)
    ref = (m.double() / d.double()).float()
    assert torch.equal(_bits(fast), _bits(ref)), int((_bits(fast) != _bits(ref)).sum())
    assert (_bits(fast[m == 0]) == _bits(m[m == 0])).all()      # ±0 / d keeps the sign


@pytest.mark.parametrize("huge", [False, True])
def test_kernel_fast_ieee_matches_reference_bit_for_bit(huge):
    """huge: a 1e15 gradient puts v above 2^64 -> that program takes the sqrt_rn/div_rn
    fallback; without it every entry (zeros included) goes through the fast sequences."""
    n, phase = 2048 + 33, 960
    gen = torch.Generator().manual_seed(n)
    npad = padded_numel(n)
    p = torch.randn(n, generator=gen).to(DEV)
    st = _init_state(n, DEV, phase)
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    for t in range(1, 4):
        g = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
        g[100:140] = 0.0
        if huge:
            g[7] = 1e15
        g = g.to(DEV)
        u = torch.rand(npad, generator=gen).to(DEV)
        q_adamw_step_reference(p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, step=t, rand=u, phase=phase)
        launch(p2, g, _kernel_views(st2), n, npad, seed=1, rand=u, phase=phase, row0=3,
               fast_ieee=True, **_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, t, DEV))
        assert torch.equal(p, p2), t
        for k in st:
            assert torch.equal(st[k], st2[k]), (t, k)


def test_fast_ieee_gate():
    from fullstack_fp4.optim.q_adamw.triton_step import fast_ieee_ok
    assert fast_ieee_ok(1e-8, 31.6)
    assert not fast_ieee_ok(0.0, 1.0) and not fast_ieee_ok(1e-30, 1.0)
    assert not fast_ieee_ok(1e-8, 1e5)


def test_check_script_self_test_runs():
    if not INTERP:
        pytest.skip("the GPU runs the full script")
    assert _check_mod().main(["--self-test"]) == 0
