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


class _FakeStream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other.name)


class _FakeGrad:
    def __init__(self):
        self.recorded = []

    def record_stream(self, s):
        self.recorded.append(s.name)


def test_side_lane_waits_for_work_made_after_the_fork(monkeypatch):
    """The streams' protocol, on stand-in streams (runs without a GPU): the side streams wait
    for the current stream once at the step's first launch (the fork); a side launch whose
    inputs the step made on the current stream after that (``made_here``: a fresh state, a
    gradient's contiguous copy) waits again first — without that wait a side launch can read a
    gradient copy not yet made; every side launch records its gradient on its stream; ``join`` makes the current stream wait for every side stream."""
    from fullstack_fp4.optim.q_adamw import optimizer as qo
    cur = _FakeStream("cur")
    made = []

    def new_stream(device=None):
        made.append(_FakeStream(f"side{len(made) + 1}"))
        return made[-1]

    monkeypatch.setattr(qo, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda idx=None: cur)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: s.name)   # the context, named
    lanes = qo._LaunchLanes(3)
    dev = torch.device("cuda", 0)
    grads = [_FakeGrad() for _ in range(5)]
    ctx = [lanes.next(dev, grads[0]),                      # lane 0: the fork, no switch
           lanes.next(dev, grads[1], made_here=False),     # side1
           lanes.next(dev, grads[2], made_here=True),      # side2, after a copy on cur
           lanes.next(dev, grads[3], made_here=True),      # lane 0 again: nothing to wait for
           lanes.next(dev, grads[4], made_here=False)]     # side1
    assert ctx[1:3] == ["side1", "side2"] and ctx[4] == "side1"
    assert not isinstance(ctx[0], str) and not isinstance(ctx[3], str)
    s1, s2 = made
    assert s1.waited == ["cur"] and s2.waited == ["cur", "cur"]
    assert [g.recorded for g in grads] == [[], ["side1"], ["side2"], [], ["side1"]]
    lanes.join()
    assert cur.waited == ["side1", "side2"] and lanes.forked == {}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the kernel path on CPU tensors runs under the interpreter only")
def test_step_says_which_launches_read_work_made_after_the_fork(monkeypatch):
    """What the step hands ``_LaunchLanes.next``: ``made_here`` for every parameter at the
    first step (its state is made in the step) and afterwards only for a gradient the step
    copies (non-contiguous)."""
    from fullstack_fp4.optim.q_adamw import optimizer as qo
    calls = []
    real = qo._LaunchLanes.next

    def spy(self, device, grad, made_here=False):
        calls.append(made_here)
        return real(self, device, grad, made_here)

    monkeypatch.setattr(qo._LaunchLanes, "next", spy)
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(32, 48, generator=gen)) for _ in range(3)]
    opt = QAdamW(ps, lr=1e-2, min_numel=16, use_kernel=True, launch_streams=2)
    for step in range(2):
        for i, p in enumerate(ps):
            g = torch.randn(48, 32, generator=gen)
            p.grad = g.t() if i == 1 else g.t().contiguous()
        opt.step()
        assert calls == ([True, True, True] if step == 0 else [False, True, False]), step
        calls.clear()
