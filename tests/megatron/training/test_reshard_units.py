"""The conversions behind resuming at another TP size (megatron/training/reshard*.py,
tp_layout.py and fullstack_fp4/integration/reshard_state.py), each against an oracle written
here:

* tp_layout: shard orders written out by hand (contiguous slices; SwiGLU fc1 `[gate_i; up_i]`);
* LoRA-SVD fold / split: the dense weight the shards were split from (exact up to the FP32
  rounding of the split and the merge); the moment routing against the realignment's own
  `transfer_moments`; the dense first moment kept;
* Q-AdamW: decode -> re-cut -> re-encode against the codecs composed by hand, and its error
  against the codec's own first quantization of the same moments.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from fullstack_fp4.integration.lora_svd_layers import (dense_moments, route_moments,
                                                       transfer_moments)
from fullstack_fp4.linear.lora_svd import lora_svd_split, merge, subspace_basis
from fullstack_fp4.optim.q_adamw.codecs import CHUNK, CODEC_VERSION, padded_numel
from fullstack_fp4.optim.q_adamw.state import decode_param_state, encode_param_state
from fullstack_fp4.integration.reshard_state import SavedRank, encode_piece
from megatron.training.reshard_convert import lora_from_whole, lora_to_whole
from megatron.training.tp_layout import from_canonical, local_index, to_canonical

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "studies"))
from q_adamw_error_table import synthetic_moments  # noqa: E402

BETA, R = 0.25, 4


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _hand_shards(w: torch.Tensor, axis: int, tp: int, glu: bool) -> list[torch.Tensor]:
    """The TP shards megatron gives each rank, written out: contiguous slices, or for a SwiGLU
    fc1 (rows [gate; up]) rank i's [gate slice i; up slice i]."""
    if not glu:
        return list(w.chunk(tp, dim=axis))
    gate, up = w.chunk(2, dim=0)
    return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]


# ------------------------------------------------------------------ tp_layout
def test_local_index_by_hand():
    assert local_index(8, 2, 1).tolist() == [4, 5, 6, 7]
    assert local_index(8, 2, 0, glu=True).tolist() == [0, 1, 4, 5]
    assert local_index(8, 2, 1, glu=True).tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError):
        local_index(6, 2, 0, glu=True)


@pytest.mark.parametrize("axis,glu", [(0, False), (1, False), (0, True), (None, False)])
def test_shards_join_and_cut_like_megatron(axis, glu):
    w = torch.randn(8, 12)
    if axis is None:  # replicated: every rank holds all of it
        assert torch.equal(to_canonical([w, w.clone()], None), w)
        assert torch.equal(from_canonical(w, None, 2, 1), w)
        return
    shards = _hand_shards(w, axis, 2, glu)
    assert torch.equal(to_canonical(shards, axis, glu=glu), w)
    for i in range(2):
        assert torch.equal(from_canonical(w, axis, 2, i, glu=glu), shards[i])


# ------------------------------------------------------------------ LoRA-SVD
def _split_shards(w, axis, tp, glu, seed=0):
    """Each hand-made shard split on its own, as the layers do at TP = tp."""
    out = []
    for i, shard in enumerate(_hand_shards(w, axis, tp, glu)):
        gen = torch.Generator().manual_seed(seed + i)
        out.append(lora_svd_split(shard, R, BETA, generator=gen, factor_dtype=torch.bfloat16))
    return out  # (w_res, l2, l1) per shard


@pytest.mark.parametrize("axis,glu", [(0, False), (0, True), (1, False)],
                         ids=["column", "column_swiglu_fc1", "row"])
