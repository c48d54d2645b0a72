"""Training-step time with ``train.compile=true`` (each block under torch.compile) against eager.

    python -m bench.compile [--device auto] [--repeats 5] [--steps 3] [--layers 4] [--hidden 256]

The model is a small dense GPT (``--layers`` attention + MLP pairs, SwiGLU, tied embeddings,
vocab 4096, seq 256, micro-batch 8) trained by the real trainer (``Trainer.train_step``: data,
forward, backward, clipping, AdamW) on random tokens, in the device's default dtype (bf16 on a
GPU, fp32 on a CPU). Both trainers start from the same weights and read the same batches. The
compiled one takes its first step alone (that step pays for compiling: ``compile_seconds``);
then both are timed alternately, ``--repeats`` rounds of ``--steps`` steps each, and the median
seconds per step are compared (``speedup`` = eager / compiled), so machine noise hits both
alike. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.timing import interleaved_medians, synchronize, timed_steps
from bench.train_throughput import write_random_corpus
from meshlm.config import load_run_config
from meshlm.training.compile import compile_blocks
from meshlm.training.trainer import Trainer

VOCAB, SEQ, MICRO_BATCH = 4096, 256, 8


def build_trainer(args, data_prefix: Path, run_dir: Path) -> Trainer:
    overrides = [
        f"model.vocab_size={VOCAB}", f"model.hidden_size={args.hidden}", f"model.pattern={'*-' * args.layers}",
        f"model.num_attention_heads={args.hidden // 64}", "model.tie_embeddings=true", "model.mlp_activation=swiglu",
        f"train.seq_len={SEQ}", f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={MICRO_BATCH}",
        "train.steps=1000", "train.eval_every=0", "train.save_every=0", "train.tensorboard=false",
        "train.progress=false", f"train.run_dir={run_dir}", f"train.device={args.device}",
        f"data.prefixes=[{data_prefix}]", "data.blend=null", "data.split=100,0,0",
    ]
    return Trainer(load_run_config(None, overrides))


def graphs_compiled() -> int:
    """Graphs TorchDynamo has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def graph_break_reasons() -> dict[str, int]:
    """Each graph-break reason's first line and how often TorchDynamo met it in this process so far."""
    from torch._dynamo.utils import counters
    reasons: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        first_line = (reason.strip().splitlines() or ["?"])[0][:200]
        reasons[first_line] = reasons.get(first_line, 0) + count
    return reasons


def measure(args, workdir: Path) -> dict:
    write_random_corpus(workdir / "random", (args.repeats + 2) * args.steps * MICRO_BATCH * SEQ * 4, vocab_size=VOCAB)
    eager = build_trainer(args, workdir / "random", workdir / "eager")
    compiled = build_trainer(args, workdir / "random", workdir / "compiled")
    notices = []
    compiled_blocks = compile_blocks(compiled.model, compiled.device, notices.append)
    first_losses = []
    started = time.perf_counter()
    first_losses.append(compiled.train_step().loss)  # compiles the block kinds' forward and backward
    synchronize(compiled.device)
    compile_seconds = time.perf_counter() - started
    first_losses.append(eager.train_step().loss)  # warm-up of the eager side, on the same batch
    medians = interleaved_medians({"eager": lambda: timed_steps(eager, args.steps),
                                   "compiled": lambda: timed_steps(compiled, args.steps)}, args.repeats)
    tokens = MICRO_BATCH * SEQ
    return {
        "device": str(eager.device) + (f" ({torch.cuda.get_device_name(eager.device)})"
                                       if eager.device.type == "cuda" else f" ({torch.get_num_threads()} threads)"),
        "dtype": eager.config.precision.dtype, "torch": torch.__version__,
        "model": f"{args.layers} x (attention + SwiGLU MLP), hidden {args.hidden}, vocab {VOCAB}, "
                 f"{eager.num_parameters / 1e6:.1f}M parameters",
        "tokens_per_step": tokens, "compiled_blocks": compiled_blocks, "fallback": notices[0] if notices else None,
        "compile_seconds": round(compile_seconds, 2),
        "first_step_loss": {"eager": first_losses[1], "compiled": first_losses[0]},
        "eager_step_ms": round(1e3 * medians["eager"], 2), "compiled_step_ms": round(1e3 * medians["compiled"], 2),
        "eager_tokens_per_s": round(tokens / medians["eager"]), "compiled_tokens_per_s": round(tokens / medians["compiled"]),
        "speedup": round(medians["eager"] / medians["compiled"], 3),
        "repeats": args.repeats, "steps_per_repeat": args.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        print(json.dumps(measure(args, Path(workdir)), indent=1))


if __name__ == "__main__":
    main()
