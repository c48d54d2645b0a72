"""A rank's training state as pieces of global (single-process) tensors, by name.

The checkpoint keys, each a tensor of the single-process model's shape:

    model/NAME                  parameter or persistent buffer, in the model's dtype
    master/NAME                 fp32 master weight (bf16/fp16 runs only)
    optim/NAME/exp_avg          AdamW first moment (fp32)
    optim/NAME/exp_avg_sq       AdamW second moment (fp32)
    optim/NAME/momentum_buffer  Muon's momentum (fp32; optim.optimizer=muon, its matrices)
    recipe/LAYER/amax_history   a low-precision recipe's per-layer state (fp8_delayed's amax
                                history, replicated over the ranks that hold the layer)
    outer/global/NAME           parallel.dp_sync (diloco, palsgd): the global copy (fp32)
    outer/momentum/NAME         the outer optimizer's momentum (fp32, sharded over DP)
    outer/pending/NAME, outer/pending_flag, replicaR/outer/anchor/NAME
                                parallel.outer_overlap: a sync still to apply (its reduced
                                message, the same on every replica) and each replica's anchor
    replicaR/KEY                parallel.dp_sync: DP replica R >= 1's own model/, master/, optim/
                                and recipe/ entries (replicas differ between syncs; replica 0
                                keeps the plain keys, so every tool reads its model)

``training_tensors`` lists, for each key, the chunks this rank holds (views into the live
tensors, from ``meshlm/checkpoint/sharding.py``) wherever they live:

* a model parameter or buffer: the (TP/EP-sharded or replicated) tensor itself;
* fp32 masters: ``MixedPrecision``'s master copies, or -- when the distributed optimizer owns
  them in bf16/fp16 -- its flat buffer of this rank's ZeRO-1 segments;
* Adam moments: ``torch.optim.AdamW``'s per-parameter state, or the distributed optimizer's
  flat moment buffers, one segment per (parameter, owned range).

Saving reads through these views; loading writes through them and then ``finish_loading``
re-derives what depends on them (the bf16 model weights from the masters, the optimizer's
step count). Nothing here communicates. Scalars that are not tensors (step counts, learning-
rate group settings, the loss scaler) are plain JSON from ``optimizer_scalars``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from meshlm.checkpoint.sharding import Chunk, flat_chunks, tensor_chunks
from meshlm.optim.adamw import adamw_step_tensor
from meshlm.optim.muon import MOMENTUM_KEY, MUON_GROUP
from meshlm.parallel.pipeline.stages import STAGE_COPY_NAMES
from meshlm.precision.delayed_scaling import delayed_scalings

MOMENTS = ("exp_avg", "exp_avg_sq")
MUON_MOMENTUM = (MOMENTUM_KEY,)
STATE_KEYS = MOMENTS + MUON_MOMENTUM
"""Every per-parameter optimizer tensor a checkpoint may hold (AdamW's moments, Muon's momentum)."""
GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay")
"""Per-group optimizer settings a checkpoint restores (as torch's AdamW.load_state_dict does)."""


@dataclass
class GlobalTensor:
    """One checkpoint tensor: its single-process shape and dtype, and this rank's chunks of it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[Chunk] = field(default_factory=list)


@dataclass
class TrainingParts:
    """The live objects a checkpoint saves and restores."""

    model: torch.nn.Module
    optimizer: object
    """``torch.optim.AdamW``, a ``DistributedOptimizer``, or an object whose ``optimizers`` lists them."""
    precision: object
    """``MixedPrecision``: its masters (bf16/fp16) and loss scaler."""
    context: object = None
    """``ParallelContext`` (None: one process)."""
    dp_sync: object = None
    """``LowCommunicationSync`` (parallel.dp_sync other than every_step), else None."""


def optimizers_of(optimizer) -> list:
    return list(getattr(optimizer, "optimizers", [optimizer]))


def is_sharded(optimizer) -> bool:
    """A distributed optimizer, ZeRO stage 1-3 (it has flat moment buffers cut into segments)."""
    return hasattr(optimizer, "segments") and hasattr(optimizer, "exp_avg")


def _add(tensors: dict, key: str, shape, dtype, chunks: list[Chunk]) -> None:
    entry = tensors.setdefault(key, GlobalTensor(tuple(shape), dtype))
    entry.chunks.extend(chunks)


def model_tensors(parts: TrainingParts) -> dict[str, GlobalTensor]:
    """``model/NAME`` for every parameter (tied ones once) and persistent buffer."""
    tensors, sharded = {}, set()
    all_params = dict(parts.model.named_parameters(remove_duplicate=False))
    params = dict(parts.model.named_parameters())
    for optimizer in optimizers_of(parts.optimizer):  # ZeRO-3: the parameters are the segments of model_shard
        if getattr(optimizer, "zero_stage", 1) == 3:
            _segment_tensors(tensors, optimizer, params, parts.context, "model/{name}", {"": optimizer.model_shard})
            sharded.update(optimizer.reducer.names)
    for name, param in params.items():
        if name in sharded:
            continue
        shape, chunks = tensor_chunks(param, param.data, parts.context)
        _add(tensors, f"model/{name}", shape, param.dtype, chunks)
    for name, value in parts.model.state_dict().items():
        if name not in all_params:  # a persistent buffer (replicated)
            _add(tensors, f"model/{name}", value.shape, value.dtype, [((0,) * value.dim(), value)])
    return tensors


def _segment_tensors(tensors: dict, optimizer, params: dict, context, prefix: str, buffers) -> None:
    """Chunks of flat per-rank buffers (ZeRO-1): ``buffers`` maps a key suffix to a flat buffer, or
    is a function of the parameter's index giving that map (the optimizer state of each parameter)."""
    layout, names = optimizer.reducer.layout, optimizer.reducer.names
    for segment in optimizer.segments:
        name, length = names[segment.param], segment.end - segment.start
        first = segment.start - layout.offsets[segment.param]
        for suffix, buffer in (buffers(segment.param) if callable(buffers) else buffers).items():
            flat = buffer[segment.local:segment.local + length]
            shape, chunks = flat_chunks(params[name], flat, first, context)
            _add(tensors, prefix.format(name=name, suffix=suffix), shape, buffer.dtype, chunks)


def master_tensors(parts: TrainingParts) -> dict[str, GlobalTensor]:
    """``master/NAME`` (bf16/fp16 runs): from the distributed optimizer's segments where it owns
    the masters, else from ``MixedPrecision``'s full local masters."""
    if not getattr(parts.precision, "low_precision", False):
        return {}
    params, tensors, owned = dict(parts.model.named_parameters()), {}, set()
    for optimizer in optimizers_of(parts.optimizer):
        if is_sharded(optimizer) and getattr(optimizer, "low_precision", False):
            _segment_tensors(tensors, optimizer, params, parts.context, "master/{name}", {"": optimizer.values})
            owned.update(optimizer.reducer.names)
    for name, master in parts.precision.master_parameters():
        if name not in owned and master.requires_grad:  # a frozen parameter is its own master (model/NAME)
            shape, chunks = tensor_chunks(params[name], master.data, parts.context)
            _add(tensors, f"master/{name}", shape, torch.float32, chunks)
    return tensors


def state_keys(group: dict) -> tuple[str, ...]:
    """The per-parameter tensors of a parameter group: Muon's momentum, or AdamW's two moments."""
    return MUON_MOMENTUM if group.get("name") == MUON_GROUP else MOMENTS


def ensure_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a torch AdamW (or Muon, ``meshlm/optim/muon.py``) its zero state, as
    its first step would."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            keys = state_keys(group)
            if keys[0] not in state:
                if keys == MOMENTS:
                    state["step"] = adamw_step_tensor(0.0, group, param)
                for key in keys:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)


