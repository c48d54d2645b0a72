"""Per-block widths (``meshlm prune --per-block``): each block keeps as many units as its scores earn.

Uniform Minitron pruning (``prune.py``) gives every block of a kind the same new size. Puzzle
(Bercovich et al. 2024) and Minitron's per-layer variants instead let blocks differ: a block whose
units all carry weight keeps more of them, one whose importance sits in a few units keeps fewer.
Here the requested size is the *average*: ``--ffn F`` gives the MLP blocks F x (their number)
neurons in all, and those are the units with the best scores over all MLP blocks together.

**Comparable scores.** Raw activation scores are not comparable between blocks (the residual
stream, and with it every activation, grows with depth), so each block's scores are divided by
the block's mean score before they are pooled: a unit then counts by how much it stands out in
its own block. A block whose scores are flat keeps more units than one whose scores are peaked;
equal scores everywhere give every block the same size, the uniform result. Ties go to the unit
of lower rank in its block, so they are spread evenly.

**Units that go together.** The pooled unit is what one block can add or remove while staying
valid: an MLP neuron; a whole GQA group (its KV head with ``--heads / --kv-heads`` query heads,
scored by the sum of its query heads); a *row* of Mamba heads (the j-th best head of every B/C
group, so each group keeps as many heads); a row of experts (one per router group).

**Floors.** Every block keeps at least 1/8 of its MLP neurons, one GQA group, one row of Mamba
heads and ``moe_top_k`` experts (enough router groups' worth for group-limited routing). The
embedding width is shared by all blocks, so ``--hidden`` stays uniform; an axis not asked for
keeps every block's size.
"""

from __future__ import annotations

import math

import torch

from meshlm.adapt.importance import Importance
from meshlm.adapt.prune import BlockSizes, Widths, block_sizes, original_widths, uniform_sizes
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig


def per_block_sizes(config: ModelConfig, importance: Importance, widths: Widths, blocks: list[int]) -> BlockSizes:
    """The kept ``blocks``' sizes: each pruned axis's total spread by pooled, normalised importance."""
    old, sizes = original_widths(config), uniform_sizes(config, widths, blocks)
    of_kind = {kind: [index for index in blocks if config.block_kinds[index] == kind] for kind in "-*ME"}
    if of_kind["-"] and widths.ffn_hidden_size != old.ffn_hidden_size:
        floors = {index: math.ceil(block_sizes(config, index)["ffn_hidden_size"] / 8) for index in of_kind["-"]}
        neurons = allocate({index: importance.neurons[index] for index in of_kind["-"]},
                           widths.ffn_hidden_size, floors, "--ffn", "neurons")
        for index, count in neurons.items():
            sizes[index]["ffn_hidden_size"] = count
    if of_kind["*"] and (widths.num_kv_heads, widths.num_attention_heads) != (old.num_kv_heads,
                                                                             old.num_attention_heads):
        attention_sizes(config, importance, widths, of_kind["*"], sizes, widths.num_kv_heads != old.num_kv_heads)
    if of_kind["M"] and widths.mamba_num_heads != old.mamba_num_heads:
        groups = config.mamba_num_groups
        heads = allocate({index: importance.mamba_heads[index] for index in of_kind["M"]}, widths.mamba_num_heads,
                         dict.fromkeys(of_kind["M"], groups), "--mamba-heads", "Mamba heads", groups)
        for index, count in heads.items():
            sizes[index]["mamba_num_heads"] = count
    if of_kind["E"] and widths.moe_num_experts != old.moe_num_experts:
        groups = config.moe_router_num_groups or 1
        floor = groups * math.ceil(config.moe_top_k / (config.moe_router_group_top_k or 1))
        experts = allocate({index: importance.experts[index] for index in of_kind["E"]}, widths.moe_num_experts,
                           dict.fromkeys(of_kind["E"], floor), "--experts", "experts", groups)
        for index, count in experts.items():
            sizes[index]["moe_num_experts"] = count
    return sizes