def test_lora_fold_and_resplit_keep_the_dense_weight(axis, glu):
    """TP=2 shards -> layout-free W -> TP=1 split (and back to TP=2): every step keeps the
    dense weight the shards were split from, up to the FP32 rounding of a split + merge."""
    torch.manual_seed(0)
    w = torch.randn(48, 40) * 0.02
    # a split and a merge round twice in FP32 (measured 0.4 ulp of max|w|); a lost or misplaced
    # low-rank part would be ~1e6 times larger
    tol = 4 * torch.finfo(torch.float32).eps * float(w.abs().max())
    parts = _split_shards(w, axis, 2, glu)
    whole = lora_to_whole([p[0] for p in parts], [p[2] for p in parts],
                          [p[1].to(torch.bfloat16) for p in parts], BETA, axis, glu)
    assert (whole["w"] - w).abs().max() <= tol
    w_res, l2, l1, states = lora_from_whole(
        whole, 1, 0, axis, glu, rank_r=R, beta=BETA, factor_dtype=torch.bfloat16, oversample=8,
        power_iters=2, generator=torch.Generator().manual_seed(7))
    assert states is None and l2.shape == (48, R) and l1.shape == (R, 40)
    assert (merge(w_res, l1, l2, BETA, torch.float32) - w).abs().max() <= 2 * tol
    assert torch.equal(l2, l2.to(torch.bfloat16).float())           # stored in the factor dtype
    assert (l2.T @ l2 - torch.eye(R)).abs().max() < 2e-2            # orthonormal up to BF16
    # and back to TP = 2: each shard again rank R, same dense weight
    back = lora_to_whole([w_res], [l1], [l2], BETA, axis, glu)
    for rank, shard in enumerate(_hand_shards(w, axis, 2, glu)):
        wr, b2, b1, _ = lora_from_whole(back, 2, rank, axis, glu, rank_r=R, beta=BETA,
                                        factor_dtype=torch.bfloat16, oversample=8, power_iters=2,
                                        generator=torch.Generator().manual_seed(rank))
        assert b1.shape[0] == R and b2.shape[1] == R
        assert (merge(wr, b1, b2, BETA, torch.float32) - shard).abs().max() <= 3 * tol


def _adam_state(shape, gen):
    m = torch.randn(shape, generator=gen) * 1e-3
    return {"exp_avg": m, "exp_avg_sq": m * m + torch.rand(shape, generator=gen) * 1e-7}


def test_moment_routing_is_the_realignments_transfer():
    """dense_moments + route_moments = transfer_moments (the realignment's policy), bit for
    bit, for an FP32 state re-split into the same shapes."""
    gen = torch.Generator().manual_seed(3)
    st_res, st_l1 = _adam_state((32, 24), gen), _adam_state((R, 24), gen)
    st_res["step"] = st_l1["step"] = torch.tensor(5.0)
    l2_old = torch.linalg.qr(torch.randn(32, R, generator=gen))[0].to(torch.bfloat16).float()
    l2_new = torch.linalg.qr(torch.randn(32, R, generator=gen))[0].to(torch.bfloat16).float()
    ref_r, ref_1 = transfer_moments(st_res, st_l1, l2_old, subspace_basis(l2_old), l2_new,
                                    subspace_basis(l2_new), BETA)
    new_r, new_1 = route_moments(dense_moments(st_res, st_l1, l2_old, BETA), l2_new,
                                 subspace_basis(l2_new), BETA)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(new_r[k], ref_r[k]) and torch.equal(new_1[k], ref_1[k]), k


