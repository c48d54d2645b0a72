"""Tensor- and sequence-parallel MoE against the single-process block, in real gloo processes.

One spawned world of 4 ranks runs every case at tp 2 (two TP groups side by side) and tp 4,
sequence parallelism off and on: top-1 and top-2, softmax (before and after top-k) and sigmoid
routers (with a non-zero expert bias), a shared expert with and without its gate, capacity
dropping by both policies, LatentMoE with biases, and non-zero aux and z-loss coefficients. Every rank builds the full block
(or model) from a seed, computes the single-process reference itself, then splits a copy with
``parallelize_moe`` (or ``parallelize_model``) and compares the output, the losses, the expert
traffic and dropped count, the input gradient and every parameter gradient (shards gathered to
full, partial gradients summed over the group). The parent asserts relative errors <= 1e-5 and
that the integer statistics are equal.
"""

import copy

import torch
import torch.distributed as dist

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.moe.layer import MoELayer
from meshlm.parallel.mesh import build_parallel_context
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.tensor.moe import parallelize_moe
from meshlm.parallel.tensor.sharding import gather_full_tensor, reduce_partial_tp_grads
from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_checks import assert_all_within_tolerance, seeded, sequence_slice

TOLERANCE = 1e-5
BATCH, SEQ, HIDDEN = 2, 16, 32
AUX_COEFF, Z_COEFF = 0.3, 0.05

LAYER_CASES = {
    "softmax top-2, gated shared expert": dict(moe_shared_expert_ffn_hidden_size=32, moe_shared_expert_gate=True,
                                               moe_normalize_topk=True),
    "sigmoid top-1, expert bias": dict(moe_score_function="sigmoid", moe_top_k=1, moe_routed_scaling_factor=2.5),
    "top-k then softmax, squared relu": dict(moe_softmax_before_topk=False, mlp_activation="squared_relu"),
    "capacity 1.0 by probs": dict(moe_capacity_factor=1.0),
    "capacity 0.75 by position, sigmoid top-2": dict(moe_capacity_factor=0.75, moe_drop_policy="position",
                                                     moe_score_function="sigmoid", moe_normalize_topk=True),
    "latent, biases, shared expert": dict(moe_latent_size=16, mlp_bias=True, moe_shared_expert_ffn_hidden_size=32),
    "sequence aux loss, group-limited top-k": dict(moe_aux_loss_type="sequence", moe_router_num_groups=4,
                                                   moe_router_group_top_k=2),
    "gpt-oss: biased router and experts, clamped swiglu": dict(moe_softmax_before_topk=False, moe_router_bias=True,
                                                               moe_expert_linear_bias=True,
                                                               mlp_activation="clamped_swiglu", swiglu_limit=0.5),
}
MODEL_PATTERNS = ("*E*-", "ME")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach() - expected).abs().max() / expected.abs().max())


def make_config(**overrides) -> ModelConfig:
    values = dict(hidden_size=HIDDEN, pattern="E", vocab_size=64, moe_num_experts=8, moe_top_k=2,
                  moe_ffn_hidden_size=16, init_std=0.2, moe_aux_loss_coeff=AUX_COEFF, moe_z_loss_coeff=Z_COEFF)
    values.update(overrides)
    return ModelConfig(**values)


