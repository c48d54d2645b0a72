"""Distributed, layout-independent training checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes only what it holds -- its shards of the weights, of the fp32 masters and of
the Adam moments -- each described in *global* coordinates: the single-process tensor's shape,
with the rank's pieces as rectangular chunks of it (``meshlm/checkpoint/sharding.py`` derives
them from the shard metadata on parameters; ``global_state.py`` lists them for a run;
``planners.py`` hands them to DCP). A run at any other layout (tp, dp, ZeRO-1 on or off,
another dtype, pipeline stages, experts) asks for the chunks *it* holds and DCP reads the
overlapping stored chunks. Replicated tensors are written once, by one of their holders
(``own_chunks`` balances the bytes). Nothing is gathered to one rank, so saving costs each
rank its share of the bytes, in parallel.

    RUN_DIR/checkpoints/step_N/
        __R_0.distcp           rank R's chunks (DCP), for every rank R of the saving run
        .metadata              DCP's index: every key's global shape, dtype and chunks
        config.json            {"format": "meshlm", "model": ..., "run": ...}: `meshlm generate` and
                               `meshlm convert` read the model straight from the shards
        run.yaml               the run's full config
        trainer_state.json     step, samples consumed (the data position), losses
        training.json          the saving layout, optimizer step counts and group settings, loss scaler
        tokenizer.json (+ its side files) when the run has one
        complete.json          written last: size and CRC-32 of every file above

Keys: ``model/NAME``, ``master/NAME`` (bf16/fp16), ``optim/NAME/exp_avg``, ``optim/NAME/exp_avg_sq``
and ``rng/R`` (rank R's RNG states; a run at the same layout takes its own rank's, another
layout rank 0's -- every rank seeds identically, so they agree until a run draws differently).

**Atomic commit.** Every rank writes into ``step_N.tmp-XXXX`` (rank 0 picks XXXX and broadcasts
it). After DCP's final collective every rank has finished writing; each computes the CRC-32 of
its own files and rank 0 gathers them, writes the small files, then ``complete.json`` last, and
renames the folder to ``step_N``; then older checkpoints beyond ``train.keep_checkpoints`` go.
A crash at any point leaves the previous checkpoint as the newest complete one.

**Asynchronous save** (``train.async_save``). The step stalls only while this rank's chunks are
copied into CPU staging buffers (pinned on CUDA, reused between saves); a background thread
then runs DCP's plan/write and the commit. DCP's collectives then run on a process group of
their own (gloo, created with the checkpointer), never on the groups training uses, so the two
threads cannot interleave collectives. The next save, ``wait()``, and ``load`` wait for it.

**Loading** checks, before any bytes are read, that the folder is complete, that its model
config equals the run's (naming every field that differs), that every key the run needs
exists with the run's shape, and that the files this rank will read have the recorded size
and CRC-32 (naming the file); ranks agree on the first error so all of them raise it. Then
DCP reads into the live tensors in place, and what derives from them is recomputed (the
bf16 model weights from the fp32 masters; the distributed optimizer's all-gather).

Why custom planners rather than DTensor/ShardedTensor state dicts: see ``planners.py``.

**The API** (the trainer's ``self.checkpoints``; ``Trainer.training_parts()`` gives ``parts``)::

    checkpointer = Checkpointer(run_dir, run_config, context, tokenizer_file)  # every rank, same point
    checkpointer.save(state, parts, async_save=False) -> Path   # collective; TrainerState + TrainingParts
    checkpointer.wait() -> Path | None                          # the asynchronous save in flight, if any
    checkpointer.latest() -> Path | None                        # the newest complete step_N of run_dir
    checkpointer.load(path, parts) -> TrainerState              # collective, in place, any saved layout

``load`` can run at any time (a rollback), not only at start-up: it writes into the live
tensors and returns the ``TrainerState`` to continue from. Errors are ``CheckpointError``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from meshlm.checkpoint.files import (CHECKPOINTS_DIR, COMPLETE_FILE, CONFIG_FILE, FORMAT_NAME, FORMAT_VERSION,
                                     RUN_CONFIG_FILE, STATE_FILE, TRAINING_FILE, copy_tokenizer, file_checksum,
                                     fsync_directory, replace_directory)
from meshlm.checkpoint.folders import latest_checkpoint, prune_checkpoints
from meshlm.checkpoint.global_state import GlobalTensor, TrainingParts, layout_of, optimizer_scalars, training_tensors
from meshlm.checkpoint.loading import load_checkpoint, resume_warnings
from meshlm.checkpoint.planners import ChunkSavePlanner
from meshlm.checkpoint.training_checkpoint import TrainerState, capture_rng_state
from meshlm.errors import CheckpointError
from meshlm.parallel.collectives import all_gather_objects, broadcast_objects, gather_objects, group_rank
from meshlm.parallel.groups import group_of


# --- what a save writes -------------------------------------------------------------------------------
def own_chunks(tensors: dict[str, GlobalTensor], group, cache: dict | None = None) -> dict[str, GlobalTensor]:
    """The chunks this rank writes: a chunk that several ranks hold (a replica over DP, over TP
    for a replicated weight, ...) goes to one of them, the least loaded so far, biggest chunks
    first -- the same answer on every rank from one all-gather of the chunk lists (no data).
    Replicas are then neither staged nor written twice (DCP would deduplicate them too, but
    only after every rank had staged its copy). ``cache`` keeps the answer for the next save
    while this rank's chunk list is unchanged (a run's shapes and layout do not change)."""
    if group is None:
        return tensors
    mine = [(key, offsets, view.numel() * view.element_size()) for key, tensor in tensors.items()
            for offsets, view in tensor.chunks]
    if cache is not None and cache.get("mine") == mine:
        writer = cache["writer"]
    else:
        writer = assign_writers(mine, group)
        if cache is not None:
            cache.update(mine=mine, writer=writer)
    rank = group.rank
    kept = {key: GlobalTensor(tensor.shape, tensor.dtype, [(offsets, view) for offsets, view in tensor.chunks
                                                           if writer[(key, offsets)] == rank])
            for key, tensor in tensors.items()}
    return {key: tensor for key, tensor in kept.items() if tensor.chunks}


def assign_writers(mine: list[tuple], group) -> dict:
    """{(key, offsets): the rank that writes the chunk}, from every rank's (key, offsets, bytes) list."""
    everyone = all_gather_objects(mine, group)
    holders, sizes = {}, {}
    for rank, chunks in enumerate(everyone):
        for key, offsets, size in chunks:
            holders.setdefault((key, offsets), []).append(rank)
            sizes[(key, offsets)] = size
    load, writer = [0] * len(everyone), {}
    for chunk in sorted(holders, key=lambda item: (-sizes[item], item)):
        writer[chunk] = min(holders[chunk], key=lambda rank: (load[rank], rank))
        load[writer[chunk]] += sizes[chunk]
    return writer


