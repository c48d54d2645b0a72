"""Expert-parallel MoE (folded onto tp / dp) against the single-process block, in real gloo processes.

Every rank builds the full block from a seed and computes the single-process reference of the
whole global batch itself: one micro-batch per data-parallel rank, losses summed. Then it splits
a copy over the expert grid (``parallelize_moe_block`` -> ``parallelize_expert_moe``), runs its own
micro-batch (its sequence slice under SP), and compares the output, the losses, the expert traffic
and dropped count, the input gradient and every parameter gradient, after the trainer's
reductions: TP-partial gradients summed over TP, dense gradients over dp_cp, expert gradients
over edp, shards gathered to full. Layouts on a world of 4 fold EP onto DP ranks, onto TP ranks
(with and without SP: without SP each TP rank takes 1/tp of the sequence) and ETP onto both,
with each dispatcher. Cases: top-1/top-2, softmax/sigmoid, a shared expert, capacity dropping by
both policies (dropping decided on the whole micro-batch, so identical across layouts), LatentMoE
with biases, the sequence-level balance loss, and a routing that leaves EP ranks without tokens.
Also: the expert shards carry their metadata, and a full state dict round-trips.
"""

import copy

import torch
import torch.distributed as dist

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.moe.layer import MoELayer
from meshlm.parallel.collective_checks import compare_collectives
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.context.context_parallel import slice_sequence
from meshlm.parallel.expert.expert_parallel import ExpertParallelMoELayer, expert_parallel_names
from meshlm.parallel.mesh import build_parallel_context
from meshlm.parallel.parallelize import parallelize_model, parallelize_moe_block
from meshlm.parallel.tensor.sharding import (gather_full_state_dict, gather_full_tensor, load_full_state_dict,
                                             reduce_partial_tp_grads, shard_tensor)
from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_checks import assert_all_within_tolerance, seeded

TOLERANCE = 1e-5
BATCH, SEQ, HIDDEN = 2, 8, 32
AUX_COEFF, Z_COEFF = 0.3, 0.05

