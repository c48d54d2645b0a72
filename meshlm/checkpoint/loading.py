"""Reading a checkpoint into a run at any layout, after checking everything that can be checked.

``load_checkpoint`` (what ``Checkpointer.load`` and so the trainer's resume call) works in
three stages, so that a bad checkpoint is refused before anything is changed and with the
same error on every rank:

1. *Check* (local, no bytes of tensors read): the folder exists and carries its completion
   marker; its model config equals the run's (every differing field named); every key the
   run needs exists in DCP's ``.metadata`` with the run's global shape; every file this rank
   will read has the size and CRC-32 recorded in ``complete.json`` (a truncated or corrupted
   shard is named). The ranks then agree on the first error (``agree_on_error``).
2. *Read*: DCP reads the overlaps of the stored chunks with this rank's chunks, straight into
   the live tensors (``ChunkLoadPlanner``).
3. *Derive*: optimizer step counts and group settings, the loss scaler, the RNG states; the
   bf16/fp16 model weights from the fp32 masters (``finish_loading``).

Where a key comes from: an fp32 run reads its weights from ``master/NAME`` when the checkpoint
has fp32 masters (a bf16 run saved them), else from ``model/NAME``; a bf16/fp16 run reads its
masters from ``master/NAME``, or from ``model/NAME`` when an fp32 run saved it. So the dtype
may change on resume too.

Older single-process checkpoints (``model.safetensors`` + ``optimizer.pt`` ...) are read in
full and sliced into the same chunks (``load_single_process_checkpoint``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshlm.checkpoint.files import COMPLETE_FILE, CONFIG_FILE, METADATA_FILE, STATE_FILE, TRAINING_FILE, read_json
from meshlm.checkpoint.folders import check_folder, is_single_process_format, read_metadata, verify_files
from meshlm.checkpoint.global_state import (STATE_KEYS, TrainingParts, finish_loading, layout_of, split_replica,
                                            restore_optimizer_scalars, training_tensors)
from meshlm.checkpoint.planners import ChunkLoadPlanner, read_items_by_file
from meshlm.checkpoint.sharding import box_view
from meshlm.checkpoint.training_checkpoint import TrainerState, check_model_config, read_checkpoint, restore_rng_state
from meshlm.errors import CheckpointError
from meshlm.optim.muon import MOMENTUM_KEY
from meshlm.parallel.collectives import all_gather_objects


# --- stage 1: checks (the folder's own: ``folders.check_folder``, ``verify_files``) ---------------
def agree_on_error(message: str | None, group) -> None:
    """Raise CheckpointError on every rank of ``group`` if any rank has a ``message`` (the first)."""
    messages = all_gather_objects(message, group)
    first = next((text for text in messages if text), None)
    if first:
        raise CheckpointError(first)




def plan_sources(parts: TrainingParts, stored: dict[str, tuple]) -> tuple[dict, dict[str, str]]:
    """(chunks to fill, {key: stored key it is read from}) for this rank; ``stored``: key -> shape."""
    tensors = training_tensors(parts, for_loading=True)
    low_precision = getattr(parts.precision, "low_precision", False)
    param_names = {name for name, _ in parts.model.named_parameters()}
    requests, sources = {}, {}
    for key, tensor in tensors.items():
        prefix, plain = split_replica(key)
        kind, name = plain.split("/", 1)
        if kind == "model" and name in param_names:
            if low_precision and f"{prefix}master/{name}" in tensors:
                continue  # recomputed from the masters
            # a frozen parameter in bf16/fp16 has no master (its own value is kept) and is read as saved
            source = f"master/{name}" if f"master/{name}" in stored and not low_precision else plain
        elif kind == "master":
            source = plain if plain in stored else f"model/{name}"
        elif kind == "recipe" and plain not in stored:
            continue  # a checkpoint of a run without this recipe state: start from empty histories
        elif kind == "outer" and plain not in stored:
            if not plain.startswith("outer/global/"):
                continue  # no outer momentum saved (another dp_sync, or none): it starts at zero
            param = name.split("/", 1)[1]  # no global copy saved: replica 0's parameters are it
            source = f"master/{param}" if f"master/{param}" in stored else f"model/{param}"
        else:
            source = plain
        # a replica without entries of its own (saved by fewer replicas, or every_step) starts as replica 0
        sources[key] = prefix + source if prefix + source in stored else source
        requests[key] = tensor
    return requests, sources


def check_shapes(requests: dict, sources: dict[str, str], stored: dict[str, tuple], where: Path) -> None:
    missing = sorted({sources[key] for key in requests if sources[key] not in stored})
    wrong = [f"{sources[key]}: checkpoint {tuple(stored[sources[key]])} vs run {tuple(tensor.shape)}"
             for key, tensor in sorted(requests.items())
             if sources[key] in stored and tuple(stored[sources[key]]) != tuple(tensor.shape)]
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if wrong:
        parts.append("shape mismatch: " + "; ".join(wrong[:8]) + (" ..." if len(wrong) > 8 else ""))
    if missing and not wrong and all(key.startswith("optim/") for key in missing):
        state = missing[0].rsplit("/", 1)[1]
        saved_by = "adamw" if state == MOMENTUM_KEY else "muon"  # the other one's state is what is missing
        raise CheckpointError(f"{where} holds no {state} for {len(missing)} parameters ({missing[0].split('/')[1]}, "
                              f"...): it was saved with optim.optimizer={saved_by}. Resume with "
                              f"optim.optimizer={saved_by}, or start a new run from its weights with train.init_from "
                              "(a fresh optimizer).")
    if parts:
        raise CheckpointError(f"{where} does not fit this run's model ({' | '.join(parts)}); it was saved for a "
                              "different model.")


def stored_shapes(metadata) -> dict[str, tuple]:
    return {key: tuple(value.size) for key, value in metadata.state_dict_metadata.items()
            if isinstance(value, TensorStorageMetadata)}


# --- the whole load ----------------------------------------------------------------------------------
def load_checkpoint(directory, parts: TrainingParts, run_config, group=None) -> TrainerState:
    """Restore ``parts`` in place from ``directory``; collective over ``group`` (every rank)."""
    directory = Path(directory)
    try:
        check_folder(directory)
        single = is_single_process_format(directory)
        prepared = prepare_single_process(directory, parts, run_config) if single else \
            prepare_distributed(directory, parts, run_config)
        message = None
    except CheckpointError as error:
        prepared, message = None, str(error)
    agree_on_error(message, group)
    if isinstance(prepared, dict):
        return apply_single_process(prepared, parts)
    planner, training = prepared
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({}, storage_reader=FileSystemReader(directory), planner=planner,
                     process_group=group.process_group if group is not None else None, no_dist=group is None)
    except Exception as error:  # DCP reports every rank's failure to every rank
        raise CheckpointError(f"reading {directory} failed: {error}") from error
    restore_scalars(parts, training["optimizers"], training.get("loss_scaler"), directory / TRAINING_FILE)
    finish_loading(parts)
    restore_rng_state(next(iter(planner.loaded.values())))
    return TrainerState.from_dict(read_json(directory / STATE_FILE))


def prepare_distributed(directory: Path, parts: TrainingParts, run_config):
    check_model_config(directory / CONFIG_FILE, run_config.model)
    marker = read_json(directory / COMPLETE_FILE)
    training = read_json(directory / TRAINING_FILE)
    metadata = read_metadata(directory, marker)
    stored = stored_shapes(metadata)
    requests, sources = plan_sources(parts, stored)
    check_shapes(requests, sources, stored, directory / METADATA_FILE)
    rank = dist.get_rank() if dist.is_initialized() else 0
    same_layout = training.get("layout") == layout_of(parts.context, run_config)
    rng_key = f"rng/{rank if same_layout else 0}"
    if rng_key not in metadata.state_dict_metadata:
        raise CheckpointError(f"{directory / METADATA_FILE} has no {rng_key}; the checkpoint is damaged.")
    planner = ChunkLoadPlanner(requests, sources, [rng_key])
    verify_files(directory, read_items_by_file(planner, metadata), marker)
    return planner, training


DATA_ORDER_KEYS = (("train", "global_batch_size"), ("train", "seq_len"), ("train", "seed"),
                   ("data", "blend"), ("data", "prefixes"), ("data", "weights"), ("data", "split"))
"""Settings the global sample order depends on. ``train.steps`` is not one of them: the sample
order is prefix-stable (meshlm/data/gpt_dataset.py), so a longer run reads the same first samples;
it only stretches the learning-rate schedule (see ``SCHEDULE_KEYS``)."""
SCHEDULE_KEYS = (("train", "steps"),)
"""Settings the learning-rate schedule depends on beyond ``optim.*``."""


def resume_warnings(directory: Path, run_config, dp_size: int) -> list[str]:
    """What changed since the checkpoint's run that makes the continuation differ from an uninterrupted
    run: the global sample order (and the LR schedule) are functions of these settings; under
    ``parallel.dp_sync`` the DP replicas the checkpoint holds (``replica_warning``), given this
    run's DP size."""
    try:
        saved = read_json(directory / CONFIG_FILE).get("run") or {}
    except CheckpointError:
        return []
    current = run_config.to_dict()

    def changes(keys) -> list[str]:
        found = []
        for section, key in keys:
            before, now = (saved.get(section) or {}).get(key), current[section][key]
            if before is not None and before != now:
                found.append(f"{section}.{key}: checkpoint {before!r}, now {now!r}")
        return found

    warnings = []
    data_changes, schedule_changes = changes(DATA_ORDER_KEYS), changes(SCHEDULE_KEYS)
    if data_changes:
        warnings.append(f"resuming {directory} with changed settings ({'; '.join(data_changes)}): the order of "
                        "the training samples depends on them, so from here on the run reads a different sample "
                        "order than the checkpoint's run would have -- some samples may repeat or be skipped.")
    if schedule_changes:
        warnings.append(f"resuming {directory} with {'; '.join(schedule_changes)}: the samples continue where "
                        "the checkpoint stopped, but the learning-rate schedule (warmup/decay over train.steps) "
                        "is recomputed for the new length.")
    replicas = replica_warning(directory, saved, run_config.parallel.dp_sync, dp_size)
    if replicas:
        warnings.append(replicas)
    return warnings


