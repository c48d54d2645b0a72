"""Minitron pruning: keep a trained model's most important units and blocks, as a smaller model.

Minitron (Muralidharan et al. 2024; Sreenivas et al. 2024) compresses a trained model in two
steps: prune it by activation-based importance (``importance.py``), then recover the lost
quality by distilling from the original (forward KL on its logits; ``meshlm prune`` prints the
``meshlm train`` command). This file is the first step's surgery.

**Uniform widths.** Every block of a kind gets the same new size, so the result is an ordinary
model described by the usual config fields: ``hidden_size`` (embedding channels, cut in the
embedding, every norm, every projection's hidden side and the output head), query and KV heads of
attention, ``ffn_hidden_size`` (MLP neurons), Mamba heads, routed experts. In each block the
top-scoring units survive, in their original order, so a model pruned to its own shape is the
original, tensor for tensor.

**Per-block sizes** (``BlockSizes``). What survives is chosen block by block, so each block may
also keep its own number of units: ``prune_blocks.py`` (``meshlm prune --per-block``) spreads a
total over the blocks of a kind by importance, and the pruned config writes the blocks whose sizes
differ from the model's as ``model.block_overrides``. A model that already has overrides is cut
block by block with its own sizes (head_dim, KV heads, Mamba groups of each block); a uniform
size for an axis that some block overrides is refused (it might not fit that block).

**Grouped units.** Some units only exist in groups, and a group is kept or cut consistently:

- *GQA.* A KV head serves a group of r = heads / kv_heads query heads. The KV heads kept are the
  groups with the largest summed query-head scores; inside each kept group the best
  ``--heads / --kv-heads`` query heads stay (all r when the ratio is unchanged), so every kept
  query head still reads the KV head it was trained with. Query heads never move between groups.
- *Mamba-2 groups.* Head m reads B and C of group m // (H / G). The G groups all stay (B, C and
  their conv channels are not cut) and each keeps its best H' / G heads, so the head-to-group
  map and the per-group gated norm stay intact. A head is cut in every place it lives: its
  z, x and dt rows of the fused ``in_proj`` (layout z | x | B | C | dt), its x channels of the
  depthwise conv, ``dt_bias``, ``A_log``, ``D``, its channels of the gated norm and its columns
  of ``out_proj``.
- *Latent attention* (MLA): every query head has its own key and value head, so heads are cut
  alone: their rows of the query and key/value up-projections and their value columns of o. The
  latents, their norms and the shared rotary key stay whole.
- *Router groups* (``moe_router_num_groups``): each group keeps its best E' / groups experts.

**Depth** (``drop_blocks``): the blocks whose skipping costs least (``Importance.blocks``) are
removed and the pattern string shrinks (``"*-*-*-"`` minus block 2 is ``"*-*-"``; a stage
boundary '|' left with an empty stage goes too).

**A parameter budget** (``search_widths``). Minitron prefers width pruning to depth pruning at
equal size ("width before depth"), so a budget is met by widths alone (after any explicit
``drop_blocks``): the search tries every combination of eighths of hidden, FFN, KV groups (with
their query heads) and Mamba heads (experts only change when asked) that respects the
divisibility rules, keeps those within the budget and takes the one that keeps most importance --
the product over the pruned axes of the fraction of each axis's summed scores kept (averaged over
blocks) -- preferring more parameters on a tie. Minitron trains the best few candidates briefly
before choosing; this picks on importance alone.

Only the tensor names this file knows are sliced; any other name is refused rather than copied
with a shape that might be wrong.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass
from functools import partial

import torch

from meshlm.adapt.importance import Importance
from meshlm.checkpoint.model_files import expected_shapes, load_state_checked
from meshlm.checkpoint.safetensors_stream import PlannedTensor
from meshlm.errors import ConfigError
from meshlm.models.block import Block
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.norms import make_norm
from meshlm.models.pattern import STAGE_BOUNDARY, parallel_residual_pairs

FLAGS = {"hidden_size": "--hidden", "ffn_hidden_size": "--ffn", "num_attention_heads": "--heads",
         "num_kv_heads": "--kv-heads", "mamba_num_heads": "--mamba-heads", "moe_num_experts": "--experts"}
"""The width fields and the ``meshlm prune`` flag that sets each."""
KIND_OF = {"ffn_hidden_size": "-", "num_attention_heads": "*", "num_kv_heads": "*", "mamba_num_heads": "M",
           "moe_num_experts": "E"}
AXES = {"num_attention_heads": ("num_attention_heads", "num_kv_heads"),
        "num_kv_heads": ("num_attention_heads", "num_kv_heads"),
        "ffn_hidden_size": ("ffn_hidden_size",), "mamba_num_heads": ("mamba_num_heads",),
        "moe_num_experts": ("moe_num_experts",)}
"""The per-block fields a width field's pruning changes (query and KV heads move together)."""
BlockSizes = dict[int, dict[str, int]]
"""Original block index -> that block's new sizes: the ``BLOCK_OVERRIDE_FIELDS`` of its kind."""


