"""Checkpoint save/load time and bytes per rank, synchronous vs asynchronous, against raw I/O.

    python -m bench.checkpoint_io [--world 2] [--layout tp2|dp2|dp2-zero|...] [--hidden 512]
                                  [--blocks 8] [--repeats 3] [--dir /fast/disk]

A dense model (pattern ``*-`` repeated) trains with the real ``Trainer`` in ``--world`` spawned
gloo processes on CPU. Each rank measures, after warm-up steps (medians of ``--repeats``):

* ``step_s``: a training step without any save;
* ``sync_save_s``: ``Checkpointer.save`` (plan, write + fsync, CRC-32, commit), the whole
  collective as this rank sees it; ``bytes_written``: this rank's shard file; ``state_bytes``:
  the bytes of weights, fp32 masters and Adam moments this rank holds (replicas included, so a
  replicated tensor is written by one of its holders only: bytes_written sums to the checkpoint);
* ``raw_torch_save_s``: ``torch.save`` of the same tensors into one file + fsync -- the disk's
  speed for these bytes, the baseline the sharded save is compared with;
* ``load_s``: ``Checkpointer.load`` of that checkpoint in place (checks, CRC-32 of the files
  read, DCP read, derived state);
* asynchronous save (``train.async_save``): ``async_blocking_s`` is what the step that issues
  the save waits for (listing the chunks and agreeing which replica writes each -- one small
  all-gather, cached after the first save --, capturing the scalars and RNG states, copying
  this rank's chunks to CPU staging buffers, starting the thread); then steps run while the
  shard is written (``steps_in_flight`` of them; their mean ``in_flight_step_s`` against
  ``step_s`` shows the writer thread's contention for CPU and disk); ``async_total_s`` until
  the commit. The target of the issue: ``async_blocking_s`` < 10% of ``sync_save_s``
  (``stall_over_sync``).

JSON on stdout: per rank, and the slowest rank (what the job waits for).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tests.helpers.distributed import run_distributed

LAYOUTS = {"dp2": ["parallel.dp=2"], "dp2-zero": ["parallel.dp=2", "parallel.distributed_optimizer=true"],
           "tp2": ["parallel.tp=2"], "tp2xdp2": ["parallel.tp=2", "parallel.dp=2"],
           "tp2xdp2-zero": ["parallel.tp=2", "parallel.dp=2", "parallel.distributed_optimizer=true"],
           "single": []}


def overrides_for(args, blend: Path, run_dir: Path) -> list[str]:
    return [f"model.vocab_size={args.vocab}", f"model.hidden_size={args.hidden}",
            f"model.pattern={'*-' * args.blocks}", "model.num_attention_heads=8",
            f"precision.dtype={args.dtype}", f"train.seq_len={args.seq_len}", "train.micro_batch_size=2",
            f"train.global_batch_size={2 * args.world}", "train.steps=1000", "train.eval_every=0",
            "train.save_every=0", "train.keep_checkpoints=2", "train.progress=false", "train.tensorboard=false",
            "train.plot=false", "train.device=cpu", f"train.run_dir={run_dir}", f"data.blend={blend}",
            "data.split=100,0,0", *LAYOUTS[args.layout]]


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def state_tensors(trainer) -> list[torch.Tensor]:
    from meshlm.checkpoint.global_state import training_tensors

    return [view for tensor in training_tensors(trainer.training_parts()).values() for _, view in tensor.chunks]


def raw_save(tensors: list[torch.Tensor], path: Path) -> None:
    with open(path, "wb") as stream:
        torch.save([tensor.detach().clone() for tensor in tensors], stream)
        stream.flush()
        os.fsync(stream.fileno())


def measure(args, blend: str, root: str) -> dict:
    """In each spawned rank: the measurements of the module docstring."""
    import torch.distributed as dist

    from meshlm.config import load_run_config
    from meshlm.training.trainer import Trainer

    torch.set_num_threads(args.threads)
    rank = dist.get_rank()
    trainer = Trainer(load_run_config(None, overrides_for(args, Path(blend), Path(root) / "run")))
    for _ in range(2):
        trainer.train_step()
    steps = [timed(trainer.train_step) for _ in range(args.repeats)]
    parts, checkpoints = trainer.training_parts(), trainer.checkpoints
    sync = [timed(lambda: checkpoints.save(trainer.state, parts)) for _ in range(args.repeats)]
    path = checkpoints.latest()
    written = sum(file.stat().st_size for file in path.glob(f"__{rank}_*"))
    tensors = state_tensors(trainer)
    raw = [timed(lambda: raw_save(tensors, Path(root) / f"raw_{rank}.pt")) for _ in range(args.repeats)]
    loads = [timed(lambda: checkpoints.load(path, parts)) for _ in range(args.repeats)]
    blocking, totals, in_flight = [], [], []
    for _ in range(args.repeats):
        trainer.train_step()  # a new step number, so each save writes a new folder
        dist.barrier()
        started = time.perf_counter()
        checkpoints.save(trainer.state, parts, async_save=True)
        blocking.append(time.perf_counter() - started)
        while True:  # every rank must take the same number of steps: agree on whether the save is done
            done = torch.tensor([0 if checkpoints.saving else 1])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                break
            in_flight.append(timed(trainer.train_step))
        checkpoints.wait()
        totals.append(time.perf_counter() - started)
    return {"step_s": statistics.median(steps), "sync_save_s": statistics.median(sync),
            "bytes_written": written, "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "raw_torch_save_s": statistics.median(raw), "load_s": statistics.median(loads),
            "async_blocking_s": statistics.median(blocking), "async_total_s": statistics.median(totals),
            "steps_in_flight": len(in_flight) / args.repeats,
            "in_flight_step_s": statistics.mean(in_flight) if in_flight else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dp2-zero")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4, help="attention+MLP pairs")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    args = parser.parse_args(argv)
    from bench.communication import write_random_corpus
    from meshlm.config import load_run_config
    from meshlm.models.language_model import LanguageModel

    with tempfile.TemporaryDirectory(prefix="meshlm_ckpt_io_", dir=args.dir) as folder:
        blend = write_random_corpus(Path(folder) / "corpus")
        config = load_run_config(None, overrides_for(args, blend, Path(folder) / "x"))
        num_parameters = LanguageModel(config.model).num_parameters()
        by_rank = run_distributed(measure, args.world, args, str(blend), folder, timeout_s=1200)
    slowest = {key: max(rank[key] for rank in by_rank) for key in
               ("step_s", "sync_save_s", "raw_torch_save_s", "load_s", "async_blocking_s", "async_total_s")}
    report = {"model": {"hidden": args.hidden, "blocks": 2 * args.blocks, "num_parameters": num_parameters,
                        "dtype": args.dtype},
              "layout": args.layout, "world": args.world, "per_rank": by_rank, "slowest_rank": slowest,
              "checkpoint_bytes": sum(rank["bytes_written"] for rank in by_rank),
              "stall_over_sync": slowest["async_blocking_s"] / slowest["sync_save_s"],
              "sync_over_raw_torch_save": slowest["sync_save_s"] / slowest["raw_torch_save_s"]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
