"""Fused Triton step vs the PyTorch reference, same uniforms: bit-identical (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the interpreter (set before triton loads); never on a GPU,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # where it would turn every later kernel into Python
triton = pytest.importorskip("triton")

from fullstack_fp4.optim.q_adamw.codecs import padded_numel  # noqa: E402
from fullstack_fp4.optim.q_adamw.optimizer import (_hyper, _init_state,  # noqa: E402
                                                   _kernel_views, q_adamw_step_reference)
from fullstack_fp4.optim.q_adamw import triton_rows as ts  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter or a GPU")
@pytest.mark.parametrize("n,phase,fast_dec", [(1500, 0, False), (2048 + 33, 960, True)])
def test_kernel_matches_reference_bit_for_bit(n, phase, fast_dec):
    """phase 960: the tensor starts 64 entries before a chunk boundary (a distributed-optimizer
    piece), so the first program sees 60 rows before the tensor and the chunk scales shift."""
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
        else "cpu"
    gen = torch.Generator().manual_seed(n)
    npad = padded_numel(n)
    p = torch.randn(n, generator=gen).to(dev)
    st = _init_state(n, dev, phase)
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    for t in range(1, 4):
        # heavy-tailed gradients, a zero run and a huge entry
        g = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen)))
        g[100:140] = 0.0
        g[7] = 1e15
        g = g.to(dev)
        u = torch.rand(npad, generator=gen).to(dev)
        q_adamw_step_reference(p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, step=t, rand=u, phase=phase)
        launch(p2, g, _kernel_views(st2), n, npad, seed=1, rand=u, phase=phase, row0=3,
               fast_dec=fast_dec,
               **_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, t, dev))
        assert torch.equal(p, p2), t
        for k in st:
            assert torch.equal(st[k], st2[k]), (t, k)
    assert torch.isfinite(p2).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="checks the kernel's rounding helpers in the interpreter")
def test_rounding_helpers_match_nvfp4_and_torch():
    """The kernel's branch-free E2M1/E4M3 rounding == nvfp4.e2m1's thresholds / torch's cast,
    on every grid point, every midpoint (tie) and their FP32 neighbours."""
    import triton.language as tl

    from fullstack_fp4.nvfp4.e2m1 import e2m1_round_nearest, e2m1_round_stochastic

    @triton.jit
    def k(a_ptr, u_ptr, x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a = tl.load(a_ptr + i)
        x = tl.load(x_ptr + i)
        u = tl.load(u_ptr + i)
        tl.store(o_ptr + i, ts._rtn_code(a).to(tl.float32))
        tl.store(o_ptr + N + i, ts._rtn_val(a))
        tl.store(o_ptr + 2 * N + i, ts._sr_code(a, u).to(tl.float32))
        v, c = ts._e4m3_rne(x)
        tl.store(o_ptr + 3 * N + i, v)
        tl.store(o_ptr + 4 * N + i, c.to(tl.float32))

    def around(pts):
        pts = torch.tensor(sorted(set(pts)), dtype=torch.float32)
        up = torch.nextafter(pts, torch.tensor(float("inf")))
        dn = torch.nextafter(pts, torch.tensor(float("-inf")))
        return torch.cat([pts, up, dn])

    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m = ((e4[1:] + e4[:-1]) / 2).tolist()
    a = around(grid + mids).clamp(0.0, 6.0)
    a = torch.cat([a, torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 6.0])
    x = around(e4.tolist() + e4m).clamp(0.0, 448.0)
    x = torch.cat([x, torch.rand(2048, generator=torch.Generator().manual_seed(2)) * 448.0,
                   torch.rand(2048, generator=torch.Generator().manual_seed(3)) * 0.05])
    N = 1 << (max(a.numel(), x.numel()) - 1).bit_length()
    a = torch.cat([a, torch.zeros(N - a.numel())])
    x = torch.cat([x, torch.zeros(N - x.numel())])
    u = torch.rand(N, generator=torch.Generator().manual_seed(1))
    out = torch.empty(5 * N)
    k[(1,)](a, u, x, out, N=N)
    code, val, sr, e4v, e4c = out.view(5, N)
    ref = e2m1_round_nearest(a).float()
    assert torch.equal(code, ref)
    grid_t = torch.tensor(grid)
    assert torch.equal(val, grid_t[ref.long()])
    assert torch.equal(sr, e2m1_round_stochastic(a, u).float())
    q = x.to(torch.float8_e4m3fn)
    assert torch.equal(e4v, q.float())
    assert torch.equal(e4c, q.view(torch.uint8).float())


def test_kernel_signs_are_nvfp4s():
    from fullstack_fp4.nvfp4.hadamard import DEFAULT_SIGNS
    assert ts._SIGNS == tuple(int(v) for v in DEFAULT_SIGNS)
