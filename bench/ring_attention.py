"""Ring attention's blocks through the fused kernel versus the explicit-matmul reference: time and memory.

    python -m bench.ring_attention [--chunks 1024 4096] [--dtypes fp32 bf16] [--repeats 3] [--threads 1]

One CP rank's attention work, in one process: the two chunks of c tokens it holds at cp = 1
make three blocks -- (chunk 0, chunk 0) causal, (1, 0) full, (1, 1) causal -- computed the way
``ring_attention`` computes every step (``meshlm/parallel/context/ring_attention.py``): each
block's partial result merged into fp32 accumulators (``merge_into``), then each block's
backward given the final output and lse, dQ/dK/dV summed in fp32. Two block paths
(``meshlm/models/block_attention.py``):

* ``fused``: ``block_forward``/``block_backward``, the fused attention kernel in the run's dtype
  (on CPU the CPU flash kernel; ``kernel`` says which ran);
* ``reference``: ``reference_block_forward``/``reference_block_backward`` on inputs cast to
  fp32 -- the explicit matmuls over the [c x c] scores that ring attention used before.

Per (chunk, dtype, path) it prints the median forward+backward time over ``repeats`` runs,
interleaved (fused, reference, fused, ...) so that drift in the machine's load hits both alike;
``largest_tensor_bytes``, the biggest tensor any op returned during forward+backward (a
``TorchDispatchMode`` sees every op's outputs, not a kernel's internal tiles); and
``block_saved_bytes``, what autograd keeps when one full block's forward is differentiated
directly (``saved_tensors_hooks``, unique storages, inputs included). Per (chunk, dtype),
``ring_saved_bytes`` is what the real ``ring_attention`` autograd function keeps for backward
(cp = 1 forward: q, k, v, the output it returns and the fp32 lse). Shapes: batch 1, 8 heads
(8 KV heads), head dim 64. ``ratios`` are reference / fused.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from meshlm.models.block_attention import (accumulation_dtype, block_backward, block_forward, fused_kernel,
                                                     reference_block_backward, reference_block_forward)
from meshlm.parallel.context.ring_attention import merge_into, ring_attention
from meshlm.parallel.mesh import ParallelContext
from tests.helpers.saved_tensors import LargestTensor, SavedStorages

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS, HEAD_DIM = 8, 64


def _reference_forward(query, key, value, causal, scale):
    wide = accumulation_dtype(query.dtype)
    return reference_block_forward(query.to(wide), key.to(wide), value.to(wide), causal, scale)


def _reference_backward(grad_out, query, key, value, out, lse, causal, scale):
    wide = accumulation_dtype(query.dtype)
    return reference_block_backward(*(tensor.to(wide) for tensor in (grad_out, query, key, value, out, lse)),
                                    causal, scale)


PATHS = {"fused": (block_forward, block_backward), "reference": (_reference_forward, _reference_backward)}


def rank_blocks(chunk: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) of the blocks of one rank's two chunks at cp = 1."""
    first, second = slice(0, chunk), slice(chunk, 2 * chunk)
    return [(first, first, True), (second, first, False), (second, second, True)]


def forward_and_backward(path: str, query, key, value, grad_out) -> None:
    """The ring's per-rank computation with one block path: merge in fp32, backward with final (out, lse)."""
    forward, backward = PATHS[path]
    blocks, scale = rank_blocks(query.shape[2] // 2), 1.0 / math.sqrt(query.shape[-1])
    wide = accumulation_dtype(query.dtype)
    out = torch.zeros(query.shape, dtype=wide)
    lse = torch.full(query.shape[:-1], float("-inf"), dtype=wide)
    for rows, cols, causal in blocks:
        merge_into(out, lse, rows, *forward(query[..., rows, :], key[..., cols, :], value[..., cols, :], causal, scale))
    output = out.to(query.dtype)
    grads = [torch.zeros(tensor.shape, dtype=wide) for tensor in (query, key, value)]
    for rows, cols, causal in blocks:
        dq, dk, dv = backward(grad_out[..., rows, :], query[..., rows, :], key[..., cols, :], value[..., cols, :],
                              output[..., rows, :], lse[..., rows], causal, scale)
        grads[0][..., rows, :] += dq
        grads[1][..., cols, :] += dk
        grads[2][..., cols, :] += dv


def saved_bytes(function, *inputs) -> int:
    """Bytes of the unique storages autograd saves for backward during ``function(*inputs)``."""
    leaves = [tensor.detach().requires_grad_() for tensor in inputs]
    with SavedStorages() as saved:
        function(*leaves)
    return saved.nbytes


def measure(chunk: int, dtype_name: str, repeats: int) -> dict:
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(0)
    query, key, value, grad_out = (torch.randn(1, HEADS, 2 * chunk, HEAD_DIM, generator=generator).to(dtype)
                                   for _ in range(4))
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(repeats):
        for path in PATHS:
            started = time.perf_counter()
            forward_and_backward(path, query, key, value, grad_out)
            seconds[path].append(time.perf_counter() - started)
    full_block = [tensor.contiguous() for tensor in (query[..., chunk:, :], key[..., :chunk, :], value[..., :chunk, :])]
    results = {}
    for path, (forward, _) in PATHS.items():
        with LargestTensor() as largest:
            forward_and_backward(path, query, key, value, grad_out)
        results[path] = {
            "forward_backward_s_median": round(statistics.median(seconds[path]), 4),
            "forward_backward_s_all": [round(value, 4) for value in seconds[path]],
            "largest_tensor_bytes": largest.bytes,
            "block_saved_bytes": saved_bytes(lambda q, k, v, forward=forward: forward(q, k, v, False, 0.125),
                                             *full_block),
        }
    ring_saved = saved_bytes(lambda q, k, v: ring_attention(q, k, v, ParallelContext()), query, key, value)
    fused, reference = results["fused"], results["reference"]
    return {
        "chunk": chunk, "dtype": dtype_name, "kernel": getattr(fused_kernel(query, key), "name", "reference"),
        "paths": results, "ring_saved_bytes": ring_saved,
        "ratios": {
            "time_reference_over_fused": round(reference["forward_backward_s_median"]
                                               / fused["forward_backward_s_median"], 3),
            "largest_tensor_reference_over_fused": round(reference["largest_tensor_bytes"]
                                                         / fused["largest_tensor_bytes"], 2),
            "block_saved_reference_over_fused": round(reference["block_saved_bytes"] / fused["block_saved_bytes"], 2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(chunk, dtype, args.repeats) for chunk in args.chunks for dtype in args.dtypes]
    print(json.dumps({"device": "cpu", "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
                      "batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