def moment_tensors(parts: TrainingParts, for_loading: bool = False) -> dict[str, GlobalTensor]:
    """``optim/NAME/exp_avg`` and ``optim/NAME/exp_avg_sq`` of every parameter AdamW updates,
    ``optim/NAME/momentum_buffer`` of every matrix Muon updates. An optimizer that has not stepped
    yet gets zero state first (so a load has targets)."""
    params, tensors = dict(parts.model.named_parameters()), {}
    for optimizer in optimizers_of(parts.optimizer):
        if is_sharded(optimizer):
            _segment_tensors(tensors, optimizer, params, parts.context, "optim/{name}/{suffix}",
                             optimizer.state_buffers)
            continue
        if for_loading:
            ensure_adamw_state(optimizer)
        for group in optimizer.param_groups:
            for name, param in zip(group["param_names"], group["params"]):
                state = optimizer.state.get(param, {})
                for key in state_keys(group):
                    moment = state[key] if key in state else torch.zeros_like(param)
                    shape, chunks = tensor_chunks(params[name], moment, parts.context)
                    _add(tensors, f"optim/{name}/{key}", shape, torch.float32, chunks)
    return tensors


def recipe_tensors(parts: TrainingParts) -> dict[str, GlobalTensor]:
    """``recipe/LAYER/amax_history`` for every layer with a delayed-scaling history (fp8_delayed)."""
    tensors = {}
    for name, state in delayed_scalings(parts.model):
        _add(tensors, f"recipe/{name}/amax_history", state.history.shape, state.history.dtype,
             [((0,) * state.history.dim(), state.history)])
    return tensors


