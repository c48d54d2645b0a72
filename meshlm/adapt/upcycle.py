"""Upcycling: turn a trained dense model into a Mixture-of-Experts model that computes the same thing.

Training an MoE from scratch throws away what a dense checkpoint already knows. Sparse
upcycling (Komatsuzaki et al. 2022) copies the dense MLP into every expert; He et al. 2024
("Upcycling Large Language Models into Mixture of Experts") extend it to *fine-grained* experts
with "virtual group" initialization and weight scaling. Every dense MLP block ('-') becomes an
MoE block ('E'); everything else is copied unchanged.

**Shards.** A dense MLP is y = W_down phi(x), where phi(x) in R^F acts channel by channel
(phi_j = act(u_j . x), or silu(g_j . x) * (u_j . x) for SwiGLU). Cutting the F channels into G
consecutive shards S_1..S_G of width F/G splits it exactly into a sum of G narrower MLPs:

    y = sum_g W_down[:, S_g] phi_{S_g}(x) = sum_g D_g(x).

**Experts and virtual groups.** With granularity G, E experts of width F/G and top-K routing,
E = C*G and K = m*G. Expert e = c*G + g is a copy of shard g, for the C "virtual groups"
c = 0..C-1: each virtual group of G consecutive experts is one whole dense MLP. The router row
of every expert of group c is the same random vector r_c, so the G members of a group get equal
logits, scores and weights. Ties in the top-k go to the lower index and the members of a group
are consecutive, so the K chosen experts are exactly m whole virtual groups (those with the
best scores). The MoE output is then

    sum_{chosen c} sum_g w_c * alpha * D_g(x) = alpha * W(x) * y,   W(x) = sum_{chosen c} w_c,

where alpha scales the experts' down projections (the output is linear in them, for every
activation). The output equals the dense one at step 0 exactly when alpha * W(x) = 1:

- weights normalized over the K chosen (``moe_normalize_topk``, or top-k-then-softmax, with
  softmax or sigmoid scores) sum to the routed scaling factor s, shared equally by the G
  members of each group: W(x) = s / G for every x, so alpha = G / s and the output is *exact*.
  This is the default (softmax, top-k of the softmax, renormalized).
- unnormalized softmax-then-top-k (the paper's preferred router): w_c = s e^{l_c} / (G sum_c'
  e^{l_c'}) (the softmax runs over all E experts, G per group) depends on x. With equal logits
  every visit weighs s/E, so W = m s / E and alpha = E / (m s) = E G / (K s): the paper's (and
  Megatron's) scale E*G/K. The output matches only up to the spread of the logits, which a
  small ``router_init_std`` keeps small.
- unnormalized sigmoid: w_c = s sigmoid(l_c), about s/2 each, so alpha = 2 G / (K s), again
  approximate.

``visit_weight_at_equal_logits`` gives the per-visit weight w0 of each case, alpha =
G / (K w0), and ``is_exact`` says which case a config is in.

**Spread.** The C router vectors are orthogonal and of equal length (random directions; the
length of an N(0, std^2) vector), so for isotropic hidden states the C group logits are
independent and identically distributed and each token's m best groups are a uniform draw:
routing starts evenly spread over the virtual groups (independent Gaussian rows would not be:
their lengths differ, and the longer ones win more often). The members of a group travel
together until training breaks their tie. No capacity
limit is set (dropping a token would break the equality); routed experts have no biases, so a
dense model with ``mlp_bias`` cannot be upcycled exactly and is refused.

**One tensor at a time.** ``upcycle_plan`` describes the MoE model as a plan, {name:
PlannedTensor}: every dense tensor read and cast to fp32 when it is written, each stacked expert
tensor built from the one dense MLP weight it copies, the routers drawn up front (they are
small, and drawing them in block order keeps the seed's meaning). ``meshlm upcycle`` writes the
plan straight to disk, reading the dense model or checkpoint tensor by tensor, so it holds one
expert tensor and the dense weight it comes from, never either model; ``upcycle_model`` builds
the same plan into a model in memory.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import torch

from meshlm.checkpoint.model_files import expected_shapes, load_state_checked
from meshlm.checkpoint.safetensors_stream import PlannedTensor, planned
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.mlp import is_gated

ROUTING_DEFAULTS = dict(moe_score_function="softmax", moe_softmax_before_topk=True, moe_normalize_topk=True,
                        moe_routed_scaling_factor=1.0)
"""Upcycling's router unless overridden: the exact case (see the module docstring)."""

BALANCING_DEFAULTS = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
"""Router balancing unless chosen: Switch Transformer's load-balancing coefficient (Fedus et al.
2022) and ST-MoE's router z-loss (Zoph et al. 2022). The upcycled experts start as copies, so
nothing but a balancing term keeps training from sending every token to the few groups that
pull ahead (router collapse). Choosing ``moe_aux_loss_coeff`` or aux-loss-free balancing
(``moe_bias_update_rate``) replaces the first; ``moe_z_loss_coeff`` the second; a nonzero value
the dense config already carries is kept."""


