"""One GPU session's checks and measurements, most important first, inside a wall-clock budget.

    python -m bench.gpu_session --out DIR [--budget-s 540] [--stages NAME,...] [--done FILE]
    python -m bench.gpu_session --out DIR --dry-run          # the same plan on this CPU, tiny

A lent GPU comes for a few minutes at a time (15 minutes of device time a session, a command at
most 10, the machine's start included), while issues 14, 15 and 20 between them ask for the CUDA
test tier, MFU on three 1B models, FP8 against bf16 step times and low-communication DP on a
GPU: together much more than one session holds. This script runs them as *stages*, in the order
they matter, each in its own process with its own time limit, and skips a stage whose estimate
no longer fits the budget -- so a session spends its minutes on the most important work not yet
done, and a hanging stage cannot eat the rest:

============================  =====  ================================================================
stage                         issue  what it runs
============================  =====  ================================================================
``env``                       14     GPU, driver, torch / CUDA / Triton versions; which FP8 scale
                                     layouts ``torch._scaled_mm`` runs (always runs, never "done")
``tier_compile_layouts``      14     the tier's compiled blocks and its gloo layouts on one GPU; each
                                     model kind's compiled gradients against its eager ones in
                                     fp32, and bf16's, eager and compiled, against fp32's (which
                                     path a gap comes from: the fourth session's bf16 comparison
                                     put the hybrid's compiled and eager dt_bias 8.4x apart)
``fp8_dense_wide``            15     ``fp8_dense`` on ``--model dense_wide`` (hidden 4096, 4 layer
                                     pairs: GEMMs 4x larger, 94% of the FLOPs), with Inductor's code
                                     (``inductor_fp8_wide.py.gz``): the linear-heavy model where
                                     1.3x can be had (1.41x in the fourth session); with the forward
                                     GEMM's split accumulator too
                                     (``fp8_tensorwise_split_accumulation``: is its fast accumulation
                                     what cost tensorwise 2.1% of validation loss there?), and
                                     ``fp8_delayed`` compiled, which Inductor refused there (its
                                     scales were views into one tensor)
``throughput_hybrid``         14     ``bench.gpu_throughput``, hybrid 1B, eager and compiled, each
                                     variant profiled one step (``--profile 60``: the compiled
                                     hybrid's Mamba-2 kernels are many, each a few ms): the SSD
                                     scan's reworked Triton path, checked on the device by the
                                     trainer first (``meshlm/models/scan_kernels.py``), then timed;
                                     and Inductor's generated code for it
                                     (``inductor_hybrid.py.gz``): what each profiled kernel moves
``throughput_dense``          14     ``bench.gpu_throughput``, dense 1B, eager and compiled, with the
                                     plain-PyTorch baseline: MFU and the ratio to the baseline; each
                                     variant then profiled one step (``--profile 25``): where
                                     meshlm's step and the plain loop's part
``tier``                      14     the CUDA tier without compile and layouts (fused paths, the FP8
                                     GEMMs, the four model kinds, one NCCL process, gloo on CUDA) and
                                     the ordinary suite's CUDA cases (Triton SSD kernels, FP8 GEMM)
``fp8_dense``                 15     ``bench.low_precision --model dense``, bf16, fp8_tensorwise and
                                     fp8_delayed compiled: the FP8 step-time target (>= 1.3x), each
                                     run with one step profiled (``--profile 25``): where FP8 loses
                                     its GEMMs' gain, and Inductor's code (``inductor_fp8.py.gz``).
                                     Delayed scaling casts with a scale from past steps, so its
                                     cast need not wait for this tensor's amax pass
``fp8_gemms``                 15     ``bench.fp8_gemms``: each GEMM of the FP8 bench model's layers in
                                     bf16 and on FP8 codes (split and fast accumulation) and what
                                     quantizing an operand costs: how much of 1.3x the GEMMs allow
``fp8_dense_recipes``         15     ``bench.low_precision --model dense``: every FP8 recipe, eager
``sliding_window``            14     ``bench.sliding_window --device cuda``: a window's two fused causal
                                     blocks a chunk against its band-masked chunks, full causal
                                     attention and the dense band mask, in bf16: whether every
                                     window should run fused on a GPU (on the CPU only windows of
                                     1024 and more do, ``attention.FUSED_WINDOW_MIN_ON_CPU``)
``serving``                   14     ``bench.serving --device cuda``: ``meshlm serve``'s continuous
                                     batching (up to 8 and 32 rows) against one request at a time,
                                     32 requests of 128 new tokens: tokens/s, latency (a guess: 90 s)
``local_sgd``                 20     ``bench.local_sgd --device cuda --model moe``: DDP, DiLoCo and
                                     PALSGD at H=8 (also with the outer sync overlapped) over a
                                     simulated 1 Gbps link, 4 ranks on the GPU, on the 13.5M-parameter
                                     MoE, with the bench's outer pair tuned for H=8 and PALSGD's p
                                     0.05. Issue 20 is resolved on the CPU's figures (the link 19% of
                                     DDP's step there; DiLoCo and PALSGD 1.24x and 1.26x sooner to
                                     DDP's final loss), so this runs last, for the GPU's figures only
                                     when the budget has room; it writes what it has after every run
============================  =====  ================================================================

Each stage's estimate is a guess until a GPU session has run it; ``session.json`` records the
seconds each stage took, so the estimates can be corrected from it. The first two sessions (both
on an H200, 2026-11-27) measured ``env`` (8 s), ``tier`` (142 s: 57 s for ``TIER_CORE`` and 85 s
for ``CUDA_CASES``, 67 of them one CPU-only FP8 test that compiles with Inductor's C++ backend,
now left to the CPU suite; the stage, then given 120 s, was stopped, and its two halves ran by
hand and passed), ``throughput_dense`` (94 s with
its profiles), ``fp8_dense`` (124 s), ``tier_compile_layouts`` (136 s) and
``throughput_hybrid_moe`` (130 s, without profiles); the third (H200, 2026-11-28) ``env`` (10 s),
``local_sgd`` (421 s, with the CPU's micro-batches of 4: eight passes a step; one a step now, so
less), ``fp8_gemms`` (37 s), ``throughput_dense`` (88 s) and ``throughput_hybrid_moe`` (142 s,
with profiles: hybrid and MoE, which the hybrid-only stage replaced once the MoE's figures stood).
The fourth (H200, 2026-11-30) ran ``env`` (7 s), ``throughput_hybrid`` (84 s), ``fp8_dense_wide``
(211 s, three configs), ``throughput_dense`` (79 s), ``tier`` (102 s) and ``tier_compile_layouts``
(209 s; 2 of 24 tests failed). ``fp8_dense_recipes`` is still a guess. The order puts the compiled
blocks' tier first (issue 14's "done when" asks for the tier to pass, and the fourth session's run
of it left the hybrid's compiled bf16 gradients in question), then the FP8 step on the wide model
(issue 15's step-time target, met there, with the loss gap and the delayed recipe's compile to
settle), then the throughput benches (both measured in the fourth session), the rest of the CUDA
tier, the other FP8 measurements, the serving bench, and issue 20's GPU run last (that issue is resolved). A stage
is given its estimate plus half again (at most what is left of the
budget) before it is stopped; what a bench wrote before that stays (``bench.gpu_throughput`` rewrites its JSON after every variant).

**Across sessions.** Everything goes under ``--out`` (on the device tool: ``$OUT``, whose files
come back; at most 8 of them, so every stage appends to one ``session.log``): ``session.json`` (a
record per stage: status, seconds, exit code, the end of its output; rewritten after every stage,
so a killed session keeps what it finished) and each bench's own JSON (ten files if every stage
ran, with the hybrid's generated code; one call, inside its 10 minutes, runs three or four of
them). Commit the returned ``session.json`` as ``bench/results/gpu_session.json`` with the benches' files beside it; the next
GPU session passes ``--done bench/results/gpu_session.json`` and starts with the first stage that
has not passed yet, carrying the earlier records forward. A committed record whose result a later
fix made meaningless gets ``"status": "invalidated"`` and a ``"why"`` by hand: ``--done`` runs
every stage whose status is not ``passed`` again. ``--stages`` runs the named stages only.
Within one session the same works between two calls (the device tool empties ``$OUT`` before each
command but sends the working tree): a first call with the default budget (9 minutes, inside the
10 a command may take), then the returned ``session.json`` copied to
``bench/results/gpu_session.json`` and, while the machine is warm, a second call with ``--done``
and a ``--budget-s`` that fits the device time left.

The demo corpus (``data/demo``, which ``fp8_dense*`` and ``local_sgd`` train on) is built on a
fresh machine first, in about half a minute; carry it (``carry: ["data/demo"]``) to skip that.

``--dry-run`` runs the same plan on this CPU with tiny settings (the tier as
``MESHLM_GPU_TESTS_ON_CPU=1``, the benches on their CPU or tiny shapes): it checks the script and
every stage's command line, not the GPU. ``tests/bench/test_gpu_session.py`` holds the planning
logic (budget, ``--done``, time limits) to its word.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIER_CORE = ["tests/gpu/test_fused_paths.py", "tests/gpu/test_fp8_hardware.py", "tests/gpu/test_model_kinds.py",
             "tests/gpu/test_nccl.py", "tests/gpu/test_gloo_on_cuda.py"]
CUDA_CASES = ["tests/kernels", "tests/precision/test_fp8_gemm.py", "tests/precision/test_quantized_projections.py",
              "--deselect", "tests/precision/test_fp8_gemm.py::test_vector_entries_become_aligned_scales_eagerly_and_compiled"]
"""Files of the ordinary suite that run on CUDA where torch sees it (``make test-gpu`` runs them too),
less one CPU-only test that took 67 of the tier's 142 s on the second GPU session (it compiles a
CPU graph with Inductor's C++ backend; the CPU suite runs it)."""
PYTEST = ["-m", "pytest", "-rs", "-p", "no:cacheprovider"]  # with the project's -q: a summary line
ENV_PROBE = """
import json, torch
from meshlm.precision.fp8_gemm import SCALINGS, hardware_fp8_supported, unsupported_reason
cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "fp8_scaled_mm": {scaling: unsupported_reason(device, scaling, torch.float8_e4m3fn, torch.float8_e4m3fn,
                                                      torch.bfloat16) or "runs" for scaling in SCALINGS}}
print(json.dumps(info, indent=1))
"""


