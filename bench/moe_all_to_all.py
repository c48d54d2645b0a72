"""Expert parallelism's all-to-all bytes per step per rank, measured beside the analytic figure,
with and without LatentMoE; the all-gather dispatcher as the baseline; the shared-expert overlap.

    python -m bench.moe_all_to_all [--hidden 64] [--latent 16] [--seq-len 32] [--micro-batch-size 2]

An MoE model (pattern ``*E*E``: 2 attention + 2 MoE blocks, E experts, top-k, dropless) trains
with the real ``Trainer`` in 4 spawned gloo processes at ep4 (attention: dp 4) and at tp2+SP x
ep2 x etp2 (attention: tp 2 x dp 2), both with expert-DP 1. After a warm-up step,
``meshlm.parallel.comm_log.record_communication`` counts one ``train_step``'s collectives on the
EP group of each rank (message bytes, comm_log's convention: an all-to-all's size is this rank's
input).

Analytic figure, all-to-all dispatcher, per MoE block and micro-batch, d = the expert width
(hidden, or the latent size with LatentMoE), 4 bytes per fp32 element, n_U = this rank's tokens
times etp (the source set its ETP group shares), k = top-k, E = experts:

    forward   count exchange       E * 8 bytes (int64)
              tokens out           n_U k d * 4        (every kept assignment of the source set)
              outputs back         m_recv d * 4       (the rows this rank's experts processed)
    backward  output gradients     n_U k d * 4
              input gradients      m_recv d * 4

m_recv depends on the routing: it is the number of assignments to this rank's experts, which
the trainer logs (``tokens_per_expert``, summed over every rank's micro-batches of the step --
with expert-DP 1 exactly the tokens that reach this rank). Summed over the EP group, m_recv
equals n_U k, so the mean over ranks is 4 n_U k d * 4 + 8 E whatever the routing. LatentMoE
changes only d, so it divides the token bytes by hidden/latent exactly.

All-gather dispatcher (the baseline: every EP rank receives every token of the group):
per block and micro-batch ep n_U (16 d + 16 k) bytes on the EP group -- token all-gather and
output reduce-scatter forward, their adjoints backward (4 x ep n_U d * 4), the expert ids (ep
n_U k * 8) and the weights forward and backward (2 x ep n_U k * 4). Ratio to the all-to-all
token bytes: ep / k.

Overlap: one MoE block with a shared expert (hidden 256, 4096 tokens per rank, ep 4), forward +
backward timed with the shared expert computed while the token all-to-all is in flight and after
it (``ExpertParallelMoELayer.overlap_shared_expert``); the machine's core count is printed with it.
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

from bench.communication import write_random_corpus
from tests.helpers.distributed import run_distributed

LAYOUTS = {"ep4": ["parallel.ep=4"],
           "tp2 sp ep2 etp2": ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "parallel.etp=2"]}
PATTERN = "*E*E"
VOCAB = 64
FP32, INT64 = 4, 8
DISPATCHER_KINDS = {"all_to_all": ("all_to_all",), "all_gather": ("all_gather", "reduce_scatter")}
"""The collectives each dispatcher issues on the EP group. (torch's DeviceMesh reuses a process
group for the same ranks, so at ep4 on 4 ranks the EP group is also the dense gradients' group,
whose all-reduce is not the dispatcher's.)"""


def overrides_for(args, blend: Path, run_dir: Path, layout: list[str], latent: bool, dispatcher: str) -> list[str]:
    return [f"model.vocab_size={VOCAB}", f"model.hidden_size={args.hidden}", f"model.pattern={PATTERN}",
            "model.num_attention_heads=4", f"model.moe_num_experts={args.experts}", f"model.moe_top_k={args.top_k}",
            f"model.moe_ffn_hidden_size={2 * args.hidden}",
            *([f"model.moe_latent_size={args.latent}"] if latent else []),
            f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch_size}",
            f"train.global_batch_size={args.micro_batch_size * args.micro_batches_per_step}",
            "train.steps=10", "train.eval_every=0", "train.save_every=0", "train.progress=false",
            "train.tensorboard=false", "train.plot=false", "train.device=cpu", f"train.run_dir={run_dir}",
            f"data.blend={blend}", "data.split=100,0,0", f"parallel.moe_dispatcher={dispatcher}", *layout]


def variants():
    for layout in LAYOUTS:
        for latent in (False, True):
            for dispatcher in ("all_to_all", "all_gather"):
                yield layout, latent, dispatcher