def balancing_defaults(dense: ModelConfig, moe_overrides: dict) -> dict:
    """The entries of ``BALANCING_DEFAULTS`` that neither the overrides nor the dense config set."""
    chosen = set(moe_overrides)
    if "moe_bias_update_rate" in chosen or dense.moe_bias_update_rate:
        chosen.add("moe_aux_loss_coeff")  # aux-loss-free balancing was chosen instead
    return {name: value for name, value in BALANCING_DEFAULTS.items()
            if name not in chosen and not getattr(dense, name)}


def upcycled_config(dense: ModelConfig, num_experts: int, top_k: int, granularity: int = 1,
                    **moe_overrides) -> ModelConfig:
    """The MoE config: every '-' block becomes 'E' with experts of width F/G; moe_* overrides apply."""
    ffn = dense.resolved_ffn_hidden_size
    pattern_kinds = dense.block_kinds
    if "-" not in pattern_kinds:
        raise ConfigError(f"model.pattern={dense.pattern!r} has no dense MLP block ('-') to upcycle.")
    if "E" in pattern_kinds:
        raise ConfigError(f"model.pattern={dense.pattern!r} already has MoE blocks; upcycle a dense model.")
    if dense.mlp_bias:
        raise ConfigError("model.mlp_bias=true: routed experts have no biases, so the dense MLP cannot be "
                          "copied into them exactly; upcycle a model without MLP biases.")
    if granularity < 1 or ffn % granularity:
        raise ConfigError(f"--granularity {granularity} must divide the dense FFN width {ffn}.")
    if num_experts % granularity or top_k % granularity:
        raise ConfigError(f"--experts {num_experts} and --top-k {top_k} must be multiples of --granularity "
                          f"{granularity}: each token must visit whole virtual groups (all G shards of an MLP).")
    unknown = sorted(name for name in moe_overrides if not name.startswith("moe_"))
    if unknown:
        raise ConfigError(f"upcycle overrides must be moe_* model fields; got {', '.join(unknown)}.")
    values = dense.to_dict()
    values.update(ROUTING_DEFAULTS)
    values.update(balancing_defaults(dense, moe_overrides))
    values.update(pattern=dense.pattern.replace("-", "E"), moe_num_experts=num_experts, moe_top_k=top_k,
                  moe_ffn_hidden_size=ffn // granularity, moe_shared_expert_ffn_hidden_size=0,
                  moe_latent_size=None, moe_capacity_factor=None)
    values.update(moe_overrides)
    config = ModelConfig.from_dict(values)
    _check_groups_hold_whole_virtual_groups(config, granularity)
    return config


def _check_groups_hold_whole_virtual_groups(config: ModelConfig, granularity: int) -> None:
    if config.moe_latent_size is not None or config.moe_shared_expert_ffn_hidden_size:
        raise ConfigError("upcycling copies the dense MLP into routed experts at the hidden width; "
                          "leave moe_latent_size null and moe_shared_expert_ffn_hidden_size 0.")
    if config.moe_capacity_factor is not None:
        raise ConfigError("upcycling needs dropless routing (a dropped token breaks the equality); "
                          "leave moe_capacity_factor null.")
    if config.moe_router_num_groups is not None:
        group_size = config.moe_num_experts // config.moe_router_num_groups
        if group_size % granularity:
            raise ConfigError(f"moe_router_num_groups={config.moe_router_num_groups} makes router groups of "
                              f"{group_size} experts, not whole virtual groups of {granularity}.")


def visit_weight_at_equal_logits(config: ModelConfig) -> float:
    """The routing weight of one visit when all logits are equal (w0 in the module docstring)."""
    k, scale = config.moe_top_k, config.moe_routed_scaling_factor
    if is_exact(config):
        return scale / k
    if config.moe_score_function == "sigmoid":
        return scale / 2
    return scale / config.moe_num_experts


def is_exact(config: ModelConfig) -> bool:
    """Whether the chosen weights always sum to the scaling factor (the exact upcycling case)."""
    topk_then_softmax = config.moe_score_function == "softmax" and not config.moe_softmax_before_topk
    return config.moe_normalize_topk or topk_then_softmax


def down_projection_scale(config: ModelConfig, granularity: int) -> float:
    """alpha = G / (K * w0): what makes sum over a token's visits of w * alpha * D_g equal sum_g D_g."""
    return granularity / (config.moe_top_k * visit_weight_at_equal_logits(config))