@dataclass(frozen=True)
class Widths:
    """The new uniform sizes (every field set, for the kinds the model has)."""

    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    mamba_num_heads: int
    moe_num_experts: int


def original_widths(config: ModelConfig) -> Widths:
    return Widths(config.hidden_size, config.resolved_ffn_hidden_size, config.num_attention_heads,
                  config.resolved_num_kv_heads, config.resolved_mamba_num_heads, config.moe_num_experts)


def check_prunable(config: ModelConfig) -> None:
    if config.mtp_depth:
        raise ConfigError(f"the model has model.mtp_depth={config.mtp_depth}; meshlm prune does not cut "
                          "multi-token-prediction blocks yet, so prune a model without MTP.")


def resolve_widths(config: ModelConfig, requested: dict[str, int | None], per_block: bool = False) -> Widths:
    """The new sizes from the requested ones ({field: value or None to keep}), checked: a ConfigError
    names the flag, the value and the fix. Query heads default to whole GQA groups (the KV heads
    times the group size); with plain multi-head attention the KV heads follow the query heads.
    Uniform sizes (``per_block`` False) must not touch an axis that ``model.block_overrides`` sets."""
    check_prunable(config)
    old = original_widths(config)
    values = dataclasses.asdict(old)
    for name, value in requested.items():
        if value is None:
            continue
        kind = KIND_OF.get(name)
        if kind is not None and kind not in config.block_kinds:
            raise ConfigError(f"{FLAGS[name]} {value}: the model has no {kind!r} blocks (model.pattern="
                              f"{config.pattern!r}); leave {FLAGS[name]} out.")
        if not isinstance(value, int) or value < 1 or value > values[name]:
            raise ConfigError(f"{FLAGS[name]} {value} must lie in [1, {values[name]}] (the model's {name} is "
                              f"{values[name]}; pruning only removes units).")
        values[name] = value
    heads, kv_heads = requested.get("num_attention_heads"), requested.get("num_kv_heads")
    group = old.num_attention_heads // old.num_kv_heads
    if heads is not None and kv_heads is None:
        values["num_kv_heads"] = heads if group == 1 else old.num_kv_heads
    if kv_heads is not None and heads is None:
        values["num_attention_heads"] = kv_heads * group
    new = Widths(**values)
    if "*" in config.block_kinds:
        check_heads(new, group)
    if "M" in config.block_kinds and new.mamba_num_heads % config.mamba_num_groups:
        raise ConfigError(f"--mamba-heads {new.mamba_num_heads} must be a multiple of model.mamba_num_groups="
                          f"{config.mamba_num_groups} (every B/C group keeps the same number of heads).")
    if "E" in config.block_kinds:
        check_experts(config, new.moe_num_experts)
    if not per_block:
        check_overrides_untouched(config, old, new)
    return new


def check_overrides_untouched(config: ModelConfig, old: Widths, new: Widths) -> None:
    for name, axis in AXES.items():
        if getattr(new, name) == getattr(old, name):
            continue
        for index, overrides in config.block_overrides.items():
            touched = sorted(set(overrides) & set(axis))
            if touched:
                raise ConfigError(f"{FLAGS[name]} {getattr(new, name)}: block {index} has its own {touched[0]} "
                                  f"(model.block_overrides), so one size for every block might not fit it; add "
                                  f"--per-block, or leave {FLAGS[name]} out.")


