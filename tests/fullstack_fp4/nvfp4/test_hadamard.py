"""RHT-16 and the general Hadamard transform vs an independently built matrix (Kronecker)."""

import pytest
import torch

from fullstack_fp4.nvfp4 import (DEFAULT_SIGNS, hadamard16, hadamard_matrix, hadamard_transform,
                                 inverse_hadamard16)

TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def kron_hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h2, h)
    return h


def test_default_signs_are_transformer_engines():
    assert list(DEFAULT_SIGNS) == TE_SIGNS


def test_matrix_matches_kronecker_and_te_construction():
    assert torch.equal(hadamard_matrix(16, torch.float64), kron_hadamard(16))
    # hadamard16 applied to the identity gives the transform matrix: diag(s) · H / 4, exactly
    # TE's _build_hadamard_matrix(sign_mat @ h) * 1/sqrt(16).
    r = hadamard16(torch.eye(16, dtype=torch.float64))
    want = torch.diag(torch.tensor(TE_SIGNS, dtype=torch.float64)) @ kron_hadamard(16) / 4
    assert torch.equal(r, want)
    assert torch.equal(r @ r.T, torch.eye(16, dtype=torch.float64))  # orthogonal (exact)


def test_rht_blockwise_inverse_norm_and_cancellation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 64, generator=g, dtype=torch.float64)
    y = hadamard16(x)
    assert y.dtype == torch.float64 and y.shape == x.shape
    # Blockwise: each 16-block transformed independently by the same matrix.
    r = hadamard16(torch.eye(16, dtype=torch.float64))
    assert torch.allclose(y, (x.reshape(3, 8, 4, 16) @ r).reshape(x.shape), atol=1e-13)
    assert torch.allclose(inverse_hadamard16(y), x, atol=1e-13)
    assert torch.allclose(y.reshape(-1, 16).norm(dim=1), x.reshape(-1, 16).norm(dim=1), rtol=1e-13)
    a, b = torch.randn(5, 64, generator=g, dtype=torch.float64), torch.randn(7, 64, generator=g,
                                                                          dtype=torch.float64)
    assert torch.allclose(hadamard16(a) @ hadamard16(b).T, a @ b.T, atol=1e-12)
    # FP32/BF16 inputs are computed and returned in FP32.
    assert hadamard16(x.to(torch.bfloat16)).dtype == torch.float32


def test_custom_signs_and_errors():
    s = [1.0] * 16
    x = torch.randn(2, 16, dtype=torch.float64)
    assert torch.allclose(hadamard16(x, s), x @ kron_hadamard(16) / 4, atol=1e-13)
    with pytest.raises(ValueError):
        hadamard16(torch.ones(2, 24))
    with pytest.raises(ValueError):
        hadamard16(x, [1.0] * 15)
    with pytest.raises(ValueError):
        hadamard16(x, [2.0] * 16)
    # signs given as a tensor: same transform as the tuple; a bad tensor is refused too (the
    # check runs on the host and the device copy is cached, so a repeat must still validate)
    t = torch.tensor(DEFAULT_SIGNS)
    assert torch.equal(hadamard16(x, t), hadamard16(x, DEFAULT_SIGNS))
    for _ in range(2):
        with pytest.raises(ValueError):
            hadamard16(x, torch.full((16,), 0.5))


@pytest.mark.parametrize("size", [1, 2, 4, 32, 128])
def test_general_transform_orthogonal_self_inverse(size):
    x = torch.randn(4, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(size))
    y = hadamard_transform(x, size)
    h = kron_hadamard(size) / size ** 0.5
    assert torch.allclose(y, (x.reshape(4, -1, size) @ h).reshape(4, 256), atol=1e-12)
    assert torch.allclose(hadamard_transform(y, size), x, atol=1e-12)


def test_general_transform_errors():
    with pytest.raises(ValueError):
        hadamard_transform(torch.ones(2, 48), 48)
    with pytest.raises(ValueError):
        hadamard_transform(torch.ones(2, 48), 32)
