"""``meshlm plan --gpu cpu`` against this machine: predicted vs measured peak memory and step time.

    python -m bench.plan_vs_measured [--steps 3] [--hidden 128] [--seq-len 128]

Six layouts of one small model (tp, pp, dp, ZeRO-1, cp, ep) train with the real ``Trainer`` in 2
spawned gloo processes (``tests/helpers/distributed.py``). On each rank, after one warm-up step:
the persistent bytes (``tests/helpers/persistent_memory.py``: weights, gradient buffers,
optimizer state) against the planner's parameter state, and the median of ``--steps`` steps' wall time is the measured step
time. The prediction is the planner's for the same layout and micro-batch, with this CPU's
rates calibrated once per model as ``meshlm plan --gpu cpu`` does (``hardware.calibrate_cpu``: the
model's block kinds, head and optimizer timed with the thread one of 2 ranks gets,
``meshlm/planning/cpu_calibration.py``; gloo's latency and bandwidth are ``hardware.CPU_LINK``).
The worst rank's numbers are compared. Targets (issue 19): memory within 5%, step time within
25%. The step times are of this machine at the time: run it on a quiet machine.

Activations (``--activations``, single process): the planner's per-block-kind activation items
(``memory_estimate.activation_items``, which ``meshlm plan`` adds up) against the bytes autograd
saves for backward, measured as ``bench/activation_memory.py`` does (``saved_tensors_hooks``,
distinct storages, parameters left out), block by block, for a dense ('*-'), a hybrid ('M*-')
and an MoE ('*E') model, in fp32 and bf16, with each recompute setting. Target: within 5%.
Measured (CPU, torch's default SDPA = flash, s=128, b=4, h=96), all blocks together: fp32 within
4% for every model and setting; full recompute exact; bf16 under by 10-30% (dense -17%, hybrid
-11%, MoE -27%). Per kind, what the estimate misses: RMSNorm saves an fp32 copy of x and the fp32
normalized x (+4 bytes per h element in bf16, +rstd); attention's output is o_proj's input (one
storage, not two), RoPE's cast cos/sin (8 bytes per head_dim per token) and flash's fp32
log-sum-exp (4 bytes per head) are not counted, so selective recompute drops only the latter
(-8% fp32 / -34% bf16 on '*'); and the bf16 MoE block keeps ~1.1 kB per token more in fp32.
Not measured in the distributed runs: the transient peak of a step -- torch's memory profiler
refuses the gloo collectives' in-place outputs (a 'version mismatch' in its data-flow graph).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tests.helpers.distributed import run_distributed

LAYOUTS = {
    "dp2": ["parallel.dp=2"],
    "dp2 zero1": ["parallel.dp=2", "parallel.zero_stage=1"],
    "tp2 sp": ["parallel.tp=2", "parallel.sp=true"],
    "pp2": ["parallel.pp=2"],
    "cp2": ["parallel.cp=2"],
    "ep2 (MoE)": ["parallel.ep=2", "parallel.dp=2", "model.pattern=*E*E*E*E", "model.moe_num_experts=4"],
}


def measure(overrides: list[str], steps: int) -> dict:
    from meshlm.config import load_run_config
    from meshlm.training.trainer import Trainer
    from tests.helpers.persistent_memory import persistent_bytes

    trainer = Trainer(load_run_config(None, overrides))
    trainer.train_step()
    persistent = sum(persistent_bytes(trainer).values())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        trainer.stop_requests.agreed_reason(trainer.context.world_group)  # the training loop's per-step vote
        times.append(time.perf_counter() - start)
    return {"persistent_bytes": persistent, "step_s": statistics.median(times)}


LINK_SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
"""Message bytes of the link measurement."""


def link_costs(repeats: int = 7, rounds: int = 20) -> dict:
    """Seconds one all-reduce, all-gather, reduce-scatter (of a buffer of the size, between 2
    ranks) and one one-way send cost a rank *inside a training-like loop* (a
    millisecond of single-threaded matmuls between messages, as between a step's collectives):
    the loop's time with the message minus without, per message, median of ``repeats``."""
    import torch
    import torch.distributed as dist

    from meshlm.parallel.groups import group_of
    from meshlm.parallel.plain_collectives import all_gather_into_, all_reduce_, reduce_scatter_into_

    torch.set_num_threads(1)
    rank = dist.get_rank()
    world = group_of(dist.group.WORLD, "world", torch.device("cpu"))  # the trainer's own collectives
    left, right = torch.randn(256, 128), torch.randn(128, 512)

    def loop(message) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            for _ in range(6):
                left @ right
            if message is not None:
                message()
        return (time.perf_counter() - start) / rounds

    def exchange(buffer):
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)

    costs = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}, "p2p": {}}
    for size in LINK_SIZES:
        buffer, half = torch.randn(size // 4), torch.randn(size // 8)
        for name, message, per_loop in (("all_reduce", lambda: all_reduce_(buffer, world), 1),
                                        ("all_gather", lambda: all_gather_into_(buffer, half, world), 1),
                                        ("reduce_scatter", lambda: reduce_scatter_into_(half, buffer, world), 1),
                                        ("p2p", lambda: exchange(buffer), 2)):
            loop(message)
            with_message = statistics.median(loop(message) for _ in range(repeats))
            without = statistics.median(loop(None) for _ in range(repeats))
            costs[name][size] = max(0.0, with_message - without) / per_loop
    return costs


def fit_link(costs: dict) -> dict:
    """Alpha-beta through the measured costs (least squares): a one-way message of n bytes takes
    latency + n / bandwidth; a 2-rank ring all-reduce is two such steps of n/2 bytes each way,
    i.e. 2 latency + n / bandwidth."""
    def line(points):
        count = len(points)
        mean_x = sum(x for x, _ in points) / count
        mean_y = sum(y for _, y in points) / count
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
        return mean_y - slope * mean_x, slope

    p2p_intercept, p2p_slope = line(list(costs["p2p"].items()))
    reduce_intercept, reduce_slope = line(list(costs["all_reduce"].items()))
    return {"p2p_latency_s": p2p_intercept, "p2p_gbps": 1e-9 / p2p_slope,
            "all_reduce_latency_s": reduce_intercept / 2, "all_reduce_gbps": 1e-9 / reduce_slope}


def print_link() -> None:
    costs = run_distributed(link_costs, 2)[0]
    print(f"{'bytes':>9} {'all-reduce ms':>14} {'all-gather ms':>14} {'reduce-scatter ms':>18} {'send ms':>8}")
    for size in LINK_SIZES:
        print(f"{size:>9} {costs['all_reduce'][size] * 1e3:>14.3f} {costs['all_gather'][size] * 1e3:>14.3f} "
              f"{costs['reduce_scatter'][size] * 1e3:>18.3f} {costs['p2p'][size] * 1e3:>8.3f}")
    fitted = fit_link(costs)
    print("alpha-beta: " + ", ".join(f"{key} {value * 1e3:.3f} ms" if key.endswith("_s") else f"{key} {value:.2f}"
                                    for key, value in fitted.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--activations", action="store_true", help="only the single-process activation check")
    parser.add_argument("--link", action="store_true", help="only measure gloo's per-message cost between 2 "
                        "processes in a training-like loop (what hardware.CPU_LINK holds)")
    args = parser.parse_args(argv)
    if args.activations:
        return print_activations(args.seq_len)
    if args.link:
        return print_link()
    from meshlm.config import load_run_config
    from meshlm.planning.hardware import calibrate_cpu
    from meshlm.planning.layouts import Layout
    from meshlm.planning.predict import predict_at
    from tests.helpers.counting_corpus import write_corpus

    root = Path(tempfile.mkdtemp())
    blend = write_corpus(root / "corpus", num_documents=400, max_length=400)
    base = ["model.vocab_size=64", f"model.hidden_size={args.hidden}", "model.pattern=*-*-*-*-",
            "model.num_attention_heads=4", f"train.seq_len={args.seq_len}", "train.micro_batch_size=2",
            "train.global_batch_size=8", "train.steps=100", "train.eval_every=0", "train.save_every=0",
            "train.progress=false", "train.tensorboard=false", "train.plot=false", "train.device=cpu",
            "optim.warmup_steps=0", "train.prefetch_batches=false", f"data.blend={blend}", "data.split=98,2,0"]
    calibrated = {}  # one calibration per model (the MoE layout's model differs)
    print(f"{'layout':<12} {'pred MiB':>9} {'meas MiB':>9} {'error':>7} {'pred s':>8} {'meas s':>8} {'error':>7}")
    for name, extra in LAYOUTS.items():
        overrides = [*base, f"train.run_dir={root / name.replace(' ', '_')}", *extra]
        config = load_run_config(None, overrides)
        if repr(config.model) not in calibrated:
            calibrated[repr(config.model)] = hardware = calibrate_cpu(config, processes=2)
            rates = ", ".join(f"{kind} {rate / 1e9:.1f}" for kind, rate in hardware.block_rates.items())
            print(f"cpu ({config.model.pattern}): matmul peak {hardware.peak_tflops * 1e3:.1f} GFLOP/s per process, "
                  f"fwd+bwd GFLOP/s by block kind: {rates}; optimizer {hardware.hbm_gbps:.1f} GB/s; "
                  f"gloo {hardware.intra_gbps} GB/s + {hardware.intra_latency_s * 1e6:.0f} us")
        hardware = calibrated[repr(config.model)]
        measured = run_distributed(measure, 2, overrides, args.steps)
        parallel = config.parallel
        dp = 2 // (parallel.tp * parallel.pp * parallel.cp)
        layout = Layout(parallel.tp, parallel.sp, parallel.pp, parallel.vp, dp, parallel.cp, parallel.ep,
                        parallel.sharding_stage, config.train.recompute)
        predicted = predict_at(config, layout, hardware, config.train.micro_batch_size)
        persistent = max(rank["persistent_bytes"] for rank in measured)
        state = sum(predicted["memory_items"][item] for item in ("weights", "gradients", "optimizer"))
        seconds = max(rank["step_s"] for rank in measured)
        print(f"{name:<12} {state / 2 ** 20:>9.3f} {persistent / 2 ** 20:>9.3f} "
              f"{state / persistent - 1:>+7.1%} {predicted['step_time_s']:>8.4f} "
              f"{seconds:>8.4f} {predicted['step_time_s'] / seconds - 1:>+7.1%}")


ACTIVATION_MODELS = {
    "dense": ["model.pattern=*-*-", "model.num_kv_heads=2"],
    "hybrid": ["model.pattern=M*-M-", "model.position_embedding=none", "model.mamba_state_size=16",
               "model.mamba_head_dim=16", "model.mamba_chunk_size=32", "model.mlp_activation=squared_relu",
               "model.ffn_hidden_size=256"],
    "moe": ["model.pattern=*E*E", "model.num_kv_heads=2", "model.moe_num_experts=8", "model.moe_top_k=2",
            "model.moe_ffn_hidden_size=128"],
}


def activation_rows(seq_len: int) -> list[dict]:
    """Predicted and measured saved bytes per block kind, for each model, dtype and recompute setting."""
    import dataclasses

    import torch

    from meshlm.config import load_run_config
    from meshlm.models.language_model import LanguageModel
    from meshlm.planning.layouts import Layout, apply_layout
    from meshlm.planning.memory import planning_context
    from meshlm.training.memory_estimate import activation_items
    from meshlm.training.recompute import apply_recompute
    from tests.helpers.saved_tensors import saved_bytes_by_block_kind

    rows = []
    for name, extra in ACTIVATION_MODELS.items():
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            base = ["model.vocab_size=256", "model.hidden_size=96", "model.num_attention_heads=4",
                    f"train.seq_len={seq_len}", "train.micro_batch_size=4", "train.global_batch_size=4",
                    f"precision.dtype={dtype_name}", *extra]
            config = load_run_config(None, base)
            torch.manual_seed(0)
            model = LanguageModel(config.model).to(dtype)
            for mode in ("none", "selective", "full"):
                layout = Layout(recompute=mode)
                run = apply_layout(config, layout)
                run = dataclasses.replace(run, train=dataclasses.replace(run.train, recompute=mode))
                items = activation_items(run, planning_context(run, layout))
                apply_recompute(model, mode)
                measured = saved_bytes_by_block_kind(model, run.train.micro_batch_size, seq_len, dtype)
                predictions = {kind: int(items[f"blocks {kind}"]) for kind in measured}
                predictions["all"], measured["all"] = sum(predictions.values()), sum(measured.values())
                for kind, value in measured.items():
                    rows.append({"model": name, "dtype": dtype_name, "recompute": mode, "kind": kind,
                                 "predicted_bytes": predictions[kind], "measured_bytes": value,
                                 "error": predictions[kind] / value - 1 if value else None})
    return rows


def print_activations(seq_len: int) -> None:
    print(f"{'model':<7} {'dtype':<5} {'recompute':<10} {'kind':<5} {'pred KiB':>10} {'meas KiB':>10} {'error':>7}")
    for row in activation_rows(seq_len):
        error = "" if row["error"] is None else f"{row['error']:+.1%}"
        print(f"{row['model']:<7} {row['dtype']:<5} {row['recompute']:<10} {row['kind']:<5} "
              f"{row['predicted_bytes'] / 1024:>10.1f} {row['measured_bytes'] / 1024:>10.1f} {error:>7}")


if __name__ == "__main__":
    main()