def check_heads(new: Widths, group: int) -> None:
    heads, kv_heads = new.num_attention_heads, new.num_kv_heads
    if heads % kv_heads:
        raise ConfigError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads} (each KV head keeps a "
                          "whole group of query heads).")
    if heads // kv_heads > group:
        raise ConfigError(f"--heads {heads} with --kv-heads {kv_heads} gives each KV head {heads // kv_heads} query "
                          f"heads, but it has {group}; give --heads at most {kv_heads * group} (query heads never "
                          "move to another KV head).")


def check_experts(config: ModelConfig, experts: int) -> None:
    if experts < config.moe_top_k:
        raise ConfigError(f"--experts {experts} is below model.moe_top_k={config.moe_top_k}; keep at least "
                          f"{config.moe_top_k} experts.")
    groups = config.moe_router_num_groups
    if groups and experts % groups:
        raise ConfigError(f"--experts {experts} must be a multiple of model.moe_router_num_groups={groups} "
                          "(every router group keeps the same number of experts).")
    if groups and experts // groups * config.moe_router_group_top_k < config.moe_top_k:
        raise ConfigError(f"--experts {experts} leaves too few experts in the {config.moe_router_group_top_k} "
                          f"eligible router groups for model.moe_top_k={config.moe_top_k}; keep more experts.")


