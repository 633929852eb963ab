"""``QAdamW``: AdamW whose two moments are stored in NVFP4 (codecs.py), fused on the GPU.

Update (AdamW, decoupled decay, bias correction; t = the parameter's step count)::

    p ← p · (1 − lr·wd)
    m ← β1·m̂ + (1−β1)·g          v ← β2·v̂ + (1−β2)·g²       (m̂, v̂ decoded from 4 bits)
    p ← p − (lr / (1−β1^t)) · m / (sqrt(v) / sqrt(1−β2^t) + eps)
    store encode_exp_avg(m), encode_exp_avg_sq(v)

The step uses the *fresh* FP32 m and v (before re-encoding), like an FP32 AdamW step that
happens to start from the decoded moments; the quantization error enters the next step only.
In FP32 each of the four sums is one fused multiply-add (rounded once; ``codecs._fma_rn``, the
kernel's FFMA), and β1·m̂ enters the first as ``x · (dec · β1)`` with x the exact inverse RHT
of the decoded block (``codecs._decode_chunked``).

Paths. CUDA FP32 params: one fused Triton launch per parameter (triton_step.py), uniforms for
stochastic rounding from Philox in the kernel; with ``multi_tensor=True`` one launch for all of
a param group's parameters at one step count (triton_multi.py: each parameter computed bit for
bit as its own launch computes it; parameters it cannot address — ``numel`` not a multiple of
16, a tensor off a 16-byte boundary — keep their own launch; slower at 3b shapes, docs/perf/q-adamw.md).
The per-parameter launches can go round-robin to ``launch_streams`` CUDA streams (default 1;
2: the current stream and a side stream forked from it at the step's first launch and joined
into it at the end), so one launch's last, partly filled wave overlaps the next launch's first:
each launch touches only its own parameter's tensors, so the result is bit for bit the
one-stream result, and the step reaches the one-flat-launch time (docs/perf/q-adamw.md). A side launch
whose inputs the step itself made on the current stream after the fork (a fresh state, a
non-contiguous gradient's copy) waits for the current stream first
(tests/fullstack_fp4/optim/test_q_adamw_streams.py). The default is 1: more streams are faster
only where the host keeps up, and host-bound slower where it does not (docs/perf/q-adamw.md).
Otherwise (CPU): ``q_adamw_step_reference``, the pure-PyTorch oracle, with uniforms from a
``torch.Generator``. Both seed their uniforms from ``(seed, parameter index, step)``: no RNG
state to checkpoint, so a resumed run draws the same bits as an uninterrupted one
(``state_dict`` round trips are bit-exact).

Parameters with ``numel < min_numel`` (default 4096: norms, biases, small heads; their FP32
moments are a negligible share of memory, and they are the tensors where a tile of 64 mixes
the most unrelated entries) keep FP32 moments and the same update.

Parameters are read flat (``p.view(-1)``), so 1-D FP32 shards of any length — what
megatron-core's distributed optimizer hands its inner optimizer — work as they are: the codec
pads to the 64-tile and the padding is zeroed on every encode.

Placement (a piece of a larger tensor). A parameter may carry ``p.q_adamw_place``
(:class:`Placement`: the whole tensor's seed key and numel, this piece's first element in it,
and the whole tensor's chunk-grid phase). Then everything the codec and the rounding depend on
is a function of the *whole* tensor's element index: the 16-blocks and 64-tiles (the piece
must start on a tile), the 1024-chunks of the second-level scale (the piece's grid phase is
``(phase + offset) mod 1024``), the stochastic-rounding uniforms (the whole tensor's stream,
sliced at ``offset``; the kernel's Philox counter is the whole tensor's row index), the seed
(``key``, not the local index) and the FP32-moments decision (``full_numel < min_numel``).
If the cuts between pieces fall on chunk boundaries of that grid, the pieces' states are
exactly the whole tensor's state cut at those boundaries, and a run whose tensors are split
over ranks (megatron-core's distributed optimizer, DP=2) computes bit for bit what the run
with whole tensors computes (fullstack_fp4/integration/optimizers.py sets the placements).

The model's BF16 copy (megatron's FP32 main params). A parameter may carry
``p.fp4_model_param_out`` (``MODEL_OUT_ATTR``): a contiguous BF16 tensor of ``p.numel()``
entries — the BF16 model parameter whose FP32 main copy ``p`` is, or for a distributed-optimizer
shard the matching slice of it. The step of a quantized parameter then also writes
``p_new.to(bfloat16)`` there (RNE, bit for bit; the kernel in the same pass, the reference with
``copy_``) and records ``p.fp4_model_param_written = p._version`` (``MODEL_WRITTEN_ATTR``): the
wrapper's main -> model copy can skip ``p`` while that stands (any later in-place write to ``p``,
e.g. a checkpoint load's ``copy_``, bumps the version; fullstack_fp4/integration/
model_param_write.py). FP32-moment parameters (``full_numel < min_numel``) do not write it:
the wrapper's main -> model copy writes their model params.

Division (``approx_division``, default off). The kernel can compute the update's ``m / d``
(``d = sqrt(v)/sqrt(1−β2^t) + eps``) as ``m · rcp.approx(d)``: the SFU's reciprocal (≤ 1 ulp)
and one multiply in place of the IEEE division's ~10 instructions and slow-path branch
(triton_rows._adam; docs/perf/q-adamw.md has the counts and times). It moves the update ``m/d`` by at
most 2^-22 of itself (IEEE: 2^-24), far below the 4-bit moments' own error; ``m``, ``v`` and
``sqrt(v)`` — everything the states are encoded from — keep the reference's bits, so the
states stay bit for bit the reference's and only ``p`` differs, by at most ``lr_t·|m/d|·2^-22``
plus a rounding of ``p`` per step. apex builds the kernel behind its ``FusedAdam``
(``amp_C``'s multi_tensor_adam; megatron-core's ``Adam`` when Transformer Engine is absent) with
nvcc ``--use_fast_math``, i.e. approximate division and square root. The CPU reference has no
such instruction and always divides in IEEE, so the option changes only the GPU path.

State (per quantized parameter): the two encoded moments as integer tensors, and ``step``; the
layout, the zero state and whole-state decode / encode are state.py's. ``state_dict()`` also
records ``q_adamw_codec`` (codecs.CODEC_VERSION); ``load_state_dict`` refuses a 4-bit state of
another codec version, or whose tensors are not the sizes this codec gives the parameter, with
a message that says so (``state.check_codec_version``): read with another codec its bytes
would decode to wrong moments without any error.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .codecs import (BLOCK, CHUNK, CODEC_VERSION, TILE, _fma_rn, _sqrt_rn,
                     decode_exp_avg_parts, decode_exp_avg_sq, encode_exp_avg, encode_exp_avg_sq,
                     padded_numel)
# The state dict's layout (keys, packing, the zero state, the codec-version check) is state.py's.
from .state import _KEYS, _pack_state, check_codec_version, init_state, unpack_state

__all__ = ["QAdamW", "Placement", "PLACE_ATTR", "GRAD_ATTR", "grad_of", "q_adamw_step_reference",
           "kernel_uniforms", "optimizer_state_bytes", "MODEL_OUT_ATTR", "MODEL_WRITTEN_ATTR",
           "model_out_of", "model_param_written", "kernel_hyper", "kernel_views"]

PLACE_ATTR = "q_adamw_place"


@dataclass(frozen=True)
class Placement:
    """Where a parameter (a flat piece) sits in the whole tensor it was cut from.

    ``key``: the whole tensor's seed key (the same on every rank holding a piece of it);
    ``offset``: index of the piece's first element in the whole (flat) tensor, a multiple of
    TILE; ``full_numel``: the whole tensor's numel; ``phase``: the chunk-grid phase of the whole
    tensor (its element 0 sits at entry ``phase`` of its first 1024-chunk), a multiple of 64
    (the kernel groups 16-blocks four to a 64-tile on the grid)."""

    key: int
    offset: int
    full_numel: int
    phase: int = 0

    def chunk_phase(self) -> int:
        return (self.phase + self.offset) % CHUNK

    def check(self, n: int) -> None:
        ok = (self.offset % TILE == 0 and self.phase % TILE == 0 and 0 <= self.phase < CHUNK
              and self.offset + n <= self.full_numel
              and (self.offset + n == self.full_numel or n % TILE == 0))
        if not ok:
            raise ValueError(f"QAdamW placement {self} for a piece of {n} entries: the piece "
                             f"must start (and, unless it ends the tensor, end) on a "
                             f"{TILE}-entry tile, and the phase be a multiple of {TILE}")

def _f32(x: float, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=device)


def kernel_hyper(lr, beta1, beta2, eps, wd, step, device):
    """FP32 scalars, computed once in FP64 and rounded — the kernel gets the same values."""
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return dict(decay=1.0 - lr * wd, beta1=beta1, omb1=1.0 - beta1, beta2=beta2,
                omb2=1.0 - beta2, inv_sqrt_bc2=1.0 / math.sqrt(bc2), eps=eps, step_size=lr / bc1)


def q_adamw_step_reference(p_flat: torch.Tensor, g_flat: torch.Tensor, st: dict, *, lr: float,
                           beta1: float, beta2: float, eps: float, weight_decay: float,
                           step: int, rand: torch.Tensor, phase: int = 0,
                           model_out: Optional[torch.Tensor] = None) -> None:
    """One Q-AdamW step on flat FP32 ``p_flat`` in place, state dict ``st`` updated in place.

    Pure PyTorch, FP32, in exactly the kernel's order of operations. ``rand``: uniforms for the
    first moment's stochastic rounding, length ``padded_numel(n)``. ``phase``: the chunk-grid
    phase the state was encoded with (codecs.num_chunks). ``model_out``: a BF16 tensor of ``n``
    entries that receives the new parameter rounded to nearest even (the kernel's model_out).
    """
    n = p_flat.numel()
    dev = p_flat.device
    h = {k: _f32(v, dev) for k, v in kernel_hyper(lr, beta1, beta2, eps, weight_decay, step,
                                             dev).items()}
    ms, vs = unpack_state(st, n, phase)
    xm, dm = decode_exp_avg_parts(ms)       # m̂ = xm · dm, xm exact (codecs._decode_chunked)
    v = decode_exp_avg_sq(vs)
    g = g_flat.reshape(-1).to(torch.float32)
    p = p_flat * h["decay"]
    # the four sums are fused multiply-adds (one rounding each, _fma_rn): the kernel's
    # FFMAs, one instruction per entry fewer each than FMUL + FADD (docs/perf/q-adamw.md); β1 · m̂ is
    # xm · (dm · β1), so m̂ itself is never rounded (one FMUL per entry fewer)
    m = _fma_rn(xm, dm * h["beta1"], g * h["omb1"])
    v = _fma_rn(v, h["beta2"], (g * g) * h["omb2"])
    s = _sqrt_rn(v)
    # a product, not s / sqrt(bc2): torch may turn a division by a scalar into one anyway
    upd = m / _fma_rn(s, h["inv_sqrt_bc2"], h["eps"])
    p_flat.copy_(_fma_rn(upd, -h["step_size"], p))
    if model_out is not None:
        model_out.view(-1).copy_(p_flat)        # FP32 -> BF16: round to nearest even
    _pack_state(st, encode_exp_avg(m, rand=rand, phase=phase),
                encode_exp_avg_sq(v, phase=phase))


def placement_of(p: torch.Tensor, index: int) -> Placement:
    """``p.q_adamw_place`` if set (checked), else the whole tensor keyed by its index."""
    pl = getattr(p, PLACE_ATTR, None)
    if pl is None:
        return Placement(index, 0, p.numel(), 0)
    pl.check(p.numel())
    return pl


def _seed(seed: int, index: int, step: int) -> int:
    # Distinct, deterministic 31-bit seed per (parameter, step): a resume redraws the same bits.
    return (seed * 1_000_003 + index * 7_919 + step * 104_729) % (2 ** 31 - 1)


def kernel_uniforms(seed: int, npad: int, row0: int = 0, *, u8: bool = True, rounds: int = 10,
                    device=None) -> torch.Tensor:
    """The first moment's stochastic-rounding uniforms that the fused kernel draws from Philox
    (``launch`` without ``rand``), in plain PyTorch: ``npad`` FP32 uniforms for the piece whose
    first 16-block is block ``row0`` of the whole tensor. ``q_adamw_step_reference(...,
    rand=kernel_uniforms(...))`` then computes the kernel's Philox-path step bit for bit (tests;
    the GPU check of benchmarks/bench_q_adamw.py).

    Row (16-block) ``r`` of the whole tensor draws ``Philox4x32(counter = (2r, 0, 0, 0), key =
    seed's two 32-bit words, rounds)`` (``tl.randint4x(seed, 2r, rounds)``):

    * ``u8`` (the default): entry ``j`` of the row takes byte ``j % 4`` (low byte first) of word
      ``j // 4`` as ``u = (byte + ½) / 2^8``;
    * otherwise two calls (counters ``2r`` and ``2r + 1``, words 0-3 and 4-7): entry ``j`` takes
      16-bit half ``j % 2`` (low half first) of word ``j // 2`` as ``u = half / 2^16``.

    Both grids are exact in FP32, so ``floor(u · 2^22)`` is the kernel's integer dither."""
    from fullstack_fp4.nvfp4.sr_stream import philox4x32_10

    if npad % BLOCK:
        raise ValueError(f"kernel_uniforms: npad={npad} is not a multiple of {BLOCK}")
    r = torch.arange(row0, row0 + npad // BLOCK, dtype=torch.int64, device=device)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    if u8:
        words = torch.stack(philox4x32_10(2 * r, torch.zeros_like(r), k0, k1, rounds=rounds),
                            -1)                                         # [rows, 4]
        parts = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], -1)
        u = (parts.double() + 0.5) / 256.0
    else:
        words = torch.cat([torch.stack(philox4x32_10(2 * r + i, torch.zeros_like(r), k0, k1,
                                                     rounds=rounds), -1) for i in (0, 1)], -1)
        parts = torch.stack([words & 0xFFFF, words >> 16], -1)          # [rows, 8, 2]
        u = parts.double() / 65536.0
    return u.reshape(-1).float()


