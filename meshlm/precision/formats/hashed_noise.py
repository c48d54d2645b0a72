"""Rounding noise that is a hash of the value being rounded: the same in every layout and on resume.

Stochastic rounding needs one uniform random number per element. Drawn from a stateful
generator, the number an element gets depends on how many the process drew before it: split a
gradient over tensor- or context-parallel ranks, or its micro-batches over data-parallel ranks,
and every element is rounded with a different number than in one process, and a resumed run
rounds differently from an uninterrupted one unless the generator state travels with the
checkpoint.

Here the number is *counter-based* (Salmon et al. 2011, "Parallel random numbers: as easy as 1,
2, 3"), as for dropout (``meshlm/models/dropout.py``, whose integer hash this reuses), but keyed
by *what is rounded* instead of where it sits in the run:

    u(e) = H(key, position of e inside its scaling block, bits of e's scaled fp32 value) / 2**32

    key       the recipe's seed, the optimizer step, the linear layer and which GEMM operand
              (``meshlm/precision/quantized_linear.py``): a fresh, independent draw per step
    position  0 .. block size - 1: the element's place inside its 1 x 16 block

Whatever rank holds an element, with whatever else, it computes the same bits for it, so a
tensor-, sequence-, context-, data- or pipeline-parallel run rounds exactly like one process, a
recomputed GEMM rounds like the first pass, and a resumed run like the uninterrupted one -- with
no generator state to save. Over keys (steps) each element still rounds up with probability
exactly its distance to the lower neighbour, so rounding stays unbiased. The price: within one
GEMM operand, two elements with bit-identical scaled values at the same place of their blocks
round the same way (their errors are correlated instead of independent). Distinct blocks have
distinct scales, so in practice that takes equal values in one 16-element block position of two
blocks that share a scale -- rare in gradients, and never a bias.
"""

from __future__ import annotations

import torch

from meshlm.models.dropout import MASK32, fold, fold_wide

TWO_TO_32 = 2.0**32


def noise_key(*coordinates: int) -> int:
    """Fold non-negative Python ints (seed, step, layer, operand) into one 32-bit key.

    The hash's integer operations run on Python ints here (they give the bits they give on int64
    tensors): no tensor is made, so no ``int(tensor)`` stops ``torch.compile``'s graph (a graph
    break in every quantized linear layer) or waits for a device."""
    state = 0
    for value in coordinates:
        state = fold_wide(state, int(value))
    return state


def hashed_uniform(scaled: torch.Tensor, positions: torch.Tensor, key: int) -> torch.Tensor:
    """Uniform numbers in [0, 1) (fp32, ``scaled``'s shape), one per element: a hash of ``key``,
    the element's ``positions`` (int64, broadcastable to ``scaled``) and the bits of its fp32 value."""
    bits = scaled.float().contiguous().view(torch.int32).long() & MASK32
    state = fold(torch.full((), key & MASK32, dtype=torch.int64, device=scaled.device), positions)
    return fold(state, bits).float() / TWO_TO_32


__all__ = ["hashed_uniform", "noise_key"]