# --- which units survive ------------------------------------------------------------------------
def top_per_group(scores: torch.Tensor, keep: int, groups: int = 1) -> torch.Tensor:
    """Indices of the ``keep // groups`` best scores in each of ``groups`` equal consecutive groups,
    ascending (ties go to the lower index)."""
    per_group = scores.reshape(groups, -1)
    order = torch.sort(per_group, dim=1, descending=True, stable=True).indices[:, :keep // groups]
    offsets = torch.arange(groups)[:, None] * per_group.shape[1]
    return (order + offsets).flatten().sort().values


def select_heads(scores: torch.Tensor, kv_heads: int, old_kv_heads: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query heads, KV heads) kept: the KV groups with the largest summed query scores, and the
    best heads / kv_heads query heads inside each (see the module docstring)."""
    groups = scores.reshape(old_kv_heads, -1)
    kept_kv = top_per_group(groups.sum(dim=1), kv_heads)
    per_group = heads // kv_heads
    kept_queries = [kv * groups.shape[1] + top_per_group(groups[kv], per_group) for kv in kept_kv.tolist()]
    return torch.cat(kept_queries), kept_kv


@dataclass
class Selection:
    """What survives, by original index: embedding channels, blocks, and per kept block its units
    (and its new sizes)."""

    hidden: torch.Tensor
    blocks: list[int]
    sizes: BlockSizes
    heads: dict[int, torch.Tensor]
    kv_heads: dict[int, torch.Tensor]
    neurons: dict[int, torch.Tensor]
    mamba_heads: dict[int, torch.Tensor]
    experts: dict[int, torch.Tensor]


def block_sizes(config: ModelConfig, index: int) -> dict[str, int]:
    """Block ``index``'s resolved sizes (its ``block_overrides`` applied), the fields of its kind."""
    block, kind = config.for_block(index), config.block_kinds[index]
    if kind == "*" and block.attention_type == "mla":  # a key/value head per query head, widths of their own
        return {"num_attention_heads": block.num_attention_heads, "num_kv_heads": block.num_attention_heads}
    if kind == "*":
        return {"num_attention_heads": block.num_attention_heads, "num_kv_heads": block.resolved_num_kv_heads,
                "head_dim": block.resolved_head_dim}
    if kind == "-":
        return {"ffn_hidden_size": block.resolved_ffn_hidden_size}
    if kind == "M":
        return {"mamba_num_heads": block.resolved_mamba_num_heads}
    if kind == "E":
        return {"moe_num_experts": block.moe_num_experts, "moe_ffn_hidden_size": block.resolved_moe_ffn_hidden_size}
    return {}


def uniform_sizes(config: ModelConfig, widths: Widths, blocks: list[int]) -> BlockSizes:
    """Every kept block at ``widths`` on the axes they change; the axes they keep stay each block's own."""
    old, sizes = original_widths(config), {}
    for index in blocks:
        sizes[index] = block_sizes(config, index)
        for name in sizes[index]:
            if name in AXES and getattr(widths, name) != getattr(old, name):
                sizes[index][name] = getattr(widths, name)
    return sizes


def select(config: ModelConfig, importance: Importance, widths: Widths, drop_blocks: int = 0,
           sizes: BlockSizes | None = None) -> Selection:
    """The surviving units: ``sizes`` per block (default: ``widths`` for every block)."""
    blocks = kept_blocks(importance, config.num_blocks, drop_blocks)
    sizes = uniform_sizes(config, widths, blocks) if sizes is None else sizes
    selection = Selection(top_per_group(importance.hidden, widths.hidden_size), blocks, sizes, {}, {}, {}, {}, {})
    for index in blocks:
        kind, size = config.block_kinds[index], sizes[index]
        if kind == "*":
            selection.heads[index], selection.kv_heads[index] = select_heads(
                importance.heads[index], size["num_kv_heads"], config.for_block(index).resolved_num_kv_heads,
                size["num_attention_heads"])
        elif kind == "-":
            selection.neurons[index] = top_per_group(importance.neurons[index], size["ffn_hidden_size"])
        elif kind == "M":
            selection.mamba_heads[index] = top_per_group(importance.mamba_heads[index], size["mamba_num_heads"],
                                                         config.mamba_num_groups)
        elif kind == "E":
            selection.experts[index] = top_per_group(importance.experts[index], size["moe_num_experts"],
                                                     config.moe_router_num_groups or 1)
    return selection


def kept_blocks(importance: Importance, num_blocks: int, drop_blocks: int) -> list[int]:
    """All block indices but the ``drop_blocks`` whose skipping costs least."""
    check_drop_blocks(num_blocks, drop_blocks)
    if drop_blocks == 0:
        return list(range(num_blocks))
    if importance.blocks is None:
        raise ValueError("depth importance was not measured")
    dropped = torch.sort(importance.blocks, stable=True).indices[:drop_blocks].tolist()
    return [index for index in range(num_blocks) if index not in dropped]


def check_drop_blocks(num_blocks: int, drop_blocks: int) -> None:
    if not 0 <= drop_blocks < num_blocks:
        raise ConfigError(f"--drop-blocks {drop_blocks} must lie in [0, {num_blocks - 1}] (the model has "
                          f"{num_blocks} blocks and keeps at least one).")


# --- the pruned config ----------------------------------------------------------------------------
def pruned_config(config: ModelConfig, widths: Widths, blocks: list[int], sizes: BlockSizes | None = None) -> ModelConfig:
    """The model of the kept blocks at the new widths; every size spelled out (a derived size such as
    head_dim = hidden / heads must not move when hidden or heads do). A block whose ``sizes`` differ
    from these gets a ``block_overrides`` entry of the fields that differ (under its new index)."""
    sizes = uniform_sizes(config, widths, blocks) if sizes is None else sizes
    values = config.to_dict()
    values.update(hidden_size=widths.hidden_size, pattern=shrunk_pattern(config.pattern, blocks), block_overrides={})
    kinds = set(config.block_kinds)
    latent = config.attention_type == "mla"
    if "*" in kinds and latent:  # the head widths are the mla_* fields, which pruning keeps
        values.update(num_attention_heads=widths.num_attention_heads)
    elif "*" in kinds:
        values.update(num_attention_heads=widths.num_attention_heads, num_kv_heads=widths.num_kv_heads,
                      head_dim=config.resolved_head_dim)
    if "-" in kinds or "E" in kinds:
        values.update(ffn_hidden_size=widths.ffn_hidden_size)
    if "M" in kinds:
        values.update(mamba_num_heads=widths.mamba_num_heads)
    if "E" in kinds:
        values.update(moe_num_experts=widths.moe_num_experts, moe_ffn_hidden_size=config.resolved_moe_ffn_hidden_size)
    plain = ModelConfig.from_dict(values)
    overrides = {}
    for new_index, index in enumerate(blocks):
        default = block_sizes(plain, new_index)
        differing = {name: value for name, value in sizes[index].items() if value != default[name]
                     and not (latent and name == "num_kv_heads")}  # latent attention: the query heads say it
        if differing:
            overrides[new_index] = differing
    return ModelConfig.from_dict({**values, "block_overrides": overrides}) if overrides else plain


def shrunk_pattern(pattern: str, kept: list[int]) -> str:
    """``pattern`` with only the ``kept`` blocks; a '|' that would leave an empty stage is dropped."""
    kept_set, out, index = set(kept), [], 0
    for symbol in pattern:
        if symbol.isspace():
            continue
        if symbol == STAGE_BOUNDARY:
            if out and out[-1] != STAGE_BOUNDARY:
                out.append(symbol)
            continue
        if index in kept_set:
            out.append(symbol)
        index += 1
    return "".join(out).rstrip(STAGE_BOUNDARY)


# --- slicing the tensors ------------------------------------------------------------------------
BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)")