def training_tensors(parts: TrainingParts, for_loading: bool = False) -> dict[str, GlobalTensor]:
    """Every checkpoint tensor this rank holds a piece of (see the module docstring). The last
    pipeline stage's copy of a tied embedding is loaded like the original but never saved (its
    ZeRO-1 segments would overlap the first stage's differently cut ones)."""
    for optimizer in optimizers_of(parts.optimizer):  # ZeRO-1 all-gathers still running into the parameters
        getattr(optimizer, "wait_for_parameters", lambda: None)()
    tensors = {**model_tensors(parts), **master_tensors(parts), **moment_tensors(parts, for_loading),
               **recipe_tensors(parts)}
    if parts.dp_sync is not None:  # replicas differ between syncs: each keeps its own entries
        tensors = {replica_key(key, parts.context.dp_rank): value for key, value in tensors.items()}
        tensors.update(outer_tensors(parts))
    if for_loading:
        return tensors
    return {key: value for key, value in tensors.items() if not is_stage_copy(parameter_name(key), parts.context)}


def replica_key(key: str, replica: int) -> str:
    """A DP replica's key: the plain key for replica 0, ``replicaR/KEY`` for the others."""
    return key if replica == 0 else f"replica{replica}/{key}"


def split_replica(key: str) -> tuple[str, str]:
    """``replica3/model/x`` -> ('replica3/', 'model/x'); a plain key -> ('', key)."""
    match = re.match(r"(replica\d+/)(.*)", key)
    return (match.group(1), match.group(2)) if match else ("", key)


def outer_tensors(parts: TrainingParts) -> dict[str, GlobalTensor]:
    """``outer/global/NAME`` (the whole global copy, like a replicated parameter) and
    ``outer/momentum/NAME`` (this rank's flat DP slice of the momentum, like a ZeRO-1 segment)."""
    tensors, params = {}, dict(parts.model.named_parameters())
    for name, _, view in parts.dp_sync.global_views():
        shape, chunks = tensor_chunks(params[name], view, parts.context)
        _add(tensors, f"outer/global/{name}", shape, torch.float32, chunks)
    for name, _, first, flat in parts.dp_sync.momentum_segments():
        shape, chunks = flat_chunks(params[name], flat, first, parts.context)
        _add(tensors, f"outer/momentum/{name}", shape, torch.float32, chunks)
    for kind, name, _, view in parts.dp_sync.overlap_views():  # parallel.outer_overlap: a sync in flight
        shape, chunks = tensor_chunks(params[name], view, parts.context)
        key = f"outer/{kind}/{name}" if kind == "pending" else replica_key(f"outer/{kind}/{name}",
                                                                             parts.context.dp_rank)
        _add(tensors, key, shape, view.dtype, chunks)
    if parts.dp_sync.overlap:
        flag = parts.dp_sync.pending_flag
        _add(tensors, "outer/pending_flag", tuple(flag.shape), flag.dtype, [((0,), flag)])
    return tensors


