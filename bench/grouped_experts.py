"""Tokens/s of the grouped expert computation against a Python loop over experts, same tokens.

    python -m bench.grouped_experts [--experts 8] [--tokens 2048] [--hidden 256] [--ffn 512] [--repeats 5]

An MoE block's experts see the routed tokens grouped by expert (``meshlm/models/moe/dispatch.py``)
and run as one grouped computation (``meshlm/models/moe/experts.py``: ``F.grouped_mm`` with the
group end offsets, one kernel per projection). The baseline is what a straightforward MoE does:
a Python loop over the experts. Two levels are timed, forward + backward (gradients of the
inputs and of every expert weight), on identical tokens, routing and weights:

- ``experts``: the expert MLPs alone on the permuted rows [n*k, d]: ``GroupedExperts`` with the
  grouped kernel vs the same module with its per-expert loop (one matmul per expert segment).
- ``layer``: the whole routed computation from the tokens [n, d] and the routing (top-k ids and
  weights) to the combined output [n, d]: ours (``plan_dispatch`` + ``permute`` + grouped
  experts + ``unpermute``) vs the loop of Hugging Face's Mixtral-style MoE block: for each
  expert, find its tokens, gather them, run that expert's MLP, scale by the routing weight and
  index_add the result back.

Each measurement runs ``--iterations`` forward+backward passes after a warm-up; the two sides
alternate ``--repeats`` times so machine noise hits both alike, and the medians are compared.
Prints one JSON object; ``ratio`` = grouped tokens/s / loop tokens/s (target >= 1.0 on CPU at
8 experts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshlm.models.config import ModelConfig
from meshlm.models.mlp import activate
from meshlm.models.moe.dispatch import permute, plan_dispatch, unpermute
from meshlm.models.moe.experts import GroupedExperts, grouped_mm_supported


def make_inputs(num_tokens: int, hidden: int, ffn: int, num_experts: int, top_k: int, seed: int = 0):
    """Experts (SwiGLU), tokens, and a softmax top-k routing of them."""
    torch.manual_seed(seed)
    config = ModelConfig(pattern="E", hidden_size=hidden, moe_num_experts=num_experts, moe_top_k=top_k,
                         moe_ffn_hidden_size=ffn, init_std=0.02)
    experts = GroupedExperts(config, model_size=hidden)
    tokens = torch.randn(num_tokens, hidden)
    probs = (tokens @ torch.randn(hidden, num_experts) * 0.1).softmax(-1)
    weights, expert_ids = probs.topk(top_k, dim=-1)
    return experts, tokens, expert_ids, weights


def grouped_layer(experts: GroupedExperts, tokens, expert_ids, weights) -> torch.Tensor:
    plan = plan_dispatch(expert_ids, weights, experts.up_weight.shape[0])
    rows = experts(permute(tokens, plan), plan.tokens_per_expert)
    return unpermute(rows, plan, weights, tokens.shape[0])


def loop_layer(experts: GroupedExperts, tokens, expert_ids, weights) -> torch.Tensor:
    """Mixtral-style: for each expert, gather its tokens, run its MLP, scale, index_add back."""
    output = torch.zeros_like(tokens)
    for expert in range(experts.up_weight.shape[0]):
        token_index, slot = torch.where(expert_ids == expert)
        if token_index.numel() == 0:
            continue
        x = tokens[token_index]
        gate = x @ experts.gate_weight[expert].T if experts.gate_weight is not None else None
        hidden = activate(experts.activation, x @ experts.up_weight[expert].T, gate)
        y = hidden @ experts.down_weight[expert].T
        output = output.index_add(0, token_index, y * weights[token_index, slot, None])
    return output


def seconds_per_pass(step, iterations: int) -> float:
    """Mean wall time of ``step()`` (forward + backward) over ``iterations`` runs."""
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    return (time.perf_counter() - started) / iterations


def experts_step(experts: GroupedExperts, rows: torch.Tensor, tokens_per_expert: torch.Tensor, grouped: bool):
    def step():
        experts.use_grouped_mm = grouped
        experts.zero_grad(set_to_none=True)
        rows.grad = None
        experts(rows, tokens_per_expert).square().mean().backward()
    return step


def layer_step(function, experts: GroupedExperts, tokens, expert_ids, weights):
    def step():
        experts.use_grouped_mm = None  # the grouped kernel where supported (the loop layer never uses it)
        experts.zero_grad(set_to_none=True)
        tokens.grad = weights.grad = None
        function(experts, tokens, expert_ids, weights).square().mean().backward()
    return step


def compare(steps: dict, work_tokens: int, repeats: int, iterations: int) -> dict:
    """Interleaved timings of the named steps; tokens/s medians and the grouped/loop ratio."""
    for step in steps.values():
        seconds_per_pass(step, 2)  # warm-up
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(seconds_per_pass(step, iterations))
    rates = {name: work_tokens / statistics.median(values) for name, values in times.items()}
    return {"tokens_per_s": {name: round(rate, 1) for name, rate in rates.items()},
            "median_ms": {name: round(1000 * statistics.median(values), 3) for name, values in times.items()},
            "ratio": round(rates["grouped"] / rates["loop"], 3)}


def run(num_experts: int, num_tokens: int, hidden: int, ffn: int, top_k: int, repeats: int, iterations: int) -> dict:
    experts, tokens, expert_ids, weights = make_inputs(num_tokens, hidden, ffn, num_experts, top_k)
    plan = plan_dispatch(expert_ids, weights, num_experts)
    rows = permute(tokens, plan).requires_grad_(True)
    tokens.requires_grad_(True)
    weights.requires_grad_(True)
    check_same_numbers(experts, tokens, expert_ids, weights)
    experts_result = compare({"grouped": experts_step(experts, rows, plan.tokens_per_expert, True),
                              "loop": experts_step(experts, rows, plan.tokens_per_expert, False)},
                             num_tokens, repeats, iterations)
    layer_result = compare({"grouped": layer_step(grouped_layer, experts, tokens, expert_ids, weights),
                            "loop": layer_step(loop_layer, experts, tokens, expert_ids, weights)},
                           num_tokens, repeats, iterations)
    return {"device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
            "experts": num_experts, "top_k": top_k, "tokens": num_tokens, "hidden": hidden, "ffn": ffn,
            "activation": "swiglu", "dtype": "fp32", "pass": "forward+backward",
            "grouped_mm_kernel": grouped_mm_supported(rows.detach(), experts.up_weight),
            "tokens_per_expert": plan.tokens_per_expert.tolist(),
            "expert_mlps": experts_result, "whole_routed_layer": layer_result, "target_ratio": 1.0}


def check_same_numbers(experts, tokens, expert_ids, weights) -> None:
    """Both sides compute the same output (else the timing compares different work)."""
    with torch.no_grad():
        experts.use_grouped_mm = None
        ours, theirs = grouped_layer(experts, tokens, expert_ids, weights), loop_layer(experts, tokens, expert_ids,
                                                                                      weights)
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6):
        raise AssertionError(f"grouped and loop outputs differ by {(ours - theirs).abs().max():.3g}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens routed (each to top-k experts)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="inner width of one expert")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timings per side (median reported)")
    parser.add_argument("--iterations", type=int, default=2, help="forward+backward passes per timing")
    args = parser.parse_args(argv)
    report = run(args.experts, args.tokens, args.hidden, args.ffn, args.top_k, args.repeats, args.iterations)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