def heads_to_rows(heads: torch.Tensor, width: int) -> torch.Tensor:
    """The rows (or columns) of heads' channels in a [heads * width] dimension."""
    return (heads[:, None] * width + torch.arange(width)).flatten()


def tensor_indices(config: ModelConfig, name: str, selection: Selection) -> dict[int, torch.Tensor]:
    """{dim: kept indices} of the original tensor ``name`` (dims not named are kept whole)."""
    hidden = selection.hidden
    if name in ("embedding.weight", "output.weight"):
        return {1: hidden}
    if name.startswith("final_norm."):
        return {0: hidden}
    match = BLOCK_NAME.fullmatch(name)
    if match is None:
        raise ConfigError(f"meshlm prune does not know how to cut the tensor {name}; prune a model without it.")
    index, rest = int(match.group(1)), match.group(2)
    if rest.startswith(("norm.", "output_norm.")):
        return {0: hidden}
    kind = config.block_kinds[index]
    rest = rest.removeprefix("mixer.")
    rules = {"*": attention_indices, "-": mlp_indices, "M": mamba_indices, "E": moe_indices,
             "L": linear_indices}.get(kind)
    found = rules(config, rest, index, selection) if rules is not None else None
    if found is None:
        raise ConfigError(f"meshlm prune does not know how to cut the tensor {name}; prune a model without it.")
    return found


def attention_indices(config, rest, index, selection):
    if config.attention_type == "mla":
        return latent_attention_indices(config, rest, index, selection)
    width = config.for_block(index).resolved_head_dim
    queries = heads_to_rows(selection.heads[index], width)
    kv = heads_to_rows(selection.kv_heads[index], width)
    rows = {"q_proj": queries, "k_proj": kv, "v_proj": kv}
    module, _, parameter = rest.partition(".")
    if module in rows:
        return {0: rows[module], 1: selection.hidden} if parameter == "weight" else {0: rows[module]}
    if module == "o_proj":
        return {0: selection.hidden, 1: queries} if parameter == "weight" else {0: selection.hidden}
    if module in ("q_norm", "k_norm"):  # per head (model.qk_norm_per_head): a row per head, kept with it
        kept = selection.heads[index] if module == "q_norm" else selection.kv_heads[index]
        return {0: kept} if config.qk_norm_per_head else {}
    if rest == "sinks":  # one logit per query head (model.attention_sinks), kept with it
        return {0: selection.heads[index]}
    return None


def latent_attention_indices(config, rest, index, selection):
    """Multi-head latent attention (``meshlm/models/latent_attention.py``): a head is its rows of the
    query and key/value up-projections and its value columns of o; the latents, their norms and the
    shared rotary key are kept whole (only their hidden-side columns are cut)."""
    heads = selection.heads[index]
    key_width, value_width = config.resolved_head_dim, config.mla_v_head_dim
    module = rest.partition(".")[0]
    rules = {"q_proj": {0: heads_to_rows(heads, key_width), 1: selection.hidden},
             "q_a_proj": {1: selection.hidden}, "q_a_norm": {},
             "q_b_proj": {0: heads_to_rows(heads, key_width)},
             "kv_a_proj": {1: selection.hidden}, "kv_a_norm": {},
             "kv_b_proj": {0: heads_to_rows(heads, config.mla_qk_nope_head_dim + value_width)},
             "o_proj": {0: selection.hidden, 1: heads_to_rows(heads, value_width)}, "sinks": {0: heads}}
    return rules.get(module)


