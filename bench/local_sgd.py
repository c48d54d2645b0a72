"""DDP vs local SGD vs DiLoCo vs PALSGD on the demo corpus, dp4 over a simulated slow link.

    python -m bench.local_sgd [--model hybrid|moe] [--init-steps 32] [--warmup 32] [--steps 64|128]
                              [--global-batch 64|128] [--micro-batch 4|32] [--sync-every 8 32]
                              [--link 1Gbps,5ms]
                              [--no-baseline-without-link] [--eval-every 8] [--device cpu|cuda]
                              [--methods local_sgd diloco palsgd] [--diloco-outer 0.85,0.75]
                              [--palsgd-outer 0.85,0.75] [--target-loss L] [--overlap-at H ...]
                              [--local-overrides KEY=VALUE ...]
                              [--out FILE] [--plot bench/local_sgd.png]

Each method trains the same small demo-style hybrid (``configs/demo.yaml`` narrowed: hidden 128,
pattern ``M-*E-M-*``; ``--model moe``: four of its blocks 64-expert MoE layers, ``MODELS``) for
``--steps`` steps in 4 spawned gloo processes (``parallel.dp=4``) on the demo blend, with
``parallel.simulate_link`` holding every DP collective back by bytes/bandwidth + latency
(``meshlm/parallel/simulated_link.py``), the same data order, seed, batch and schedule:

- ``ddp``: ``parallel.dp_sync=every_step`` (one gradient all-reduce a step);
- ``local_sgd``, ``diloco``, ``palsgd`` at each H of ``--sync-every``; PALSGD with p 0.05 and eta
  1 (``PALSGD_P``; its authors use p 0.2); DiLoCo and PALSGD with an outer Nesterov SGD of lr 0.85
  and momentum 0.75, tuned for H=8 (``OUTER_DEFAULTS``; the published pairs, DiLoCo's 0.7 / 0.9 and PALSGD's 0.1 / 0.9, are
  ``--diloco-outer`` and ``--palsgd-outer`` away, and every figure measured before 2026-11-29 used
  0.7 / 0.9 for both).

``--overlap-at H`` adds DiLoCo and PALSGD at H with ``parallel.outer_overlap=true`` (Streaming
DiLoCo, Douillard et al. 2025): the outer all-reduce -- one all-reduce's bytes every H steps --
runs during the next inner step instead of holding the replicas at the sync; each replica then
loads the new global copy plus its own progress since the sync. Where a step computes little
(a GPU), that wait is a visible share of the step.

The protocol has two DDP phases, both from the papers:

1. ``--init-steps N`` (default 32): DiLoCo's main experiments start from a model pre-trained with
   ordinary data parallelism (Douillard et al. 2023; from scratch is slightly worse). One DDP run
   of N steps (the demo's warm-up, then the peak learning rate held: a checkpoint from the middle
   of a pre-training run) writes the model that *every* run -- DDP included -- starts from with
   ``train.init_from``: fresh AdamW, the demo's schedule (25 warm-up steps, cosine to 3e-4 over
   ``--steps``). That run is seeded apart (``INIT_SEED``), so it reads other samples than the
   continued runs, whose data and validation batches are those of a run without it. All figures
   (steps, tokens, seconds, bytes) are for the continued runs only.
2. ``--warmup W`` (default 32): each low-communication run starts with W DDP steps
   (``parallel.local_warmup`` for local SGD and DiLoCo -- post-local SGD, Lin et al. 2020 --
   ``parallel.palsgd_warmup`` for PALSGD, its authors' 32); their time and bytes are counted.
   This is the lever: the continued run's fresh AdamW under a warming learning rate is where
   replicas that train alone drift apart most. Measured (global batch 64, 64 continued steps,
   H=8, DDP 5.388): without it DiLoCo is +3.6% and PALSGD +4.6% from DDP, with W=16 +1.9% and
   +2.4% (34% of DDP's bytes), with W=32 +0.35% and +0.9% (local SGD +1.2%; 56% of the bytes).

``--global-batch`` (default 64 on a CPU: 16 sequences per replica a step) is the other lever:
with 4 a replica (16) the replicas' AdamW steps are so noisy that averaging them cancels much of
their progress (W=32 over 128 continued steps: DiLoCo +4.5%, PALSGD +6.5%); with 32 a replica
(128) the same 128 continued steps end DiLoCo +0.86% / +2.1% and PALSGD +2.0% / +2.8% from DDP
(H=8 / 32; measured on this CPU, 2026-11-25), against +2.4-3.6% at 64.

Defaults by device (``DEFAULTS``): on a CPU 64 continued steps of a global batch of 64 in
micro-batches of 4, what two cores train in minutes; on a GPU (``--device cuda``) 128 steps of 128,
where the larger batch keeps the replicas close, so the steps after the warm-up -- the ones a
low-communication method makes cheaper -- are three quarters of the run, not half, and each
replica's 32 sequences are one micro-batch (``--micro-batch``). The first GPU run (H200,
2026-11-28) kept the CPU's micro-batches of 4: eight launch-bound forward and backward passes of a
1.3M-parameter model a step, in four processes taking turns on one GPU, made a DDP step 0.35 s
of computation against the 1 Gbps link's 0.04 s (11% of DDP's time), so no method could be more
than 1.13x faster; the best, DiLoCo at H=8, reached the target 1.01x sooner (``README``).

Reported per run: the validation loss at every ``--eval-every`` steps (DDP) or at the least
common multiple of it and H (a low-communication run, so the evaluated model is the synced one)
against the wall-clock seconds of training up to that step (evaluations excluded), the bytes
the DP groups moved (ring bytes per rank), the final loss relative to DDP's at equal steps (and
so equal tokens), and the seconds to reach the target loss (default: DDP's final validation
loss x 1.03; linear interpolation between evaluations; null if not reached). Targets (issue
20): PALSGD and DiLoCo within 3% of DDP's final validation loss and faster than DDP to the
target. Beside them (``--baseline-without-link``, on by default) DDP runs once more without the
simulated link: the same losses in the time of the computation and the real collectives alone.
That is the floor of any method that computes as much as DDP, and ``link_share_of_ddp`` (1 -
its time / DDP's) is the link's share of DDP's time: such a method is at most 1 / (1 - share)
times faster than DDP over the same steps (PALSGD's pulls skip the computation of a step, so it
alone can go below that floor). A table goes to stderr, one JSON object to stdout (and
``--out``), and the loss-vs-time plot to ``--plot`` (the run without the link dashed).

``--repeats N`` runs the whole plan N times, each repeat starting one method later, and reports
the median seconds (the losses are identical in every repeat: only the machine's timing varies).
The first ``--warmup`` steps are the same DDP steps in every run (bitwise equal losses), so
``seconds_to_target_same_warmup`` times them alike in every run (the median over all runs of the
time to that step), every later step keeping its own duration: the machine's noise in the shared
phase is not credited to a method. The plot shows those curves.

The machine's two cores are shared by the four ranks, so compute is slow and the link's share of
a step is small: at a global batch of 64 a DDP step is about 1.1-1.5 s of compute against some
0.07 s on the 1 Gbps link, so no method can be much faster here (1.02-1.06x of DDP's time to the
target at H=8, 0.86-0.93x at H=32; 2 repeats, 2026-11-25). Over ``--link 100Mbps,5ms`` (about
0.65 s a DDP step) the steps after the warm-up are 31-49% cheaper, but the target is reached
some 10 steps after the warm-up: 1.07-1.11x at H=8, 0.97-1.02x at H=32 (2 repeats, 2026-11-24).
``--model moe`` makes the link a third of DDP's time on this CPU (1 Gbps / 5 ms, 2026-11-29, one
repeat; ``bench/results/local_sgd_moe_cpu*.json``): over 64 continued steps DDP trains in 99.4 s
(66.2 s without the link), local SGD / DiLoCo / PALSGD at H=8 in 87.2 / 89.9 / 79.2 s and end
+1.2% / +0.7% / +1.3% from DDP, at H=32 +1.4% / +0.9% / +1.2% -- yet DDP reaches the target at
step 41, nine steps after the warm-up, so the speed-up to it is 0.98 / 0.99 / 1.06x at H=8 and
0.88-0.94x at H=32 (DiLoCo and PALSGD overlapped at H=8: 0.97 / 1.02x). With a 16-step warm-up
over 128 steps the steps after it cost 0.9-1.0 s against DDP's 1.55 s, and DiLoCo's validation
loss is below DDP's at equal seconds from the warm-up's end (25 s) to about 115 s (5.217 against
5.257 at 98 s), but it ends +3.4% (PALSGD +5.2%), short of the +3% target: with 16 sequences a
replica, the replicas drift apart faster than the cheaper steps gain. At a global batch of 128
(128 steps, warm-up 32, ``--micro-batch 8``) DiLoCo ends +1.1% and PALSGD +2.6%, but the link is
24% of DDP's time: DiLoCo's steps after the warm-up cost 0.78x DDP's and it needs 96 steps to
DDP's 80 to reach the target (0.97x; PALSGD 0.92x). Those figures used DiLoCo's published outer
pair; with ``OUTER_DEFAULTS`` (tuned for H=8) the same batch-128 protocol ends DiLoCo -0.34% and
PALSGD (p 0.2) +0.53% from DDP (2 repeats, ``bench/results/local_sgd_moe_cpu_tuned_p02.json``),
and with ``PALSGD_P`` (2 repeats, 2026-11-29, ``bench/results/local_sgd_moe_cpu_tuned.json``; the
link 19% of DDP's time) DiLoCo -0.34% and PALSGD -0.36%, reaching DDP's final loss x 1.03 / 1.01 /
1.00 sooner than DDP by 1.07 / 1.14 / 1.24x (DiLoCo) and 1.06 / 1.16 / 1.26x (PALSGD).
``--device cuda`` puts the four ranks on one GPU (gloo, ``parallel.backend=gloo``: NCCL takes one
rank per GPU), each replica's batch in one micro-batch so that the link is a larger share of the
DDP step. The wall-clock figures are for the machine they were measured on only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
DEMO_DATA = REPO / "data" / "demo"
MODELS = {
    "hybrid": ["model.hidden_size=128", "model.num_attention_heads=4", "model.ffn_hidden_size=384",
               "model.moe_ffn_hidden_size=192", "model.pattern=M-*E-M-*"],
    "moe": ["model.hidden_size=128", "model.num_attention_heads=4", "model.moe_ffn_hidden_size=192",
            "model.pattern=ME*EME*E", "model.moe_num_experts=64"],
}
"""``--model``: ``hybrid`` (default) is the demo-style hybrid narrowed to hidden 128, 1.3M parameters
of which the tied 4096-token embedding is 0.5M: a DDP step all-reduces 5.3 MB. ``moe`` keeps the
width and the two attention and two Mamba blocks but makes the other four blocks Mixture-of-Experts
layers of 64 experts (top-2 of the config's default): 13.5M parameters, 54 MB all-reduced a DDP
step, for the same FLOPs a token but for four 64-way routers (2.4% more; a step takes some 1.5x the
hybrid's on this CPU: 64 experts' small GEMMs and AdamW over ten times the parameters) -- the ratio
of bytes to FLOPs of a model whose replicas each hold every expert (DP without EP, as across data
centres): over the 1 Gbps link a third of DDP's time, against some 5% for the hybrid."""
PALSGD_P = 0.05
"""PALSGD's pseudo-synchronization probability here, against its authors' 0.2. A pull is
theta <- theta - (lr / p) eta (theta - theta_global): with eta 1 and this model's AdamW peak lr of
3e-3 it moves a replica only some 1.5% (at p 0.2) of the way to the global copy, so a pull mostly
skips a step's computation -- and that step's progress. Fewer pulls keep more progress: at H=8 on
the MoE model (losses only, ``bench/results/local_sgd_outer_sweep_cpu.json``) PALSGD ends +0.53% /
+0.17% / -0.36% from DDP at p 0.2 / 0.1 / 0.05, and stronger pulls do worse (eta 10 / 40: +0.67% /
+1.12%). The authors' eta goes with their learning-rate scale; ``--local-overrides
parallel.palsgd_p=0.2`` restores their p."""
METHODS = {
    "local_sgd": ["parallel.dp_sync=local_sgd"],
    "diloco": ["parallel.dp_sync=diloco"],
    "palsgd": ["parallel.dp_sync=palsgd", f"parallel.palsgd_p={PALSGD_P}", "parallel.palsgd_eta=1.0"],
}
DEFAULTS = {"cpu": {"steps": 64, "global_batch": 64, "micro_batch": 4},
            "cuda": {"steps": 128, "global_batch": 128, "micro_batch": 32}}
"""``--steps``, ``--global-batch`` and ``--micro-batch`` where they are not given, by ``--device``
(module docstring): on a GPU a replica's whole batch is one micro-batch."""
VALIDATION_SEQUENCES = 16
"""At least this many validation sequences (``train.eval_batches`` micro-batches of ``--micro-batch``)."""
NO_LINK = "ddp no link"
"""The run of DDP without ``parallel.simulate_link`` (``--baseline-without-link``): computation
and the real collectives only, the same losses as DDP's."""
TARGET_FACTORS = (1.03, 1.02, 1.01, 1.0)
"""Targets of ``speedup_by_target``: DDP's final validation loss times each. The speed-up to a
target depends on where it lies on DDP's curve -- a low-communication run that trails DDP in the
middle of the run and catches up as the learning rate decays gains most on the targets nearest
DDP's final loss -- so the bench reports it at each, beside the headline ``--target-loss``, on
the curves with the common warm-up timed alike (``same_warmup_time``)."""
INIT_SEED = 4321
"""train.seed of the ``--init-steps`` run (the continued runs keep the default 1234)."""
OUTER_DEFAULTS = {"diloco": "0.85,0.75", "palsgd": "0.85,0.75"}
"""Outer (lr, Nesterov momentum) of the bench's DiLoCo and PALSGD: the best of a sweep at H=8 on
the MoE model, 128 steps of 128 sequences after a 32-step warm-up, losses only
(``bench/results/local_sgd_outer_sweep_cpu.json``, 2026-11-29). DiLoCo ended -0.33% from DDP with
(0.85, 0.75), +0.06% with (1.0, 0.6), +0.87% with (0.7, 0.6), +1.0% with (1.0, 0.4), +1.14% with
its published (0.7, 0.9), +1.34% with (0.5, 0.9), +2.1% with (1.3, 0) and +3.3% as plain
averaging (local SGD); PALSGD +0.53% with (0.85, 0.75), +0.99% with (1.0, 0.75), +1.45% with
(0.85, 0.85), +2.3% with (1.2, 0.7) and +2.56% with (0.7, 0.9). The published pair is tuned for H
in the hundreds: over a dozen outer steps of 8 inner steps its momentum 0.9 overshoots (at H=4,
+2.5%), while plain averaging keeps only what the replicas' noisy AdamW steps have in common, so
an outer step somewhat longer than the average change, with moderate momentum, does best. The
library's defaults (``parallel.outer_lr`` 0.7, ``parallel.outer_momentum`` 0.9) stay the
published pair; a run with a short H should sweep these two as this bench did."""


def run_overrides(args, run_dir: Path, steps: int, eval_every: int) -> list[str]:
    return [*MODELS[args.model], f"data.blend={DEMO_DATA / 'blend.json'}", f"train.run_dir={run_dir}",
            f"train.steps={steps}",
            "train.seq_len=128", f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}", f"train.eval_every={eval_every}",
            f"train.eval_batches={max(1, VALIDATION_SEQUENCES // args.micro_batch)}", "train.save_every=0",
            "train.progress=false", "train.tensorboard=false", "train.plot=false",
            f"train.device={'cuda:0' if args.device == 'cuda' else 'cpu'}", "parallel.dp=4",
            f"parallel.simulate_link={args.link}",
            *(["parallel.backend=gloo"] if args.device == "cuda" else [])]  # NCCL: one rank per GPU


