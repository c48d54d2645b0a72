"""meshlm/precision/formats/hashed_noise.py: the noise key is the dropout hash folded over Python ints."""

from __future__ import annotations

import random

import torch
import torch._dynamo

from meshlm.models.dropout import fold_wide
from meshlm.precision.formats.hashed_noise import hashed_uniform, noise_key


def test_noise_key_is_the_int64_tensor_hash_of_its_coordinates():
    rng = random.Random(0)
    for _ in range(500):
        coordinates = [rng.randrange(0, 2**40) for _ in range(rng.randint(1, 5))]
        state = torch.zeros((), dtype=torch.int64)
        for value in coordinates:
            state = fold_wide(state, value)
        key = noise_key(*coordinates)
        assert type(key) is int and 0 <= key < 2**32
        assert key == int(state), coordinates


def test_stochastic_rounding_noise_compiles_into_one_graph():
    """No tensor, so no ``int(tensor)``: a quantizer that makes its key compiles without a graph break
    (it broke the graph in every quantized linear layer's gradient GEMMs)."""
    def noise(scaled: torch.Tensor, step: int) -> torch.Tensor:
        return hashed_uniform(scaled, torch.arange(scaled.shape[-1]), noise_key(1234, step, 7, 2))

    scaled = torch.randn(4, 16)
    explanation = torch._dynamo.explain(noise)(scaled, 5)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    assert torch.equal(torch.compile(noise, backend="eager")(scaled, 5), noise(scaled, 5))