def mlp_indices(config, rest, index, selection, dense=True):
    """Dense MLP tensor rules; a shared expert (``dense`` False) keeps all its neurons."""
    neurons = selection.neurons[index] if dense else None
    rules = {"gate_proj.weight": {0: neurons, 1: selection.hidden}, "up_proj.weight": {0: neurons, 1: selection.hidden},
             "gate_proj.bias": {0: neurons}, "up_proj.bias": {0: neurons},
             "down_proj.weight": {0: selection.hidden, 1: neurons}, "down_proj.bias": {0: selection.hidden}}
    return {dim: kept for dim, kept in rules[rest].items() if kept is not None} if rest in rules else None


def mamba_indices(config, rest, index, selection):
    heads, width = selection.mamba_heads[index], config.mamba_head_dim
    inner = config.for_block(index).mamba_inner_size
    bc = 2 * config.mamba_num_groups * config.mamba_state_size   # B and C: never cut
    channels = heads_to_rows(heads, width)
    projection = torch.cat([channels, inner + channels, 2 * inner + torch.arange(bc), 2 * inner + bc + heads])
    conv = torch.cat([channels, inner + torch.arange(bc)])
    rules = {"in_proj.weight": {0: projection, 1: selection.hidden}, "in_proj.bias": {0: projection},
             "conv1d.weight": {0: conv}, "conv1d.bias": {0: conv},
             "dt_bias": {0: heads}, "A_log": {0: heads}, "D": {0: heads}, "norm.weight": {0: channels},
             "out_proj.weight": {0: selection.hidden, 1: channels}, "out_proj.bias": {0: selection.hidden}}
    return rules.get(rest)


def moe_indices(config, rest, index, selection):
    experts, hidden = selection.experts[index], selection.hidden
    latent = config.moe_latent_size is not None  # the experts then work at the latent width, not cut
    if rest.startswith("shared_expert."):
        return mlp_indices(config, rest.removeprefix("shared_expert."), index, selection, dense=False)
    rules = {"router.weight": {0: experts, 1: hidden}, "router.expert_bias": {0: experts}, "router.bias": {0: experts},
             "experts.gate_bias": {0: experts}, "experts.up_bias": {0: experts},
             "experts.down_bias": {0: experts} if latent else {0: experts, 1: hidden},
             "experts.gate_weight": {0: experts} if latent else {0: experts, 2: hidden},
             "experts.up_weight": {0: experts} if latent else {0: experts, 2: hidden},
             "experts.down_weight": {0: experts} if latent else {0: experts, 1: hidden},
             "latent_in_proj.weight": {1: hidden}, "latent_in_proj.bias": {}, "shared_expert_gate.weight": {1: hidden},
             "latent_out_proj.weight": {0: hidden}, "latent_out_proj.bias": {0: hidden}}
    return rules.get(rest)


def linear_indices(config, rest, index, selection):
    return {0: selection.hidden, 1: selection.hidden} if rest == "out_proj.weight" else None


def cut(tensor: torch.Tensor, indices: dict[int, torch.Tensor]) -> torch.Tensor:
    for dim, kept in indices.items():
        tensor = tensor.index_select(dim, kept.to(tensor.device))
    return tensor.contiguous()


def prune_plan(config: ModelConfig, stored: dict[str, tuple], read, importance: Importance, widths: Widths,
               drop_blocks: int = 0, sizes: BlockSizes | None = None) -> tuple[ModelConfig, dict[str, PlannedTensor]]:
    """(pruned config, plan of its tensors, each cut from ``read(name)`` when written) for the model
    whose tensors are ``stored`` ({name: (shape, dtype)}); ``sizes``: per-block sizes (default uniform)."""
    selection = select(config, importance, widths, drop_blocks, sizes)
    new_config = pruned_config(config, widths, selection.blocks, selection.sizes)
    renamed = {old: new for new, old in enumerate(selection.blocks)}
    shapes = expected_shapes(new_config)
    plan = {}
    for name, (shape, dtype) in stored.items():
        if config.tie_embeddings and name == "output.weight":
            continue
        match = BLOCK_NAME.fullmatch(name)
        if match is not None and int(match.group(1)) not in renamed:
            continue  # a dropped block
        new_name = name if match is None else f"blocks.{renamed[int(match.group(1))]}.{match.group(2)}"
        indices = tensor_indices(config, name, selection)
        new_shape = tuple(len(indices[dim]) if dim in indices else size for dim, size in enumerate(shape))
        if new_name not in shapes or tuple(shapes[new_name]) != new_shape:
            raise AssertionError(f"pruning {name} -> {new_name} {new_shape} does not match the pruned model "
                                 f"({tuple(shapes.get(new_name, ()))})")
        plan[new_name] = PlannedTensor(new_shape, dtype, partial(_cut_read, read, name, indices))
    missing = sorted(set(shapes) - set(plan))
    if missing:
        raise AssertionError(f"the pruned plan misses {missing}")
    return new_config, {name: plan[name] for name in shapes}


