"""hadamard.py: orthogonality, fixed signs, and an unchanged weight gradient without quantization."""

import pytest
import torch

from meshlm.precision.formats.hadamard import apply_blockwise, hadamard_matrix, random_hadamard_matrix, random_signs


def test_sylvester_matrix_is_symmetric_orthogonal_with_entries_a_quarter():
    hadamard = hadamard_matrix()
    assert hadamard.shape == (16, 16)
    assert torch.equal(hadamard.abs(), torch.full((16, 16), 0.25))
    assert torch.equal(hadamard, hadamard.T)
    assert torch.equal(hadamard @ hadamard.T, torch.eye(16))  # exact in fp32
    assert torch.allclose(hadamard_matrix(4, torch.float64) * 2,
                          torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]],
                                       dtype=torch.float64))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(12)


def test_random_signs_are_fixed_by_the_seed_and_the_matrix_stays_orthogonal():
    global_state = torch.get_rng_state()
    signs = random_signs()
    assert torch.equal(signs, random_signs()) and not torch.equal(signs, random_signs(seed=1))
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert torch.equal(torch.get_rng_state(), global_state)
    rotation = random_hadamard_matrix()
    assert torch.equal(rotation, signs[:, None] * hadamard_matrix())
    assert torch.equal(rotation @ rotation.T, torch.eye(16))
    assert torch.equal(rotation.T @ rotation, torch.eye(16))


def test_the_weight_gradient_is_unchanged_when_both_operands_are_transformed():
    generator = torch.Generator().manual_seed(0)
    grad_output = torch.randn(64, 24, generator=generator, dtype=torch.float64)  # [tokens, out]
    inputs = torch.randn(64, 40, generator=generator, dtype=torch.float64)       # [tokens, in]
    rotation = random_hadamard_matrix(dtype=torch.float64)
    weight_grad = grad_output.T @ inputs
    rotated = apply_blockwise(grad_output, rotation, dim=0).T @ apply_blockwise(inputs, rotation, dim=0)
    assert torch.allclose(rotated, weight_grad, rtol=0, atol=1e-12)


def test_apply_blockwise_is_a_block_diagonal_map_and_its_inverse_is_the_transpose():
    x = torch.randn(2, 48, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rotation = random_hadamard_matrix(dtype=torch.float64)
    block_diagonal = torch.block_diag(rotation, rotation, rotation)
    transformed = apply_blockwise(x, rotation, dim=1)
    assert torch.allclose(transformed, torch.einsum("ij,bjk->bik", block_diagonal.T, x), atol=1e-12)
    assert torch.allclose(apply_blockwise(transformed, rotation.T, dim=1), x, atol=1e-12)
    low_precision = apply_blockwise(x.to(torch.bfloat16), rotation, dim=1)
    assert low_precision.dtype == torch.bfloat16 and low_precision.shape == x.shape


def test_an_outlier_is_spread_over_its_block():
    x = torch.zeros(32)
    x[3] = 100.0
    transformed = apply_blockwise(x, random_hadamard_matrix())
    assert torch.equal(transformed[:16].abs(), torch.full((16,), 25.0))  # amax 100 -> 25
    assert torch.equal(transformed[16:], torch.zeros(16))


def test_a_length_not_a_multiple_of_16_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        apply_blockwise(torch.zeros(20, 3), random_hadamard_matrix(), dim=0)
