"""Q-AdamW's per-parameter state dict: its layout, the zero state, whole-state decode and encode,
and the codec-version check on load (optimizer.py's module docstring, "State").

A quantized parameter's state holds the two encoded moments (codecs.py) as integer tensors, so
that ``Optimizer.load_state_dict`` — which casts floating-point state to the parameter's dtype —
leaves the bits alone: ``exp_avg_codes`` uint8, ``exp_avg_scales`` uint8 (E4M3 bits),
``exp_avg_chunk_scales`` int32 (FP32 bits), the same three for ``exp_avg_sq``,
``exp_avg_sq_means`` int16 (BF16 bits). A parameter below ``min_numel`` keeps FP32
``exp_avg`` / ``exp_avg_sq`` instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from .codecs import (BLOCK, CHUNK, CODEC_VERSION, TILE, MomentState, decode_exp_avg,
                     decode_exp_avg_sq, encode_exp_avg, encode_exp_avg_sq, num_chunks,
                     padded_numel)

__all__ = ["decode_param_state", "encode_param_state", "check_codec_version", "init_state",
           "unpack_state"]

_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_chunk_scales", "exp_avg_sq_codes",
         "exp_avg_sq_scales", "exp_avg_sq_chunk_scales", "exp_avg_sq_means")


def _pack_state(st: dict, m: MomentState, v: MomentState) -> None:
    st["exp_avg_codes"] = m.codes
    st["exp_avg_scales"] = m.block_scale.view(torch.uint8)
    st["exp_avg_chunk_scales"] = m.chunk_scale.view(torch.int32)
    st["exp_avg_sq_codes"] = v.codes
    st["exp_avg_sq_scales"] = v.block_scale.view(torch.uint8)
    st["exp_avg_sq_chunk_scales"] = v.chunk_scale.view(torch.int32)
    st["exp_avg_sq_means"] = v.tile_mean.view(torch.int16)


def unpack_state(st: dict, n: int, phase: int = 0):
    """The two `MomentState`s (m, v) of a 4-bit state dict of ``n`` entries on the chunk grid
    at ``phase``: views of its tensors, nothing decoded."""
    m = MomentState(st["exp_avg_codes"], st["exp_avg_scales"].view(torch.float8_e4m3fn),
                    st["exp_avg_chunk_scales"].view(torch.float32), n, phase=phase)
    v = MomentState(st["exp_avg_sq_codes"], st["exp_avg_sq_scales"].view(torch.float8_e4m3fn),
                    st["exp_avg_sq_chunk_scales"].view(torch.float32), n,
                    tile_mean=st["exp_avg_sq_means"].view(torch.bfloat16), phase=phase)
    return m, v


def _init_state_by_encoding(n: int, device, phase: int = 0) -> dict:
    """The zero state as the codecs encode it (builds FP32 temporaries of ~10 × n entries)."""
    z = torch.zeros(n, dtype=torch.float32, device=device)
    st: dict = {}
    _pack_state(st, encode_exp_avg(z, rand=torch.zeros(padded_numel(n), device=device),
                                   phase=phase),
                encode_exp_avg_sq(z, phase=phase))
    return st


def init_state(n: int, device, phase: int = 0) -> dict:
    """Zero moments, encoded: every all-zero chunk encodes to the same bytes wherever it sits,
    so the state is one encoded zero chunk's block scale / chunk scale broadcast, zero codes and
    zero means — equal to ``_init_state_by_encoding`` (tested) without its FP32 temporaries
    (~40 B per entry of the largest parameter at the first step: 4 GB for a 98M embedding)."""
    one = _init_state_by_encoding(CHUNK, device)
    npad = padded_numel(n)
    nch = num_chunks(npad, phase)
    st = {}
    for k, v in one.items():
        if k.endswith("chunk_scales"):
            st[k] = v[:1].expand(nch).clone()
        elif k.endswith("scales"):
            st[k] = v[:1].expand(npad // BLOCK).clone()
        elif k.endswith("codes"):
            st[k] = torch.zeros(npad // 2, dtype=v.dtype, device=device)
        else:                                    # tile means
            st[k] = torch.zeros(npad // TILE, dtype=v.dtype, device=device)
    return st


def decode_param_state(st: dict, n: int, phase: int = 0):
    """The moments of one parameter's state as flat FP32 ``(m, v)`` of ``n`` entries.

    A quantized state (``exp_avg_codes`` ...) is decoded exactly as the step decodes it (the
    v guard included: ``v̂ >= (μ/4)²``); ``phase`` is the chunk phase it was encoded with
    (``Placement.chunk_phase()``, 0 for a whole tensor). A state with FP32 moments
    (``numel < min_numel``) is returned flattened. Used to carry a state into another parallel
    layout (fullstack_fp4/integration/reshard_state.py): decode here, re-cut,
    :func:`encode_param_state`."""
    if "exp_avg_codes" in st:
        ms, vs = unpack_state(st, n, phase)
        return decode_exp_avg(ms), decode_exp_avg_sq(vs)
    return (st["exp_avg"].detach().reshape(-1).float(),
            st["exp_avg_sq"].detach().reshape(-1).float())


def encode_param_state(m: torch.Tensor, v: torch.Tensor, *, quantized: bool, shape,
                       phase: int = 0, rand: Optional[torch.Tensor] = None) -> dict:
    """A state (without ``step``) holding the FP32 moments ``m``, ``v`` (``numel`` entries each):
    encoded with the step's codecs when ``quantized`` (first moment with stochastic rounding from
    ``rand``, ``padded_numel(numel)`` uniforms; chunk grid at ``phase``), else FP32 tensors of
    ``shape`` (the parameter's). The inverse of :func:`decode_param_state` up to the codecs'
    quantization error (the state of an FP32-moment parameter round-trips exactly)."""
    m, v = m.reshape(-1).float(), v.reshape(-1).float()
    if not quantized:
        return {"exp_avg": m.clone().view(shape), "exp_avg_sq": v.clone().view(shape)}
    if rand is None or rand.numel() < padded_numel(m.numel()):
        raise ValueError(f"encode_param_state: need {padded_numel(m.numel())} uniforms")
    st: dict = {}
    _pack_state(st, encode_exp_avg(m, rand=rand, phase=phase), encode_exp_avg_sq(v, phase=phase))
    return st


def check_codec_version(state_dict: dict, numels: dict) -> None:
    """Raise ``ValueError`` (one message, nothing loaded) if a QAdamW ``state_dict`` holds 4-bit
    states that this codec would misread: written by another ``CODEC_VERSION`` (a state dict
    without the key is version 1), or with tensors of other sizes
    than this codec gives a parameter of ``numels[index]`` entries (the wrong parameter, or a
    corrupted file)."""
    quantized = [i for i, st in state_dict.get("state", {}).items() if "exp_avg_codes" in st]
    if not quantized:
        return
    version = state_dict.get("q_adamw_codec", 1)
    if version != CODEC_VERSION:
        raise ValueError(
            f"QAdamW state of codec version {version}, this code reads version {CODEC_VERSION} "
            "(version 1: v with the 6-rule and 32-entry tile means; version 2: "
            "the \"4\" rule and 64-entry tiles): its 4-bit moments would decode wrongly; resume "
            "it with the fullstack_fp4 version that wrote it")
    for i in quantized:
        if i not in numels:
            continue
        npad = padded_numel(numels[i])
        st = state_dict["state"][i]
        want = {"exp_avg_codes": npad // 2, "exp_avg_sq_codes": npad // 2,
                "exp_avg_scales": npad // BLOCK, "exp_avg_sq_scales": npad // BLOCK,
                "exp_avg_sq_means": npad // TILE}
        bad = {k: (tuple(st[k].shape) if k in st else None, n) for k, n in want.items()
               if k not in st or st[k].numel() != n}
        if bad:
            raise ValueError(f"QAdamW state of parameter {i} ({numels[i]} entries) does not "
                             f"fit codec version {CODEC_VERSION}: (saved shape, expected "
                             f"entries) {bad}")