def _cut_read(read, name: str, indices: dict[int, torch.Tensor]) -> torch.Tensor:
    return cut(read(name), indices)


@torch.no_grad()
def prune_model(model: LanguageModel, importance: Importance, widths: Widths, drop_blocks: int = 0,
                sizes: BlockSizes | None = None) -> LanguageModel:
    """The pruned model, in memory (same dtypes as ``model``)."""
    state = {name: value.detach() for name, value in model.state_dict().items()}
    stored = {name: (tuple(value.shape), value.dtype) for name, value in state.items()}
    config, plan = prune_plan(model.config, stored, state.__getitem__, importance, widths, drop_blocks, sizes)
    with torch.device("meta"):
        pruned = LanguageModel(config)
    load_state_checked(pruned, {name: entry.produce() for name, entry in plan.items()}, "the pruned state")
    return pruned


# --- a parameter budget ---------------------------------------------------------------------------
class ParameterCounter:
    """Parameters of ``config``'s model pruned to some widths: the embedding, head and final norm,
    plus one block of each kind built on ``meta``, memoized by the sizes that kind depends on."""

    RELEVANT = {"*": ("num_attention_heads", "num_kv_heads"), "-": ("ffn_hidden_size",),
                "M": ("mamba_num_heads",), "E": ("moe_num_experts", "ffn_hidden_size")}

    def __init__(self, config: ModelConfig):
        self.config = config
        self.cache: dict[tuple, int] = {}

    def block(self, kind: str, widths: Widths) -> int:
        key = (kind, widths.hidden_size, *(getattr(widths, name) for name in self.RELEVANT.get(kind, ())))
        if key not in self.cache:
            config = pruned_config(self.config, widths, list(range(self.config.num_blocks)))
            with torch.device("meta"):
                self.cache[key] = sum(p.numel() for p in Block(kind, config, 0).parameters())
        return self.cache[key]

    def count(self, widths: Widths, kinds) -> int:
        config, hidden = self.config, widths.hidden_size
        with torch.device("meta"):
            norm = sum(p.numel() for p in make_norm(config.norm, hidden, config.norm_eps,
                                                    bias=config.norm_bias).parameters())
        total = config.vocab_size * hidden * (1 if config.tie_embeddings else 2) + norm
        if config.parallel_residual_shared_norm:  # each pair's feed-forward block applies its partner's norm
            total -= norm * len(parallel_residual_pairs(list(kinds)))
        return total + sum(self.block(kind, widths) for kind in kinds)

    def __call__(self, config: ModelConfig) -> int:
        """The parameters of ``config`` (the counter's own config, or a pruned one of it)."""
        if config.block_overrides:
            raise ValueError("ParameterCounter counts uniform models; this one has model.block_overrides")
        return self.count(original_widths(config), config.block_kinds)


