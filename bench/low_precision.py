"""Low-precision training recipes against bf16: the same run under each, validation loss and step time.

    python -m bench.low_precision [--steps N] [--configs bf16,fp8_tensorwise,...] [--model hybrid|dense]
                                  [--device cpu|cuda] [--out FILE] [SECTION.KEY=VALUE ...]

Every config trains the same model from the same seed on the same batches of the demo corpus
(Shakespeare + Python, built offline by ``meshlm data demo`` into ``data/demo`` when it is not
there yet) for the same number of steps, with ``precision.dtype=bf16``; they differ only in
``precision.recipe`` (``meshlm/precision/recipes.py``) and its settings:

- ``bf16``: no recipe, the baseline (always run, first);
- ``fp8_tensorwise``, ``fp8_delayed``, ``fp8_blockwise``, ``mxfp8``: the FP8 recipes;
- ``nvfp4``: the full NVFP4 recipe of "Pretraining LLMs with NVFP4" (NVIDIA 2025): the first and
  last block kept in bf16 (``precision.high_precision_layers=1``), the 16 x 16 random Hadamard
  transform on the weight-gradient operands, stochastic rounding of the gradients;
- its ablations, each removing one part: ``nvfp4_no_hadamard``, ``nvfp4_no_stochastic_rounding``
  and ``nvfp4_all_layers`` (every block in NVFP4).

Measured per config: the validation loss at the end (``train.eval_batches`` fixed micro-batches,
the same for every config) and at step 0, its ratio to bf16's and the difference in percent, and
the median wall-clock seconds of a training step and its ratio to bf16's (beside it the median
CPU seconds, all threads; on a busy machine those grow too, as OpenMP threads spin while waiting),
``gemms`` (whether the quantized layers multiplied FP8 codes on the hardware GEMM or dequantized
operands: only the first is FP8 speed) and ``compile_notices`` and ``graph_breaks`` (with
``train.compile=true``: a block that fell back to eager; where TorchDynamo split a block's graph,
and ``graph_break_reasons``: each reason's first line and count).
Training runs write to a temporary folder, removed afterwards. A config the trainer refuses (a
``ConfigError``, e.g. a recipe this checkout does not have yet) gets ``{"error": message}`` and
the bench goes on. A line per finished run goes to stderr; one JSON object (also written to
``--out``) to stdout at the end.

Targets (the issue's): each FP8 recipe's validation loss at most 1% above bf16's, NVFP4's at most
3% above (the NVFP4 paper reports about 1.5% at 12B parameters and 10T tokens; a short run of a
small model is a much weaker check); each ablation's validation loss above full NVFP4's (the
removed part helped; ``val_loss_delta`` is how much). On a Hopper GPU (``--device cuda --model
dense``): FP8 steps at least 1.3x faster than bf16's, on a linear-heavy dense Transformer (8
attention + MLP layers, hidden 2048, FFN 8192: about 90% of its FLOPs are GEMMs of linear layers,
which the recipes quantize; 100 steps of 4 accumulated micro-batches of 8 x 1024 tokens, so the
optimizer is paid once per 32K tokens as in pre-training). ``--model dense_wide`` is the same at
hidden 4096, FFN 16384, 32 heads and 4 layer pairs (60 steps): its GEMMs are 4x larger and some
94% of its FLOPs, for how the ratio grows with the GEMMs' share. The speed targets are reported only on
CUDA: on a CPU the recipes run emulated (quantize, dequantize, bf16 matmul), so their step times
say nothing about FP8 hardware.

``--model hybrid`` (the default) is the demo's hybrid (``configs/demo.yaml``: Mamba-2, attention,
MLP and MoE blocks). The defaults of steps, sequence length, micro-batch, micro-batches per step
and evaluation batches depend on the model and device (``DEFAULTS``). On a 2-core CPU without
bf16 instructions (AVX2 only; a bf16 matmul runs in software, hundreds of times slower than
fp32's) the hybrid trains 60 steps of 8 x 128 tokens and validates on 16 x 8 x 128 tokens:
measured on an idle 2-core AMD EPYC, a bf16 step takes about 4.0 s, an FP8 one 2.8-4.2 s, an
NVFP4 one 3.8-5.0 s, and the nine runs about 40 minutes (other work on the machine stretches
every step alike, so run it alone). Any ``SECTION.KEY=VALUE`` after the options overrides every
config (e.g. ``train.seq_len=256``). ``--profile TOP`` profiles one step of each run (its TOP
operators by their own device time) and ``--inductor-code FILE`` keeps the kernels Inductor
generated for the compiled runs, all configs in one gzip file, each run's count in its
``inductor_modules``: where an FP8 step's quantization fused into its neighbours and where not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.compile import graph_break_reasons
from bench.profiling import profile_step, save_inductor_code
from meshlm.config import load_run_config
from meshlm.data.demo_corpus import build_demo_corpus
from meshlm.errors import ConfigError
from meshlm.precision.quantized_experts import GroupedQuantization
from meshlm.precision.quantized_linear import LinearQuantization
from meshlm.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG, DEMO_DATA = ROOT / "configs" / "demo.yaml", ROOT / "data" / "demo"

NVFP4 = ["precision.recipe=nvfp4", "precision.high_precision_layers=1", "precision.nvfp4_hadamard=true",
         "precision.nvfp4_stochastic_rounding=true"]
CONFIGS = {
    "bf16": ["precision.recipe=none"],
    "fp8_tensorwise": ["precision.recipe=fp8_tensorwise"],
    "fp8_tensorwise_split_accumulation": ["precision.recipe=fp8_tensorwise", "precision.fp8_fast_accumulation=none"],
    "fp8_delayed": ["precision.recipe=fp8_delayed"],
    "fp8_blockwise": ["precision.recipe=fp8_blockwise"],
    "mxfp8": ["precision.recipe=mxfp8"],
    "nvfp4": NVFP4,
    "nvfp4_no_hadamard": [*NVFP4, "precision.nvfp4_hadamard=false"],
    "nvfp4_no_stochastic_rounding": [*NVFP4, "precision.nvfp4_stochastic_rounding=false"],
    "nvfp4_all_layers": [*NVFP4, "precision.high_precision_layers=0"],
}
FP8_CONFIGS = ("fp8_tensorwise", "fp8_tensorwise_split_accumulation", "fp8_delayed", "fp8_blockwise", "mxfp8")
ABLATIONS = {"nvfp4_no_hadamard": "random Hadamard transform", "nvfp4_no_stochastic_rounding": "stochastic rounding",
             "nvfp4_all_layers": "bf16 first and last block"}
MAX_LOSS_INCREASE_PERCENT = {**{name: 1.0 for name in FP8_CONFIGS}, "nvfp4": 3.0}
MIN_FP8_SPEEDUP = 1.3

# A linear-heavy dense Transformer for the GPU speed target (vocabulary: the demo tokenizer's).
DENSE_MODEL = ["model.vocab_size=4096", "model.hidden_size=2048", f"model.pattern={'*-' * 8}",
               "model.num_attention_heads=16", "model.mlp_activation=squared_relu", "model.ffn_hidden_size=8192",
               "model.tie_embeddings=true", "optim.lr=6e-4", "optim.min_lr=6e-5"]
# The same at twice the width and half the depth (0.82B parameters): about 94% of its FLOPs are
# linear layers' GEMMs, each 4x the size, where FP8 tensor cores come closer to their 2x; the
# elementwise work, the quantization of every operand included, stays the same per token.
DENSE_WIDE_MODEL = ["model.vocab_size=4096", "model.hidden_size=4096", f"model.pattern={'*-' * 4}",
                    "model.num_attention_heads=32", "model.mlp_activation=squared_relu",
                    "model.ffn_hidden_size=16384", "model.tie_embeddings=true", "optim.lr=3e-4", "optim.min_lr=3e-5"]
MODELS = {"hybrid": [], "dense": DENSE_MODEL, "dense_wide": DENSE_WIDE_MODEL}
"""--model: overrides on top of the demo config (hybrid) or of the defaults (the dense models)."""
# (model, device): steps, seq_len, micro_batch_size, micro-batches per step (gradient
# accumulation), eval_batches. The hybrid on CPU: 9 configs x 60 steps of 8 x 128 tokens, 16
# validation batches (the module docstring). The dense GPU shape accumulates 4 micro-batches a
# step, as pre-training does (millions of tokens per optimizer step): the optimizer and the
# master-weight copies, which no recipe speeds up (about 7 ms a step for its 0.41B parameters
# against some 30 ms of bf16 GEMMs per micro-batch on an H100), are then paid once per 4.
DEFAULTS = {
    ("hybrid", "cpu"): (60, 128, 8, 1, 16),
    ("hybrid", "cuda"): (250, 256, 16, 1, 8),
    ("dense", "cuda"): (100, 1024, 8, 4, 8),
    ("dense_wide", "cuda"): (60, 1024, 8, 4, 8),
}


class TimedTrainer(Trainer):
    """The trainer, recording the wall-clock and CPU seconds of each training step and what
    ``train.compile`` said; with ``profile_top``, one step in the middle of the run (past the
    compiling ones) is profiled instead of timed (``profile``: ``bench/profiling.py``'s
    record: the top operators by their own device time)."""

    def __init__(self, config, profile_top: int = 0):
        super().__init__(config)
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self.compile_notices: list[str] = []
        """What ``train.compile`` said (a block that fell back to eager, a recipe run eagerly)."""
        self.profile_top, self.profile_at = profile_top, config.train.steps // 2
        self.profile: dict | None = None

    def open_logs(self):
        super().open_logs()
        say = self.progress.message

        def message(text: str) -> None:
            if "train.compile" in text:
                self.compile_notices.append(text)
            say(text)

        self.progress.message = message

    def train_step(self):
        if self.profile_top and self.profile is None and len(self.step_seconds) >= self.profile_at:
            result = []
            self.profile = profile_step(lambda: result.append(super(TimedTrainer, self).train_step()), self.device,
                                        self.profile_top)
            return result[0]
        wall, cpu = time.perf_counter(), time.process_time()
        result = super().train_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_seconds.append(time.perf_counter() - wall)
        self.step_cpu_seconds.append(time.process_time() - cpu)
        return result


def run_overrides(args, run_dir: Path) -> list[str]:
    """The overrides every config shares: model, data, shape, schedule and quiet logging."""
    steps, seq_len, micro_batch, accumulation, eval_batches = args.shape
    return [*MODELS[args.model], f"data.blend={DEMO_DATA / 'blend.json'}", f"train.run_dir={run_dir}", f"train.device={args.device}",
            "precision.dtype=bf16", f"train.steps={steps}", f"train.seq_len={seq_len}",
            f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={micro_batch * accumulation}",
            f"train.eval_batches={eval_batches}", f"train.eval_every={steps}", f"train.log_every={steps}",
            f"optim.warmup_steps={max(1, steps // 10)}", "train.save_every=0", "train.progress=false",
            "train.tensorboard=false", "train.plot=false"]


def train_one(name: str, args, workdir: Path) -> dict:
    """Train config ``name``; its losses and step times, or ``{"error": ...}`` when it is refused."""
    base = str(DEMO_CONFIG) if args.model == "hybrid" else None
    overrides = [*run_overrides(args, workdir / name), *CONFIGS[name], *args.overrides]
    started = time.perf_counter()
    try:
        trainer = TimedTrainer(load_run_config(base, overrides), args.profile)
    except ConfigError as error:
        return {"error": str(error)}
    reasons_before = graph_break_reasons()
    result = trainer.run()
    reasons = {reason: count - reasons_before.get(reason, 0) for reason, count in graph_break_reasons().items()
               if count > reasons_before.get(reason, 0)}
    final_step = max(result.val_losses)
    return {"val_loss": result.val_losses[final_step], "initial_val_loss": result.val_losses.get(0),
            "final_train_loss": result.losses[final_step], "skipped_steps": result.skipped_steps,
            "step_s": round(statistics.median(trainer.step_seconds), 4),
            "step_cpu_s": round(statistics.median(trainer.step_cpu_seconds), 4),
            "run_s": round(time.perf_counter() - started, 1), "overrides": CONFIGS[name],
            "gemms": gemm_paths(trainer.model), "compile_notices": trainer.compile_notices,
            "graph_breaks": sum(reasons.values()), "graph_break_reasons": reasons,
            **({"profile": trainer.profile} if trainer.profile is not None else {})}


def gemm_paths(model: torch.nn.Module) -> list[str]:
    """How the quantized linear layers and experts multiply: 'hardware' (``torch._scaled_mm`` on FP8
    codes) and/or 'emulated' (dequantized operands); empty without a recipe. A step time only means
    FP8 hardware speed where this says 'hardware'."""
    quantizations = [getattr(module, "quantization", None) for module in model.modules()]
    quantizations += [grouped for module in model.modules()
                      for grouped in (getattr(module, "quantizations", None) or {}).values()]
    paths = {"hardware" if quantization.hardware else "emulated" for quantization in quantizations
             if isinstance(quantization, (LinearQuantization, GroupedQuantization))}
    return sorted(paths)


def compare(runs: dict) -> None:
    """Add each run's validation loss and step time relative to bf16's, in place."""
    baseline = runs.get("bf16", {})
    if "val_loss" not in baseline:
        return
    for entry in runs.values():
        if "val_loss" in entry:
            ratio = entry["val_loss"] / baseline["val_loss"]
            entry["val_loss_ratio"], entry["val_loss_diff_percent"] = round(ratio, 5), round(100 * (ratio - 1), 3)
            entry["step_time_ratio"] = round(entry["step_s"] / baseline["step_s"], 3)


def targets(runs: dict, device: str) -> tuple[dict, dict]:
    """The issue's targets as booleans, and each ablation's effect; configs that did not run are left out."""
    met, ablations = {}, {}
    for name, limit in MAX_LOSS_INCREASE_PERCENT.items():
        if "val_loss_diff_percent" in runs.get(name, {}):
            met[f"{name}_val_loss_within_{limit:g}pct"] = runs[name]["val_loss_diff_percent"] <= limit
    full = runs.get("nvfp4", {}).get("val_loss")
    for name, part in ABLATIONS.items():
        if full is not None and "val_loss" in runs.get(name, {}):
            delta = runs[name]["val_loss"] - full
            ablations[name] = {"removed": part, "val_loss_delta": round(delta, 5), "worse_than_nvfp4": delta > 0}
            met[f"{name}_worse_than_nvfp4"] = delta > 0
    if device == "cuda":
        for name in FP8_CONFIGS:
            if "step_time_ratio" in runs.get(name, {}):
                speedup = 1 / runs[name]["step_time_ratio"]
                met[f"{name}_at_least_{MIN_FP8_SPEEDUP:g}x_faster"] = speedup >= MIN_FP8_SPEEDUP
    return met, ablations


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def machine(device: str) -> dict:
    name = torch.cuda.get_device_name() if device == "cuda" else cpu_name()
    return {"torch": torch.__version__, "python": platform.python_version(), "device": device, "device_name": name,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def progress_line(index: int, total: int, name: str, entry: dict) -> str:
    if "error" in entry:
        return f"[{index}/{total}] {name}: skipped: {entry['error']}"
    relative = (f" ({entry['val_loss_diff_percent']:+.2f}% vs bf16, step time x{entry['step_time_ratio']:.2f})"
                if "val_loss_diff_percent" in entry else "")
    return (f"[{index}/{total}] {name}: val loss {entry['val_loss']:.4f}{relative}, median step "
            f"{entry['step_s']:.2f} s (cpu {entry['step_cpu_s']:.2f} s), run {entry['run_s']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="overrides for every config")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {', '.join(CONFIGS)} (bf16 is always run)")
    parser.add_argument("--steps", type=int, help="training steps per config (default: by model and device)")
    parser.add_argument("--model", choices=tuple(MODELS), default="hybrid",
                        help="hybrid: the demo model; dense: a linear-heavy Transformer for the GPU speed target; "
                             "dense_wide: the same twice as wide, half as deep")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--inductor-code", type=Path, default=None, metavar="FILE",
                        help="write the graph modules Inductor generated for the compiled runs (train.compile=true), "
                             "all configs in run order, to one gzip file (bench.profiling.save_inductor_code; give "
                             "the bench a fresh TORCHINDUCTOR_CACHE_DIR, or cached modules are left out)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="profile one step in the middle of each run (not timed): its TOP operators by their "
                             "own device time, where an FP8 step and a bf16 step part")
    args = parser.parse_args(argv)
    if args.profile < 0:
        parser.error(f"--profile {args.profile}: give how many operators to list (0, the default, profiles nothing).")
    names = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if (args.model, args.device) not in DEFAULTS:
        parser.error(f"--model {args.model} is the GPU speed measurement (use --device cuda): on a CPU without "
                     "bf16 matrix units one of its steps would take tens of minutes")
    args.configs = ["bf16", *[name for name in CONFIGS if name in names and name != "bf16"]]
    steps, *shape = DEFAULTS[args.model, args.device]
    args.shape = (args.steps or steps, *shape)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    build_demo_corpus(DEMO_DATA, workers=2)  # skipped when it is already there
    steps, seq_len, micro_batch, accumulation, eval_batches = args.shape
    report = {"machine": machine(args.device), "model": args.model, "steps": steps, "seq_len": seq_len,
              "micro_batch_size": micro_batch, "micro_batches_per_step": accumulation, "eval_batches": eval_batches,
              "overrides": args.overrides, "runs": {}}
    print(f"low-precision bench: {len(args.configs)} configs x {steps} steps, {args.model} model on {args.device}, "
          f"{accumulation} x {micro_batch} x {seq_len} tokens a step", file=sys.stderr, flush=True)
    started, modules_before = time.time(), 0
    with tempfile.TemporaryDirectory(prefix="meshlm-low-precision-") as workdir:
        for index, name in enumerate(args.configs, 1):
            report["runs"][name] = train_one(name, args, Path(workdir))
            if args.inductor_code:  # rewritten after every run: a stopped bench keeps what it has
                modules = save_inductor_code(args.inductor_code, started)
                report["runs"][name]["inductor_modules"] = modules - modules_before  # this run's, in the file's order
                modules_before = modules
            compare(report["runs"])
            print(progress_line(index, len(args.configs), name, report["runs"][name]), file=sys.stderr, flush=True)
    report["targets_met"], report["ablations"] = targets(report["runs"], args.device)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