@pytest.mark.parametrize("axis,glu", [(0, True), (1, False)], ids=["column_swiglu_fc1", "row"])
def test_resharded_moments_keep_the_dense_first_moment(axis, glu):
    """TP=2 -> TP=1: m_res + β L2 m_L1 of the new split is the dense first moment the saved
    shards described (their m_res_i + β L2_i m_L1_i, placed by hand); v_res is cut unchanged."""
    torch.manual_seed(1)
    w = torch.randn(48, 40) * 0.02
    parts = _split_shards(w, axis, 2, glu)
    gen = torch.Generator().manual_seed(4)
    states = [(_adam_state(p[0].shape, gen), _adam_state(p[2].shape, gen)) for p in parts]
    l2s = [p[1] for p in parts]
    dense_shards = [sr["exp_avg"] + BETA * (b @ s1["exp_avg"]) for (sr, s1), b in zip(states, l2s)]
    m_oracle = torch.empty_like(w)
    v_res_oracle = torch.empty_like(w)
    for rank, (dm, (sr, _)) in enumerate(zip(dense_shards, states)):
        idx = local_index(w.shape[axis], 2, rank, glu=glu)
        m_oracle.index_copy_(axis, idx, dm)
        v_res_oracle.index_copy_(axis, idx, sr["exp_avg_sq"])
    whole = lora_to_whole([p[0] for p in parts], [p[2] for p in parts], l2s, BETA, axis, glu,
                          states)
    _, l2, _, (st_r, st_1) = lora_from_whole(
        whole, 1, 0, axis, glu, rank_r=R, beta=BETA, factor_dtype=torch.bfloat16, oversample=8,
        power_iters=2, generator=torch.Generator().manual_seed(9), route="projected")
    m_new = st_r["exp_avg"] + BETA * (l2 @ st_1["exp_avg"])
    assert (m_new - m_oracle).abs().max() <= 1e-5 * float(m_oracle.abs().max())
    assert torch.equal(st_r["exp_avg_sq"], v_res_oracle)
    assert (st_1["exp_avg_sq"] >= 0).all() and st_1["exp_avg"].shape == (R, 40)
    # the dense route (the default): W_res keeps the dense moments as they are, L1's are 0
    v_oracle = torch.empty_like(w)
    for rank, ((sr, s1), b) in enumerate(zip(states, l2s)):
        idx = local_index(w.shape[axis], 2, rank, glu=glu)
        v_oracle.index_copy_(axis, idx, sr["exp_avg_sq"] + BETA ** 2 * ((b * b) @ s1["exp_avg_sq"]))
    _, _, l1, (st_r, st_1) = lora_from_whole(
        whole, 1, 0, axis, glu, rank_r=R, beta=BETA, factor_dtype=torch.bfloat16, oversample=8,
        power_iters=2, generator=torch.Generator().manual_seed(9), route="dense")
    assert (st_r["exp_avg"] - m_oracle).abs().max() <= 1e-6 * float(m_oracle.abs().max())
    assert (st_r["exp_avg_sq"] - v_oracle).abs().max() <= 1e-6 * float(v_oracle.abs().max())
    assert not st_1["exp_avg"].any() and not st_1["exp_avg_sq"].any()
    assert st_1["exp_avg"].shape == l1.shape


# ------------------------------------------------------------------ Q-AdamW
def _payload(states: list[dict], numels: list[int], places=None,
             codec=CODEC_VERSION) -> dict:
    layout = {"numels": numels, **({"q_adamw_places": places} if places else {})}
    inner = {"state": dict(enumerate(states)), "q_adamw_codec": codec}
    return {"layout": layout, "inner": inner, "main_params": None}