@dataclass
class Stage:
    """One step of the plan: a command line (and its tiny CPU variant), and how long it should take."""

    name: str
    issue: int
    estimate_s: float
    command: list[str]
    dry_command: list[str]
    dry_environment: dict = field(default_factory=dict)
    """Variables set for the dry run's command only."""
    always: bool = False
    """Run in every session, whatever ``--done`` says (the machine's facts may differ)."""
    environment: dict = field(default_factory=dict)
    """Variables set for the command, on the GPU and in the dry run alike."""


def plan(out: Path) -> list[Stage]:
    """The stages in priority order (module docstring), writing their files under ``out``."""
    python = sys.executable

    def throughput(models: str) -> list[str]:  # a file per stage: two stages in one call must not overwrite
        return [python, "-m", "bench.gpu_throughput", "--out", str(out / f"gpu_throughput_{models}.json")]

    low_precision = [python, "-m", "bench.low_precision", "--model", "dense"]
    low_precision_dry = [python, "-m", "bench.low_precision", "--model", "hybrid", "--device", "cpu", "--steps", "2",
                         "train.eval_batches=1", "train.seq_len=32"]
    dry_tier = {"MESHLM_GPU_TESTS_ON_CPU": "1"}
    # the compiled hybrid's generated kernels, to read its profile against (bench.profiling); a cache
    # of its own, so that every module is generated in this run and none is taken from an older one
    inductor_code = ["--inductor-code", str(out / "inductor_hybrid.py.gz")]
    fresh_inductor_cache = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tempfile.gettempdir()) / "meshlm-inductor-hybrid")}
    fp8_inductor_code = ["--inductor-code", str(out / "inductor_fp8.py.gz")]  # the same, for the FP8 runs
    fresh_fp8_inductor_cache = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tempfile.gettempdir()) / "meshlm-inductor-fp8")}
    return [
        Stage("env", 14, 15, [python, "-c", ENV_PROBE], [python, "-c", ENV_PROBE], always=True),
        Stage("tier_compile_layouts", 14, 280,
              [python, *PYTEST, "tests/gpu/test_compiled_blocks.py", "tests/gpu/test_layouts.py"],
              [python, *PYTEST, "tests/gpu/test_compiled_blocks.py", "tests/gpu/test_layouts.py"], dry_tier),
        Stage("fp8_dense_wide", 15, 280,
              [python, "-m", "bench.low_precision", "--model", "dense_wide", "--device", "cuda", "--configs",
               "bf16,fp8_tensorwise,fp8_tensorwise_split_accumulation,fp8_delayed", "--profile", "25",
               "--out", str(out / "low_precision_wide.json"),
               "--inductor-code", str(out / "inductor_fp8_wide.py.gz"), "train.compile=true"],
              [*low_precision_dry, "--configs", "bf16,fp8_delayed", "--out", str(out / "low_precision_wide.json")],
              environment={"TORCHINDUCTOR_CACHE_DIR": str(Path(tempfile.gettempdir()) / "meshlm-inductor-fp8-wide")}),
        Stage("throughput_hybrid", 14, 130, [*throughput("hybrid"), "--models", "hybrid", "--recompute", "none",
                                             "--profile", "60", *inductor_code],
              [*throughput("hybrid"), "--models", "hybrid", "--recompute", "none", "--profile", "25", "--tiny",
               *inductor_code], environment=fresh_inductor_cache),
        Stage("throughput_dense", 14, 110, [*throughput("dense"), "--models", "dense", "--recompute", "none",
                                            "--profile", "25"],
              [*throughput("dense"), "--models", "dense", "--recompute", "none", "--profile", "25", "--tiny"]),
        Stage("tier", 14, 100, [python, *PYTEST, *TIER_CORE, *CUDA_CASES], [python, *PYTEST, *TIER_CORE, *CUDA_CASES],
              dry_tier),
        Stage("fp8_dense", 15, 190,
              [*low_precision, "--device", "cuda", "--configs", "bf16,fp8_tensorwise,fp8_delayed", "--profile", "25",
               "--out", str(out / "low_precision_compiled.json"), *fp8_inductor_code, "train.compile=true"],
              [*low_precision_dry, "--configs", "bf16,fp8_tensorwise", "--profile", "5", "--out",
               str(out / "low_precision_compiled.json")], environment=fresh_fp8_inductor_cache),
        Stage("fp8_gemms", 15, 45, [python, "-m", "bench.fp8_gemms", "--out", str(out / "fp8_gemms.json")],
              [python, "-m", "bench.fp8_gemms", "--device", "cpu", "--tokens", "64", "--hidden", "64", "--ffn", "128",
               "--calls", "2", "--repeats", "2", "--out", str(out / "fp8_gemms.json")]),
        Stage("fp8_dense_recipes", 15, 240,
              [*low_precision, "--device", "cuda", "--configs", "bf16,fp8_tensorwise,fp8_delayed,fp8_blockwise",
               "--out", str(out / "low_precision_eager.json")],
              [*low_precision_dry, "--configs", "bf16,fp8_delayed", "--out", str(out / "low_precision_eager.json")]),
        Stage("sliding_window", 14, 60,
              [python, "-m", "bench.sliding_window", "--device", "cuda", "--out", str(out / "sliding_window_gpu.json")],
              [python, "-m", "bench.sliding_window", "--device", "cpu", "--seqs", "256", "--windows", "64",
               "--repeats", "1", "--out", str(out / "sliding_window_gpu.json")]),
        Stage("serving", 14, 90,
              [python, "-m", "bench.serving", "--device", "cuda", "--requests", "32", "--batch-sizes", "8,32",
               "--max-new-tokens", "128", "--out", str(out / "serving_gpu.json")],
              [python, "-m", "bench.serving", "--device", "cpu", "--requests", "4", "--batch-sizes", "2",
               "--max-new-tokens", "4", "--repeats", "1", "--out", str(out / "serving_gpu.json")]),
        Stage("local_sgd", 20, 300,
              [python, "-m", "bench.local_sgd", "--device", "cuda", "--model", "moe", "--sync-every", "8",
               "--methods", "diloco", "palsgd", "--overlap-at", "8", "--out", str(out / "local_sgd.json"),
               "--plot", str(out / "local_sgd.png")],
              [python, "-m", "bench.local_sgd", "--device", "cpu", "--model", "moe", "--steps", "4", "--init-steps",
               "2", "--warmup", "1", "--sync-every", "2", "--methods", "diloco", "--eval-every", "2",
               "--global-batch", "16",
               "--out", str(out / "local_sgd.json"), "--plot", str(out / "local_sgd.png")]),
    ]


