"""QAdamW: tracks torch AdamW, exact resume, grad None, flat shards, FP32 small params, bytes."""

import pytest
import torch

from fullstack_fp4.optim import QAdamW, state_bytes_per_param


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 16, generator=g)
    w_true = torch.randn(16, 1, generator=g)
    # label noise 0.5: the loss has a floor (~0.25), as a real task does
    y = torch.tanh(x @ torch.randn(16, 16, generator=g) / 4) @ w_true + 0.5 * torch.randn(
        4096, 1, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 1))
    return model, x, y


def _train(opt_fn, steps=200):
    model, x, y = _problem()
    opt = opt_fn(model.parameters())
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tracks_torch_adamw_on_mlp():
    """MLP regression with label noise, 200 steps, lr 3e-3, min_numel 1024 (the 4096-entry first
    layer is quantized): the loss stays within 5% of torch.optim.AdamW's at every step
    (measured: max 2.1%)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead on a 2-core runner
    try:
        ref = _train(lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01))
        q = _train(lambda p: QAdamW(p, lr=3e-3, weight_decay=0.01, min_numel=1024))
    finally:
        torch.set_num_threads(threads)
    assert ref[-1] < 0.3 * ref[0]  # the problem is learnt
    for t in range(200):
        assert abs(q[t] - ref[t]) <= 0.05 * ref[t], (t, q[t], ref[t])


def test_all_fp32_path_equals_torch_adamw():
    """With every param below min_numel, QAdamW is plain AdamW (same formula as torch)."""
    ref = _train(lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01, foreach=False), 30)
    q = _train(lambda p: QAdamW(p, lr=3e-3, weight_decay=0.01, min_numel=10 ** 9), 30)
    assert max(abs(a - b) / a for a, b in zip(ref, q)) < 1e-5


def _flat_run(steps, p0, grads, opt=None):
    p = torch.nn.Parameter(p0.clone())
    opt = opt or QAdamW([p], lr=1e-2, min_numel=1, seed=3)
    if opt.param_groups[0]["params"][0] is not p:
        opt.param_groups[0]["params"][0] = p
    for g in grads[:steps]:
        p.grad = g.clone()
        opt.step()
    return p, opt


def test_exact_resume_bit_identical():
    n = 3001  # a flat shard of odd length: padding in the last block, tile and chunk
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))
             for _ in range(7)]
    straight, _ = _flat_run(7, p0, grads)

    p, opt = _flat_run(4, p0, grads)
    sd = opt.state_dict()
    buf = __import__("io").BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd2 = torch.load(buf)
    st = sd2["state"][0]
    assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_codes"].numel() == 3008 // 2
    assert st["exp_avg_sq_means"].dtype == torch.int16
    p_new = torch.nn.Parameter(p.detach().clone())
    opt2 = QAdamW([p_new], lr=1e-2, min_numel=1, seed=3)
    opt2.load_state_dict(sd2)
    for g in grads[4:]:
        p_new.grad = g.clone()
        opt2.step()
    assert torch.equal(p_new.detach(), straight.detach())


def test_grad_none_skipped_and_small_params_fp32():
    a = torch.nn.Parameter(torch.randn(5000))
    b = torch.nn.Parameter(torch.randn(10))
    c = torch.nn.Parameter(torch.randn(6000))
    opt = QAdamW([a, b, c], lr=1e-2)
    a.grad = torch.randn(5000)
    b.grad = torch.randn(10)
    c0 = c.detach().clone()
    opt.step()
    assert torch.equal(c.detach(), c0) and c not in opt.state
    assert opt.state[b]["exp_avg"].dtype == torch.float32          # below min_numel
    assert opt.state[a]["exp_avg_codes"].dtype == torch.uint8       # quantized
    # bytes: 'a' ~1.2 B/param, 'b' 8 B/param
    assert opt.state_bytes() == sum(
        t.numel() * t.element_size() for k, t in opt.state[a].items() if k != "step") + 80
    assert opt.state_bytes() == 80 + round(state_bytes_per_param(5000) * 5000)


def test_matrix_param_equals_flat_shard():
    """A 2-D param and the same numbers as a 1-D shard give the same trajectory."""
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(48, 100, generator=gen)
    grads = [torch.randn(48, 100, generator=gen) for _ in range(3)]
    w = torch.nn.Parameter(w0.clone())
    f = torch.nn.Parameter(w0.clone().reshape(-1))
    ow, of = QAdamW([w], min_numel=1), QAdamW([f], min_numel=1)
    for g in grads:
        w.grad, f.grad = g.clone(), g.clone().reshape(-1)
        ow.step()
        of.step()
    assert torch.equal(w.detach().reshape(-1), f.detach())


def test_pieces_with_placement_equal_whole_tensor():
    """A tensor cut into pieces at chunk boundaries of its grid (what the distributed optimizer
    hands each rank) and stepped piece by piece, each piece tagged with its Placement, equals
    the whole tensor stepped at once: parameters and every state byte (the pieces' states,
    concatenated, are the whole tensor's state). Oracle: the same QAdamW on the whole tensor."""
    from fullstack_fp4.optim.q_adamw.optimizer import PLACE_ATTR, Placement

    gen = torch.Generator().manual_seed(11)
    n, phase = 5000, 640                      # the whole tensor starts 640 entries into a chunk
    cuts = [0, 384, 384 + 2048, n]            # 640 + 384 = 1024: cuts on the chunk grid
    w0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))
             for _ in range(3)]
    whole = torch.nn.Parameter(w0.clone())
    setattr(whole, PLACE_ATTR, Placement(key=7, offset=0, full_numel=n, phase=phase))
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        q = torch.nn.Parameter(w0[a:b].clone())
        setattr(q, PLACE_ATTR, Placement(key=7, offset=a, full_numel=n, phase=phase))
        pieces.append(q)
    # pieces in another order and as separate optimizers: nothing depends on the local index
    ow = QAdamW([whole], min_numel=4096)
    ops = [QAdamW([torch.nn.Parameter(torch.zeros(3)), q], min_numel=4096) for q in pieces[::-1]]
    for g in grads:
        whole.grad = g.clone()
        for q, (a, b) in zip(pieces, zip(cuts, cuts[1:])):
            q.grad = g[a:b].clone()
        ow.step()
        for o in ops:
            o.step()
    assert torch.equal(torch.cat([q.detach() for q in pieces]), whole.detach())
    for k, t in ow.state[whole].items():
        if k == "step":
            continue
        cat = torch.cat([ops[::-1][i].state[q][k] for i, q in enumerate(pieces)])
        assert torch.equal(cat, t), k
    # the first piece (384 entries) is below min_numel but part of a quantized tensor
    assert ops[-1].state[pieces[0]]["exp_avg_codes"].dtype == torch.uint8
    # a piece not starting on a 64-tile is refused
    bad = torch.nn.Parameter(torch.zeros(100))
    setattr(bad, PLACE_ATTR, Placement(key=0, offset=16, full_numel=200))
    bad.grad = torch.zeros(100)
    import pytest
    with pytest.raises(ValueError, match="tile"):
        QAdamW([bad], min_numel=1).step()


