"""Tokens/s and MFU of ``meshlm train``'s step against a plain-PyTorch loop, in the same run.

    python -m bench.train_throughput [--dtypes fp32 bf16] [--repeats 5] [--steps 2]

The model is a dense GPT of about 25M parameters (6 attention + MLP layers, hidden 512, 8
heads, seq 256, vocab 8192, micro-batch 8, tied embeddings, SwiGLU). The meshlm side is the
real trainer (``Trainer.train_step``: data read from a token store, forward, backward,
gradient hand-off to the masters, clipping, AdamW); the reference is ``bench/reference_gpt.py``
on random tokens. The two are timed alternately, ``--repeats`` times, ``--steps`` steps each
after a warmup, and the medians are reported, so machine noise hits both alike.

MFU = model FLOPs per token (``meshlm.models.flops``, training = 3 x forward, no
recomputation) x tokens/s / peak, where the peak is a large matmul measured at start-up in the
run's dtype on this machine (the same number the trainer logs on CPU). Prints one JSON object
per dtype and a summary line. The trainer's glibc malloc setting (``train.keep_freed_cpu_memory``,
see ``meshlm/training/cpu_allocator.py``) is process-wide, so it holds for both loops alike;
``--no-keep-freed-memory`` measures both without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.reference_gpt import ReferenceGPT, ReferenceTrainer
from meshlm.config import load_run_config
from meshlm.data.indexed import TokenStoreWriter
from meshlm.models.flops import model_flops_per_token
from meshlm.training.metrics import measured_peak_flops
from meshlm.training.trainer import Trainer

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, MICRO_BATCH = 8192, 512, 6, 8, 256, 8


def write_random_corpus(prefix: Path, num_tokens: int, seed: int = 0, vocab_size: int = VOCAB,
                        document_lengths: tuple[int, int] = (200, 2000), tokens_per_document: int = 1000) -> None:
    """A token store of random documents: ``num_tokens // tokens_per_document`` of them, each of a
    length drawn from ``document_lengths``, every token uniform over the vocabulary."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(*document_lengths, size=max(1, num_tokens // tokens_per_document))
    with TokenStoreWriter(prefix, vocab_size) as writer:
        writer.add_documents(rng.integers(0, vocab_size, size=int(lengths.sum())), lengths)


def meshlm_trainer(data_prefix: Path, run_dir: Path, dtype: str, keep_freed_memory: bool = True) -> Trainer:
    overrides = [
        f"model.vocab_size={VOCAB}", f"model.hidden_size={HIDDEN}", f"model.pattern={'*-' * LAYERS}",
        f"model.num_attention_heads={HEADS}", "model.tie_embeddings=true", "model.mlp_activation=swiglu",
        f"train.seq_len={SEQ}", f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={MICRO_BATCH}",
        "train.steps=1000", "train.eval_every=0", "train.save_every=0", "train.tensorboard=false",
        "train.progress=false", f"train.run_dir={run_dir}", f"precision.dtype={dtype}",
        f"data.prefixes=[{data_prefix}]", "data.blend=null", "data.split=100,0,0",
        f"train.keep_freed_cpu_memory={str(keep_freed_memory).lower()}",
    ]
    return Trainer(load_run_config(None, overrides))


def reference_trainer(config, dtype: str) -> ReferenceTrainer:
    model = ReferenceGPT(VOCAB, HIDDEN, LAYERS, HEADS, config.model.resolved_ffn_hidden_size)
    return ReferenceTrainer(model, dtype)


def time_steps(step, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps


def measure(dtype: str, repeats: int, steps: int, workdir: Path, keep_freed_memory: bool = True) -> dict:
    torch.manual_seed(0)
    trainer = meshlm_trainer(workdir / "random", workdir / f"run-{dtype}", dtype, keep_freed_memory)
    reference = reference_trainer(trainer.config, dtype)
    batch = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1))
    reference_step = lambda: reference.train_step(batch[:, :-1], batch[:, 1:])  # noqa: E731
    for _ in range(2):  # warmup: allocator, autotuning, first-touch
        trainer.train_step()
        reference_step()
    meshlm_times, reference_times = [], []
    for _ in range(repeats):
        meshlm_times.append(time_steps(trainer.train_step, steps))
        reference_times.append(time_steps(reference_step, steps))
    tokens = MICRO_BATCH * SEQ
    flops_per_token = model_flops_per_token(trainer.config.model, SEQ)
    peak, _ = measured_peak_flops("cpu", dtype)
    meshlm_tps = tokens / statistics.median(meshlm_times)
    reference_tps = tokens / statistics.median(reference_times)
    return {
        "dtype": dtype, "threads": torch.get_num_threads(), "keep_freed_cpu_memory": keep_freed_memory,
        "parameters": trainer.model.num_parameters(),
        "reference_parameters": sum(p.numel() for p in reference.model.parameters()),
        "tokens_per_step": tokens, "repeats": repeats, "steps_per_repeat": steps,
        "meshlm_step_s": [round(t, 4) for t in meshlm_times],
        "reference_step_s": [round(t, 4) for t in reference_times],
        "meshlm_tokens_per_s": round(meshlm_tps, 1), "reference_tokens_per_s": round(reference_tps, 1),
        "ratio_meshlm_over_reference": round(meshlm_tps / reference_tps, 4),
        "flops_per_token": flops_per_token, "peak_flops_measured": peak,
        "meshlm_mfu": round(flops_per_token * meshlm_tps / peak, 4),
        "reference_mfu": round(flops_per_token * reference_tps / peak, 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-keep-freed-memory", action="store_true",
                        help="leave glibc malloc at its defaults (the trainer's train.keep_freed_cpu_memory=false); "
                             "a process-wide setting, so it applies to the reference loop too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        write_random_corpus(workdir / "random", 2_000_000)
        results = [measure(dtype, args.repeats, args.steps, workdir, not args.no_keep_freed_memory)
                   for dtype in args.dtypes]
    for result in results:
        print(json.dumps(result))
    print(json.dumps({"summary": {r["dtype"]: {"ratio": r["ratio_meshlm_over_reference"], "mfu": r["meshlm_mfu"]}
                                  for r in results}}))


if __name__ == "__main__":
    main()