def replica_warning(directory: Path, saved_run: dict, dp_sync: str, dp_size: int) -> str | None:
    """Between two syncs the replicas of a ``parallel.dp_sync`` run differ, and its checkpoint keeps
    each one's weights and optimizer state. A resume that cannot keep them all says what becomes of
    them: at fewer DP replicas the extra ones' progress since the last sync is dropped; at more, the
    new ones start as copies of replica 0 (``plan_sources``); with ``dp_sync=every_step`` the run
    continues from replica 0 alone."""
    mode = (saved_run.get("parallel") or {}).get("dp_sync", "every_step")
    if mode == "every_step":
        return None
    try:
        before = int((read_json(directory / TRAINING_FILE).get("layout") or {}).get("dp", dp_size))
    except (CheckpointError, TypeError, ValueError):
        return None
    saved_by = f"{directory} was saved by {before} DP replicas training apart (parallel.dp_sync={mode})"
    if dp_sync == "every_step" and before > 1:
        return (f"{saved_by}; with parallel.dp_sync=every_step the run continues from replica 0's weights and "
                "optimizer state, and the other replicas' progress since their last sync is dropped.")
    if dp_size < before:
        return (f"{saved_by}; at parallel.dp={dp_size} {_replicas(dp_size, before - 1)} dropped with the progress "
                "since the last sync (resume at the same DP size to keep it).")
    if dp_size > before:
        return (f"{saved_by}; at parallel.dp={dp_size} {_replicas(before, dp_size - 1)} started as copies of "
                "replica 0's weights and optimizer state.")
    return None


