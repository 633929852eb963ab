"""Fused Triton step vs the PyTorch reference, same uniforms: bit-identical (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")   # CPU: the interpreter (set before triton loads)
triton = pytest.importorskip("triton")

from fullstack_fp4.optim.q_adamw.codecs import padded_numel  # noqa: E402
from fullstack_fp4.optim.q_adamw.optimizer import (_hyper, _init_state,  # noqa: E402
                                                   _kernel_views, q_adamw_step_reference)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter or a GPU")
@pytest.mark.parametrize("n", [1500, 2048 + 33])
def test_kernel_matches_reference_bit_for_bit(n):
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
        else "cpu"
    gen = torch.Generator().manual_seed(n)
    npad = padded_numel(n)
    p = torch.randn(n, generator=gen).to(dev)
    st = _init_state(n, dev)
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
                               weight_decay=0.01, step=t, rand=u)
        launch(p2, g, _kernel_views(st2), n, npad, seed=1, rand=u,
               **_hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, t, dev))
        assert torch.equal(p, p2), t
        for k in st:
            assert torch.equal(st[k], st2[k]), (t, k)
    assert torch.isfinite(p2).all()