def init_overrides(args, run_dir: Path) -> list[str]:
    """The shared starting point (``--init-steps``): one DDP run of that many steps at the peak
    learning rate (warm-up, then constant: a checkpoint from the middle of a pre-training run, as
    DiLoCo's), seeded with ``INIT_SEED`` so that its data are other samples than the ones the
    continued runs read (``train.init_from`` restarts the data position at 0; the validation
    batches, drawn with the continued runs' seed, are the same as without ``--init-steps``)."""
    return [*run_overrides(args, run_dir, args.init_steps, 0), "optim.schedule=constant",
            f"train.seed={INIT_SEED}"]


def timed_run(overrides: list[str]) -> dict:
    """In each spawned rank: train, timing each evaluated step's training time (evaluations
    excluded) and counting the DP groups' bytes."""
    import torch

    from meshlm.config import load_run_config
    from meshlm.parallel.comm_log import record_communication
    from meshlm.training.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(load_run_config(DEMO_CONFIG, overrides))
    start, evaluating, curve = time.perf_counter(), [0.0], {}
    evaluate = trainer.maybe_evaluate

    def timed_evaluate(final: bool):
        began = time.perf_counter()
        value = evaluate(final)
        if value is not None:
            curve[trainer.state.step] = (began - start - evaluating[0], value)
        evaluating[0] += time.perf_counter() - began
        return value

    trainer.maybe_evaluate = timed_evaluate
    context = trainer.context
    with record_communication({"dp": context.dp_group, "dp_cp": context.dp_cp_group}) as log:
        trainer.run()
    dp_bytes = sum(count.ring_bytes_sent for (_, label), count in log.counts.items() if label in ("dp", "dp_cp"))
    return {"curve": curve, "train_seconds": time.perf_counter() - start - evaluating[0], "dp_bytes": dp_bytes}


