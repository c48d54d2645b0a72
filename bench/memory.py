"""Per-rank memory of parameters, gradients and optimizer state, for plain DP and ZeRO stages 1, 2 and 3.

    python -m bench.memory [--hidden 250] [--bucket-size-mb 4]

A model of a few million parameters trains two steps at dp = 1, 2, 4 (spawned gloo processes),
in fp32 and bf16, with plain data parallelism (``GradientReducer`` + ``torch.optim.AdamW``) and
with the ``DistributedOptimizer`` at ZeRO stages 1, 2 and 3 (``parallel.zero_stage``). After the
second step's update (between steps: what persists), every
rank walks the actual tensors -- the model's parameters, MixedPrecision's fp32 masters, the
gradient buffer and every ``.grad``, the optimizer's state -- and adds up the bytes of their
*storages*, each storage once (views into one flat buffer count once, in the first category
that holds them). Printed as JSON beside the exact formula for OUR implementation, with N the
parameter count, P the gradient/value buffer length (N plus bucket padding: each bucket rounded
up to a multiple of dp under the distributed optimizer, none without), T the number of
parameter tensors:

    plain DP, fp32:     4N params            + 4N grad buffer + 8N Adam moments + 4T Adam step counters
    plain DP, bf16:     2N params + 4N masters + 4N grad buffer + 8N + 4T
    ZeRO-1,   fp32:     4P params (= masters, the value buffer) + 4P grad buffer + 8P/dp moments
    ZeRO-1,   bf16:     2P params (flat buffer) + 4P/dp masters + 4T + 4P grad buffer + 8P/dp moments
                        (the 4T: each master Parameter stays as the gradient holder of its full shape,
                        its data one 4-byte element broadcast to that shape)
    ZeRO-2:             as ZeRO-1 with a 4P/dp gradient shard instead of the 4P buffer
    ZeRO-3,   fp32:     4P/dp values (parameters = masters) + 4P/dp grad shard + 8P/dp moments
    ZeRO-3,   bf16:     2P/dp params + 4P/dp masters + 4T + 4P/dp grad shard + 8P/dp moments
                        (a stage-3 parameter's storage is empty between steps; a unit is gathered
                        only while it runs)

For ZeRO-2/3, P pads each *unit* (a block, the embedding, the tail) to a multiple of dp.

Beside it, the ZeRO paper's count (Rajbhandari et al. 2020, sections 3.1 and 5.1): mixed-precision
Adam holds (2 + 2 + K) N bytes with K = 12 of fp32 state (master weights and two moments), and
(2 + 2 + K/dp) N with optimizer-state partitioning (P_os); for fp32 Adam the same count reads
(4 + 4 + 8/dp) N; with gradient partitioning too (P_os+g, stage 2) 2 + (2 + 12)/dp, and with
the parameters (P_os+g+p, stage 3) (2 + 2 + 12)/dp. Our fp32 numbers are exactly that (plus
padding). In bf16 ours differ in one place: gradients are accumulated and reduced in fp32 (4
bytes, not 2, as in Megatron-LM's distributed optimizer), so our bf16 ZeRO-1 is 6 + 12/dp bytes
per parameter where the paper's is 4 + 12/dp, and our ZeRO-3 (2 + 4 + 12)/dp where the paper's
is (2 + 2 + 12)/dp. With ``parallel.reduce_grads_in_fp32=false`` (rows marked so) ZeRO-2/3 keep
the gradient shard in bf16, 2P/dp bytes, and match the paper's count exactly (plus padding).
Transient buffers (the foreach temporaries of the update, 4P/dp; the low-precision gradient of
one parameter while backward produces it) are not persistent state and are not counted.
"""

from __future__ import annotations

import argparse
import json

import torch

from meshlm.parallel.data.distributed_optimizer import DistributedOptimizer
from meshlm.parallel.mesh import ParallelContext
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_training import TrainSpec, build_run, context_from_world, train_steps

CATEGORIES = ("parameters", "master_weights", "gradients", "optimizer_state")


def model_fields(hidden: int) -> dict:
    """About 3.7M parameters at hidden 250; a hidden size that is not a multiple of 4 gives the
    buckets something to pad at dp = 4."""
    return dict(vocab_size=4096, hidden_size=hidden, pattern="*-*-", num_attention_heads=5)


def measured_bytes(run) -> dict[str, int]:
    """Bytes of the unique storages behind each category, each storage counted once."""
    seen: set[int] = set()

    def storage_bytes(tensors) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(run.model.parameters())
    stage = getattr(run.optimizer, "zero_stage", 0)
    if stage == 3:
        params.append(run.optimizer.model_shard)  # the parameters themselves hold no storage between steps
    masters = [master for _, master in run.precision.master_parameters()]
    if isinstance(run.optimizer, DistributedOptimizer) and run.optimizer.low_precision:
        masters.append(run.optimizer.values)  # the fp32 masters' shard lives in the optimizer
    grads = ([run.reducer.buffer] if run.reducer is not None else []) + [p.grad for p in params] + [m.grad for m in masters]
    if isinstance(run.optimizer, DistributedOptimizer):
        state = [run.optimizer.exp_avg, run.optimizer.exp_avg_sq]
    else:
        state = [value for entry in run.optimizer.state.values() for value in entry.values()
                 if isinstance(value, torch.Tensor)]
    return dict(zip(CATEGORIES, (storage_bytes(params), storage_bytes(masters), storage_bytes(grads),
                                 storage_bytes(state))))