def check_per_block(config: ModelConfig, widths: Widths) -> None:
    """Refuse, before any forward, averages below the floors: the allocation with equal scores."""
    kinds = config.block_kinds
    sizes = {index: block_sizes(config, index) for index in range(config.num_blocks)}
    ones = {kind: {index: torch.ones(sizes[index][name]) for index in sizes if kinds[index] == kind}
            for kind, name in (("*", "num_attention_heads"), ("-", "ffn_hidden_size"), ("M", "mamba_num_heads"),
                               ("E", "moe_num_experts"))}
    flat = Importance(hidden=torch.ones(config.hidden_size), heads=ones["*"], neurons=ones["-"],
                      mamba_heads=ones["M"], experts=ones["E"])
    per_block_sizes(config, flat, widths, list(range(config.num_blocks)))


def attention_sizes(config: ModelConfig, importance: Importance, widths: Widths, blocks: list[int],
                    sizes: BlockSizes, spread_kv: bool) -> None:
    """KV groups spread over the attention ``blocks`` (when ``spread_kv``; else each keeps its own),
    each kept group with ``--heads / --kv-heads`` query heads."""
    per_group = widths.num_attention_heads // widths.num_kv_heads
    own = {index: block_sizes(config, index) for index in blocks}
    kv_heads = {index: own[index]["num_kv_heads"] for index in blocks}
    if spread_kv:
        groups = {index: importance.heads[index].reshape(kv_heads[index], -1).sum(dim=1) for index in blocks}
        kv_heads = allocate(groups, widths.num_kv_heads, dict.fromkeys(blocks, 1), "--kv-heads", "KV heads")
    for index, count in kv_heads.items():
        if per_group > own[index]["num_attention_heads"] // own[index]["num_kv_heads"]:
            raise ConfigError(f"--heads {widths.num_attention_heads} with --kv-heads {widths.num_kv_heads} gives each "
                              f"KV head {per_group} query heads, but block {index}'s have fewer (model."
                              "block_overrides); give fewer --heads.")
        sizes[index].update(num_kv_heads=count, num_attention_heads=count * per_group)


def allocate(scores: dict[int, torch.Tensor], average: int, floors: dict[int, int], flag: str, unit: str,
             groups: int = 1) -> dict[int, int]:
    """Units per block: ``average`` x (number of blocks) units in all, taken in rows of ``groups``
    (the j-th best unit of each of ``groups`` equal consecutive groups) by their score over the
    block's mean row score, best first, after each block's ``floors`` (in units)."""
    rows, floor_rows = {}, {}
    for index, block_scores in scores.items():
        row = block_scores.double().reshape(groups, -1).sort(dim=1, descending=True).values.sum(dim=0)
        mean = float(row.mean())
        rows[index] = (row / mean if mean > 0 else torch.ones_like(row)).tolist()
        floor_rows[index] = min(len(rows[index]), math.ceil(floors[index] / groups))
    budget, needed = average * len(scores) // groups, sum(floor_rows.values())
    if budget < needed:
        least = math.ceil(needed * groups / len(scores))
        raise ConfigError(f"{flag} {average} --per-block leaves {average * len(scores)} {unit} for {len(scores)} "
                          f"blocks, fewer than the {needed * groups} they keep at least (see meshlm/adapt/"
                          f"prune_blocks.py); give {flag} at least {least}.")
    if budget > sum(len(row) for row in rows.values()):
        raise ConfigError(f"{flag} {average} --per-block asks for more {unit} than the blocks have; give a smaller "
                          f"{flag}.")
    candidates = sorted((-round(score, 9), rank, index) for index, row in rows.items()
                        for rank, score in enumerate(row) if rank >= floor_rows[index])
    counts = dict(floor_rows)
    for _, _, index in candidates[:budget - needed]:
        counts[index] += 1
    return {index: count * groups for index, count in counts.items()}


__all__ = ["allocate", "check_per_block", "per_block_sizes"]
