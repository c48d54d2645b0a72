"""blocks.py: cutting into blocks and back, ragged last blocks, the shape of per-block grids."""

import pytest
import torch

from meshlm.precision.formats.blocks import block_amax, block_grid, expand_grid, from_blocks, to_blocks


@pytest.mark.parametrize("shape, block", [((5, 7), (2, 3)), ((2, 3, 130), (1, 128)), ((130,), (1, 32)),
                                          ((40, 24), (16, 16)), ((16, 32), (16, 16))])
def test_round_trip_cuts_the_padding_off(shape, block):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    blocks = to_blocks(x, *block)
    assert blocks.shape[-3] == block[0] and blocks.shape[-1] == block[1]
    assert torch.equal(from_blocks(blocks, x.shape), x)


def test_a_ragged_last_block_holds_only_its_own_elements():
    x = torch.arange(1.0, 6.0).reshape(1, 5)  # [[1, 2, 3, 4, 5]] in blocks of 3: [1 2 3], [4 5]
    blocks = to_blocks(x, 1, 3)
    assert blocks.shape == (1, 1, 2, 3)
    assert block_grid(block_amax(blocks), 2).tolist() == [[3.0, 5.0]]
    assert blocks[0, 0, 1].tolist() == [4.0, 5.0, 0.0]  # zero padding: no effect on an amax


def test_grid_shapes_and_expand_is_the_inverse():
    x = torch.randn(3, 40, 24)
    grid = block_grid(block_amax(to_blocks(x, 16, 16)), x.dim())
    assert grid.shape == (3, 3, 2)
    assert torch.equal(block_grid(expand_grid(grid, 3), 3), grid)
    one_dim = torch.randn(70)
    grid_1d = block_grid(block_amax(to_blocks(one_dim, 1, 32)), 1)
    assert grid_1d.shape == (3,)
    assert grid_1d[2] == one_dim[64:].abs().max()
    assert expand_grid(grid_1d, 1).shape == (1, 1, 3, 1)


def test_a_2d_block_needs_two_dimensions():
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        to_blocks(torch.randn(32), 16, 16)