# Where a param's gradient may sit instead of `.grad` (megatron-core's name in its precision-
# aware optimizer): torch refuses a `.grad` of another dtype than the param, so the BF16 grad of
# an FP32 main param (fullstack_fp4/integration/bf16_grads.py) lives here.
GRAD_ATTR = "decoupled_grad"


def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient the step reads: ``p.decoupled_grad`` when set, else ``p.grad``. Any float
    dtype: every path converts it to FP32 (exact for BF16), so a BF16 gradient steps exactly as
    the same values in FP32."""
    g = getattr(p, GRAD_ATTR, None)
    return p.grad if g is None else g


# The BF16 model parameter a main param's step also writes (module docstring), and the record
# that it did: the main param's version counter at the write.
MODEL_OUT_ATTR = "fp4_model_param_out"
MODEL_WRITTEN_ATTR = "fp4_model_param_written"


def model_out_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """``p.fp4_model_param_out`` if set, checked: the kernel writes ``p.numel()`` BF16 entries
    at its address, so anything else would write out of bounds or into the wrong entries."""
    out = getattr(p, MODEL_OUT_ATTR, None)
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != p.numel()
                            or not out.is_contiguous() or out.device != p.device):
        raise ValueError(f"{MODEL_OUT_ATTR} must be a contiguous BF16 tensor of {p.numel()} "
                         f"entries on {p.device}, got {out.dtype} {tuple(out.shape)} on "
                         f"{out.device} (contiguous={out.is_contiguous()})")
    return out


def model_param_written(p: torch.Tensor) -> bool:
    """Whether the BF16 model parameter holds ``p`` rounded, written by p's last step and ``p``
    not modified in place since (the version counter recorded then is still p's)."""
    return getattr(p, MODEL_WRITTEN_ATTR, None) == p._version


_SIDE_STREAMS: dict = {}   # (device index, lane) -> torch.cuda.Stream, made once


class _LaunchLanes:
    """One step's per-parameter launches, round-robin over ``n`` CUDA streams of a device:
    lane 0 is the current stream; lanes 1.. are side streams that wait for the current stream
    before their first launch of the step (the gradients are ready there) and that the current
    stream waits for in :meth:`join`. A side lane's gradient gets ``record_stream``: a
    temporary (a non-contiguous grad made contiguous) or a gradient freed after the step
    (``zero_grad``) must not be handed to a new allocation while the side stream still reads
    it. Parameters, states and the model-param copy belong to the optimizer and the model and
    outlive the step."""

    def __init__(self, n: int):
        self.n = n
        self.count = 0
        self.forked: dict = {}   # device index -> (current stream, [side streams])

    def next(self, device: torch.device, grad: torch.Tensor, made_here: bool = False):
        """A context that runs the next launch on ``device`` on its lane's stream.
        ``made_here``: the launch reads tensors the step wrote on the current stream (a state
        just initialised, a gradient's contiguous copy); a side lane then waits for the
        current stream first — the fork at the step's first launch does not cover work
        enqueued after it."""
        if self.n == 1 or device.type != "cuda":
            return contextlib.nullcontext()
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self.forked:
            cur = torch.cuda.current_stream(idx)
            sides = []
            for lane in range(1, self.n):
                s = _SIDE_STREAMS.get((idx, lane))
                if s is None:
                    s = _SIDE_STREAMS[(idx, lane)] = torch.cuda.Stream(device=idx)
                s.wait_stream(cur)
                sides.append(s)
            self.forked[idx] = (cur, sides)
        cur, sides = self.forked[idx]
        lane = self.count % self.n
        self.count += 1
        if lane == 0:
            return contextlib.nullcontext()
        side = sides[lane - 1]
        if made_here:
            side.wait_stream(cur)
        grad.record_stream(side)
        return torch.cuda.stream(side)

    def join(self) -> None:
        for cur, sides in self.forked.values():
            for s in sides:
                cur.wait_stream(s)
        self.forked.clear()


class QAdamW(torch.optim.Optimizer):
    """AdamW with NVFP4 moments (see the module docstring)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, min_numel: int = 4096, seed: int = 0,
                 use_kernel: Optional[bool] = None, approx_division: bool = False,
                 multi_tensor: bool = False, launch_streams: int = 1):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError("lr, eps and weight_decay must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        min_numel=min_numel, seed=seed)
        super().__init__(params, defaults)
        self.use_kernel = use_kernel  # None: the kernel for CUDA FP32 params
        # the kernel's m'/d as m' · rcp.approx(d): faster, p' within 2^-22 of the update
        # (module docstring "Division"); the CPU reference always divides in IEEE
        self.approx_division = bool(approx_division)
        # the kernel's parameters of a group stepped by one launch (triton_multi.py), each bit
        # for bit as its own launch steps it (module docstring "Paths")
        self.multi_tensor = bool(multi_tensor)
        if int(launch_streams) != launch_streams or launch_streams < 1:
            raise ValueError(f"launch_streams must be an integer >= 1, got {launch_streams}")
        # the CUDA streams the per-parameter launches go round-robin to (module docstring)
        self.launch_streams = int(launch_streams)

    def _kernel_ok(self, p: torch.Tensor) -> bool:
        """The fused kernel for CUDA FP32 params; ``use_kernel=True`` also runs it on CPU
        params under the Triton interpreter (``TRITON_INTERPRET=1``: the tests)."""
        if self.use_kernel is False:
            return False
        if not (p.dtype == torch.float32 and p.is_contiguous()):
            return False
        from .triton_step import _INTERPRET
        return p.is_cuda or (self.use_kernel is True and _INTERPRET)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lanes = _LaunchLanes(self.launch_streams)
        try:
            self._step_groups(lanes)
        finally:
            lanes.join()   # later work on the current stream sees every launch's writes
        return loss

    def _step_groups(self, lanes: "_LaunchLanes") -> None:
        index = -1
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            batches: dict = {}   # multi_tensor: (t, grad dtype, model_out?) -> [(p, Item)]
            for p in group["params"]:
                index += 1
                grad = grad_of(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("QAdamW does not support sparse gradients")
                st = self.state[p]
                pl = placement_of(p, index)
                cph = pl.chunk_phase()
                quantized = pl.full_numel >= group["min_numel"]
                fresh = not st
                if fresh:
                    st["step"] = torch.tensor(0.0)
                    if quantized:
                        st.update(init_state(p.numel(), p.device, cph))
                    else:
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p,
                                                            memory_format=torch.preserve_format)
                st["step"] += 1
                t = int(st["step"].item())
                if not quantized:
                    self._fp32_step(p, grad, st, lr, b1, b2, eps, wd, t)
                    continue
                seed = _seed(group["seed"], pl.key, t)
                n = p.numel()
                out = model_out_of(p)
                if self._kernel_ok(p):
                    from .triton_step import launch
                    g_flat = grad.reshape(-1).contiguous()
                    if self.multi_tensor:
                        from .triton_multi import Item, batchable, seed_base
                        item = Item(p.view(-1), g_flat, kernel_views(st), n, padded_numel(n),
                                    cph, pl.offset // BLOCK, seed_base(group["seed"], pl.key),
                                    None if out is None else out.view(-1).view(torch.int16))
                        if batchable(item):
                            batches.setdefault((t, g_flat.dtype, out is not None), []).append(
                                (p, item))
                            continue        # stepped below, with the group's other params
                    made_here = fresh or g_flat.data_ptr() != grad.data_ptr()   # a copy
                    with lanes.next(p.device, g_flat, made_here):
                        launch(p.view(-1), g_flat, kernel_views(st), n,
                               padded_numel(n), seed=seed, phase=cph, row0=pl.offset // BLOCK,
                               model_out=None if out is None else out.view(-1),
                               fast_div=self.approx_division,
                               **kernel_hyper(lr, b1, b2, eps, wd, t, p.device))
                else:
                    # the whole tensor's uniform stream, sliced at this piece
                    gen = torch.Generator(device=p.device).manual_seed(seed)
                    rand = torch.rand(padded_numel(pl.full_numel), generator=gen,
                                      device=p.device)[pl.offset:pl.offset + padded_numel(n)]
                    direct = p.is_contiguous() and p.dtype == torch.float32
                    flat = p.data.view(-1) if direct else p.data.reshape(-1).float()
                    q_adamw_step_reference(flat, grad, st, lr=lr, beta1=b1, beta2=b2,
                                           eps=eps, weight_decay=wd, step=t, rand=rand,
                                           phase=cph,
                                           # .data: like the kernel and megatron's copy, no
                                           # version bump of the model param
                                           model_out=None if out is None else out.data)
                    if not direct:
                        p.data.copy_(flat.view_as(p))
                if out is not None:
                    # both paths write p through .data / a pointer, which leaves p's version
                    # counter alone: any later in-place write to p invalidates this record
                    setattr(p, MODEL_WRITTEN_ATTR, p._version)
            for (t, _, has_out), members in batches.items():
                from .triton_multi import launch_multi
                launch_multi([it for _, it in members], t=t, fast_div=self.approx_division,
                             **kernel_hyper(lr, b1, b2, eps, wd, t, members[0][0].device))
                if has_out:
                    for p, _ in members:
                        setattr(p, MODEL_WRITTEN_ATTR, p._version)

    def state_dict(self) -> dict:
        """torch's, plus ``q_adamw_codec``: the codec version the 4-bit states are in."""
        sd = super().state_dict()
        sd["q_adamw_codec"] = CODEC_VERSION
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the 4-bit state keeps its integer dtypes (torch would cast every
        state tensor of a floating-point parameter to the parameter's dtype), and a state of
        another codec version or size is refused before anything is loaded
        (``state.check_codec_version``)."""
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        check_codec_version(state_dict, {i: p.numel() for i, p in zip(ids, params)})
        raw = {k: dict(v) for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        for i, p in zip(ids, params):
            for k in _KEYS:
                if i in raw and k in raw[i]:
                    self.state[p][k] = raw[i][k].to(p.device)

    @staticmethod
    def _fp32_step(p, grad, st, lr, b1, b2, eps, wd, t):
        g = grad.to(p.dtype)   # a BF16 grad converts exactly
        m, v = st["exp_avg"], st["exp_avg_sq"]
        p.mul_(1.0 - lr * wd)
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = (v.sqrt() / math.sqrt(1.0 - b2 ** t)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1.0 - b1 ** t))

    def state_bytes(self) -> int:
        """Bytes held in optimizer state tensors (all parameters; 'step' counters excluded)."""
        return optimizer_state_bytes(self)

    def state_bytes_per_param(self) -> float:
        n = sum(p.numel() for g in self.param_groups for p in g["params"] if p in self.state)
        return self.state_bytes() / max(n, 1)


def kernel_views(st: dict) -> dict:
    """The state dict as the step kernels take it: the chunk scales viewed as FP32."""
    d = dict(st)
    d["exp_avg_chunk_scales"] = st["exp_avg_chunk_scales"].view(torch.float32)
    d["exp_avg_sq_chunk_scales"] = st["exp_avg_sq_chunk_scales"].view(torch.float32)
    return d


def _tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of ``t``; a tensor subclass that flattens into inner tensors (torchao's
    low-bit optimizer states: an FP32-shaped wrapper around codes and scales) counts its inner
    tensors, not the wrapper's nominal dtype."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``opt.state`` except ``step`` (works for any torch optimizer,
    and for states held in tensor subclasses: :func:`_tensor_bytes`)."""
    total = 0
    for st in opt.state.values():
        for k, t in st.items():
            if k != "step" and torch.is_tensor(t):
                total += _tensor_bytes(t)
    return total