def median_run(repeats: list[dict]) -> dict:
    """One run from its repeats: the median seconds at each evaluated step and in all. The losses
    and bytes are the same in every repeat (same seed, data and layout; checked): only the
    machine's timing varies."""
    first = repeats[0]
    for other in repeats[1:]:
        if {step: loss for step, (_, loss) in other["curve"].items()} != \
                {step: loss for step, (_, loss) in first["curve"].items()}:
            raise RuntimeError("a repeat's validation losses differ from the first's: the runs are not reproducible")
    curve = {step: (statistics.median(run["curve"][step][0] for run in repeats), loss)
             for step, (_, loss) in first["curve"].items()}
    return {"curve": curve, "train_seconds": statistics.median(run["train_seconds"] for run in repeats),
            "train_seconds_each": [round(run["train_seconds"], 1) for run in repeats], "dp_bytes": first["dp_bytes"]}


def same_warmup_time(curve: dict, common: int, common_seconds: float | None) -> dict:
    """The curve with its first ``common`` steps timed as in every run (``common_seconds``: the
    median over all runs of the time to step ``common``). Those steps are the same DDP steps in
    every run -- the continued runs' start and the low-communication runs' warm-up, bitwise equal
    losses -- so a difference in their time is the machine's, not the method's: they are rescaled
    to the common time and every later step keeps its own measured duration."""
    if not common:
        return curve
    own = curve[common][0]
    return {step: (seconds * common_seconds / own if step <= common else seconds - own + common_seconds, loss)
            for step, (seconds, loss) in curve.items()}


