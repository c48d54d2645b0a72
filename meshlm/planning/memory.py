"""Memory of one GPU under a layout, itemized: what ``meshlm plan`` adds up before anything runs.

Two parts, of two kinds of accuracy.

**Parameter state, exact.** The planner builds the model on ``meta`` (shapes, no storage), splits
it as the layout's rank 0 of each pipeline stage would (``parallelize_model`` with a
``ParallelContext`` that carries the sizes but no groups, then ``keep_stage_modules``), and lays
the parameters out in the very buffers the trainer allocates, with the trainer's own layout
functions (``plan_buckets``, ``plan_unit_buckets``), padding included:

    ZeRO 0   weights N*d        gradients: fp32 bucket buffer N*4    optimizer: (fp32 masters N*4) + Adam 2*N*4
                                                                                 + a 4-byte step per tensor
    ZeRO 1   weights T*d        gradients: fp32 buffer T*4 (a full one: each bucket is reduce-scattered in place)
                                optimizer: Adam 2*T/S*4 (+ bf16: master shard T/S*4 + 4 bytes per parameter)
    ZeRO 2   as 1 but gradients a T/S shard (fp32, or d with reduce_grads_in_fp32=false)
    ZeRO 3   weights the T/S shard (each unit gathered only around its use)

with N the rank's trained parameters (plus the frozen ones' weights, N_f*d, whole on every rank:
LoRA's base weights), d the model dtype's bytes, T the padded buffer (each bucket padded
to a multiple of S) and S the sharding group: dp*cp for dense weights, the expert-data-parallel
size for routed experts (``expert_data_parallel.py``: their own buffers). A single process has no
reducer: its gradients are the fp32 masters' ``.grad``.

Under ``optim.optimizer=muon`` without ZeRO the parameters Muon steps
(``meshlm.optim.muon.muon_parameter``: the blocks' weight matrices, N_m of the N) keep one fp32
``momentum_buffer`` and no step counter: Adam 2*(N - N_m)*4 + momentum N_m*4, and a step per
AdamW tensor only. Under ZeRO (Distributed Muon) the sharded buffers keep AdamW's layout, the
momentum in the first moment's place: the same bytes as AdamW.
The masters are as above.

**Activations, estimated** by ``meshlm/training/memory_estimate.py`` (per block kind, with the
recompute setting and the 1F1B / interleaved in-flight micro-batches; see its docstring for the
terms and their measured accuracy), plus three items it leaves out: communication buffers (each
process group's workspace, ZeRO-2's gradient staging buckets and ZeRO-3's gathered units), the
MTP depths' activations shown as their own item, and the allocator's fragmentation margin.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from meshlm.models.language_model import LanguageModel
from meshlm.optim.muon import muon_parameter
from meshlm.parallel.data.grad_reducer import bucket_elements_for, plan_buckets
from meshlm.parallel.data.units import plan_unit_buckets, unit_of
from meshlm.parallel.mesh import ParallelContext, resolve_etp
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.pipeline.stages import keep_stage_modules, rank_chunks
from meshlm.training.memory_estimate import DTYPE_BYTES, activation_items

FP32 = 4


def planning_context(config, layout) -> ParallelContext:
    """A ``ParallelContext`` with the layout's sizes (rank 0 of each group, no process groups)."""
    parallel = config.parallel
    etp = resolve_etp(parallel)
    stage_ranks = layout.tp * layout.cp * layout.dp
    return ParallelContext(world_size=layout.world_size, tp_size=layout.tp, dp_size=layout.dp,
                           sequence_parallel=layout.sp, pp_size=layout.pp, vp_size=layout.vp, cp_size=layout.cp,
                           dp_cp_size=layout.dp * layout.cp, ep_size=layout.ep, etp_size=etp,
                           edp_size=max(1, stage_ranks // (layout.ep * etp)),
                           moe_dispatcher=parallel.moe_dispatcher)


@dataclass(frozen=True)
class RankParameters:
    """One pipeline rank's trained parameters, in model order: (name, shape, is routed expert, is
    one Muon would step), how many frozen ones it holds besides (LoRA's base weights: weights
    only, never sharded), and which have a gradient partial on each TP rank."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    experts: tuple[bool, ...]
    muon: tuple[bool, ...]
    """``muon_parameter`` of each, whatever optim.optimizer is; the names and shapes are the
    trainer's after ``parallelize_model`` (the same dotted names, this rank's shard)."""
    frozen: int = 0
    partial: tuple[bool, ...] = ()
    """Of each, whether tensor parallelism keeps it whole on every rank with a partial gradient,
    summed over the TP group once per step (``mark_partial_grad``: MLA's down-projections, norms
    under SP, ...)."""

    @property
    def partial_count(self) -> int:
        return sum(shape.numel() for shape, partial in zip(self.shapes, self.partial) if partial)

    @property
    def count(self) -> int:
        return sum(shape.numel() for shape in self.shapes)


_CACHE: dict = {}


def rank_parameters(config, layout, pp_rank: int = 0) -> RankParameters:
    """The parameters pipeline rank ``pp_rank`` holds under ``layout`` (built on meta; cached)."""
    key = (repr(config.model), config.parallel.vocab_pad_multiple, config.parallel.etp, config.train.seq_len,
           layout.tp, layout.sp, layout.pp, layout.vp, layout.cp, layout.dp, layout.ep, pp_rank)
    if key not in _CACHE:
        with torch.device("meta"):
            model = LanguageModel(config.model, seed=0)
        context = dataclasses.replace(planning_context(config, layout), pp_rank=pp_rank)
        model = parallelize_model(model, context, config.parallel.vocab_pad_multiple)
        if layout.pp > 1:
            chunks = rank_chunks(config.model, layout.pp, layout.vp, pp_rank, config.train.seq_len)
            keep_stage_modules(model, chunks, pp_rank, layout.pp)
        named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        frozen = sum(param.numel() for param in model.parameters() if not param.requires_grad)
        _CACHE[key] = RankParameters(tuple(name for name, _ in named), tuple(param.shape for _, param in named),
                                     tuple(bool(getattr(param, "expert_parallel", False)) for _, param in named),
                                     tuple(muon_parameter(name, param) for name, param in named), frozen,
                                     tuple(bool(getattr(param, "tp_partial_grad", False)) for _, param in named))
    return _CACHE[key]


def sharding_groups(parameters: RankParameters, layout, context) -> list[tuple[list[int], int]]:
    """(parameter indices, sharding size) per reducer: dense over dp*cp, experts over edp."""
    everything = list(range(len(parameters.shapes)))
    experts = [index for index in everything if parameters.experts[index]]
    if layout.world_size == 1 or not experts:
        return [(everything, context.dp_cp_size)]
    dense = [index for index in everything if not parameters.experts[index]]
    return [(dense, context.dp_cp_size), (experts, context.edp_size)]


def parameter_state(config, layout, pp_rank: int = 0) -> dict[str, int]:
    """Exact bytes of weights, gradients and optimizer state on pipeline rank ``pp_rank`` (see the
    module docstring)."""
    parameters = rank_parameters(config, layout, pp_rank)
    context = planning_context(config, layout)
    dtype_bytes = DTYPE_BYTES[config.precision.dtype]
    low_precision = config.precision.dtype != "fp32"
    zero = layout.zero if layout.world_size > 1 else 0
    grad_bytes = FP32 if zero < 2 or config.parallel.reduce_grads_in_fp32 or not low_precision else dtype_bytes
    muon = [flag and config.optim.optimizer == "muon" for flag in parameters.muon]
    weights, gradients, optimizer = parameters.frozen * dtype_bytes, 0, 0
    for indices, shards in sharding_groups(parameters, layout, context):
        shapes = [parameters.shapes[index] for index in indices]
        count, tensors = sum(shape.numel() for shape in shapes), len(shapes)
        if zero == 0:
            momentum = sum(parameters.shapes[index].numel() for index in indices if muon[index])
            weights += count * dtype_bytes
            gradients += count * FP32
            # Adam's two moments, or Muon's one momentum for the parameters it steps
            optimizer += (count - momentum) * 2 * FP32 + momentum * FP32 + (count * FP32 if low_precision else 0)
            continue
        if zero == 1:
            total = plan_buckets(shapes, bucket_elements_for(config.parallel.bucket_size_mb), shards).total
        else:
            total = plan_unit_buckets(shapes, [unit_of(parameters.names[index]) for index in indices], shards)[0].total
        shard = total // shards
        weights += shard * dtype_bytes if zero == 3 else total * dtype_bytes
        gradients += total * FP32 if zero == 1 else shard * grad_bytes
        optimizer += 2 * shard * FP32
        if low_precision:  # the master shard, and a 4-byte stand-in per full-shape master
            optimizer += shard * FP32 + tensors * FP32
    if zero == 0:  # torch's AdamW: a float32 step counter per tensor (Muon keeps none)
        optimizer += (len(parameters.shapes) - sum(muon)) * FP32
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer}


def communication_buffer_bytes(config, layout, hardware, parameters: RankParameters) -> int:
    """Collective workspace: per group a rank joins, plus ZeRO-2's staging buckets (two in flight)
    and ZeRO-3's gathered units (the one running and the one prefetched)."""
    groups = sum(size > 1 for size in (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.dp * layout.cp))
    workspace = groups * hardware.comm_buffer_mib_per_group * 2 ** 20
    if layout.zero < 2 or layout.world_size == 1:
        return int(workspace)
    units: dict[str, int] = {}
    for name, shape in zip(parameters.names, parameters.shapes):
        units[unit_of(name)] = units.get(unit_of(name), 0) + shape.numel()
    largest = max(units.values(), default=0)
    staging = 2 * largest * FP32
    gathered = 2 * largest * DTYPE_BYTES[config.precision.dtype] if layout.zero == 3 else 0
    return int(workspace + staging + gathered)


def memory_items(config, layout, hardware) -> dict[str, int]:
    """Peak bytes per GPU by item, on the pipeline rank with the most (the first, usually)."""
    context = planning_context(config, layout)
    best: dict[str, int] = {}
    for pp_rank in sorted({0, layout.pp - 1}):
        items = dict(parameter_state(config, layout, pp_rank))
        activations = activation_items(config, dataclasses.replace(context, pp_rank=pp_rank))
        for name, value in activations.items():
            if value and name != "mtp":
                items[f"activations {name}"] = int(value)
        items["activations mtp"] = int(activations["mtp"]) if config.model.mtp_depth else 0
        items["communication buffers"] = communication_buffer_bytes(config, layout, hardware,
                                                                    rank_parameters(config, layout, pp_rank))
        items["fragmentation margin"] = int(math.ceil(hardware.fragmentation * sum(
            value for name, value in items.items() if name.startswith("activations") or name == "communication buffers")))
        if sum(items.values()) > sum(best.values()):
            best = items
    return best


__all__ = ["RankParameters", "communication_buffer_bytes", "memory_items", "parameter_state", "planning_context",
           "rank_parameters"]
