"""LoRA fine-tuning against full fine-tuning of the same model: step time and training-state memory.

    python -m bench.lora [--device auto] [--dtype auto] [--layers 4] [--hidden 512] [--rank 16] [--repeats 5]
                         [--steps 3] [--dropout 0.1]

A dense Llama-style model (``--layers`` attention + SwiGLU MLP pairs, vocab 8192, seq 256, micro-
batch 4) is fine-tuned by the real trainer (``Trainer.train_step``: data, forward, backward,
clipping, AdamW) on random tokens, once with every weight trained and once with ``model.lora_rank``
adapters on every linear layer of the blocks (``meshlm/models/lora.py``), in ``--dtype`` (auto: the
device's default, bf16 on a GPU, fp32 on a CPU). Both are timed alternately, ``--repeats`` rounds
of ``--steps`` steps each after one untimed step (``bench/timing.py``), and compared by their
median seconds per step (``speedup`` = full / LoRA). Memory is the training state each holds
between steps, counted from the tensors: weights, fp32 masters (bf16 runs) and AdamW's moments
(``state_ratio`` = full / LoRA; the gradients, released after each step, are not in it). Also
printed: the trainable share and the model FLOPs per token each step is counted at (a LoRA step
needs no weight gradient of the frozen weights: ``meshlm/models/flops.py``). A third run, timed in
the same rounds, drops ``--dropout`` of the adapters' inputs (``model.lora_dropout``: a hash of
each element's coordinates, then a masked copy per adapted layer): ``dropout_cost`` = its median
step over the plain LoRA step's (``--dropout 0`` leaves it out). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from bench.timing import interleaved_medians, timed_steps
from bench.train_throughput import write_random_corpus
from meshlm.config import load_run_config
from meshlm.models.flops import model_flops_per_token
from meshlm.training.trainer import Trainer

VOCAB, SEQ, MICRO_BATCH = 8192, 256, 4


def build_trainer(args, data_prefix: Path, run_dir: Path, rank: int, dropout: float = 0.0) -> Trainer:
    overrides = [
        f"model.vocab_size={VOCAB}", f"model.hidden_size={args.hidden}", f"model.pattern={'*-' * args.layers}",
        f"model.num_attention_heads={args.hidden // 64}", f"model.lora_rank={rank}", f"model.lora_dropout={dropout}",
        f"train.seq_len={SEQ}", f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={MICRO_BATCH}",
        "train.steps=1000", "train.eval_every=0", "train.save_every=0", "train.tensorboard=false",
        "train.progress=false", "train.plot=false", f"train.run_dir={run_dir}", f"train.device={args.device}",
        f"precision.dtype={args.dtype}",
        f"data.prefixes=[{data_prefix}]", "data.blend=null", "data.split=100,0,0",
    ]
    return Trainer(load_run_config(None, overrides))


def tensor_bytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)


def state_bytes(trainer: Trainer) -> dict[str, int]:
    """The training state ``trainer`` holds, by kind, counted from its tensors (each storage once)."""
    parameters = list(trainer.model.parameters())
    own = {id(parameter) for parameter in parameters}
    masters = [master for master in trainer.master_parameters if id(master) not in own]
    moments = [value for state in trainer.optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor) and value.dim() > 0]
    return {"weights": tensor_bytes(parameters), "masters": tensor_bytes(masters), "optimizer": tensor_bytes(moments)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"), help="precision.dtype")
    parser.add_argument("--layers", type=int, default=4, help="attention + MLP pairs")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 64)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (medians are compared)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--dropout", type=float, default=0.1, help="model.lora_dropout of the third run (0: none)")
    args = parser.parse_args(argv)
    problems = [f"--{name} {getattr(args, name)} must be at least 1" for name in ("layers", "rank", "repeats", "steps")
                if getattr(args, name) < 1]
    if not 0 <= args.dropout < 1:
        problems.append(f"--dropout {args.dropout} must be a probability in [0, 1)")
    if args.hidden < 64 or args.hidden % 64:
        problems.append(f"--hidden {args.hidden} must be a positive multiple of 64 (heads of 64)")
    if problems:
        print(f"bench.lora: {problems[0]}.", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_random_corpus(root / "corpus", 400_000, vocab_size=VOCAB)
        trainers = {"full": build_trainer(args, root / "corpus", root / "full", 0),
                    "lora": build_trainer(args, root / "corpus", root / "lora", args.rank)}
        if args.dropout:
            trainers["lora_dropout"] = build_trainer(args, root / "corpus", root / "lora_dropout", args.rank,
                                                     args.dropout)
        seconds = interleaved_medians({name: (lambda trainer=trainer: timed_steps(trainer, args.steps))
                                       for name, trainer in trainers.items()}, args.repeats)
        states = {name: state_bytes(trainer) for name, trainer in trainers.items() if name != "lora_dropout"}
        lora = trainers["lora"]
        record = {
            "bench": "lora", "device": str(lora.device), "dtype": lora.config.precision.dtype,
            "torch": torch.__version__, "layers": args.layers, "hidden": args.hidden, "rank": args.rank,
            "seq_len": SEQ, "micro_batch": MICRO_BATCH, "repeats": args.repeats, "steps": args.steps,
            "parameters": lora.num_parameters, "trainable": lora.num_trainable,
            "trainable_fraction": lora.num_trainable / lora.num_parameters,
            "seconds_per_step": seconds, "speedup": seconds["full"] / seconds["lora"],
            "dropout": args.dropout,
            "dropout_cost": seconds["lora_dropout"] / seconds["lora"] if args.dropout else None,
            "state_bytes": states,
            "state_ratio": sum(states["full"].values()) / sum(states["lora"].values()),
            "flops_per_token": {name: model_flops_per_token(trainer.config.model, SEQ)
                                for name, trainer in trainers.items()},
        }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