def time_limit(stage: Stage, remaining_s: float) -> float | None:
    """Seconds ``stage`` may run with ``remaining_s`` of the budget left: its estimate and half again,
    at most what is left; None when its estimate does not fit what is left."""
    if stage.estimate_s > remaining_s:
        return None
    return min(1.5 * stage.estimate_s, remaining_s)


def earlier_records(done_file: Path | None) -> dict:
    """{stage: record} of an earlier session's ``session.json`` (nothing without one)."""
    if done_file is None:
        return {}
    try:
        return json.loads(done_file.read_text())["stages"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"bench.gpu_session: --done {done_file} is not a session.json this script wrote ({error}); "
                         "pass the file from an earlier session's --out, or leave --done out.") from None


def run_stage(stage: Stage, command: list[str], limit_s: float, log_path: Path, dry_run: bool) -> dict:
    """Run one stage in its own process group, its output appended to ``log_path``; its record."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                   **stage.environment, **(stage.dry_environment if dry_run else {})}
    started = time.monotonic()
    with log_path.open("a") as log:
        log.write(f"\n===== {stage.name} (issue {stage.issue}, limit {limit_s:.0f} s): {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=limit_s)
            status = "passed" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code, status = process.wait(), "timed out"
    seconds = round(time.monotonic() - started, 1)
    return {"status": status, "seconds": seconds, "exit_code": code, "limit_s": round(limit_s),
            "estimate_s": stage.estimate_s, "issue": stage.issue, "tail": output_tail(log_path, stage.name),
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def output_tail(log_path: Path, stage_name: str, lines: int = 25) -> list[str]:
    """The last ``lines`` lines the stage wrote to the log."""
    text = log_path.read_text(errors="replace")
    own = text[text.rfind(f"===== {stage_name} "):]
    return own.splitlines()[1:][-lines:]


def write_session(path: Path, records: dict, machine: str, budget_s: float) -> None:
    """``session.json``, through a temporary file (a kill mid-write leaves the old one)."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"machine": machine, "budget_s": budget_s, "stages": records}, indent=1) + "\n")
    temporary.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for session.log, session.json and the "
                        "benches' JSON (on the device tool: $OUT)")
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock seconds for every stage together "
                        "(default 540: a 600 s command with room to spare)")
    parser.add_argument("--stages", default=None, help="comma-separated stages to run (default: all, in order)")
    parser.add_argument("--done", type=Path, default=None, help="an earlier session.json: skip the stages that "
                        "passed there and carry their records forward")
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU variants of every stage (checks the script)")
    args = parser.parse_args(argv)
    stages = plan(args.out.resolve())
    names = [stage.name for stage in stages]
    chosen = names if args.stages is None else [name.strip() for name in args.stages.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown or not chosen:
        parser.error(f"--stages {args.stages!r}: use a comma-separated subset of {', '.join(names)}.")
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s}: give the stages a positive number of seconds.")
    records = earlier_records(args.done)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path, session_path = args.out / "session.log", args.out / "session.json"
    machine = "dry run on " + os.uname().nodename if args.dry_run else os.uname().nodename
    started, ran = time.monotonic(), []
    for stage in stages:
        if stage.name not in chosen:
            continue
        if not stage.always and records.get(stage.name, {}).get("status") == "passed":
            print(f"gpu_session: {stage.name}: passed in an earlier session ({records[stage.name].get('when')})",
                  flush=True)
            continue
        remaining = args.budget_s - (time.monotonic() - started)
        limit = time_limit(stage, remaining)
        if limit is None:
            print(f"gpu_session: {stage.name}: skipped, its estimate of {stage.estimate_s:.0f} s does not fit the "
                  f"{remaining:.0f} s left", flush=True)
            continue
        print(f"gpu_session: {stage.name} (issue {stage.issue}), up to {limit:.0f} s ...", flush=True)
        records[stage.name] = run_stage(stage, stage.dry_command if args.dry_run else stage.command, limit,
                                        log_path, args.dry_run)
        ran.append(stage.name)
        write_session(session_path, records, machine, args.budget_s)
        print(f"gpu_session: {stage.name}: {records[stage.name]['status']} in {records[stage.name]['seconds']} s",
              flush=True)
    write_session(session_path, records, machine, args.budget_s)
    print("\nstage                     status      seconds  estimate")
    for name in names:
        record = records.get(name)
        if record is not None:
            print(f"{name:<25} {record['status']:<11} {record['seconds']:>7}  {record['estimate_s']:>8}")
    for name in ran:  # the end of each failed stage's output, last, where the device tool's reply keeps it
        if records[name]["status"] != "passed":
            print(f"\n--- {name} ({records[name]['status']}):", *records[name]["tail"][-12:], sep="\n")
    return 0 if all(records.get(name, {}).get("status") == "passed" for name in chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