def test_zero_state_without_temporaries_equals_encoded_zeros():
    """init_state broadcasts one encoded zero chunk; the oracle encodes the zeros directly."""
    from fullstack_fp4.optim.q_adamw.state import init_state, _init_state_by_encoding

    for n in (1, 1000, 1024, 5000):
        for phase in (0, 448, 992):
            a, b = init_state(n, "cpu", phase), _init_state_by_encoding(n, "cpu", phase)
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (n, phase, k)


def test_model_param_out_gets_the_bf16_of_each_step():
    """``p.fp4_model_param_out`` (a BF16 tensor of p's numel, here a slice of a larger buffer, as
    a distributed-optimizer shard's destination is): after every step of a quantized param it
    holds p.to(bfloat16) bit for bit and the step recorded the write; p itself steps exactly as
    without a destination; an FP32-moment param (below min_numel) is not written; an in-place
    write to p afterwards voids the record."""
    from fullstack_fp4.optim.q_adamw.optimizer import MODEL_OUT_ATTR, model_param_written

    gen = torch.Generator().manual_seed(4)
    big0, small0 = torch.randn(64, 48, generator=gen), torch.randn(40, generator=gen)
    runs = []
    for with_out in (False, True):
        big, small = torch.nn.Parameter(big0.clone()), torch.nn.Parameter(small0.clone())
        buf = torch.zeros(64 * 48 + 100, dtype=torch.bfloat16)
        small_out = torch.zeros(40, dtype=torch.bfloat16)
        if with_out:
            setattr(big, MODEL_OUT_ATTR, buf[50:50 + big.numel()])
            setattr(small, MODEL_OUT_ATTR, small_out)
        opt = QAdamW([big, small], lr=1e-2, min_numel=1024, seed=5)
        for t in range(3):
            big.grad = torch.randn(64, 48, generator=torch.Generator().manual_seed(t))
            small.grad = torch.randn(40, generator=torch.Generator().manual_seed(t + 9))
            opt.step()
            if with_out:
                assert torch.equal(buf[50:50 + big.numel()].view(torch.int16),
                                   big.detach().reshape(-1).to(torch.bfloat16).view(torch.int16))
                assert model_param_written(big) and not model_param_written(small)
                assert (buf[:50] == 0).all() and (buf[50 + big.numel():] == 0).all()
                assert (small_out == 0).all()
        runs.append((big.detach().clone(), small.detach().clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    with torch.no_grad():
        big.mul_(1.0)                                   # an in-place write, e.g. a load's copy_
    assert not model_param_written(big)


def test_model_param_out_that_does_not_fit_is_refused():
    import pytest

    from fullstack_fp4.optim.q_adamw.optimizer import MODEL_OUT_ATTR

    p = torch.nn.Parameter(torch.zeros(32, 64))
    p.grad = torch.ones(32, 64)
    setattr(p, MODEL_OUT_ATTR, torch.zeros(32 * 64 - 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=MODEL_OUT_ATTR):
        QAdamW([p], lr=1e-2, min_numel=1).step()


class _Packed4bit(torch.Tensor):
    """A minimal FP32-shaped wrapper around 4-bit codes and per-128 scales, the way torchao
    holds AdamW4bit's states (``__tensor_flatten__`` names the inner tensors)."""

    @staticmethod
    def __new__(cls, codes, scale, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    def __init__(self, codes, scale, shape):
        self.codes, self.scale = codes, scale

    def __tensor_flatten__(self):
        return ["codes", "scale"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_state_bytes_count_a_subclass_by_its_inner_tensors():
    """Hand count: 1024 entries as 512 code bytes + 8 FP32 scales = 544 B per state, not the
    wrapper's nominal 4096 (the bench reported torchao's 4-bit states as 8 B/param so)."""
    from fullstack_fp4.optim import optimizer_state_bytes
    p = torch.nn.Parameter(torch.zeros(1024))
    opt = torch.optim.SGD([p], lr=0.1)
    mk = lambda: _Packed4bit(torch.zeros(512, dtype=torch.uint8), torch.zeros(8), (1024,))  # noqa: E731
    opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": mk(), "exp_avg_sq": mk()}
    assert optimizer_state_bytes(opt) == 2 * (512 + 8 * 4)
    opt.state[p] = {"exp_avg": torch.zeros(1024), "step": torch.tensor(1.0)}
    assert optimizer_state_bytes(opt) == 4096


def test_state_dict_carries_the_codec_version_and_another_is_refused():
    """state_dict() records codecs.CODEC_VERSION; load_state_dict() reads its own state back
    bit for bit, and refuses — before loading anything — a 4-bit state without the key (codec
    version 1: v with 32-entry tile means and the 6-rule) or whose tensors have other sizes
    than this codec gives the parameter. A state of FP32 moments only (every parameter below
    min_numel) has no codec and loads without the check."""
    import copy

    from fullstack_fp4.optim.q_adamw.codecs import CODEC_VERSION

    def opt_for(seed, min_numel=1):
        p = torch.nn.Parameter(torch.randn(40, 48, generator=torch.Generator().manual_seed(seed)))
        return p, QAdamW([p], lr=1e-2, min_numel=min_numel)

    p, opt = opt_for(0)
    p.grad = torch.randn(40, 48, generator=torch.Generator().manual_seed(1))
    opt.step()
    sd = opt.state_dict()
    assert sd["q_adamw_codec"] == CODEC_VERSION == 2
    # 40 · 48 = 1920 entries: 30 tiles of 64
    assert sd["state"][0]["exp_avg_sq_means"].numel() == 30
    q, fresh = opt_for(2)
    fresh.load_state_dict(copy.deepcopy(sd))
    assert all(torch.equal(fresh.state[q][k], opt.state[p][k]) for k in opt.state[p])

    old = copy.deepcopy(sd)
    del old["q_adamw_codec"]
    _, o1 = opt_for(3)
    with pytest.raises(ValueError, match="codec version 1, this code reads version 2"):
        o1.load_state_dict(old)
    assert not o1.state                       # nothing loaded

    wrong = copy.deepcopy(sd)
    wrong["state"][0]["exp_avg_sq_means"] = torch.zeros(60, dtype=torch.int16)   # 32-tiles
    _, o2 = opt_for(4)
    with pytest.raises(ValueError, match="does not fit codec version 2"):
        o2.load_state_dict(wrong)
    assert not o2.state

    r, small = opt_for(5, min_numel=10 ** 6)      # FP32 moments only
    r.grad = torch.ones(40, 48)
    small.step()
    sd32 = small.state_dict()
    del sd32["q_adamw_codec"]
    _, o3 = opt_for(6, min_numel=10 ** 6)
    o3.load_state_dict(sd32)
    assert len(o3.state) == 1