LAYER_CASES = {
    "softmax top-2, gated shared expert": dict(moe_shared_expert_ffn_hidden_size=32, moe_shared_expert_gate=True,
                                               moe_normalize_topk=True),
    "sigmoid top-1, expert bias, sequence aux": dict(moe_score_function="sigmoid", moe_top_k=1,
                                                     moe_routed_scaling_factor=2.5, moe_aux_loss_type="sequence"),
    "capacity 1.0 by probs": dict(moe_capacity_factor=1.0),
    "capacity 0.75 by position, sigmoid top-2": dict(moe_capacity_factor=0.75, moe_drop_policy="position",
                                                     moe_score_function="sigmoid", moe_normalize_topk=True),
    "latent, biases, shared expert": dict(moe_latent_size=16, mlp_bias=True, moe_shared_expert_ffn_hidden_size=32),
    "experts 0-1 only (empty ranks)": dict(moe_score_function="sigmoid"),
}
LAYOUTS = {  # world 4
    "ep4": dict(ep=4),
    "ep2 etp2": dict(ep=2, etp=2),
    "tp2 ep2 etp1 (no sp)": dict(tp=2, ep=2, etp=1),
    "tp2 sp ep2 etp2": dict(tp=2, sp=True, ep=2),
    "tp2 sp ep4 etp1": dict(tp=2, sp=True, ep=4, etp=1),
    "tp2 etp1 (folding only)": dict(tp=2, etp=1),
    "cp2 ep2 edp2": dict(cp=2, ep=2),
    "tp2 sp cp2 ep4 etp1": dict(tp=2, sp=True, cp=2, ep=4, etp=1),
    "tp2 cp2 ep2 etp2 (no sp)": dict(tp=2, cp=2, ep=2, etp=2),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max()
    difference = (actual.detach() - expected).abs().max()
    return float(difference / scale) if scale > 0 else float(difference)


def sequence_slice(full: torch.Tensor, context) -> torch.Tensor:
    """This rank's tokens of a [b, s, ...] tensor in attention's layout: its CP chunks, then its SP slice."""
    local = slice_sequence(full, context)
    if not context.sequence_parallel:
        return local
    return shard_tensor(local, 1, [local.shape[1]], context.tp_rank, context.tp_size)


def make_config(**overrides) -> ModelConfig:
    values = dict(hidden_size=HIDDEN, pattern="E", vocab_size=64, moe_num_experts=8, moe_top_k=2,
                  moe_ffn_hidden_size=16, init_std=0.2, moe_aux_loss_coeff=AUX_COEFF, moe_z_loss_coeff=Z_COEFF)
    values.update(overrides)
    return ModelConfig(**values)


@torch.no_grad()
def perturb(module: torch.nn.Module, seed: int, favour_first_two: bool = False) -> None:
    """Non-trivial values in every parameter and expert bias (or a bias that sends every token to experts 0, 1)."""
    for index, param in enumerate(module.parameters()):
        param.add_(0.1 * seeded(*param.shape, seed=seed + index))
    for name, buffer in module.named_buffers():
        if name.endswith("expert_bias"):
            buffer.copy_(0.3 * seeded(*buffer.shape, seed=seed - 1))
            if favour_first_two:
                buffer[:2] += 100.0


def reduce_like_the_trainer(model: torch.nn.Module, context) -> None:
    """TP-partial gradients over TP, then dense gradients over dp_cp and expert gradients over edp."""
    reduce_partial_tp_grads(model, context)
    experts = expert_parallel_names(model)
    for name, param in model.named_parameters():
        group = context.edp_group if name in experts else context.dp_cp_group
        all_reduce_(param.grad, group)


def gradient_errors(parallel: torch.nn.Module, reference: torch.nn.Module, context) -> dict:
    reduce_like_the_trainer(parallel, context)
    expected = dict(reference.named_parameters())
    errors = {f"grad {name}": relative_error(gather_full_tensor(param, param.grad, context), expected[name].grad)
              for name, param in parallel.named_parameters()}
    assert set(errors) == {f"grad {name}" for name in expected}
    return errors


def layer_loss(layer, x, upstream, cp_size: int = 1):
    """Under CP each rank adds 1/cp of the router losses (what ``share_losses`` does in the trainer)."""
    out, losses = layer(x, None)
    return out, losses, (out * upstream).sum() + (AUX_COEFF * losses.aux_loss + Z_COEFF * losses.z_loss) / cp_size


def check_layer(context, label: str, overrides: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    reference = MoELayer(make_config(**overrides))
    perturb(reference, seed, favour_first_two="empty" in label)
    parallel = parallelize_moe_block(copy.deepcopy(reference), context)
    assert isinstance(parallel, ExpertParallelMoELayer)
    inputs = [seeded(BATCH, SEQ, HIDDEN, seed=seed + 10 * d) for d in range(context.dp_size)]
    upstreams = [seeded(BATCH, SEQ, HIDDEN, seed=seed + 10 * d + 1) for d in range(context.dp_size)]
    full_x = inputs[context.dp_rank].clone().requires_grad_()
    for index, (x, upstream) in enumerate(zip(inputs, upstreams)):  # the whole global batch
        mine = x.clone().requires_grad_() if index != context.dp_rank else full_x
        out, losses, total = layer_loss(reference, mine, upstream)
        total.backward()
        if index == context.dp_rank:
            expected, expected_losses = out.detach(), losses
    local_x = sequence_slice(inputs[context.dp_rank], context).clone().requires_grad_()
    out, losses, total = layer_loss(parallel, local_x, sequence_slice(upstreams[context.dp_rank], context),
                                    context.cp_size)
    total.backward()

    if "capacity" in label:
        assert expected_losses.dropped_tokens > 0, "the capacity case must actually drop"
    if "empty" in label:
        assert losses.tokens_per_expert[2:].sum() == 0, "every token must go to experts 0 and 1"
    counts = losses.tokens_per_expert.clone()  # this CP rank's tokens: summed over CP, the micro-batch's
    all_reduce_(counts, context.cp_group)
    assert torch.equal(counts, expected_losses.tokens_per_expert)
    assert torch.equal(losses.dropped_tokens, expected_losses.dropped_tokens)
    return {"output": relative_error(out, sequence_slice(expected, context)),
            "aux loss": relative_error(losses.aux_loss, expected_losses.aux_loss.detach()),
            "z loss": relative_error(losses.z_loss, expected_losses.z_loss.detach()),
            "input grad": relative_error(local_x.grad, sequence_slice(full_x.grad, context)),
            **gradient_errors(parallel, reference, context)}


def context_for(layout: dict, dispatcher: str = "all_to_all"):
    return build_parallel_context(ParallelConfig(moe_dispatcher=dispatcher, check_collectives=True, **layout),
                                  make_config(), torch.device("cpu"))


def run_layer_cases(layouts: list[str]) -> dict:
    errors = {}
    for layout in layouts:
        for dispatcher in ("all_to_all", "all_gather"):
            context = context_for(LAYOUTS[layout], dispatcher)
            for label, overrides in LAYER_CASES.items():
                for quantity, error in check_layer(context, label, overrides, seed=len(errors)).items():
                    errors[f"{label} {layout} {dispatcher}: {quantity}"] = error
                compare_collectives(context, f"after the {label} case at {layout} with {dispatcher}")
    dist.barrier()
    return errors


def test_expert_parallel_layer_on_dp_ranks_matches_single_process():
    layouts = ["ep4", "ep2 etp2"]
    every_rank = run_distributed(run_layer_cases, 4, layouts)
    assert all(sum(case.endswith(": aux loss") for case in errors) == len(LAYER_CASES) * len(layouts) * 2
               for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)


def test_expert_parallel_layer_folded_onto_tp_matches_single_process():
    layouts = ["tp2 ep2 etp1 (no sp)", "tp2 sp ep2 etp2", "tp2 sp ep4 etp1", "tp2 etp1 (folding only)"]
    every_rank = run_distributed(run_layer_cases, 4, layouts)
    assert all(sum(case.endswith(": aux loss") for case in errors) == len(LAYER_CASES) * len(layouts) * 2
               for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)


def test_expert_parallel_layer_folded_onto_cp_matches_single_process():
    layouts = ["cp2 ep2 edp2", "tp2 sp cp2 ep4 etp1", "tp2 cp2 ep2 etp2 (no sp)"]
    every_rank = run_distributed(run_layer_cases, 4, layouts)
    assert all(sum(case.endswith(": aux loss") for case in errors) == len(LAYER_CASES) * len(layouts) * 2
               for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)


GPT_OSS_EXPERTS = dict(moe_softmax_before_topk=False, moe_router_bias=True, moe_expert_linear_bias=True,
                       mlp_activation="clamped_swiglu", swiglu_limit=0.5)
"""gpt-oss's MoE block: a router with a bias, experts with biases and the clamped SwiGLU."""


def run_biased_expert_cases(layouts: list[str]) -> dict:
    errors = {}
    for layout in layouts:
        context = context_for(LAYOUTS[layout])
        for quantity, error in check_layer(context, "gpt-oss", GPT_OSS_EXPERTS, seed=len(errors)).items():
            errors[f"{layout}: {quantity}"] = error
        compare_collectives(context, f"after the gpt-oss case at {layout}")
    dist.barrier()
    return errors


def test_experts_with_biases_over_the_expert_grid_match_single_process():
    """Experts carry their biases over ep and etp (the down bias split on d), folded onto tp and cp."""
    layouts = ["ep2 etp2", "tp2 sp ep4 etp1", "tp2 cp2 ep2 etp2 (no sp)"]
    every_rank = run_distributed(run_biased_expert_cases, 4, layouts)
    assert all(sum(case.endswith("experts.down_bias") for case in errors) == len(layouts) for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)


def check_state_dict(layout: str) -> dict:
    """Metadata of the expert shards; gather_full_state_dict / load_full_state_dict round trip."""
    context = context_for(LAYOUTS[layout])
    torch.manual_seed(0)
    config = make_config(pattern="*E", num_attention_heads=4, moe_shared_expert_ffn_hidden_size=32,
                         attention_sinks=True, moe_router_bias=True, moe_expert_linear_bias=True)  # gpt-oss's too
    reference = LanguageModel(config)
    perturb(reference, 5)  # biases and sinks away from their zero start
    parallel = parallelize_model(copy.deepcopy(reference), context)
    experts = dict(parallel.named_parameters())["blocks.1.mixer.experts.down_weight"]
    full_state = gather_full_state_dict(parallel, context)
    errors = {name: relative_error(full_state[name], value) for name, value in reference.state_dict().items()}
    other = LanguageModel(config)
    perturb(other, 3)
    load_full_state_dict(parallelize_model(other, context), full_state, context)
    errors.update({f"reloaded {name}": relative_error(value, full_state[name])
                   for name, value in gather_full_state_dict(other, context).items()})
    down_bias = dict(parallel.named_parameters())["blocks.1.mixer.experts.down_bias"]
    return {"errors": errors, "local experts": experts.shape[0], "expert_parallel": experts.expert_parallel,
            "etp dim": getattr(experts, "expert_partition_dim", None), "ffn": experts.shape[2],
            "down bias": tuple(down_bias.shape), "down bias etp dim": getattr(down_bias, "expert_partition_dim", None)}


def run_state_dict_checks() -> dict:
    return {layout: check_state_dict(layout) for layout in ("ep4", "ep2 etp2", "tp2 sp ep2 etp2")}


def test_expert_shards_round_trip_the_full_state_dict():
    every_rank = run_distributed(run_state_dict_checks, 4)
    for results in every_rank:
        assert (results["ep4"]["local experts"], results["ep4"]["etp dim"], results["ep4"]["ffn"]) == (2, None, 16)
        assert (results["ep2 etp2"]["local experts"], results["ep2 etp2"]["etp dim"]) == (4, 2)
        assert results["ep2 etp2"]["ffn"] == 8 and results["ep4"]["expert_parallel"] is True
        # the experts' down bias [E, d]: whole experts over ep, its d split over etp (each rank adds its share)
        assert (results["ep4"]["down bias"], results["ep4"]["down bias etp dim"]) == ((2, 32), None)
        assert (results["ep2 etp2"]["down bias"], results["ep2 etp2"]["down bias etp dim"]) == ((4, 16), 1)
        for result in results.values():
            assert max(result["errors"].values()) == 0.0
