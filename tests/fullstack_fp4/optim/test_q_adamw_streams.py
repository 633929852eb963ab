"""QAdamW's per-parameter launches spread over CUDA streams (``launch_streams``): the result is
bit for bit the one-stream result, and the current stream sees every write when ``step``
returns (the side streams are joined into it)."""
import os

import pytest
import torch

from fullstack_fp4.optim import QAdamW
from fullstack_fp4.optim.q_adamw.optimizer import MODEL_OUT_ATTR

_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_launch_streams_must_be_a_positive_integer(bad):
    p = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="launch_streams"):
        QAdamW([p], launch_streams=bad)


def _model(gen):
    """Mixed sizes (tile padding, 1024-chunk tails, one small FP32-moment param), the largest
    last so a missing join would leave its writes in flight when ``step`` returns."""
    shapes = [(256, 96), (33, 64), (3000,), (64,), (512, 512), (77, 80), (2048, 2048)]
    ps = [torch.nn.Parameter(torch.randn(*s, generator=gen).cuda()) for s in shapes]
    for p in ps[1::3]:   # some carry a BF16 model copy the kernel writes in the same pass
        setattr(p, MODEL_OUT_ATTR, torch.empty(p.shape, dtype=torch.bfloat16, device="cuda"))
    return ps


@pytest.mark.skipif(not _GPU, reason="streams exist on a CUDA device only")
@pytest.mark.parametrize("streams", [2, 3])
def test_streams_step_equals_one_stream_bit_for_bit(streams):
    gen = torch.Generator().manual_seed(3)
    runs = {}
    for lanes in (1, streams):
        ps = _model(torch.Generator().manual_seed(0))
        opt = QAdamW(ps, lr=1e-2, weight_decay=0.01, min_numel=1024, launch_streams=lanes)
        gen.manual_seed(3)
        seen = []
        for t in range(3):
            for i, p in enumerate(ps):
                g = torch.randn(p.shape[::-1] if p.dim() == 2 else p.shape, generator=gen)
                # every other 2-D grad non-contiguous: the step makes a temporary copy, which
                # the side stream reads after the loop has dropped it (record_stream's case)
                p.grad = g.cuda().t() if (p.dim() == 2 and i % 2) else g.reshape(p.shape).cuda()
            opt.step()
            # no synchronize: these clones run on the current stream right after the step
            seen.append([p.detach().clone() for p in ps]
                        + [getattr(p, MODEL_OUT_ATTR).clone() for p in ps
                           if hasattr(p, MODEL_OUT_ATTR)])
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        states = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                  for p in ps]
        runs[lanes] = (seen, states)
    (seen1, st1), (seenk, stk) = runs[1], runs[streams]
    for t, (a, b) in enumerate(zip(seen1, seenk)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), (t, i)
    for i, (a, b) in enumerate(zip(st1, stk)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (i, k)
