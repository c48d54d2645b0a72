"""Soft-capped attention (Gemma 2's ``attn_logit_softcapping``) and attention sinks (gpt-oss's): what
the explicit core they run costs, time and memory.

    python -m bench.softcap [--seqs 1024 4096] [--window 1024] [--repeats 5] [--threads 2]
                            [--device cpu] [--out bench/results/softcap_cpu.json]

One attention layer's core, forward and backward, batch 1, 8 query heads over 2 KV heads of 64
channels (Gemma 2 2B's grouping), fp32 on a CPU (bf16 on a GPU), three ways in the same run,
interleaved so machine noise hits each alike (``bench/timing.py``; medians of ``repeats``):

* ``uncapped_sdpa``: ``F.scaled_dot_product_attention(is_causal=True)`` -- the baseline, what the
  layer costs without a cap (the fused kernel, which has no hook for the cap);
* ``capped``: meshlm's core with ``softcap=50`` (``meshlm.models.attention.attention_core``:
  explicit scores, chunked over the queries under activation checkpointing, ``softcap.py``);
* ``capped_eager``: the same function written the obvious way, as transformers' eager Gemma 2
  attention does: the [s, s] scores, the tanh and the softmax kept by autograd for backward;
* ``sinks``: meshlm's core with a sink per head and no cap (``model.attention_sinks``, the same
  explicit core, ``meshlm/models/explicit_attention.py``).

Per sequence length it prints each one's seconds, the capped core's time over the baseline's
(``capped_over_uncapped``) and over the eager one's, the sinks' over the baseline's
(``sinks_over_uncapped``), the bytes each keeps for backward
(``saved_bytes``: distinct storages autograd saves, ``tests/helpers/saved_tensors.py``) and the
largest tensor any op returns, and the maximum difference between the capped core and the eager
one (they compute the same function). With ``--window`` the same for a sliding-window layer
(Gemma 2's other half), where the capped core keeps its chunked band structure.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.attention_runs import add_run_options, emit, run_setting
from bench.timing import interleaved_medians, synchronize
from meshlm.models.attention import allowed_keys, attention_core
from meshlm.models.softcap import soft_cap
from tests.helpers.saved_tensors import LargestTensor, SavedStorages

HEADS, KV_HEADS, HEAD_DIM, CAP = 8, 2, 64, 50.0


def capped_eager(query, key, value, window):
    """softmax(cap tanh(q k^T / sqrt(d) / cap) + mask) v with every [s, s] tensor kept by autograd."""
    group = HEADS // KV_HEADS
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = soft_cap(query @ key.transpose(-1, -2) * HEAD_DIM ** -0.5, CAP)
    allowed = allowed_keys(query.shape[2], key.shape[2], None, query.device, window=window)
    return torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1).to(value.dtype) @ value


def cores(window: int | None, sinks: torch.Tensor) -> dict:
    return {"uncapped_sdpa": lambda q, k, v: attention_core(q, k, v, window=window),
            "capped": lambda q, k, v: attention_core(q, k, v, window=window, softcap=CAP),
            "capped_eager": lambda q, k, v: capped_eager(q, k, v, window),
            "sinks": lambda q, k, v: attention_core(q, k, v, window=window, sinks=sinks)}


def inputs(seq: int, dtype, device):
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = [(1, HEADS, seq, HEAD_DIM), (1, KV_HEADS, seq, HEAD_DIM), (1, KV_HEADS, seq, HEAD_DIM)]
    # scores of a few tens, so the cap at 50 bends the largest
    return [(torch.randn(shape, generator=generator, device=device, dtype=dtype) * 3).requires_grad_()
            for shape in shapes]


def timed(core, tensors, grad_out, device):
    def run() -> float:
        synchronize(device)
        started = time.perf_counter()
        torch.autograd.grad(core(*tensors), tensors, grad_out)
        synchronize(device)
        return time.perf_counter() - started
    return run


def memory(core, tensors, grad_out) -> dict:
    inputs_storages = {tensor.untyped_storage().data_ptr() for tensor in tensors}
    with SavedStorages(excluded=inputs_storages) as saved, LargestTensor() as largest:
        out = core(*tensors)
        saved_bytes = sum(saved.storages.values())
        torch.autograd.grad(out, tensors, grad_out)
    return {"saved_bytes": saved_bytes, "largest_tensor_bytes": largest.bytes}


def measure(seq: int, window: int | None, repeats: int, dtype, device) -> dict:
    tensors = inputs(seq, dtype, device)
    grad_out = torch.randn(1, HEADS, seq, HEAD_DIM, device=device, dtype=dtype)
    runs = cores(window, torch.zeros(HEADS, device=device, dtype=dtype))
    seconds = interleaved_medians({name: timed(core, tensors, grad_out, device) for name, core in runs.items()},
                                  repeats)
    with torch.no_grad():
        difference = float((runs["capped"](*tensors) - runs["capped_eager"](*tensors)).abs().max())
        uncapped = float((runs["capped"](*tensors) - runs["uncapped_sdpa"](*tensors)).abs().max())
    return {"seq": seq, "window": window, "seconds": seconds,
            "capped_over_uncapped": seconds["capped"] / seconds["uncapped_sdpa"],
            "capped_over_eager": seconds["capped"] / seconds["capped_eager"],
            "sinks_over_uncapped": seconds["sinks"] / seconds["uncapped_sdpa"],
            "memory": {name: memory(core, tensors, grad_out) for name, core in runs.items()},
            "max_difference_vs_eager": difference, "max_difference_vs_uncapped": uncapped}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--window", type=int, default=1024, help="also a sliding-window layer (0: not)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    device, dtype, header = run_setting(args)
    windows = [None] + ([args.window] if args.window else [])
    results = {**header, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "cap": CAP,
               "repeats": args.repeats,
               "runs": [measure(seq, window, args.repeats, dtype, device)
                        for seq in args.seqs for window in windows if window is None or window < seq]}
    return emit(results, args.out)


if __name__ == "__main__":
    main()
