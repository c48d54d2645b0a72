"""Pipeline stages: which blocks each rank runs, and cutting the full model down to them.

The blocks are cut into pp * vp contiguous *virtual stages*; chunk c of pipeline rank r is
virtual stage c * pp + r (with vp = 1: rank r holds stage r). Where the cuts go:

* **marked**: ``model.pattern`` may mark the boundaries with ``|`` (``"M-M*|-M-E"``); then it
  must mark exactly pp * vp stages. A single process ignores the marks.
* **equal FLOPs** otherwise: the cuts that minimize the largest stage's forward FLOPs, from the
  model's own accounting (``meshlm/models/flops.py``, at ``train.seq_len``), the output head and
  the MTP depths counted on the last stage. (The embedding is a lookup: no FLOPs.) Each block
  counts with its own sizes (``model.block_overrides``), so a heterogeneous stack -- narrow
  FFNs, fewer KV heads, linear or no-op blocks -- is cut where the work, not the block count, is
  even; a no-op block weighs nothing.

Every virtual stage needs at least one block. The blocks ``model.parallel_residual`` runs side by
side share one input, so a stage holds both or neither (the cuts fall between pairs). The first
virtual stage also embeds the tokens; the last one also runs the final norm, the output head, the
loss and the MTP depths.

**One module per rank, single-process names.** Every rank builds the whole model on the
``meta`` device (and tensor-parallelizes it) as without pipelining, then ``keep_stage_modules``
deletes what its chunks do not run; only what is kept ever gets storage
(``meshlm/training/build.py``). The blocks it keeps stay at ``blocks.{global index}``, so parameter
names, checkpoints, the optimizer's groups and the gradient reducer are those of the single-
process model restricted to this rank; a chunk is just a list of block indices into that module.

**Tied embeddings across stages.** With ``tie_embeddings`` the output head is the embedding
matrix, and the MTP depths embed future tokens, so the last stage needs the embedding too. It
keeps its own copy, identical at initialization (drawn from the same (seed, name) generator), and after
each step's backward the copies' gradients are summed over the two ranks (``embedding_group``:
the first and last stage of one pipeline), so both take the same update (Megatron-LM's
"embedding group"; Narayanan et al. 2021). The last stage's copy is not counted in the global
gradient norm (``STAGE_COPY_NAMES``) and not saved twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.flops import head_flops, model_block_flops, mtp_flops
from meshlm.models.pattern import parallel_residual_pairs, parse_pattern
from meshlm.parallel.groups import Group, group_of
from meshlm.parallel.pipeline.schedules import check_microbatches

STAGE_COPY_NAMES = ("embedding.weight",)
"""Parameters the last stage holds a copy of (the first stage's value is the canonical one)."""


@dataclass(frozen=True)
class ModelChunk:
    """One virtual stage: a run of consecutive blocks."""

    virtual_stage: int
    num_virtual_stages: int
    blocks: tuple[int, ...]
    """Global block indices, in order."""

    @property
    def is_first(self) -> bool:
        """Embeds the tokens."""
        return self.virtual_stage == 0

    @property
    def is_last(self) -> bool:
        """Runs the head, the losses and the MTP depths."""
        return self.virtual_stage == self.num_virtual_stages - 1


def balanced_starts(costs: list[float], num_parts: int, last_extra: float = 0.0) -> list[int]:
    """Start indices of ``num_parts`` non-empty contiguous parts of ``costs`` whose largest sum
    (the last part plus ``last_extra``) is as small as possible (dynamic programming, exact)."""
    count = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[k][i]: smallest possible largest part when the first i items form k parts
    best = [[float("inf")] * (count + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (count + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for parts in range(1, num_parts + 1):
        for end in range(parts, count - (num_parts - parts) + 1):
            extra = last_extra if parts == num_parts else 0.0
            for start in range(parts - 1, end):
                largest = max(best[parts - 1][start], prefix[end] - prefix[start] + extra)
                if largest < best[parts][end]:
                    best[parts][end], cut[parts][end] = largest, start
    starts, end = [], count
    for parts in range(num_parts, 0, -1):
        end = cut[parts][end]
        starts.append(end)
    return starts[::-1]


def stage_starts(config, num_stages: int, seq_len: int) -> list[int]:
    """Index of the first block of each virtual stage (see the module docstring)."""
    marked = parse_pattern(config.pattern, "model.pattern").stage_starts
    paired = dict(parallel_residual_pairs(config.block_kinds)) if config.parallel_residual else {}
    if len(marked) > 1:
        if len(marked) != num_stages:
            raise ConfigError(f"model.pattern={config.pattern!r} marks {len(marked)} pipeline stages with '|', but "
                              f"parallel.pp * parallel.vp = {num_stages}; mark {num_stages} stages or remove the "
                              "'|' marks to split by FLOPs.")
        for first, second in paired.items():
            if second in marked:
                raise ConfigError(f"model.pattern={config.pattern!r} puts a pipeline-stage boundary between blocks "
                                  f"{first} and {second}, which model.parallel_residual runs side by side on one "
                                  "input; move that '|' before the attention block or after its partner.")
        return list(marked)
    # the units a stage is cut into: single blocks, and the pairs model.parallel_residual keeps together
    seconds = set(paired.values())
    units = [[index, paired[index]] if index in paired else [index]
             for index in range(config.num_blocks) if index not in seconds]
    if len(units) < num_stages:
        held = (f"{config.num_blocks} blocks make {len(units)} units a stage can hold (model.parallel_residual keeps "
                f"each of its {len(paired)} attention/partner pairs on one stage)" if paired
                else f"{config.num_blocks} blocks")
        raise ConfigError(f"model.pattern's {held}, fewer than the parallel.pp * parallel.vp = {num_stages} pipeline "
                          "stages; every stage needs a block (lower pp or vp).")
    costs = [flops.per_sequence for flops in model_block_flops(config, seq_len)]  # each block by its own sizes
    head = head_flops(config, seq_len) + mtp_flops(config, seq_len)
    starts = balanced_starts([sum(costs[index] for index in unit) for unit in units], num_stages, head)
    return [units[start][0] for start in starts]


def rank_chunks(config, pp_size: int, vp_size: int, pp_rank: int, seq_len: int) -> list[ModelChunk]:
    """This pipeline rank's model chunks: chunk c is virtual stage c * pp + pp_rank."""
    num_stages = pp_size * vp_size
    starts = stage_starts(config, num_stages, seq_len) + [config.num_blocks]
    return [ModelChunk(stage, num_stages, tuple(range(starts[stage], starts[stage + 1])))
            for stage in (chunk * pp_size + pp_rank for chunk in range(vp_size))]


def needs_embedding_copy(config) -> bool:
    """Whether the last stage uses the embedding matrix too (tied head, or MTP's future tokens)."""
    return bool(config.tie_embeddings or config.mtp_depth)


class StageBlocks(nn.ModuleDict):
    """The blocks one rank holds, under their global indices (``blocks.5...``); iterating yields
    the blocks in order and ``stage_blocks[5]`` is global block 5."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, index) -> nn.Module:
        return super().__getitem__(str(index))


@dataclass
class StageLayout:
    """What a pipeline rank holds, attached to its model as ``model.pipeline_layout``."""

    chunks: list[ModelChunk]
    parameter_order: list[str]
    """Every parameter name of the full (single-process) model, in its order (for merging states)."""
    holds_embedding_copy: bool
    """This rank is the last stage and keeps a copy of the first stage's embedding."""


def keep_stage_modules(model: nn.Module, chunks: list[ModelChunk], pp_rank: int, pp_size: int) -> StageLayout:
    """Delete, in place, every module of the full ``model`` that this rank's ``chunks`` do not run."""
    order = [name for name, _ in model.named_parameters()]
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    kept = [index for chunk in chunks for index in chunk.blocks]
    model.blocks = StageBlocks({str(index): model.blocks[index] for index in sorted(kept)})
    copy = last and not first and needs_embedding_copy(model.config)
    if not (first or copy):
        model.embedding = None
    if not first:  # learned positions are added to the embedding on the first stage only
        model.position_embedding = None
    if not last:
        model.final_norm = model.output = model.mtp = None
    layout = StageLayout(chunks, order, copy)
    model.pipeline_layout = layout
    return layout


def chunk_parameter_names(model: nn.Module, chunks: list[ModelChunk]) -> list[list[str]]:
    """The names of the parameters of this rank's stage ``model`` that each of its ``chunks`` runs:
    ``blocks.{i}.*`` with block i; the embedding with the first virtual stage (or, as the tied
    copy, the last), learned positions with the first; the final norm, output head and MTP depths
    with the last virtual stage."""
    chunk_of_block = {index: number for number, chunk in enumerate(chunks) for index in chunk.blocks}
    first = [number for number, chunk in enumerate(chunks) if chunk.is_first]
    last = [number for number, chunk in enumerate(chunks) if chunk.is_last]
    names: list[list[str]] = [[] for _ in chunks]
    for name, _ in model.named_parameters():
        top, _, rest = name.partition(".")
        if top == "blocks":
            owners = [chunk_of_block[int(rest.partition(".")[0])]]
        elif top == "embedding":
            owners = first or last
        elif top == "position_embedding":
            owners = first
        else:
            owners = last
        for number in owners:
            names[number].append(name)
    return names


def build_embedding_group(context, config) -> Group | None:
    """The group of this rank's first and last pipeline stage ("embedding"), when the last stage
    holds a copy of the embedding. Collective: every rank creates every pipeline's group, in the
    same order."""
    if context.pp_size == 1 or not needs_embedding_copy(config):
        return None
    stride = context.world_size // context.pp_size  # ranks of one stage; pipelines are strided by it
    mine = None
    for first in range(stride):
        group = dist.new_group([first, first + (context.pp_size - 1) * stride])
        if context.rank in (first, first + (context.pp_size - 1) * stride):
            mine = group_of(group, "embedding", context.device, context.collective_log)
    return mine


def check_pipeline_layout(parallel, config, seq_len: int | None, microbatches_per_dp_rank: int | None) -> None:
    """Refuse, before any collective, a pipeline layout the model or the batch cannot fill."""
    if parallel.vp > 1 and parallel.pp == 1:
        raise ConfigError(f"parallel.vp={parallel.vp} needs parallel.pp > 1 (virtual stages interleave a pipeline).")
    if parallel.pp == 1:
        return
    stage_starts(config, parallel.pp * parallel.vp, seq_len or 1)
    if microbatches_per_dp_rank is not None:
        check_microbatches(parallel.pp, parallel.vp, microbatches_per_dp_rank)


__all__ = ["ModelChunk", "STAGE_COPY_NAMES", "StageBlocks", "StageLayout", "balanced_starts",
           "build_embedding_group", "check_pipeline_layout", "chunk_parameter_names", "keep_stage_modules",
           "needs_embedding_copy", "rank_chunks", "stage_starts"]