def _uniforms(n, seed):
    return torch.rand(padded_numel(n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def moments():
    torch.manual_seed(0)  # synthetic_moments' Student-t draws use the global generator
    m, v = synthetic_moments(1 << 14, steps=60, structured=True)
    return m.view(64, 256), v.view(64, 256)


@pytest.mark.parametrize("axis", [0, 1], ids=["column", "row"])
def test_q_adamw_reencode_is_decode_recut_encode(moments, axis):
    """A TP=2 4-bit state (two shards, each encoded on its own tiles and chunks) resharded to
    TP=1: exactly the codecs composed by hand (decode each shard, join, encode the whole with
    the same uniforms), and off the saved values by less than the error the codec made when it
    first encoded the same moments: m by half of it, sqrt(v) by 0.7 of it (measured relL2: m
    0.041 after 0.123; sqrt(v) 0.039 after 0.077 for the row split, 0.042 after 0.077 for the
    column split with codec version 2, 0.040 after 0.085 with version 1; the column split cuts
    on the whole tensor's 1024-chunk grid, where most blocks of m re-encode to themselves: 3e-8
    here, 1e-2 for the output layer of test_reshard_resume.py, where rounded block scales
    moved)."""
    m, v = moments
    shards_m, shards_v = m.chunk(2, dim=axis), v.chunk(2, dim=axis)
    saved = []
    for i, (sm, sv) in enumerate(zip(shards_m, shards_v)):
        st = encode_param_state(sm, sv, quantized=True, shape=sm.shape, rand=_uniforms(sm.numel(), i))
        st["step"] = torch.tensor(7.0)
        r = SavedRank()
        r.add(_payload([st], [sm.numel()]), ["w"], "cpu")
        saved.append(r)
    # oracle: the saved values (direct decode), joined by hand
    dec = [decode_param_state(encode_param_state(sm, sv, quantized=True, shape=sm.shape,
                                                 rand=_uniforms(sm.numel(), i)), sm.numel())
           for i, (sm, sv) in enumerate(zip(shards_m, shards_v))]
    x_m = torch.cat([d[0].view(s.shape) for d, s in zip(dec, shards_m)], dim=axis)
    x_v = torch.cat([d[1].view(s.shape) for d, s in zip(dec, shards_m)], dim=axis)
    whole_m = to_canonical([r.states["w"][0].view(s.shape) for r, s in zip(saved, shards_m)], axis)
    whole_v = to_canonical([r.states["w"][1].view(s.shape) for r, s in zip(saved, shards_m)], axis)
    assert torch.equal(whole_m, x_m) and torch.equal(whole_v, x_v)
    gen = torch.Generator().manual_seed(11)
    st = encode_piece(whole_m, whole_v, saved[0].states["w"][2], shape=m.shape, offset=0,
                      full_numel=m.numel(), chunk_phase=0, min_numel=4096, generator=gen)
    assert st["step"] == 7.0 and st["exp_avg_codes"].dtype == torch.uint8
    y_m, y_v = decode_param_state(st, m.numel())
    ref = decode_param_state(encode_param_state(x_m, x_v, quantized=True, shape=m.shape,
                                                rand=torch.rand(padded_numel(m.numel()),
                                                                generator=torch.Generator().manual_seed(11))),
                             m.numel())
    assert torch.equal(y_m, ref[0]) and torch.equal(y_v, ref[1])
    # how far off: one more quantization, of the size of the first one
    first_m, first_sv = _rel(x_m.view(-1), m.view(-1)), _rel(x_v.view(-1).sqrt(), v.view(-1).sqrt())
    again_m, again_sv = _rel(y_m, x_m.view(-1)), _rel(y_v.sqrt(), x_v.view(-1).sqrt())
    assert 0 < again_m <= 0.5 * first_m, (again_m, first_m)
    assert 0 < again_sv <= 0.7 * first_sv, (again_sv, first_sv)


def test_distributed_optimizer_pieces_join_into_the_whole_state(moments):
    """Two chunk-aligned pieces (offsets 0 and 8192, placements as the distributed optimizer
    sets them) decode into the whole tensor's moments; FP32-moment params round-trip exactly,
    and a tensor that crosses min_numel (FP32 moments at TP=2, 4-bit at TP=1) converts."""
    m, v = (x.reshape(-1) for x in moments)
    half = m.numel() // 2
    phase = 3 * 64
    pieces, places, oracle_m = [], [], []
    for off in (0, half):
        cph = (phase + off) % CHUNK
        st = encode_param_state(m[off:off + half], v[off:off + half], quantized=True,
                                shape=(half,), phase=cph, rand=_uniforms(half, off))
        st["step"] = torch.tensor(3.0)
        pieces.append(st)
        places.append([5, off, m.numel(), phase])
        oracle_m.append(decode_param_state(st, half, cph)[0])
    r = SavedRank()
    for st, pl in zip(pieces, places):
        r.add(_payload([st], [half], [pl]), ["w"], "cpu")
    assert torch.equal(r.states["w"][0], torch.cat(oracle_m))
    # FP32 moments (a small tensor): exact both ways
    small = {"exp_avg": m[:100].clone(), "exp_avg_sq": v[:100].clone(), "step": torch.tensor(3.0)}
    r2 = SavedRank()
    r2.add(_payload([small], [100]), ["b"], "cpu")
    assert torch.equal(r2.states["b"][0], m[:100]) and torch.equal(r2.states["b"][1], v[:100])
    st = encode_piece(r2.states["b"][0], r2.states["b"][1], r2.states["b"][2], shape=(100,),
                      offset=0, full_numel=100, chunk_phase=0, min_numel=4096, generator=None)
    assert torch.equal(st["exp_avg"], m[:100]) and torch.equal(st["exp_avg_sq"], v[:100])
    # crossing min_numel: a 2048-entry FP32-moment shard becomes part of a 4096-entry 4-bit whole
    fp32_shards = [{"exp_avg": m[i:i + 2048].clone(), "exp_avg_sq": v[i:i + 2048].clone(),
                    "step": torch.tensor(3.0)} for i in (0, 2048)]
    ranks = []
    for st in fp32_shards:
        rk = SavedRank()
        rk.add(_payload([st], [2048]), ["x"], "cpu")
        ranks.append(rk)
    whole = to_canonical([rk.states["x"][0] for rk in ranks], 0)
    whole_v = to_canonical([rk.states["x"][1] for rk in ranks], 0)
    st = encode_piece(whole, whole_v, ranks[0].states["x"][2], shape=(4096,), offset=0,
                      full_numel=4096, chunk_phase=0, min_numel=4096,
                      generator=torch.Generator().manual_seed(0))
    back_m, back_v = decode_param_state(st, 4096)
    assert "exp_avg_codes" in st
    assert _rel(back_m, m[:4096]) < 0.3 and _rel(back_v.sqrt(), v[:4096].sqrt()) < 0.2


def test_payload_names_saved_from_placements_or_refused():
    """Which parameter each saved state belongs to: the names saved with the object; else the
    distributed optimizer's placement keys (model-parameter index); else, for an older plain
    optimizer object, this run's order when the wrapper kind and count agree; else refused."""
    from fullstack_fp4.integration.reshard_state import payload_names

    model = ["emb", "w1", "w2", "out"]
    named = {"layout": {"numels": [4, 4], "wrapper": "FP32Optimizer"}, "param_names": ["w2", "w1"]}
    assert payload_names(named, model, ["x", "y"], "FP32Optimizer") == ["w2", "w1"]
    placed = {"layout": {"numels": [4, 4], "wrapper": "DistributedOptimizer",
                         "q_adamw_places": [[3, 0, 8, 0], [1, 32, 64, 0]]}}
    assert payload_names(placed, model, ["x", "y"], "FP32Optimizer") == ["out", "w1"]
    old = {"layout": {"numels": [4, 4], "wrapper": "FP32Optimizer"}}
    assert payload_names(old, model, ["x", "y"], "FP32Optimizer") == ["x", "y"]
    with pytest.raises(ValueError, match="names no parameters"):
        payload_names(old, model, ["x", "y"], "DistributedOptimizer")


def test_a_state_of_another_codec_version_is_refused(moments):
    """4-bit moments saved by codec version 1 (no ``q_adamw_codec`` key: 32-entry tile means,
    the 6-rule) would decode to wrong values here: the resharding read refuses them with a
    ValueError naming the versions (load_resharded reports it as the checkpoint's error), and
    reads the same state saved with the current version."""
    m, v = (x.reshape(-1)[:4096] for x in moments)
    st = encode_param_state(m, v, quantized=True, shape=(4096,), rand=_uniforms(4096, 0))
    st["step"] = torch.tensor(3.0)
    SavedRank().add(_payload([st], [4096]), ["w"], "cpu")
    with pytest.raises(ValueError, match="codec version 1"):
        SavedRank().add(_payload([st], [4096], codec=1), ["w"], "cpu")
    old = _payload([st], [4096])
    del old["inner"]["q_adamw_codec"]           # what version 1 wrote: no key at all
    with pytest.raises(ValueError, match="codec version 1"):
        SavedRank().add(old, ["w"], "cpu")