@torch.no_grad()
def perturb(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values in every parameter and in the sigmoid router's expert bias."""
    for index, param in enumerate(module.parameters()):
        param.add_(0.1 * seeded(*param.shape, seed=seed + index))
    for name, buffer in module.named_buffers():
        if name.endswith("expert_bias"):
            buffer.copy_(0.3 * seeded(*buffer.shape, seed=seed - 1))


def gradient_errors(parallel: torch.nn.Module, reference: torch.nn.Module, context) -> dict:
    """Relative error of every parameter gradient, shards gathered back to full."""
    reduce_partial_tp_grads(parallel, context)
    expected = dict(reference.named_parameters())
    errors = {}
    for name, param in parallel.named_parameters():
        full_grad = gather_full_tensor(param, param.grad, context)
        errors[f"grad {name}"] = relative_error(full_grad, expected[name].grad)
    assert set(errors) == {f"grad {name}" for name in expected}
    return errors


def layer_loss(layer, x, upstream):
    out, losses = layer(x, None)
    return out, losses, (out * upstream).sum() + AUX_COEFF * losses.aux_loss + Z_COEFF * losses.z_loss


def check_layer(context, overrides: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    reference = MoELayer(make_config(**overrides))
    perturb(reference, seed)
    parallel = parallelize_moe(copy.deepcopy(reference), context)
    x, upstream = seeded(BATCH, SEQ, HIDDEN, seed=seed), seeded(BATCH, SEQ, HIDDEN, seed=seed + 1)

    full_x = x.clone().requires_grad_()
    expected, expected_losses, expected_total = layer_loss(reference, full_x, upstream)
    expected_total.backward()
    local_x = sequence_slice(x, context).clone().requires_grad_()
    out, losses, total = layer_loss(parallel, local_x, sequence_slice(upstream, context))
    total.backward()

    if "capacity" in str(overrides):
        assert expected_losses.dropped_tokens > 0, "the capacity case must actually drop"
    assert torch.equal(losses.tokens_per_expert, expected_losses.tokens_per_expert)
    assert torch.equal(losses.dropped_tokens, expected_losses.dropped_tokens)
    flagged = {name for name, p in parallel.named_parameters() if getattr(p, "tp_partial_grad", False)}
    assert "router.weight" in flagged and not any(name.startswith("experts.") for name in flagged)
    if parallel.shared_expert_gate is not None:  # partial only when it reads a sequence slice
        assert ("shared_expert_gate.weight" in flagged) == context.sequence_parallel
    return {"output": relative_error(out, sequence_slice(expected.detach(), context)),
            "aux loss": relative_error(losses.aux_loss, expected_losses.aux_loss.detach()),
            "z loss": relative_error(losses.z_loss, expected_losses.z_loss.detach()),
            "input grad": relative_error(local_x.grad, sequence_slice(full_x.grad, context)),
            **gradient_errors(parallel, reference, context)}


def check_model(context, pattern: str, seed: int) -> dict:
    """A language model with MoE blocks split by parallelize_model: losses, traffic, gradients."""
    torch.manual_seed(seed)
    config = make_config(pattern=pattern, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                         mamba_head_dim=8, mamba_state_size=8, mamba_num_groups=4, mamba_chunk_size=5,
                         moe_shared_expert_ffn_hidden_size=32, moe_shared_expert_gate=pattern == "ME",
                         moe_capacity_factor=1.25)
    reference = LanguageModel(config)
    perturb(reference, seed)
    parallel = parallelize_model(copy.deepcopy(reference), context)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=generator)
    expected = reference(ids[:, :-1], ids[:, 1:], return_logits=False)
    expected.loss.backward()
    output = parallel(ids[:, :-1], ids[:, 1:], return_logits=False)
    output.loss.backward()
    for counts, expected_counts in zip(output.tokens_per_expert, expected.tokens_per_expert, strict=True):
        assert torch.equal(counts, expected_counts)
    return {**{f"loss {name}": relative_error(value, expected.losses[name].detach())
               for name, value in output.losses.items()},
            "loss": relative_error(output.loss, expected.loss.detach()),
            **gradient_errors(parallel, reference, context)}


def every_layout():
    """(label, context) for tp 2 and 4, SP off and on, in the world of 4 (tp 2: two TP groups)."""
    for tp in (2, 4):
        for sp in (False, True):
            yield f"tp={tp} sp={sp}", build_parallel_context(ParallelConfig(tp=tp, sp=sp), ModelConfig(),
                                                             torch.device("cpu"))


def run_layer_cases() -> dict:
    errors = {}
    for layout, context in every_layout():
        for label, overrides in LAYER_CASES.items():
            for quantity, error in check_layer(context, overrides, seed=len(errors)).items():
                errors[f"layer {label} {layout}: {quantity}"] = error
    dist.barrier()
    return errors


def run_model_cases() -> dict:
    errors = {}
    for layout, context in every_layout():
        for pattern in MODEL_PATTERNS:
            for quantity, error in check_model(context, pattern, seed=len(errors)).items():
                errors[f"model {pattern} {layout}: {quantity}"] = error
    dist.barrier()
    return errors


def test_parallel_moe_layer_matches_single_process():
    every_rank = run_distributed(run_layer_cases, 4)
    assert all(sum(case.endswith(": aux loss") for case in errors) == len(LAYER_CASES) * 4 for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)


def test_parallel_moe_models_match_single_process():
    every_rank = run_distributed(run_model_cases, 4)
    assert all(sum(case.endswith(": loss moe_aux") for case in errors) == len(MODEL_PATTERNS) * 4
               for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)
