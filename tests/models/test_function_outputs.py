"""distinct_output (meshlm/models/function_outputs.py): a compiled Function's outputs are tensors of their own."""

from __future__ import annotations

import torch
import torch._dynamo

from meshlm.models.function_outputs import distinct_output
from tests.helpers.compiled_graphs import GraphCounter, returned_tensors_aliasing_intermediates


def _doubling(returned):
    """A Function computing 2x, whose forward hands its result to ``returned`` (an identity or
    ``distinct_output``) after writing it into an empty tensor, as the SSD scan's PyTorch path did."""
    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return returned(torch.empty_like(x).copy_(x * 2))

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    return Doubling


def _compiled_gradient_and_findings(function):
    counter = GraphCounter()
    torch._dynamo.reset()
    x = torch.arange(3.0, requires_grad=True)
    torch.compile(lambda inputs: function.apply(inputs) * 1, backend=counter)(x).sum().backward()
    assert len(counter.graphs) == 1
    return x.grad, returned_tensors_aliasing_intermediates(counter.graphs[0])


def test_eagerly_the_tensor_itself():
    tensor = torch.ones(2, 3)
    assert distinct_output(tensor) is tensor


def test_an_output_copied_into_an_empty_tensor_is_found_and_distinct_output_gives_it_a_tensor_of_its_own():
    """The check sees the pattern on any torch (on torch 2.11 its gradient is then zeros); with
    ``distinct_output`` the Function returns a view of its own and the gradient is 2."""
    _, findings = _compiled_gradient_and_findings(_doubling(lambda tensor: tensor))
    assert len(findings) == 1 and "copy_" in findings[0] and "empty_like" in findings[0], findings
    gradient, findings = _compiled_gradient_and_findings(_doubling(distinct_output))
    assert findings == []
    assert torch.equal(gradient, torch.full((3,), 2.0))
