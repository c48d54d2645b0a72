"""The hardware FP8 GEMM against bf16 at the FP8 bench model's shapes, and what quantizing costs.

    python -m bench.fp8_gemms [--tokens 8192] [--hidden 2048] [--ffn 8192] [--repeats 20]
    python -m bench.fp8_gemms --device cpu --tokens 64 --hidden 64 --ffn 128   # the script, on a CPU

Issue 15 asks an FP8 training step to be at least 1.3x faster than bf16's on a linear-heavy dense
model (``bench.low_precision --model dense``: attention + MLP layers of hidden 2048 with a squared-
ReLU FFN of 8192, 8 x 1024 tokens a micro-batch). A step is more than its GEMMs, so the first
question is how much faster the GEMMs themselves are at those shapes, and what the recipe pays
to get FP8 operands. For each linear layer of one attention + MLP pair (q, k, v, o: hidden to
hidden; up: hidden to FFN; down: FFN to hidden) and each of its three GEMMs -- forward ``X W^T``,
data gradient ``dY W``, weight gradient ``dY^T X`` -- this times:

- ``bf16``: ``torch.mm`` on bf16 operands, the baseline;
- ``fp8_split``: ``torch._scaled_mm`` on per-tensor-scaled codes (E4M3, the gradient E5M2 as in
  the hybrid format), the split accumulator (``use_fast_accum=False``);
- ``fp8_fast``: the same with fast accumulation, which ``precision.fp8_fast_accumulation=fprop``
  (the default) uses for the forward GEMM;
- ``quantize``: what the recipe does to one operand before a GEMM (``Recipe.fp8_codes``: the amax,
  the scale, the cast), compiled on a GPU as under ``train.compile`` (eager on a CPU, where
  Inductor's compile would take longer than the bench).

Each time is the median over ``--repeats`` rounds of ``--calls`` back-to-back calls (the device
synchronized around a round, so launch gaps are amortized as in a step). Per layer pair it adds
up the bf16 GEMMs against the FP8 ones as a recipe runs them (forward fast, gradients split)
plus the quantizations (X and W forward -- X once for q, k and v, which share its cast --, dY
backward; transposes of the kept codes, which the recipe also pays, are left out: a lower bound
on FP8's cost). ``gemm_speedup`` is then the most
an FP8 step could gain if nothing but its GEMMs changed; the step's own ratio is
``bench.low_precision``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench.timing import time_kernel
from meshlm.precision.fp8_gemm import hardware_fp8_supported, scaled_matmul
from meshlm.precision.recipes import Recipe

GEMMS = ("forward", "dgrad", "wgrad")
ROLE_OF_OPERANDS = {"forward": ("activation", "weight"), "dgrad": ("gradient", "weight"),
                    "wgrad": ("gradient", "activation")}
"""The recipe's format role of each GEMM's two operands (the gradient E5M2, the others E4M3)."""


SHARE_Q_INPUT = ("k", "v")
"""Layers whose input is q's, already cast for q."""