def parameter_name(key: str) -> str:
    """``model/NAME``, ``master/NAME``, ``optim/NAME/exp_avg``, ``recipe/NAME/amax_history``,
    ``outer/global/NAME``, and any of them under ``replicaR/`` -> NAME."""
    kind, rest = split_replica(key)[1].split("/", 1)
    if kind == "outer":
        return rest.split("/", 1)[1] if "/" in rest else rest  # outer/pending_flag names no parameter
    return rest.rsplit("/", 1)[0] if kind in ("optim", "recipe") else rest


def is_stage_copy(name: str, context) -> bool:
    """A parameter a later pipeline stage holds a copy of (the first stage's is canonical)."""
    if context is None or getattr(context, "pp_size", 1) == 1 or context.is_first_stage:
        return False
    return name in STAGE_COPY_NAMES


# --- scalars -----------------------------------------------------------------------------------
def optimizer_step_count(optimizer) -> int:
    if is_sharded(optimizer):
        return int(optimizer.step_count)
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    return max(steps, default=0)


def optimizer_scalars(optimizer) -> list[dict]:
    """Step count and group settings of each (sub-)optimizer, JSON-ready."""
    return [{"step": optimizer_step_count(part),
             "groups": [{"name": group.get("name"), **{key: group[key] for key in GROUP_SETTINGS if key in group}}
                        for group in part.param_groups]}
            for part in optimizers_of(optimizer)]


def restore_optimizer_scalars(optimizer, saved: list[dict]) -> None:
    """Set step counts (every AdamW state entry, or the distributed optimizer's count) and group
    settings by group name. Every optimizer of a run steps together, so the saved optimizers need
    not match the run's one for one (e.g. a separate expert optimizer under expert parallelism)."""
    step = max((int(entry["step"]) for entry in saved), default=0)
    settings = {group["name"]: group for entry in saved for group in entry["groups"]}
    for part in optimizers_of(optimizer):
        for group in part.param_groups:
            stored = settings.get(group.get("name"), {})
            group.update({key: tuple(value) if key == "betas" else value
                          for key, value in stored.items() if key in GROUP_SETTINGS})
        if is_sharded(part):
            part.step_count = step
            continue
        for group in part.param_groups:
            for param in group["params"]:
                if "exp_avg" in part.state[param]:
                    part.state[param]["step"] = adamw_step_tensor(step, group, param)


@torch.no_grad()
def finish_loading(parts: TrainingParts) -> None:
    """After the masters were loaded: recompute the low-precision model weights from them
    (the distributed optimizer all-gathers its segments, or at ZeRO-3 casts them into its
    parameter shard; otherwise a cast per parameter)."""
    owned = set()
    for optimizer in optimizers_of(parts.optimizer):
        # collective over the optimizer's DP group; stage 3 (any precision) refreshes its parameter
        # shard and drops the gathered, now stale, units instead of gathering
        if is_sharded(optimizer) and (optimizer.low_precision or optimizer.zero_stage == 3):
            optimizer.gather_parameters()
            owned.update(optimizer.reducer.names)
    if not getattr(parts.precision, "low_precision", False):
        return
    for (name, param), (_, master) in zip(parts.precision.model_parameters, parts.precision.master_parameters()):
        if name not in owned and master is not param:
            param.copy_(master)


def layout_of(context, run_config) -> dict:
    """The layout a checkpoint was saved at (recorded; loading works at any layout)."""
    parallel = run_config.parallel
    sizes = {name: getattr(context, f"{name}_size", 1) if context is not None else 1
             for name in ("tp", "dp", "pp", "cp", "ep", "etp")}
    return {"world_size": context.world_size if context is not None else 1, **sizes,
            "vp": getattr(context, "vp_size", 1) if context is not None else 1,
            "sp": bool(getattr(context, "sequence_parallel", False)),
            "distributed_optimizer": bool(parallel.distributed_optimizer),
            "zero_stage": parallel.sharding_stage, "dtype": run_config.precision.dtype}


__all__ = ["GlobalTensor", "MOMENTS", "TrainingParts", "ensure_adamw_state", "finish_loading", "is_sharded",
           "master_tensors", "model_tensors", "moment_tensors", "optimizer_scalars", "optimizers_of",
           "layout_of", "restore_optimizer_scalars", "training_tensors"]