def seconds_to(curve: dict, target: float) -> float | None:
    """First time the validation loss is <= target, interpolated between evaluations."""
    points = [(0.0, float("inf"))] + [curve[step] for step in sorted(curve)]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if l1 <= target:
            if l0 == float("inf"):
                return t1
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def speedup(ddp_curve: dict, curve: dict, target: float) -> float | None:
    """DDP's seconds to ``target`` over the run's (None where either never reaches it)."""
    ddp_time, reach = seconds_to(ddp_curve, target), seconds_to(curve, target)
    return ddp_time / reach if ddp_time and reach else None


def link_share(runs: dict) -> float | None:
    """The simulated link's share of DDP's training time: 1 - (DDP without the link) / (DDP with
    it), both medians of their repeats; None without the ``NO_LINK`` run. A method that computes
    as much as DDP can be at most 1 / (1 - share) times faster than DDP over the same steps."""
    if NO_LINK not in runs:
        return None
    return 1 - runs[NO_LINK]["train_seconds"] / runs["ddp"]["train_seconds"]


def plot(curves: dict, path: Path, link: str) -> None:
    """Validation loss against training seconds, the common DDP steps timed alike (``same_warmup_time``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        points = [curve[step] for step in sorted(curve)]
        style = {"color": "gray", "linestyle": "--"} if name == NO_LINK else {}
        axis.plot([t for t, _ in points], [loss for _, loss in points], marker="o", label=name,
                  linewidth=2.5 if name == "ddp" else 1.2, **style)
    axis.set_xlabel("training wall-clock seconds (evaluations excluded; the common DDP steps timed alike)")
    axis.set_ylabel("validation loss")
    axis.set_title(f"dp4 over a simulated {link} link")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def apply_device_defaults(args):
    """``args`` with ``--steps``, ``--global-batch`` and ``--micro-batch`` filled in from
    ``DEFAULTS[args.device]`` where not given."""
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="hybrid",
                        help="hybrid: 1.3M parameters (5.3 MB a DDP all-reduce); moe: 13.5M parameters, four "
                             "blocks of 64 experts, about the same FLOPs a token (MODELS)")
    parser.add_argument("--steps", type=int, default=None, help="continued steps (default: 64 on cpu, 128 on cuda)")
    parser.add_argument("--sync-every", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--link", default="1Gbps,5ms")
    parser.add_argument("--eval-every", type=int, default=8,
                        help="DDP's evaluation interval; a low-communication run evaluates at the least common "
                             "multiple of it and its H (the synced model)")
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument("--overlap-at", type=int, nargs="*", default=[], metavar="H",
                        help="also run DiLoCo and PALSGD at these H with parallel.outer_overlap=true (Streaming "
                             "DiLoCo's one-step-stale sync: the outer all-reduce runs during the next inner step)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--diloco-outer", default=OUTER_DEFAULTS["diloco"], metavar="LR,MOMENTUM")
    parser.add_argument("--palsgd-outer", default=OUTER_DEFAULTS["palsgd"], metavar="LR,MOMENTUM")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step over the 4 replicas, a multiple of 4 x --micro-batch; "
                             "default: 64 on cpu, 128 on cuda")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per forward and backward of a replica (the rest is gradient "
                             "accumulation; the same gradients either way): default 4 on cpu, 32 on cuda")
    parser.add_argument("--local-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="dotted overrides for the low-communication runs only (e.g. optim.lr=2e-3: their "
                             "inner learning rate), DDP keeps the demo's settings")
    parser.add_argument("--init-steps", type=int, default=32,
                        help="start every run (DDP included) from the model of one DDP run of this many steps "
                             "(train.init_from); the figures are then for the continued --steps only")
    parser.add_argument("--warmup", type=int, default=32,
                        help="DDP steps at the start of every low-communication run (parallel.palsgd_warmup, "
                             "parallel.local_warmup): the PALSGD authors' 32; 0 for none")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the 4 ranks share GPU 0 over gloo (compute there is ~100x faster, so the "
                             "link's share of a step is a GPU cluster's, not this CPU's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole plan this many times (methods interleaved) and report the median "
                             "seconds: the losses are identical in every repeat, the machine's timing is not")
    parser.add_argument("--baseline-without-link", action=argparse.BooleanOptionalAction, default=True,
                        help="also run DDP without the simulated link (NO_LINK): its time is the run's "
                             "computation and real collectives alone, the floor of any method that computes "
                             "as much as DDP, and measures the link's share of DDP's time")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=str(REPO / "bench" / "local_sgd.png"))
    args = apply_device_defaults(parser.parse_args(argv))
    if args.micro_batch < 1:
        parser.error(f"--micro-batch {args.micro_batch}: give each forward at least one sequence.")
    if args.global_batch < 1 or args.global_batch % (4 * args.micro_batch):
        parser.error(f"--global-batch {args.global_batch}: use a multiple of {4 * args.micro_batch} (4 replicas x "
                     f"micro-batches of {args.micro_batch}), or change --micro-batch.")
    if any(every < 2 for every in args.overlap_at):
        parser.error(f"--overlap-at {args.overlap_at}: give sync intervals H of at least 2.")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: run the plan at least once (--repeats 1 or more).")

    from meshlm.checkpoint.files import write_json_atomic
    from meshlm.data.demo_corpus import build_demo_corpus
    from tests.helpers.distributed import run_distributed

    build_demo_corpus(str(DEMO_DATA), workers=2, show_progress=False)
    outer = {method: getattr(args, f"{method}_outer").split(",") for method in OUTER_DEFAULTS}
    settings = {method: [*overrides, *([f"parallel.outer_lr={outer[method][0]}",
                                        f"parallel.outer_momentum={outer[method][1]}"] if method in outer else [])]
                for method, overrides in METHODS.items()}
    for method in METHODS:
        settings[method].append(f"parallel.{'palsgd' if method == 'palsgd' else 'local'}_warmup={args.warmup}")
    plan = [("ddp", [], args.eval_every)] + ([(NO_LINK, ["parallel.simulate_link=null"], args.eval_every)]
                                             if args.baseline_without_link and args.link else []) + [
        (f"{method} H={every}", [*settings[method], f"parallel.sync_every={every}", *args.local_overrides],
         math.lcm(args.eval_every, every)) for every in args.sync_every for method in args.methods] + [
        (f"{method} H={every} overlap", [*settings[method], f"parallel.sync_every={every}",
                                         "parallel.outer_overlap=true", *args.local_overrides],
         math.lcm(args.eval_every, every))
        for every in args.overlap_at for method in args.methods if method in OUTER_DEFAULTS]
    repeats, init = {}, None
    with tempfile.TemporaryDirectory() as workdir:
        if args.init_steps:
            init_dir = Path(workdir) / "init"
            init = run_distributed(timed_run, 4, init_overrides(args, init_dir), timeout_s=3600)[0]
            init = {"steps": args.init_steps, "train_seconds": init["train_seconds"],
                    "dp_megabytes": init["dp_bytes"] / 1e6}
            print(f"init (DDP, {args.init_steps} steps): {init['train_seconds']:.1f} s", file=sys.stderr, flush=True)
            plan = [(name, [*extra, f"train.init_from={init_dir}"], every) for name, extra, every in plan]
        for repeat in range(args.repeats):  # the whole plan again, each time starting one method later
            for name, extra, eval_every in plan[repeat % len(plan):] + plan[:repeat % len(plan)]:
                run_dir = Path(workdir) / f"{name.replace(' ', '_')}_{repeat}"
                run = run_distributed(timed_run, 4, [*run_overrides(args, run_dir, args.steps, eval_every), *extra],
                                      timeout_s=3600)[0]  # rank 0: replica 0
                repeats.setdefault(name, []).append(run)
                final = run["curve"][max(run["curve"])]
                print(f"{name:<20} final val {final[1]:.4f} after {run['train_seconds']:.1f} s, "
                      f"{run['dp_bytes'] / 1e6:.1f} MB over DP (repeat {repeat + 1}/{args.repeats})",
                      file=sys.stderr, flush=True)
                if args.out:  # so far: what a run stopped at its time limit (a GPU session's stage) still leaves
                    write_json_atomic(Path(args.out), {"partial": True, "device": args.device, "init": init,
                                                       "runs_so_far": repeats})
    runs = {name: median_run(each) for name, each in repeats.items()}
    ddp_final = runs["ddp"]["curve"][max(runs["ddp"]["curve"])][1]
    target = args.target_loss if args.target_loss is not None else ddp_final * 1.03
    linked = {name: run for name, run in runs.items() if name != NO_LINK}  # whose first steps are the same
    common = args.warmup if args.warmup and all(args.warmup in run["curve"] for run in linked.values()) else 0
    common_seconds = statistics.median(run["curve"][common][0] for run in linked.values()) if common else None
    aligned = {name: same_warmup_time(run["curve"], common, common_seconds) if name in linked else run["curve"]
               for name, run in runs.items()}
    table = {}
    for name, run in runs.items():
        final = run["curve"][max(run["curve"])][1]
        reach, reach_aligned = seconds_to(run["curve"], target), seconds_to(aligned[name], target)
        table[name] = {"final_val_loss": final, "vs_ddp_loss": final / ddp_final - 1,
                       "train_seconds": run["train_seconds"], "seconds_to_target": reach,
                       "speedup_to_target": speedup(runs["ddp"]["curve"], run["curve"], target),
                       "seconds_to_target_same_warmup": reach_aligned,
                       "speedup_to_target_same_warmup": speedup(aligned["ddp"], aligned[name], target),
                       "speedup_by_target": {f"{factor:.2f}": speedup(aligned["ddp"], aligned[name],
                                                                      ddp_final * factor)
                                             for factor in TARGET_FACTORS},
                       "seconds_curve": {step: round(seconds, 2)
                                         for step, (seconds, _) in sorted(run["curve"].items())},
                       "train_seconds_each": run["train_seconds_each"], "dp_megabytes": run["dp_bytes"] / 1e6,
                       "val_curve": {step: loss for step, (_, loss) in sorted(run["curve"].items())}}
    print(f"\n{'run':<20}{'val loss':>10}{'vs DDP':>9}{'train s':>9}{'s to target':>13}{'same warm-up':>14}"
          f"{'DP MB':>9}  speed-up to DDP's final x {' / '.join(f'{factor:.2f}' for factor in TARGET_FACTORS)}",
          file=sys.stderr)
    for name, row in table.items():
        reach = "-" if row["seconds_to_target"] is None else f"{row['seconds_to_target']:.1f}"
        same = "-" if row["seconds_to_target_same_warmup"] is None else f"{row['seconds_to_target_same_warmup']:.1f}"
        print(f"{name:<20}{row['final_val_loss']:>10.4f}{row['vs_ddp_loss']:>+9.2%}{row['train_seconds']:>9.1f}"
              f"{reach:>13}{same:>14}{row['dp_megabytes']:>9.1f}  "
              + " / ".join("-" if value is None else f"{value:.2f}x" for value in row["speedup_by_target"].values()),
              file=sys.stderr)
    result = {"model": args.model, "steps": args.steps, "global_batch": args.global_batch,
              "micro_batch": args.micro_batch, "link": args.link, "target_loss": target, "device": args.device,
              "repeats": args.repeats,
              "init": init, "start_val_loss": runs["ddp"]["curve"][0][1], "warmup": args.warmup, "outer": outer,
              "method_overrides": {method: METHODS[method] for method in args.methods},
              "local_overrides": args.local_overrides, "common_warmup_seconds": common_seconds,
              "link_share_of_ddp": link_share(runs), "runs": table}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    plot(aligned, Path(args.plot), args.link)
    return 0


if __name__ == "__main__":
    sys.exit(main())