class SaveRequest:
    """Everything one save writes, captured on the calling thread (so the run may go on)."""

    def __init__(self, directory: Path, state: TrainerState, parts: TrainingParts, run_config,
                 tokenizer_file: Path | None, keep: int, group, cache: dict | None = None):
        """``cache``: a dict kept between one run's saves (the chunk assignment, the rendered configs)."""
        cache = {} if cache is None else cache
        self.directory, self.keep, self.group = Path(directory), keep, group
        best = state.best_val_step
        self.protected = frozenset({best}) if run_config.train.keep_best and best else frozenset()
        """The best validation step's checkpoint, which pruning keeps (train.keep_best)."""
        self.tensors = own_chunks(training_tensors(parts), group, cache.setdefault("writers", {}))
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.objects = {f"rng/{rank}": capture_rng_state()}
        scaler = getattr(parts.precision, "scaler", None)
        training = {"step": state.step, "layout": layout_of(parts.context, run_config),
                    "optimizers": optimizer_scalars(parts.optimizer),
                    "loss_scaler": scaler.state_dict() if scaler is not None else None}
        if "configs" not in cache:  # the run's config does not change between saves
            config = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "model": run_config.model.to_dict(),
                      "run": run_config.to_dict()}
            cache["configs"] = {CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True) + "\n",
                                RUN_CONFIG_FILE: yaml.safe_dump(run_config.to_dict(), sort_keys=False)}
        self.files = {**cache["configs"],
                      STATE_FILE: json.dumps(asdict(state), indent=2, sort_keys=True) + "\n",
                      TRAINING_FILE: json.dumps(training, indent=2, sort_keys=True) + "\n"}
        self.tokenizer_file = Path(tokenizer_file) if tokenizer_file is not None else None

    def stage(self, buffers: dict) -> None:
        """Copy every chunk into a CPU buffer (kept in ``buffers`` for the next save): after this,
        training may change the live tensors while the copies are written."""
        staged = {}
        for key, tensor in self.tensors.items():
            chunks = []
            for offsets, view in tensor.chunks:
                buffer = buffers.get((key, offsets))
                if buffer is None or buffer.shape != view.shape or buffer.dtype != view.dtype:
                    buffer = torch.empty(view.shape, dtype=view.dtype, pin_memory=view.is_cuda)
                    buffers[(key, offsets)] = buffer
                buffer.copy_(view.detach(), non_blocking=True)
                chunks.append((offsets, buffer))
            staged[key] = GlobalTensor(tensor.shape, tensor.dtype, chunks)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.tensors = staged

    # --- the collective write and commit ------------------------------------------------------------
    def write(self) -> Path:
        """Write the shards into a temporary folder and commit it; collective over ``self.group``."""
        rank, group = group_rank(self.group), self.group
        token = broadcast_objects([secrets.token_hex(4) if rank == 0 else None], group)
        temporary = self.directory.with_name(f"{self.directory.name}.tmp-{token[0]}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP warns about single-process use and overwrites
                dcp.save({}, storage_writer=FileSystemWriter(temporary, sync_files=True),
                         planner=ChunkSavePlanner(self.tensors, self.objects),
                         process_group=group.process_group if group is not None else None, no_dist=group is None)
            sums = {path.name: file_checksum(path) for path in temporary.glob(f"__{rank}_*")}
        except BaseException:
            if rank == 0:
                shutil.rmtree(temporary, ignore_errors=True)
            raise
        gathered = gather_objects(sums, group)
        status = broadcast_objects([self._commit(temporary, gathered) if rank == 0 else None], group)
        if status[0] != "ok":
            raise CheckpointError(f"saving {self.directory} failed on rank 0: {status[0]}")
        return self.directory

    def _commit(self, temporary: Path, rank_sums: list[dict]) -> str:
        """Rank 0: small files, completion marker last, rename, prune. Returns "ok" or the error."""
        try:
            for name, text in self.files.items():
                (temporary / name).write_text(text)
            if self.tokenizer_file is not None:
                copy_tokenizer(self.tokenizer_file, temporary)
            sums = {name: value for entry in rank_sums for name, value in entry.items()}
            for path in temporary.iterdir():
                if path.name not in sums:
                    sums[path.name] = file_checksum(path)
            marker = {"step": json.loads(self.files[STATE_FILE])["step"], "files": sums}
            with open(temporary / COMPLETE_FILE, "w") as stream:
                stream.write(json.dumps(marker, indent=2, sort_keys=True) + "\n")
                stream.flush()
                os.fsync(stream.fileno())
            replace_directory(temporary, self.directory)
            fsync_directory(self.directory.parent)
            prune_checkpoints(self.directory.parent.parent, self.keep, self.protected)
            return "ok"
        except Exception as error:  # reported to every rank by the caller
            shutil.rmtree(temporary, ignore_errors=True)
            return f"{type(error).__name__}: {error}"


# --- the trainer's interface --------------------------------------------------------------------------
class Checkpointer:
    """Saves and restores one run's checkpoints (``RUN_DIR/checkpoints/step_N``).

    Build it on every rank at the same point (it creates the process group DCP uses); then
    ``save`` (collective; asynchronous when asked), ``wait`` (for an asynchronous save),
    ``latest`` and ``load`` (collective, in place). ``run_config`` is the run's ``RunConfig``.
    """

    def __init__(self, run_dir, run_config, context=None, tokenizer_file: Path | None = None,
                 keep: int | None = None, group=None):
        self.run_dir, self.run_config, self.context = Path(run_dir), run_config, context
        self.tokenizer_file = tokenizer_file
        self.keep = run_config.train.keep_checkpoints if keep is None else keep
        self.group = group
        """The ``Group`` of DCP's collectives: every rank; by default a new gloo group of its own
        ("checkpoint", carrying objects through the CPU). It is not recorded by
        ``parallel.check_collectives``: an asynchronous save uses it from a background thread
        while training goes on, on a communicator of its own."""
        if group is None and context is not None and context.distributed:
            import datetime

            self.group = group_of(dist.new_group(backend="gloo",
                                                 timeout=datetime.timedelta(seconds=run_config.parallel.timeout_s)),
                                  "checkpoint", torch.device("cpu"))
        self.staging: dict = {}
        """CPU buffers of asynchronous saves, reused by the next one."""
        self.cache: dict = {}
        """What stays the same between saves: the chunk-to-writer assignment, the rendered configs."""
        self.thread: threading.Thread | None = None
        self.pending_error: BaseException | None = None
        self.pending_path: Path | None = None

    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run (after any save in flight has committed)."""
        self.wait()
        return latest_checkpoint(self.run_dir)

    def save(self, state: TrainerState, parts: TrainingParts, async_save: bool = False) -> Path:
        """Save ``checkpoints/step_{state.step}``; collective over every rank. With ``async_save``
        the call returns once this rank's chunks are staged; the path is final after ``wait()``."""
        self.wait()
        request = SaveRequest(self.run_dir / CHECKPOINTS_DIR / f"step_{state.step}", state, parts, self.run_config,
                              self.tokenizer_file, self.keep, self.group, self.cache)
        if not async_save:
            return request.write()
        request.stage(self.staging)
        self.pending_path = request.directory
        self.thread = threading.Thread(target=self._write_in_background, args=(request,), daemon=True,
                                       name="meshlm-checkpoint-save")
        self.thread.start()
        return request.directory

    def _write_in_background(self, request: SaveRequest) -> None:
        try:
            request.write()
        except BaseException as error:  # re-raised by wait() on the training thread
            self.pending_error = error

    def wait(self) -> Path | None:
        """Wait for the asynchronous save in flight (if any); raise its error; return its path."""
        if self.thread is None:
            return None
        self.thread.join()
        self.thread, path = None, self.pending_path
        error, self.pending_error = self.pending_error, None
        if error is not None:
            raise error
        return path

    @property
    def saving(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def load(self, directory: Path, parts: TrainingParts) -> TrainerState:
        """Restore ``parts`` in place from ``directory`` (saved at any layout); collective."""
        self.wait()
        state = load_checkpoint(directory, parts, self.run_config, self.group)
        if group_rank(self.group) == 0:
            for message in resume_warnings(Path(directory), self.run_config,
                                           getattr(parts.context, "dp_size", 1)):
                warnings.warn(message, stacklevel=2)
        return state


def save_checkpoint(run_dir: str | os.PathLike, state: TrainerState, model: torch.nn.Module, optimizer, precision,
                    run_config, keep: int, tokenizer_file: Path | None = None, context=None) -> Path:
    """Write ``checkpoints/step_{state.step}`` (collective when ``context`` is distributed) and keep
    the newest ``keep``. A convenience over ``Checkpointer``."""
    distributed = context is not None and context.distributed
    checkpointer = Checkpointer(run_dir, run_config, context, tokenizer_file=tokenizer_file, keep=keep,
                                group=context.world_group if distributed else None)
    return checkpointer.save(state, TrainingParts(model, optimizer, precision, context))


__all__ = ["Checkpointer", "SaveRequest", "save_checkpoint"]