def _replicas(first: int, last: int) -> str:
    return f"replica {first} is" if first == last else f"replicas {first}..{last} are"


def restore_scalars(parts: TrainingParts, optimizers: list[dict], loss_scaler: dict | None, where: Path) -> None:
    try:
        restore_optimizer_scalars(parts.optimizer, optimizers)
    except (KeyError, ValueError, TypeError) as error:
        raise CheckpointError(f"{where}: the optimizer state does not fit this run's optimizer ({error}).") from error
    scaler = getattr(parts.precision, "scaler", None)
    if scaler is not None and loss_scaler is not None:
        scaler.load_state_dict(loss_scaler)


# --- older single-process checkpoints ------------------------------------------------------------------
def prepare_single_process(directory: Path, parts: TrainingParts, run_config) -> dict:
    """Read a single-process-format checkpoint in full and plan its slicing into this rank's chunks."""
    checkpoint = read_checkpoint(directory, run_config.model)
    full = {f"model/{name}": tensor for name, tensor in checkpoint.model_state.items()}
    masters = (checkpoint.precision_state or {}).get("master_weights") or {}
    full.update({f"master/{name}": tensor for name, tensor in masters.items()})
    saved, steps, groups = checkpoint.optimizer_state, [], []
    for group in saved.get("param_groups", []):
        groups.append({"name": group.get("name"), **{key: group[key] for key in ("lr", "betas", "eps",
                                                                                 "weight_decay") if key in group}})
        for name, packed in zip(group.get("param_names", []), group["params"]):
            entry = saved["state"].get(packed) or {}
            full.update({f"optim/{name}/{key}": entry[key] for key in STATE_KEYS if key in entry})
            steps += [int(entry["step"])] if "step" in entry else []
    stored = {key: tuple(tensor.shape) for key, tensor in full.items()}
    requests, sources = plan_sources(parts, stored)
    if not steps:  # saved before the first step: no moments yet
        sources.update({key: None for key in requests if key.startswith("optim/")})
    check_shapes({k: v for k, v in requests.items() if sources[k]}, sources, stored, directory)
    return {"directory": directory, "full": full, "requests": requests, "sources": sources,
            "optimizers": [{"step": max(steps, default=0), "groups": groups}],
            "loss_scaler": (checkpoint.precision_state or {}).get("loss_scaler"), "rng": checkpoint.rng_state,
            "state": checkpoint.trainer_state}


@torch.no_grad()
def apply_single_process(prepared: dict, parts: TrainingParts) -> TrainerState:
    for key, tensor in prepared["requests"].items():
        source = prepared["sources"][key]
        for offsets, view in tensor.chunks:
            if source is None:
                view.zero_()
                continue
            view.copy_(box_view(prepared["full"][source], (offsets, view.shape)))
    restore_scalars(parts, prepared["optimizers"], prepared["loss_scaler"], prepared["directory"])
    finish_loading(parts)
    restore_rng_state(prepared["rng"])
    return prepared["state"]


__all__ = ["check_folder", "check_shapes", "is_single_process_format", "load_checkpoint", "plan_sources",
           "read_json", "read_metadata", "replica_warning", "resume_warnings", "stored_shapes", "verify_files"]