def measure(args, blend: str, root: str) -> dict:
    """In each spawned rank: one counted train_step per variant -> bytes on the EP group, traffic."""
    from meshlm.config import load_run_config
    from meshlm.parallel.comm_log import record_communication
    from meshlm.training.trainer import Trainer

    torch.set_num_threads(1)
    measured = {}
    for layout, latent, dispatcher in variants():
        name = f"{layout} latent={latent} {dispatcher}"
        config = load_run_config(None, overrides_for(args, Path(blend), Path(root) / name, LAYOUTS[layout],
                                                     latent, dispatcher))
        trainer = Trainer(config)
        trainer.train_step()  # warm-up
        context = trainer.context
        with record_communication(labels={"ep": context.ep_group}) as log:
            result = trainer.train_step()
        measured[name] = {
            "bytes_by_kind": {kind: count.bytes for (kind, group), count in log.counts.items() if group == "ep"},
            "tokens_per_expert": [counts.tolist() for counts in result.tokens_per_expert],
            "ep_rank": context.ep_rank, "ep": context.ep_size, "etp": context.etp_size,
            "tokens_per_rank": args.micro_batch_size * args.seq_len // context.tp_size,
            "micro_batches_per_rank": args.micro_batches_per_step // context.dp_size}
    return measured


def analytic_bytes(args, entry: dict, latent: bool, dispatcher: str) -> int:
    """This rank's bytes on the EP group for one step (see the module docstring)."""
    width = args.latent if latent else args.hidden
    source_tokens = entry["tokens_per_rank"] * entry["etp"]
    blocks, micro_batches, top_k = PATTERN.count("E"), entry["micro_batches_per_rank"], args.top_k
    if dispatcher == "all_gather":
        return blocks * micro_batches * entry["ep"] * source_tokens * (4 * width * FP32 + top_k * (INT64 + 2 * FP32))
    local = args.experts // entry["ep"]
    first = entry["ep_rank"] * local
    received = sum(sum(counts[first:first + local]) for counts in entry["tokens_per_expert"])
    return (blocks * micro_batches * (2 * source_tokens * top_k * width * FP32 + args.experts * INT64)
            + 2 * received * width * FP32)


def time_overlap(args) -> dict:
    """In each spawned rank: forward+backward of one MoE block with a shared expert, overlapped or not."""
    from meshlm.config import ParallelConfig
    from meshlm.models.config import ModelConfig
    from meshlm.models.moe.layer import MoELayer
    from meshlm.parallel.mesh import build_parallel_context
    from meshlm.parallel.parallelize import parallelize_moe_block

    torch.set_num_threads(1)
    hidden = args.overlap_hidden
    config = ModelConfig(hidden_size=hidden, pattern="E", vocab_size=64, moe_num_experts=8, moe_top_k=2,
                         moe_ffn_hidden_size=hidden, moe_shared_expert_ffn_hidden_size=4 * hidden)
    context = build_parallel_context(ParallelConfig(ep=4), config, torch.device("cpu"))
    torch.manual_seed(0)
    layer = parallelize_moe_block(MoELayer(config), context)
    x = torch.randn(1, args.overlap_tokens, hidden, requires_grad=True)
    times = {}
    for overlap in (True, False, True, False, True, False):
        layer.overlap_shared_expert = overlap
        torch.distributed.barrier()
        started = time.perf_counter()
        out, _ = layer(x)
        out.sum().backward()
        torch.distributed.barrier()
        times.setdefault(overlap, []).append(time.perf_counter() - started)
    return {"overlapped_s": statistics.median(times[True]), "sequential_s": statistics.median(times[False])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--latent", type=int, default=16)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches-per-step", type=int, default=4, help="over all DP ranks")
    parser.add_argument("--overlap-hidden", type=int, default=256)
    parser.add_argument("--overlap-tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshlm_moe_a2a_") as folder:
        blend = write_random_corpus(Path(folder) / "corpus")
        by_rank = run_distributed(measure, 4, args, str(blend), folder, timeout_s=600)
    report = {"model": {"pattern": PATTERN, "hidden": args.hidden, "latent": args.latent, "experts": args.experts,
                        "top_k": args.top_k, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
                        "micro_batches_per_step": args.micro_batches_per_step}, "layouts": {}}
    for layout, latent, dispatcher in variants():
        name = f"{layout} latent={latent} {dispatcher}"
        kinds = DISPATCHER_KINDS[dispatcher]
        measured = [sum(rank[name]["bytes_by_kind"].get(kind, 0) for kind in kinds) for rank in by_rank]
        expected = [analytic_bytes(args, rank[name], latent, dispatcher) for rank in by_rank]
        report["layouts"][name] = {"measured_bytes_per_rank": measured, "analytic_bytes_per_rank": expected,
                                   "measured_equals_analytic": measured == expected,
                                   "mean_bytes_per_rank": statistics.mean(measured),
                                   "kinds_counted": list(kinds)}
    for layout in LAYOUTS:
        plain, latent = (report["layouts"][f"{layout} latent={flag} all_to_all"] for flag in (False, True))
        count_bytes = PATTERN.count("E") * by_rank[0][f"{layout} latent=False all_to_all"][
            "micro_batches_per_rank"] * args.experts * INT64
        report["layouts"][f"{layout} latent=True all_to_all"]["token_bytes_reduction_vs_no_latent"] = (
            (plain["mean_bytes_per_rank"] - count_bytes) / (latent["mean_bytes_per_rank"] - count_bytes))
        gather = report["layouts"][f"{layout} latent=False all_gather"]
        gather["bytes_vs_all_to_all"] = gather["mean_bytes_per_rank"] / plain["mean_bytes_per_rank"]
    report["hidden_over_latent"] = args.hidden / args.latent
    timings = run_distributed(time_overlap, 4, args, timeout_s=600)
    report["shared_expert_overlap"] = {
        "cpu_cores": os.cpu_count(), "backend": "gloo", "ep": 4, "tokens_per_rank": args.overlap_tokens,
        "hidden": args.overlap_hidden, "overlapped_s": max(t["overlapped_s"] for t in timings),
        "sequential_s": max(t["sequential_s"] for t in timings)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