def eighths(size: int, multiple: int = 1) -> list[int]:
    """Sizes k/8 of ``size`` (k = 1..8) rounded down to a multiple of ``multiple``, at least one multiple."""
    return sorted({max(multiple, size * k // 8 // multiple * multiple) for k in range(1, 9)})


def kept_fraction(scores: torch.Tensor, kept: torch.Tensor) -> float:
    total = float(scores.sum())
    return float(scores[kept].sum()) / total if total > 0 else 1.0


def search_widths(config: ModelConfig, importance: Importance, budget: int, fixed: dict[str, int | None],
                  drop_blocks: int = 0) -> tuple[Widths, int]:
    """The widths (and their parameter count) that keep most importance within ``budget``
    parameters; ``fixed`` sizes ({field: value}, as the flags give them) are not searched."""
    if config.block_overrides:
        raise ConfigError("--target-params: the model has model.block_overrides (per-block sizes), which the width "
                          "search does not count; give the sizes (--hidden, --ffn, ...) instead.")
    base = resolve_widths(config, fixed)
    blocks = kept_blocks(importance, config.num_blocks, drop_blocks)
    kinds = {config.block_kinds[index] for index in blocks}
    axes: dict[str, list] = {"hidden": [(h, kept_fraction(importance.hidden, top_per_group(importance.hidden, h)))
                                        for h in (eighths(config.hidden_size) if fixed.get("hidden_size") is None
                                                  else [base.hidden_size])]}
    if "-" in kinds:
        values = eighths(base.ffn_hidden_size) if fixed.get("ffn_hidden_size") is None else [base.ffn_hidden_size]
        axes["ffn"] = [(f, mean(kept_fraction(importance.neurons[i], top_per_group(importance.neurons[i], f))
                                for i in blocks if i in importance.neurons)) for f in values]
    if "*" in kinds:
        axes["attention"] = [(pair, attention_fraction(config, importance, blocks, *pair))
                             for pair in head_candidates(config, base, fixed)]
    if "M" in kinds:
        groups = config.mamba_num_groups
        values = (eighths(base.mamba_num_heads, groups) if fixed.get("mamba_num_heads") is None
                  else [base.mamba_num_heads])
        axes["mamba"] = [(m, mean(kept_fraction(importance.mamba_heads[i],
                                                top_per_group(importance.mamba_heads[i], m, groups))
                                  for i in blocks if i in importance.mamba_heads)) for m in values]
    count = ParameterCounter(config)
    kinds_kept = [config.block_kinds[index] for index in blocks]
    best, smallest = None, None
    for choice in itertools.product(*axes.values()):
        picked = dict(zip(axes, choice))
        widths = dataclasses.replace(base, hidden_size=picked["hidden"][0])
        if "ffn" in picked:
            widths = dataclasses.replace(widths, ffn_hidden_size=picked["ffn"][0])
        if "attention" in picked:
            heads, kv_heads = picked["attention"][0]
            widths = dataclasses.replace(widths, num_attention_heads=heads, num_kv_heads=kv_heads)
        if "mamba" in picked:
            widths = dataclasses.replace(widths, mamba_num_heads=picked["mamba"][0])
        parameters = count.count(widths, kinds_kept)
        kept = math.prod(fraction for _, fraction in choice)
        smallest = parameters if smallest is None else min(smallest, parameters)
        if parameters <= budget and (best is None or (kept, parameters) > best[:2]):
            best = (kept, parameters, widths)
    if best is None:
        raise ConfigError(f"--target-params {budget} is below the smallest model the width search reaches "
                          f"({smallest:,} parameters); give a larger budget, or also --drop-blocks.")
    return best[2], best[1]


def head_candidates(config: ModelConfig, base: Widths, fixed: dict) -> list[tuple[int, int]]:
    """(query heads, KV heads) pairs to try: whole GQA groups, eighths of the KV heads."""
    group = config.num_attention_heads // config.resolved_num_kv_heads
    if fixed.get("num_attention_heads") is not None or fixed.get("num_kv_heads") is not None:
        return [(base.num_attention_heads, base.num_kv_heads)]
    return [(kv * group, kv) for kv in eighths(config.resolved_num_kv_heads)]


def attention_fraction(config: ModelConfig, importance: Importance, blocks: list[int], heads: int,
                       kv_heads: int) -> float:
    fractions = [kept_fraction(importance.heads[i], select_heads(importance.heads[i], kv_heads,
                                                                 config.resolved_num_kv_heads, heads)[0])
                 for i in blocks if i in importance.heads]
    return mean(fractions)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 1.0


__all__ = ["FLAGS", "BlockSizes", "ParameterCounter", "Selection", "Widths", "block_sizes", "check_drop_blocks",
           "check_prunable", "kept_blocks", "original_widths", "prune_model", "prune_plan", "pruned_config",
           "resolve_widths", "search_widths", "select", "select_heads", "shrunk_pattern", "top_per_group",
           "uniform_sizes"]
