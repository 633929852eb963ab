"""The multi-tensor launch (triton_multi.py): every parameter stepped bit for bit as the reference
steps it with the kernel's Philox uniforms, and QAdamW(multi_tensor=True) bit for bit
QAdamW(multi_tensor=False). CPU: the Triton interpreter; the same tests run on the GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from fullstack_fp4.optim.q_adamw import triton_multi  # noqa: E402
from fullstack_fp4.optim.q_adamw.codecs import padded_numel  # noqa: E402
from fullstack_fp4.optim.q_adamw.state import init_state  # noqa: E402
from fullstack_fp4.optim.q_adamw.optimizer import (QAdamW, kernel_hyper,  # noqa: E402
                                                   kernel_views, _seed, kernel_uniforms,
                                                   q_adamw_step_reference)
from fullstack_fp4.optim.q_adamw.triton_multi import (Item, batchable,  # noqa: E402
                                                      launch_multi, seed_base)

needs_kernel = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs the Triton interpreter or a GPU")


def _dev():
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
        else "cpu"


@needs_kernel
@pytest.mark.parametrize("gdt,with_out,sub", [(torch.float32, False, 1),
                                               (torch.bfloat16, True, 2)])
def test_multi_launch_matches_reference_with_kernel_uniforms(gdt, with_out, sub):
    """Three parameters in one launch — a whole one, a distributed-optimizer piece (chunk-grid
    phase 960, first row 3 of its tensor) and another whole one — each equal to the reference
    fed ``kernel_uniforms`` of its own seed ``_seed(seed, key, t)``: params, states and (BF16
    grads, model_out) the BF16 model param written into a slice of a guarded buffer, bit for
    bit. Before step 2 one parameter's states are replaced by copies at other addresses (what
    a checkpoint load does): the launch must step the new tensors, not the cached old ones.
    ``sub``: programs of a parameter's grid run in turn by one program (2: the piece's three
    programs are one full and one cut short)."""
    dev, gseed = _dev(), 12345
    specs = [(2048, 0, 0, 5), (1536, 960, 3, 9), (3072, 0, 0, 2)]    # n, phase, row0, key
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(n, generator=gen).to(dev) for n, *_ in specs]
    sts = [init_state(n, dev, ph) for n, ph, *_ in specs]
    ps2 = [p.clone() for p in ps]
    sts2 = [{k: v.clone() for k, v in st.items()} for st in sts]
    guards = [torch.full((n + 64,), -7.0, dtype=torch.bfloat16, device=dev) for n, *_ in specs]
    gs = [torch.empty(n, dtype=gdt, device=dev) for n, *_ in specs]   # fixed addresses, as
    for t in (1, 2):                                                   # .grad's usually are
        if t == 2:
            sts2[1] = {k: v.clone() for k, v in sts2[1].items()}
        for g in gs:
            n = g.numel()
            g.copy_(torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen)))
        items = []
        for (n, ph, r0, key), p, g, st, st2, p2, gd in zip(specs, ps, gs, sts, sts2, ps2, guards):
            u = kernel_uniforms(_seed(gseed, key, t), padded_numel(n), r0, device=dev)
            q_adamw_step_reference(p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                   weight_decay=0.01, step=t, rand=u, phase=ph)
            out = gd[32:32 + n].view(torch.int16) if with_out else None
            items.append(Item(p2, g, kernel_views(st2), n, padded_numel(n), ph, r0,
                              seed_base(gseed, key), out))
        assert all(batchable(it) for it in items)
        launch_multi(items, t=t, sub=sub, **kernel_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, t, dev))
        for i, (p, p2, st, st2, gd) in enumerate(zip(ps, ps2, sts, sts2, guards)):
            assert torch.equal(p, p2), (t, i)
            for k in st:
                assert torch.equal(st[k], st2[k]), (t, i, k)
            n = p.numel()
            if with_out:
                assert torch.equal(gd[32:32 + n].view(torch.int16),
                                   p2.to(torch.bfloat16).view(torch.int16)), (t, i)
                assert (gd[:32] == -7.0).all() and (gd[32 + n:] == -7.0).all(), (t, i)
            else:
                assert (gd == -7.0).all()


def _model(dev):
    gen = torch.Generator().manual_seed(1)
    shapes = [(64, 32), (48, 32), (65, 16), (1025,), (32,), (40, 52)]
    return [torch.nn.Parameter(torch.randn(*s, generator=gen).to(dev)) for s in shapes]


@needs_kernel
@pytest.mark.long   # ~20 s a case under the interpreter: make test-all
@pytest.mark.parametrize("approx", [False, True])
def test_qadamw_multi_tensor_equals_per_parameter_launches(monkeypatch, approx):
    """Two param groups of a mixed model: 2048-, 1536-, 1040- and 2080-entry weights (batched),
    a 1025-entry one (n not a multiple of 16: launched alone) and a 32-entry norm (FP32
    moments). ``multi_tensor=True`` must give the per-parameter launches' params and states
    bit for bit over 3 steps, with one multi-tensor launch per group and step (counted: the
    batching really happens). With ``approx_division`` too (on the GPU the approximate
    division; the interpreter divides in IEEE either way)."""
    dev = _dev()
    calls = []
    real = triton_multi.launch_multi
    monkeypatch.setattr(triton_multi, "launch_multi",
                        lambda items, **kw: (calls.append(len(items)), real(items, **kw)))
    runs = []
    for multi in (False, True):
        ps = _model(dev)
        opt = QAdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}],
                     lr=1e-2, min_numel=1024, seed=7, use_kernel=True, multi_tensor=multi,
                     approx_division=approx)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(dev)
            opt.step()
        runs.append((ps, opt))
    assert calls == [3, 1] * 3
    (ps1, o1), (ps2, o2) = runs
    for a, b in zip(ps1, ps2):
        assert torch.equal(a, b)
        for k, v in o1.state[a].items():
            assert torch.equal(v, o2.state[b][k]), k


def test_batchable_and_launch_refuse_what_the_table_cannot_address():
    """n not a multiple of 16, or a parameter 4 bytes off a 16-byte boundary: not batchable,
    and a launch handed it anyway refuses with a clear error instead of mis-addressing; so do
    items with different gradient dtypes."""
    n = 64
    buf = torch.zeros(n + 4)

    def item(p, g, k=n):
        return Item(p, g, kernel_views(init_state(k, "cpu")), k, padded_numel(k), 0, 0, 1)

    ok = item(torch.zeros(n), torch.zeros(n))
    assert batchable(ok)
    assert not batchable(item(torch.zeros(n + 1), torch.zeros(n + 1), n + 1))
    off = item(buf[1:1 + n], torch.zeros(n))
    assert not batchable(off)
    hyper = kernel_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, 1, "cpu")
    with pytest.raises(ValueError, match="multiple of 16"):
        launch_multi([item(buf[:n], torch.zeros(n)), off], t=1, **hyper)
    with pytest.raises(ValueError, match="one gradient dtype"):
        launch_multi([ok, item(torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16))], t=1,
                     **hyper)


def test_seed_split_is_the_optimizers_seed():
    """The kernel's seed ``(seed_base + step_seed) mod (2^31 − 1)`` is optimizer._seed for
    seeds, keys and steps near the edges (one wrap, none, negative group seeds)."""
    for seed in (0, 7, -3, 2 ** 31 - 2, 10 ** 12):
        for key in (0, 1, 51, 10 ** 6):
            for t in (1, 2, 20_000, 2 ** 31 - 2):
                s = seed_base(seed, key) + triton_multi.step_seed(t)
                s = s - triton_multi.SEED_MOD if s >= triton_multi.SEED_MOD else s
                assert s == _seed(seed, key, t)