def layer_linears(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one attention + MLP pair (multi-head attention)."""
    return {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "o": (hidden, hidden),
            "up": (hidden, ffn), "down": (ffn, hidden)}


def gemm_shape(gemm: str, tokens: int, in_features: int, out_features: int) -> tuple[int, int, int]:
    """(M, N, K) of ``gemm``: the product ``a [M, K] @ b [N, K]^T``."""
    if gemm == "forward":
        return tokens, out_features, in_features
    if gemm == "dgrad":
        return tokens, in_features, out_features
    return out_features, in_features, tokens  # wgrad: contraction over the tokens


def seconds_per_call(run, device: torch.device, calls: int, repeats: int) -> float:
    """Median over ``repeats`` rounds of ``calls`` back-to-back calls, per call, after one warm-up round."""
    def round_of_calls():
        for _ in range(calls):
            run()
    return statistics.median(time_kernel(round_of_calls, device, warmup=1, repeats=repeats)) / calls


def measure(device: torch.device, tokens: int, hidden: int, ffn: int, calls: int, repeats: int) -> dict:
    """The record the module docstring describes."""
    recipe = Recipe("fp8_tensorwise", fp8_gemm="hardware")
    codes = recipe.fp8_codes
    if device.type == "cuda":  # a graph per operand shape and role: never let Dynamo's limit send one back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        codes = torch.compile(recipe.fp8_codes, dynamic=False)
    generator = torch.Generator().manual_seed(0)

    def operand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator).to(device=device, dtype=torch.bfloat16)

    gemms, totals = {}, {"bf16_ms": 0.0, "fp8_ms": 0.0, "quantize_ms": 0.0}
    quantize_times = {}
    for name, (in_features, out_features) in layer_linears(hidden, ffn).items():
        for gemm in GEMMS:
            rows, cols, depth = gemm_shape(gemm, tokens, in_features, out_features)
            a, b = operand(rows, depth), operand(cols, depth)
            roles = ROLE_OF_OPERANDS[gemm]
            (a_codes, a_scale), (b_codes, b_scale) = codes(a, roles[0]), codes(b, roles[1])
            flops = 2 * rows * cols * depth
            entry = {"m_n_k": [rows, cols, depth],
                     "bf16_ms": 1e3 * seconds_per_call(lambda: a @ b.t(), device, calls, repeats)}
            for label, fast in (("fp8_split_ms", False), ("fp8_fast_ms", True)):
                entry[label] = 1e3 * seconds_per_call(
                    lambda: scaled_matmul(a_codes, a_scale, b_codes, b_scale, torch.bfloat16, verified=True,
                                          fast_accumulation=fast), device, calls, repeats)
            for key in ("bf16", "fp8_split", "fp8_fast"):
                entry[f"{key}_tflops"] = round(flops / (entry[f"{key}_ms"] / 1e3) / 1e12, 1)
            entry["fp8_split_speedup"] = round(entry["bf16_ms"] / entry["fp8_split_ms"], 3)
            entry["fp8_fast_speedup"] = round(entry["bf16_ms"] / entry["fp8_fast_ms"], 3)
            gemms[f"{name}.{gemm}"] = {key: round(value, 4) if isinstance(value, float) else value
                                       for key, value in entry.items()}
            totals["bf16_ms"] += entry["bf16_ms"]
            totals["fp8_ms"] += entry["fp8_fast_ms" if gemm == "forward" else "fp8_split_ms"]
        # what the recipe quantizes per layer: X and W forward, dY backward (each once: codes are
        # kept; q, k and v read one X, cast once for the three: precision/quantized_projections.py)
        for operand_name, (rows, cols), role in (("x", (tokens, in_features), "activation"),
                                                 ("w", (out_features, in_features), "weight"),
                                                 ("dy", (tokens, out_features), "gradient")):
            if operand_name == "x" and name in SHARE_Q_INPUT:
                continue
            tensor = operand(rows, cols)
            milliseconds = 1e3 * seconds_per_call(lambda: codes(tensor, role), device, calls, repeats)
            quantize_times[f"{name}.{operand_name}"] = {"shape": [rows, cols], "ms": round(milliseconds, 4)}
            totals["quantize_ms"] += milliseconds
    fp8_total = totals["fp8_ms"] + totals["quantize_ms"]
    return {"tokens": tokens, "hidden": hidden, "ffn": ffn, "calls": calls, "repeats": repeats,
            "gemms": gemms, "quantize": quantize_times,
            "layer_pair": {**{key: round(value, 3) for key, value in totals.items()},
                           "fp8_gemm_only_speedup": round(totals["bf16_ms"] / totals["fp8_ms"], 3),
                           "gemm_speedup": round(totals["bf16_ms"] / fp8_total, 3)}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens a micro-batch (the bench's 8 x 1024)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timed round")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; the median counts")
    parser.add_argument("--out", help="also write the JSON record to this file")
    args = parser.parse_args(argv)
    for name in ("tokens", "hidden", "ffn", "calls", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be at least 1")
    if not hardware_fp8_supported(args.device, "tensorwise", out_dtype=torch.bfloat16):
        parser.error(f"torch {torch.__version__} runs no tensorwise FP8 GEMM on {args.device}: nothing to time")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    record = {"bench": "fp8_gemms", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__,
              **measure(device, args.tokens, args.hidden, args.ffn, args.calls, args.repeats)}
    text = json.dumps(record, indent=1)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