@torch.no_grad()
def upcycle_plan(dense: ModelConfig, stored: dict[str, tuple], read: Callable[[str], torch.Tensor],
                 num_experts: int, top_k: int, granularity: int = 1, router_init_std: float | None = None,
                 seed: int = 0, **moe_overrides) -> tuple[ModelConfig, dict[str, PlannedTensor]]:
    """(MoE config, plan of its fp32 tensors) for the dense model whose tensors are ``stored``
    ({name: (shape, dtype)}) and read whole by ``read(name)``; see the module docstring."""
    config = upcycled_config(dense, num_experts, top_k, granularity, **moe_overrides)
    alpha = down_projection_scale(config, granularity)
    std = dense.init_std if router_init_std is None else router_init_std
    generator = torch.Generator().manual_seed(seed)
    plan = {}
    for name, (shape, _) in stored.items():
        if not (config.tie_embeddings and name == "output.weight"):
            plan[name] = PlannedTensor(tuple(shape), torch.float32, partial(_as_fp32, read, name))
    for index, kind in enumerate(dense.block_kinds):
        if kind == "-":
            prefix = f"blocks.{index}.mixer."
            for weight in ("up_proj.weight", "down_proj.weight", "gate_proj.weight"):
                plan.pop(prefix + weight, None)
            plan.update(expert_plan(stored, read, prefix, config, granularity, alpha))
            plan.update({name: planned(value) for name, value in
                         router_weights(prefix, config, granularity, std, generator).items()})
    shapes = expected_shapes(config)  # the plan is the MoE model's, tensor for tensor
    plan = {name: plan[name] for name in shapes}
    return config, plan


@torch.no_grad()
def upcycle_model(dense_model: LanguageModel, num_experts: int, top_k: int, granularity: int = 1,
                  router_init_std: float | None = None, seed: int = 0, **moe_overrides) -> LanguageModel:
    """The upcycled MoE model (fp32 weights) of ``dense_model``, in memory; see the module docstring."""
    state = {name: value.detach() for name, value in dense_model.state_dict().items()}
    stored = {name: (tuple(value.shape), value.dtype) for name, value in state.items()}
    config, plan = upcycle_plan(dense_model.config, stored, state.__getitem__, num_experts, top_k, granularity,
                                router_init_std, seed, **moe_overrides)
    with torch.device("meta"):
        model = LanguageModel(config)
    load_state_checked(model, {name: entry.produce() for name, entry in plan.items()}, "the upcycled state")
    return model


def _as_fp32(read: Callable[[str], torch.Tensor], name: str) -> torch.Tensor:
    return read(name).float()


def expert_plan(stored: dict[str, tuple], read: Callable[[str], torch.Tensor], prefix: str, config: ModelConfig,
                granularity: int, alpha: float) -> dict[str, PlannedTensor]:
    """The stacked expert weights replacing the dense MLP at ``prefix``: expert c*G + g is shard g
    (gate/up rows, down columns), its down projection times alpha."""
    names = {"up_weight": "up_proj.weight", "down_weight": "down_proj.weight"}
    if is_gated(config.mlp_activation):
        names["gate_weight"] = "gate_proj.weight"
    plan = {}
    for ours, dense_name in names.items():
        rows, columns = stored[prefix + dense_name][0]
        shape = (config.moe_num_experts, rows // granularity, columns) if ours != "down_weight" else \
            (config.moe_num_experts, rows, columns // granularity)
        plan[prefix + "experts." + ours] = PlannedTensor(shape, torch.float32, partial(
            expert_weight, read, prefix + dense_name, config, granularity, alpha if ours == "down_weight" else None))
    return plan


def expert_weight(read: Callable[[str], torch.Tensor], dense_name: str, config: ModelConfig, granularity: int,
                  alpha: float | None) -> torch.Tensor:
    """One stacked expert weight [E, ...] from one dense MLP weight: its G shards (rows of up/gate,
    or columns of down scaled by ``alpha``), repeated for each virtual group."""
    copies = config.moe_num_experts // granularity
    dense = read(dense_name).float()
    if alpha is None:
        shards = list(dense.chunk(granularity, dim=0))                      # G x [F/G, h]
    else:
        shards = [alpha * shard for shard in dense.chunk(granularity, dim=1)]  # G x [h, F/G]
    return torch.stack(shards * copies).contiguous()  # [E, ...]: shards 0..G-1, then again per group


def router_weights(prefix: str, config: ModelConfig, granularity: int, std: float,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One row per virtual group, repeated for its G members; a zero expert bias. The rows are
    orthogonal (when there are at most hidden_size of them) with the norm of an N(0, std^2) row."""
    copies = config.moe_num_experts // granularity
    rows = torch.nn.init.orthogonal_(torch.empty(copies, config.hidden_size), generator=generator)
    rows = rows * std * config.hidden_size ** 0.5
    return {prefix + "router.weight": rows.repeat_interleave(granularity, dim=0),
            prefix + "router.expert_bias": torch.zeros(config.moe_num_experts)}


def changed_fields(dense: ModelConfig, moe: ModelConfig) -> dict:
    """The model fields the upcycled config sets differently (for a ``meshlm train`` command line)."""
    before, after = dense.to_dict(), moe.to_dict()
    return {field.name: after[field.name] for field in dataclasses.fields(ModelConfig)
            if field.init and before[field.name] != after[field.name]}


__all__ = ["BALANCING_DEFAULTS", "ROUTING_DEFAULTS", "balancing_defaults", "changed_fields", "down_projection_scale",
           "expert_plan", "expert_weight", "is_exact", "router_weights", "upcycle_model", "upcycle_plan",
           "upcycled_config", "visit_weight_at_equal_logits"]
