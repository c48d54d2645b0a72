"""Sliding-window attention's chunked core against full causal attention: time and memory.

    python -m bench.sliding_window [--seqs 2048 8192] [--windows 256 1024] [--repeats 5] [--threads 2]
                                   [--device cpu] [--out bench/results/sliding_window_cpu.json]

One attention layer's core, forward and backward, batch 1, 8 query heads over 2 KV heads of 64
channels, fp32 on a CPU (bf16 on a GPU), three ways in the same run, interleaved so machine noise
hits each alike (``bench/timing.py``; medians of ``repeats``):

* ``full_causal``: ``F.scaled_dot_product_attention(is_causal=True)`` over the whole sequence --
  the baseline, what a layer without a window costs;
* ``windowed``: ``meshlm.models.attention.windowed_attention`` (chunks of w queries against the
  2w keys of their chunk and the one before, one band mask shared by all chunks);
* ``dense_band_mask``: SDPA with the whole [s, s] band mask, the obvious way to get the same
  numbers (and the way transformers' SDPA path does it);
* ``fused_windowed``: ``meshlm.models.sink_attention.fused_windowed_attention``, what a layer
  without a soft cap runs (``attention.causal_attention``): the same chunks as two *causal* blocks
  each on the fused kernel that returns each row's log-sum-exp, merged by it, no mask.

Per (seq, window) it prints the seconds of each, ``speedup_vs_full`` and ``speedup_vs_dense_mask``
(their seconds over the windowed core's), ``fused_speedup_vs_windowed`` (the band-mask core's
seconds over the fused one's), the bytes each keeps for backward (``saved_bytes``: distinct
storages autograd saves, ``tests/helpers/saved_tensors.py``), the largest tensor any op returned (a
``TorchDispatchMode`` sees op outputs, not a kernel's tiles), and the maximum difference between
the windowed core and the fused one and the dense band mask (they compute the same function). The chunked core does
2 s w scores where full causal attention does s^2 (s^2 / 2 of them useful), so it should win
once s is a few times w; below that the fused causal kernel's skipping of the upper triangle wins.

``generation``: the KV cache after a prompt of each ``--seqs`` length and 32 decoded tokens, for a
Gemma 3-shaped stack (12 attention blocks, five sliding to one full, window ``--cache-window``,
hidden 256, 4 KV heads of 64, fp32) against the same stack without
a window: bytes held (``InferenceCache.nbytes``, the buffers' capacity) and their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.attention_runs import add_run_options, emit, run_setting
from bench.timing import interleaved_medians, synchronize
from meshlm.models.attention import windowed_attention
from meshlm.models.sink_attention import fused_windowed_attention
from tests.helpers.saved_tensors import LargestTensor, SavedStorages

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def band_mask(seq: int, window: int, device) -> torch.Tensor:
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    return (distance >= 0) & (distance < window)


def cores(window: int, seq: int, device) -> dict:
    mask = band_mask(seq, window, device)
    return {
        "full_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "windowed": lambda q, k, v: windowed_attention(q, k, v, window),
        "dense_band_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "fused_windowed": lambda q, k, v: fused_windowed_attention(q, k, v, window),
    }


def inputs(seq: int, dtype, device):
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = [(1, HEADS, seq, HEAD_DIM), (1, KV_HEADS, seq, HEAD_DIM), (1, KV_HEADS, seq, HEAD_DIM)]
    return [torch.randn(shape, generator=generator, device=device, dtype=dtype, requires_grad=True)
            for shape in shapes]


def timed(core, tensors, grad_out, device):
    def run() -> float:
        synchronize(device)
        started = time.perf_counter()
        out = core(*tensors)
        torch.autograd.grad(out, tensors, grad_out)
        synchronize(device)
        return time.perf_counter() - started
    return run


def largest_bytes(core, tensors, grad_out) -> int:
    with LargestTensor() as largest:
        torch.autograd.grad(core(*tensors), tensors, grad_out)
    return largest.bytes


def saved_bytes(core, tensors) -> int:
    """Bytes of the storages autograd keeps for backward beyond the inputs' own."""
    with SavedStorages() as saved:
        out = core(*tensors)
    inputs = {tensor.untyped_storage().data_ptr() for tensor in tensors}
    del out
    return sum(size for pointer, size in saved.storages.items() if pointer not in inputs)


def measure(seq: int, window: int, repeats: int, dtype, device) -> dict:
    tensors = inputs(seq, dtype, device)
    grad_out = torch.randn(1, HEADS, seq, HEAD_DIM, device=device, dtype=dtype)
    runs = cores(window, seq, device)
    seconds = interleaved_medians({name: timed(core, tensors, grad_out, device) for name, core in runs.items()},
                                  repeats)
    with torch.no_grad():
        masked = runs["dense_band_mask"](*tensors)
        difference = float((runs["windowed"](*tensors) - masked).abs().max())
        fused_difference = float((runs["fused_windowed"](*tensors) - masked).abs().max())
    return {"seq": seq, "window": window, "seconds": seconds,
            "speedup_vs_full": seconds["full_causal"] / seconds["windowed"],
            "speedup_vs_dense_mask": seconds["dense_band_mask"] / seconds["windowed"],
            "fused_speedup_vs_windowed": seconds["windowed"] / seconds["fused_windowed"],
            "saved_bytes": {name: saved_bytes(core, tensors) for name, core in runs.items()},
            "largest_tensor_bytes": {name: largest_bytes(core, tensors, grad_out) for name, core in runs.items()},
            "max_difference_vs_dense_mask": difference, "fused_max_difference_vs_dense_mask": fused_difference}


@torch.no_grad()
def cache_bytes(prompt: int, window: int | None, new_tokens: int = 32) -> int:
    """Bytes of the KV cache of a small Gemma 3-shaped model after ``prompt`` tokens and ``new_tokens`` steps."""
    from meshlm.inference.decode_step import DecodeStep
    from meshlm.inference.prefill import prefill
    from meshlm.models.cache import InferenceCache
    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel

    fields = dict(sliding_window=window, sliding_window_pattern="SSSSSF") if window else {}
    model = LanguageModel(ModelConfig(vocab_size=256, hidden_size=256, pattern="*-" * 12, num_attention_heads=4,
                                      num_kv_heads=4, head_dim=64, **fields)).eval()
    ids = torch.randint(0, 256, (1, prompt))
    cache = InferenceCache(max_tokens=prompt + new_tokens)
    prefill(model, ids, None, cache, chunk_size=1024)
    step, token = DecodeStep(model), torch.tensor([1])
    for _ in range(new_tokens):
        token = step(token, cache).argmax(-1)
    return cache.nbytes


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024])
    add_run_options(parser)
    parser.add_argument("--cache-window", type=int, default=512)
    args = parser.parse_args(argv)
    device, dtype, header = run_setting(args)
    results = {**header, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "repeats": args.repeats,
               "runs": [measure(seq, window, args.repeats, dtype, device)
                        for seq in args.seqs for window in args.windows if window < seq]}
    results["generation"] = []
    for seq in args.seqs:
        windowed, full = cache_bytes(seq, args.cache_window), cache_bytes(seq, None)
        results["generation"].append({"prompt": seq, "window": args.cache_window, "pattern": "SSSSSF",
                                      "cache_bytes": windowed, "cache_bytes_without_window": full,
                                      "ratio": windowed / full})
    return emit(results, args.out)


if __name__ == "__main__":
    main()
