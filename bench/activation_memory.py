"""Saved-activation memory of one transformer layer, measured, beside Korthikanti et al. (2022).

    python -m bench.activation_memory [--dtype bf16|fp32] [--activation swiglu|gelu]

A "layer" here is the attention block plus the MLP block of the pattern "*-" (one Megatron
transformer layer). During one forward of the layer, every tensor autograd saves for backward
passes through ``torch.autograd.graph.saved_tensors_hooks``; we record its storage (so views
and tensors saved twice count once) and leave out parameter storages. The sum is the layer's
activation memory between its forward and its backward. With recomputation the hook also sees
what ``torch.utils.checkpoint`` keeps: its inputs (q, k, v for selective; the block input for
full) -- the saves inside the checkpointed region are dropped.

Korthikanti et al. 2022 (§4.1, eq. 1 and §5) count, for fp16 activations, 1-byte dropout masks
and no parallelism, ``s*b*h*(34 + 5*a*s/h)`` bytes per layer and ``34*s*b*h`` with selective
recomputation. Our layer differs, and ``predicted_for_this_layer`` adds up its own terms (listed
in ``notes``) to show the measurement is understood. Two attention kernels are measured: 'math'
(scores and softmax materialized, the paper's setting) and 'default' (what SDPA picks; for
causal unpadded inputs on CPU that is a fused flash kernel, which never stores the scores; the
backward node found is reported as ``attention_backward_nodes``).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.training.recompute import apply_recompute
from tests.helpers.saved_tensors import SavedStorages

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SETTINGS = [(128, 2, 64, 4), (256, 2, 64, 4), (256, 1, 128, 8), (512, 1, 128, 4)]
"""(s, b, h, a): sequence length, micro-batch size, hidden size, attention heads."""
MODES = ("none", "selective", "full")
KERNELS = {"math": [SDPBackend.MATH], "default": None}


def build_layer(h: int, a: int, dtype: torch.dtype, activation: str) -> LanguageModel:
    torch.manual_seed(0)
    ffn = 4 * h if activation != "swiglu" else None
    config = ModelConfig(vocab_size=64, hidden_size=h, pattern="*-", num_attention_heads=a,
                         mlp_activation=activation, ffn_hidden_size=ffn)
    return LanguageModel(config).to(dtype)


def saved_bytes(model: LanguageModel, s: int, b: int, mode: str, kernel: str) -> tuple[int, list[str]]:
    """Bytes of unique non-parameter storages saved by one forward of the two blocks, and the
    names of the attention backward nodes (to report which kernel ran)."""
    apply_recompute(model, mode)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    dtype = model.embedding.weight.dtype
    hidden = torch.randn(b, s, model.config.hidden_size, dtype=dtype, requires_grad=True)
    context = SequenceContext.for_tokens(torch.zeros(b, s, dtype=torch.long))
    choice = sdpa_kernel(KERNELS[kernel]) if KERNELS[kernel] else contextlib.nullcontext()
    with choice, SavedStorages(parameter_storages) as saved:
        out = model.blocks[1](model.blocks[0](hidden, context), context)
    return saved.nbytes, attention_nodes(out)


def attention_nodes(out: torch.Tensor) -> list[str]:
    names, stack, seen = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Attention" in node.name() or node.name().startswith(("Bmm", "Softmax")):
            names.add(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sorted(names)


def paper_bytes(s: int, b: int, h: int, a: int, element_size: int) -> dict[str, float]:
    """Eq. 1 of Korthikanti et al. with its 2-byte terms rescaled to ``element_size``."""
    scale = element_size / 2
    return {"none": s * b * h * (32 * scale + 2) + a * s * s * b * (4 * scale + 1),
            "selective": s * b * h * (32 * scale + 2),
            "full": 2 * scale * s * b * h}


def predicted_for_this_layer(s, b, h, a, ffn, gated, element_size, kernel) -> dict[str, int]:
    """Our layer's own terms (see ``notes``), in bytes."""
    n, e, d = s * b * h, element_size, h // a
    norms = 2 * (8 * n + 4 * s * b + (4 * h if e != 4 else 0))  # fp32 copy of x, fp32 x*rstd, rstd, fp32 w
    rope = (4 if e != 4 else 2) * b * s * d * e  # cos and sin, cast once for q and once for k
    projections = 3 * e * n  # qkv input, o_proj input, MLP input (gate and up share it)
    mlp = (4 if gated else 2) * e * ffn * s * b  # silu input, silu(gate), up, down input | act input, down input
    outside_core = norms + rope + projections + mlp
    if kernel == "math":  # CPU math SDPA computes in fp32: q, k, v copies and the probabilities
        core = 12 * n + 4 * a * s * s * b
    else:  # flash: q, k, v and the fp32 log-sum-exp; its output is the o_proj input (same storage)
        core = 3 * e * n + 4 * a * s * b
    return {"none": outside_core + core, "selective": outside_core + 3 * e * n, "full": 2 * e * n}