def formula_bytes(spec: TrainSpec, run, dp: int) -> dict[str, int]:
    """The module docstring's formula, from N, P, T and dp."""
    n = sum(p.numel() for p in run.model.parameters())
    t = len(list(run.model.parameters()))
    p = run.reducer.layout.total
    low = spec.dtype != "fp32"
    stage = spec.parallel_config().sharding_stage
    if stage:
        weights = (2 if low else 4) * (p // dp if stage == 3 else p)
        return {"parameters": weights, "master_weights": 4 * p // dp + 4 * t if low else 0,
                "gradients": (4 if spec.reduce_grads_in_fp32 or not low else 2) * p // dp if stage >= 2 else 4 * p,
                "optimizer_state": 8 * p // dp}
    return {"parameters": 2 * n if low else 4 * n, "master_weights": 4 * n if low else 0,
            "gradients": 4 * n, "optimizer_state": 8 * n + 4 * t}


def measure(spec: TrainSpec, context: ParallelContext) -> dict:
    run = build_run(spec, context)
    found = {}

    def observe(event, step, micro):
        if event == "stepped" and step == 1:  # between steps: moments exist, the gradient buffers stay
            found.update(measured_bytes(run))

    train_steps(run, spec, context, steps=2, observe=observe)
    return {"measured": found, "formula": formula_bytes(spec, run, context.dp_size),
            "num_parameters": sum(p.numel() for p in run.model.parameters()),
            "buffer_elements": run.reducer.layout.total, "buckets": len(run.reducer.layout.buckets)}


def measure_all(specs: list[TrainSpec]) -> list[dict]:
    """In each spawned rank (or the one process when the world is 1)."""
    import torch.distributed as dist

    context = context_from_world() if dist.is_initialized() else ParallelContext()
    return [measure(spec, context) for spec in specs]


def zero_paper_bytes(dtype: str, stage: int, dp: int) -> float:
    """Bytes per parameter in the ZeRO paper's count (sections 3.1, 5.1-5.3): weights, gradients
    and K bytes of optimizer state, each divided by dp from the stage that partitions it."""
    weights, grads, state = (4, 4, 8) if dtype == "fp32" else (2, 2, 12)
    return (weights / (dp if stage >= 3 else 1) + grads / (dp if stage >= 2 else 1)
            + state / (dp if stage >= 1 else 1))


def row(spec: TrainSpec, dp: int, per_rank: list[dict]) -> dict:
    result = per_rank[0]
    n = result["num_parameters"]
    measured_total, formula_total = sum(result["measured"].values()), sum(result["formula"].values())
    stage = spec.parallel_config().sharding_stage
    return {"dtype": spec.dtype, "zero_stage": stage, "reduce_grads_in_fp32": spec.reduce_grads_in_fp32, "dp": dp,
            "num_parameters": n, "buffer_elements": result["buffer_elements"], "buckets": result["buckets"],
            "measured_bytes": result["measured"], "formula_bytes": result["formula"],
            "measured_total": measured_total, "formula_total": formula_total,
            "bytes_per_parameter": round(measured_total / n, 3),
            "zero_paper_bytes_per_parameter": round(zero_paper_bytes(spec.dtype, stage, dp), 3),
            "matches": result["measured"] == result["formula"],
            "same_on_every_rank": all(other["measured"] == result["measured"] for other in per_rank)}


def run(hidden: int, bucket_size_mb: float) -> list[dict]:
    specs = [TrainSpec(model_fields(hidden), dtype=dtype, zero_stage=stage, bucket_size_mb=bucket_size_mb,
                       micro_batches=4, micro_batch_size=1, seq_len=32)
             for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)]
    specs += [TrainSpec(model_fields(hidden), dtype="bf16", zero_stage=stage, reduce_grads_in_fp32=False,
                        bucket_size_mb=bucket_size_mb, micro_batches=4, micro_batch_size=1, seq_len=32)
              for stage in (2, 3)]  # gradients in bf16: the ZeRO paper's count
    from bench import memory  # spawned ranks import the function by module name, which "__main__" is not

    rows = []
    for dp in (1, 2, 4):
        per_rank = run_distributed(memory.measure_all, dp, specs, timeout_s=600) if dp > 1 else [measure_all(specs)]
        rows += [row(spec, dp, [results[number] for results in per_rank]) for number, spec in enumerate(specs)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=250)
    parser.add_argument("--bucket-size-mb", type=float, default=4.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(args.hidden, args.bucket_size_mb)
    print(json.dumps({"rows": rows, "all_match": all(r["matches"] and r["same_on_every_rank"] for r in rows)},
                     indent=1))


if __name__ == "__main__":
    main()
