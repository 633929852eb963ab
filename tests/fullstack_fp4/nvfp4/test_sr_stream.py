"""The stochastic-rounding stream (fullstack_fp4/nvfp4/sr_stream.py): Philox4x32-10 against
Random123's known-answer vectors, the PyTorch stream against the Triton kernels' own draws,
the 8-bit uniforms' grid, spread and the rounding bias they allow."""

import os

import torch

from fullstack_fp4.nvfp4.e2m1 import E2M1_VALUES, e2m1_decode, e2m1_round_stochastic
from fullstack_fp4.nvfp4.sr_stream import philox4x32_10, row_group, row_word, sr_uniforms


def _t(v):
    return torch.tensor([v], dtype=torch.int64)


def test_philox_known_answers():
    # Random123 kat_vectors, philox4x32_10: (counter, key) -> output
    kats = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
            ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
            ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
             (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in kats:
        got = philox4x32_10(_t(ctr[0]), _t(ctr[1]), key[0], key[1], _t(ctr[2]), _t(ctr[3]))
        assert tuple(int(w) for w in got) == want


def test_row_split_is_a_bijection_of_16_rows():
    r = torch.arange(64)
    pairs = set(zip(row_group(r).tolist(), row_word(r).tolist()))
    assert len(pairs) == 64
    assert set(row_word(r).tolist()) == {0, 1, 2, 3}
    # the quads are {2k, 2k+1, 8+2k, 9+2k} of each 16 rows
    assert [int(x) for x in r[row_group(r) == 1]] == [2, 3, 10, 11]


def test_triton_draws_are_the_stream():
    """The Triton helpers' uniforms (``philox_uniforms`` dumps them through the tiled kernels'
    ``fp4_math.philox_halves``) equal the PyTorch stream, 64-bit seed and a ragged row count
    included."""
    from fullstack_fp4.nvfp4.kernels.quantize import philox_uniforms
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    dev = "cuda" if (torch.cuda.is_available() and not interpret) else "cpu"
    for shape, seed in (((40, 64), 1234), ((3, 17, 96), 2**40 + 5)):
        assert torch.equal(philox_uniforms(shape, seed, device=dev).cpu(), sr_uniforms(shape, seed))


def test_uniforms_are_centred_bytes_spread_evenly():
    u = sr_uniforms((256, 1024), 7)
    k = u * 256 - 0.5
    assert torch.equal(k, k.round()) and int(k.min()) >= 0 and int(k.max()) <= 255
    hist = torch.bincount(k.to(torch.int64).flatten(), minlength=256).double()
    expected = u.numel() / 256
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 255 + 6 * (2 * 255) ** 0.5      # 255 dof: mean 255, sd 22.6
    assert not torch.equal(sr_uniforms((16, 64), 8), sr_uniforms((16, 64), 7))


def test_rounding_bias_at_most_a_512th_of_a_step():
    """E[SR(x)] over all 256 uniforms, exactly: within 2^-9 of an E2M1 step of x."""
    x = torch.linspace(0.0, 6.0, 6001)
    ks = torch.arange(256, dtype=torch.float32)
    u = ((ks + 0.5) / 256).reshape(256, 1).expand(256, x.numel()).contiguous()
    mean = e2m1_decode(e2m1_round_stochastic(x.expand(256, -1).contiguous(), u)).double().mean(0)
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    hi = grid[torch.searchsorted(grid, x.double(), right=True).clamp(max=7)]
    lo = grid[(torch.searchsorted(grid, x.double(), right=True) - 1).clamp(min=0)]
    step = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    assert float(((mean - x.double()).abs() / step).max()) <= 1 / 512 + 1e-12