NOTES = [
    "paper_bytes is eq. 1 with its 2-byte terms rescaled to the run's element size (dropout masks "
    "stay 1 byte); paper_formula_fp16_bytes is the formula as printed. predicted_for_this_layer "
    "adds up the terms below and equals measured_bytes exactly at every setting.",
    "Paper: fp16 activations with dropout, GELU MLP of width 4h, LayerNorm, learned positions. "
    "Per s*b*h in bytes: LN inputs 2+2, QKV input 2, Q and K 4, V 2, out-proj input 2, attention "
    "dropout mask 1, MLP input 2, GELU input 8, fc2 input 8, MLP dropout mask 1 (= 34); per a*s^2*b: "
    "softmax output 2, its dropout mask 1, dropout output 2 (= 5).",
    "No dropout here: the two s*b*h masks (2 bytes) and the s^2 dropout mask and output (3 of the "
    "5 bytes per a*s^2*b) do not exist; the s^2 term is the softmax output alone.",
    "RMSNorm (ours, norms.py) computes in fp32 and autograd keeps the fp32 input copy and the fp32 "
    "normalized x (4 + 4 bytes per element) plus rstd [s,b] and an fp32 copy of the weight: 8 per "
    "s*b*h per norm instead of LayerNorm's 2 (a fused norm that saves x and rstd would bring it to 2).",
    "SwiGLU with inner width f*h: the shared gate/up input 2, silu input 2f, silu(gate) 2f, up 2f, "
    "down input 2f = 2 + 8f per s*b*h (f = 3 at h = 64 or 128 after rounding 8h/3 up to a multiple "
    "of 64, so 26) versus GELU's 2 + 16 + dropout 1 = 19; with --activation gelu it is 2 + 16 = 18.",
    "RoPE (absent in the paper's GPT): cos and sin [b, s, h/a] are cast to the activation dtype "
    "separately for q and for k and saved by the multiplications: 4 * 2/a per s*b*h in bf16.",
    "Math attention on CPU upcasts bf16 to fp32 inside SDPA, so it saves fp32 q*scale, k*scale, v "
    "(12 per s*b*h) and fp32 probabilities (4 per a*s^2*b) rather than 2-byte ones.",
    "Fused (flash) attention never stores the s^2 scores: it saves q, k, v and a log-sum-exp "
    "(4 bytes per a*s*b), and its output is the same storage as the o_proj input. With it, "
    "selective recomputation saves only the log-sum-exp -- the ratio is ~1 by design, as the "
    "5as/h term is already gone.",
    "Selective keeps q, k, v (the checkpoint's inputs, bf16) and drops everything saved inside "
    "the attention core. Full keeps each block's input: 2 blocks per '*-' layer, so 2 * 2 s*b*h "
    "in bf16 where Megatron's one-checkpoint-per-layer has 2.",
]


def run(dtype_name: str, activation: str) -> dict:
    dtype = DTYPES[dtype_name]
    element_size = torch.tensor([], dtype=dtype).element_size()
    results = []
    for s, b, h, a in SETTINGS:
        model = build_layer(h, a, dtype, activation)
        ffn = model.config.resolved_ffn_hidden_size
        paper = paper_bytes(s, b, h, a, element_size)
        for kernel in KERNELS:
            measured, nodes = {}, []
            for mode in MODES:
                measured[mode], found = saved_bytes(model, s, b, mode, kernel)
                nodes = nodes or found
            predicted = predicted_for_this_layer(s, b, h, a, ffn, activation == "swiglu", element_size, kernel)
            results.append({
                "s": s, "b": b, "h": h, "a": a, "ffn_hidden_size": ffn, "attention_kernel": kernel,
                "attention_backward_nodes": nodes,
                "measured_bytes": measured,
                "measured_per_sbh": {mode: round(value / (s * b * h), 4) for mode, value in measured.items()},
                "predicted_for_this_layer_bytes": predicted,
                "paper_bytes": paper,
                "paper_formula_fp16_bytes": {"none": s * b * h * (34 + 5 * a * s / h), "selective": 34 * s * b * h},
                "ratio_selective_over_none": {"measured": round(measured["selective"] / measured["none"], 4),
                                              "paper": round(paper["selective"] / paper["none"], 4)},
            })
    return {"dtype": dtype_name, "element_size_bytes": element_size, "activation": activation,
            "layer": "'*-': RMSNorm+attention (RoPE, MHA) block and RMSNorm+MLP block, no dropout, no parallelism",
            "paper": "Korthikanti et al. 2022, eq. 1 (none) and §5 (selective)",
            "results": results, "notes": NOTES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--activation", choices=["swiglu", "gelu"], default="swiglu")
    args = parser.parse_args()
    print(json.dumps(run(args.dtype, args.activation), indent=1))


if __name__ == "__main__":
    main()
