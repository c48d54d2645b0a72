"""Bytes each rank sends per training step under TP (SP off / on) and DP, measured beside the formula.

    python -m bench.communication [--hidden 64] [--seq-len 32] [--micro-batch-size 2]

A tiny dense model (pattern ``*-*-``: 2 attention + 2 MLP blocks) trains with the real
``Trainer`` in 2 spawned gloo processes at tp2, tp2 + SP, dp2 and dp2 with the distributed
optimizer. One warm-up step, then ``meshlm.parallel.comm_log.record_communication`` counts every
collective of one ``train_step`` on each rank: calls and message bytes per (kind, group). Printed
as JSON beside the analytic volume, with b = micro-batch size, s = sequence length, h = hidden
size, L = mixer blocks, k = micro-batches per rank per step (the step's micro-batches / dp),
4 bytes per fp32 element:

TP, no SP (Shoeybi et al. 2019, section 3): every block enters the parallel region once (f:
identity forward, all-reduce backward) and leaves it once (g: all-reduce forward), so per
micro-batch 2 L all-reduces of b s h elements -- "2 all-reduces forward and 2 backward per
transformer layer" when a layer is one attention and one MLP block.
TP + SP (Korthikanti et al. 2022, section 4.2.2): each all-reduce becomes an all-gather (entering)
and a reduce-scatter (leaving) of the same b s h tensor, forward and backward mirrored: 2 L of
each per micro-batch, the same ring bytes as the all-reduces they replace.
DP: one all-reduce of every gradient (N elements) per step, in buckets; with the distributed
optimizer a reduce-scatter of the gradient buffer and an all-gather of the value buffer (N plus
bucket padding each).

What the formula leaves out, and the bench counts as "extras" (each written out below): the
vocabulary-parallel embedding (an all-reduce forward; under SP a reduce-scatter forward and an
all-gather backward) and head (its input enters the parallel region: an all-reduce backward; under
SP an all-gather forward and a reduce-scatter backward), the vocab-parallel cross-entropy (an
all-reduce of the row maxima, b s, and one of the exp-sums with the target logits, 2 b s), the
sum of partial gradients of TP-replicated parameters over TP after the last micro-batch (SP: the
norm weights, one coalesced all-reduce), the global gradient norm (one scalar all-reduce over the
whole world, ``meshlm/parallel/data/grad_norm.py``; none under plain DP, where every rank holds the
whole reduced gradient) and, under DP, the logging all-reduce of the step's loss sums (a few
floats).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from tests.helpers.distributed import run_distributed

LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2 sp": ["parallel.tp=2", "parallel.sp=true"],
           "dp2": ["parallel.dp=2"], "dp2 dist-opt": ["parallel.dp=2", "parallel.distributed_optimizer=true"]}
PATTERN = "*-*-"
VOCAB = 64
FP32 = 4


def write_random_corpus(directory: Path) -> Path:
    from meshlm.data.indexed import TokenStoreWriter

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with TokenStoreWriter(directory / "corpus", vocab_size=VOCAB) as writer:
        for _ in range(64):
            writer.add_document(rng.integers(0, VOCAB, int(rng.integers(40, 120))))
    blend = directory / "blend.json"
    blend.write_text(json.dumps({"datasets": [{"prefix": "corpus", "weight": 1}]}))
    return blend


def overrides_for(args, blend: Path, run_dir: Path, layout: list[str]) -> list[str]:
    return [f"model.vocab_size={VOCAB}", f"model.hidden_size={args.hidden}", f"model.pattern={PATTERN}",
            "model.num_attention_heads=4", f"model.ffn_hidden_size={2 * args.hidden}",
            f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch_size}",
            f"train.global_batch_size={args.micro_batch_size * args.micro_batches_per_step}",
            "train.steps=10", "train.eval_every=0", "train.save_every=0", "train.progress=false",
            "train.tensorboard=false", "train.plot=false", "train.device=cpu", f"train.run_dir={run_dir}",
            f"data.blend={blend}", "data.split=100,0,0", "parallel.bucket_size_mb=0.05", *layout]


def measure(args, blend: str, root: str) -> dict:
    """In each spawned rank: one counted train_step per layout -> {layout: {kind@group: counts}}."""
    from meshlm.config import load_run_config
    from meshlm.parallel.comm_log import record_communication
    from meshlm.training.trainer import Trainer

    torch.set_num_threads(1)
    measured = {}
    for name, layout in LAYOUTS.items():
        trainer = Trainer(load_run_config(None, overrides_for(args, Path(blend), Path(root) / name, layout)))
        trainer.train_step()  # warm-up
        context = trainer.context
        with record_communication(labels={"tp": context.tp_group, "dp": context.dp_group}) as log:
            trainer.train_step()
        measured[name] = {f"{kind}@{group}": {"calls": count.calls, "bytes": count.bytes,
                                              "ring_bytes_sent": count.ring_bytes_sent}
                          for (kind, group), count in sorted(log.counts.items())}
        measured[name]["_buffer_elements"] = (trainer.reducer.layout.total if trainer.reducer is not None else 0)
        measured[name]["_partial_grad_elements"] = sum(
            param.numel() for name_, param in trainer.model.named_parameters() if name_ in trainer.partial_names)
    return measured


def analytic(args, layout: str, num_parameters: int, buffer_elements: int, partial_elements: int) -> tuple[dict, dict]:
    """(the formula's bytes by kind@group, the extras' bytes by kind@group) for one step of one rank."""
    dp = 2 if layout.startswith("dp") else 1
    b, s, h, k = args.micro_batch_size, args.seq_len, args.hidden, args.micro_batches_per_step // dp
    blocks, activation = len(PATTERN), b * s * h * FP32
    formula, extras = {}, {}

    def add(table, key, value):
        table[key] = table.get(key, 0) + value

    if layout == "tp2":
        add(formula, "all_reduce@tp", 2 * blocks * activation * k)
        add(extras, "all_reduce@tp", 2 * activation * k)  # embedding forward, head input backward
    elif layout == "tp2 sp":
        add(formula, "all_gather@tp", 2 * blocks * activation * k)
        add(formula, "reduce_scatter@tp", 2 * blocks * activation * k)
        add(extras, "all_gather@tp", 2 * activation * k)  # embedding backward, head input forward
        add(extras, "reduce_scatter@tp", 2 * activation * k)  # embedding forward, head input backward
        add(extras, "all_reduce@tp", partial_elements * FP32)  # norm weights' partial gradients
    if layout.startswith("tp"):
        add(extras, "all_reduce@tp", 3 * b * s * FP32 * k)  # cross-entropy statistics
        add(extras, "all_reduce@world", FP32)  # the grad norm: squares of owned elements, summed
    elif layout == "dp2":
        add(formula, "all_reduce@dp", num_parameters * FP32)
        add(extras, "all_reduce@dp", 2 * FP32)  # the step's loss sum and its 'lm' term, for logging
    else:
        add(formula, "reduce_scatter@dp", buffer_elements * FP32)
        add(formula, "all_gather@dp", buffer_elements * FP32)
        add(extras, "all_reduce@dp", 2 * FP32)  # the step's loss sums, for logging
        add(extras, "all_reduce@world", FP32)  # the grad norm summed over the ZeRO-1 shards
    return formula, extras


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches-per-step", type=int, default=4, help="over all DP ranks (even)")
    args = parser.parse_args(argv)
    from meshlm.config import load_run_config
    from meshlm.models.language_model import LanguageModel

    with tempfile.TemporaryDirectory(prefix="meshlm_comm_") as folder:
        blend = write_random_corpus(Path(folder) / "corpus")
        config = load_run_config(None, overrides_for(args, blend, Path(folder) / "x", []))
        num_parameters = LanguageModel(config.model).num_parameters()
        by_rank = run_distributed(measure, 2, args, str(blend), folder, timeout_s=600)
    report = {"model": {"pattern": PATTERN, "hidden": args.hidden, "seq_len": args.seq_len,
                        "micro_batch_size": args.micro_batch_size,
                        "micro_batches_per_step": args.micro_batches_per_step,
                        "num_parameters": num_parameters}, "layouts": {}}
    for layout in LAYOUTS:
        measured = by_rank[0][layout]
        buffer_elements, partial_elements = measured.pop("_buffer_elements"), measured.pop("_partial_grad_elements")
        formula, extras = analytic(args, layout, num_parameters, buffer_elements, partial_elements)
        expected = {key: formula.get(key, 0) + extras.get(key, 0) for key in set(formula) | set(extras)}
        measured_bytes = {key: value["bytes"] for key, value in measured.items()}
        ranks_agree = all({k: v for k, v in rank[layout].items() if not k.startswith("_")} == measured
                          for rank in by_rank)
        report["layouts"][layout] = {
            "measured_per_rank": measured, "formula_bytes": formula, "extras_bytes": extras,
            "formula_plus_extras_equals_measured": expected == measured_bytes,
            "formula_share_of_measured": sum(formula.values()) / max(sum(measured_bytes.values()), 1),
            "every_rank_measured_the_same": ranks_agree}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
