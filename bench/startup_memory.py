"""Peak host memory of every rank of a real training run, against the one-process run's peak.

    python -m bench.startup_memory [--hidden 1536] [--blocks 24] [--vocab 32768] [--layouts tp2,tp4,tp4xpp2]

A model of about 0.55B parameters (24 blocks of attention/MLP, hidden 1536) is started by the
real ``Trainer`` and trains one step, once in one process and then at tp 2, tp 4 and tp 4 x pp 2
(spawned gloo processes, fresh ones for every layout, so each process's high-water mark is its
own). Every rank reports its peak resident memory (``VmHWM`` from /proc/self/status, which
counts the interpreter, torch's libraries, the allocator's caching and every transient) and its
*own state*: the bytes of the storages of its parameters, gradients and optimizer state.

Since construction is sharded (``meshlm/training/build.py``), no rank holds the whole model:
the target is a worst rank at most 1/N of the one-process peak + the largest single parameter +
300 MB (the interpreter and libraries), and at tp 4 x pp 2 at most 0.2 of the one-process peak.
Printed as JSON: one row per layout with every rank's figures, the ratio to the one-process peak,
the bound and whether it holds. Measured in the same run, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

MB = 2 ** 20
LAYOUTS = {"tp1": dict(tp=1, pp=1), "tp2": dict(tp=2, pp=1), "tp4": dict(tp=4, pp=1), "tp4xpp2": dict(tp=4, pp=2)}


def peak_resident_bytes() -> int:
    from meshlm.training.memory_usage import resident_bytes

    peak = resident_bytes("VmHWM")
    if peak is None:
        raise RuntimeError("no VmHWM in /proc/self/status (this benchmark needs Linux)")
    return peak


def overrides(args, blend: Path, run_dir: Path, tp: int, pp: int) -> list[str]:
    return [f"model.vocab_size={args.vocab}", f"model.hidden_size={args.hidden}",
            f"model.num_attention_heads={args.heads}", f"model.ffn_hidden_size={4 * args.hidden}",
            f"model.pattern={'*-' * (args.blocks // 2)}", f"train.seq_len={args.seq_len}", "train.micro_batch_size=1",
            f"train.global_batch_size={2 * pp}", "train.steps=1", "train.eval_every=0",
            "train.progress=false", "train.tensorboard=false", "train.plot=false", "train.device=cpu",
            f"train.run_dir={run_dir}", f"data.blend={blend}", "data.split=90,10,0",
            f"parallel.tp={tp}", f"parallel.pp={pp}"]


def run_rank(values: list[str]) -> dict:
    """In one spawned process: build the Trainer, train one step, report the peak and own state."""
    from bench.memory import measured_bytes  # the rank's parameters, masters, gradients and optimizer state
    from meshlm.config import load_run_config
    from meshlm.training.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(load_run_config(None, values))
    trainer.train_step()  # one step (Adam's moments exist from here on), no logs and no checkpoint
    largest = max(param.numel() for param in trainer.model.parameters())
    return {"peak_bytes": peak_resident_bytes(), "own_state_bytes": sum(measured_bytes(trainer).values()),
            "num_parameters": trainer.num_parameters, "largest_local_parameter": largest}


def largest_parameter_bytes(args) -> int:
    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel

    with torch.device("meta"):
        model = LanguageModel(ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                          num_attention_heads=args.heads, ffn_hidden_size=4 * args.hidden,
                                          pattern="*-" * (args.blocks // 2)), seed=0)
    return max(param.numel() * 4 for param in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layouts", default="tp2,tp4,tp4xpp2")
    args = parser.parse_args()

    from bench import startup_memory  # spawned ranks import the function by module name, which "__main__" is not
    from tests.helpers.distributed import run_distributed
    from tests.training.conftest import write_corpus

    root = Path(tempfile.mkdtemp(prefix="startup-memory-"))
    blend = write_corpus(root / "corpus")
    largest = largest_parameter_bytes(args)
    rows = []
    single = run_distributed(startup_memory.run_rank, 1, overrides(args, blend, root / "tp1", 1, 1),
                             fresh_processes=True, timeout_s=1800)[0]
    one_process_peak = single["peak_bytes"]
    rows.append({"layout": "one process", "world": 1, "ranks": [single]})
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        world = layout["tp"] * layout["pp"]
        ranks = run_distributed(startup_memory.run_rank, world, overrides(args, blend, root / name, **layout),
                                fresh_processes=True, timeout_s=1800)
        worst = max(rank["peak_bytes"] for rank in ranks)
        bound = one_process_peak / world + largest + 300 * MB
        row = {"layout": name, "world": world, "worst_rank_peak_mb": round(worst / MB),
               "worst_over_one_process": round(worst / one_process_peak, 3),
               "bound_mb": round(bound / MB), "within_bound": worst <= bound,
               "ranks": [{"peak_mb": round(rank["peak_bytes"] / MB), "own_state_mb": round(rank["own_state_bytes"] / MB)}
                         for rank in ranks]}
        if name == "tp4xpp2":
            row["target_0.2_of_one_process"] = worst <= 0.2 * one_process_peak
        rows.append(row)
    rows[0] = {"layout": "one process", "world": 1, "peak_mb": round(one_process_peak / MB),
               "own_state_mb": round(single["own_state_bytes"] / MB), "num_parameters": single["num_parameters"],
               "largest_parameter_mb": round(largest / MB)}
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
