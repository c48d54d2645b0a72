"""meshlm/kernels/__init__.py: whether Triton is installed is answered inside a compiled block
without breaking its graph (the Mamba scan asks it per call on CUDA tensors).

torch 2.11 (the GPU machine's) refuses to trace ``importlib.util.find_spec`` ("Attempted to call
function marked as skipped"), so an unmarked ``triton_installed`` broke every compiled Mamba
block there; torch 2.13 happens to trace it. ``fullgraph=True`` turns a graph break into an error.
"""

from __future__ import annotations

import importlib.util

import torch
import torch._dynamo

from meshlm.kernels import triton_installed


def test_triton_installed_is_decided_inside_a_compiled_function():
    def pick(x):
        return x + 1 if triton_installed() else x - 1

    torch._dynamo.reset()
    out = torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(2))
    installed = importlib.util.find_spec("triton") is not None
    assert out.tolist() == ([1.0, 1.0] if installed else [-1.0, -1.0])
