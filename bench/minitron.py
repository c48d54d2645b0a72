"""Minitron on the demo corpus: prune a trained teacher to about half, then distill vs. LM loss vs. scratch.

    python -m bench.minitron [--preset quick|demo] [--teacher-steps N] [--steps K] [--cap-steps C]
                             [--eval-every E] [--device cpu|cuda] [--out FILE]

Minitron (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge
Distillation") claims that a model pruned from a trained teacher and retrained by distilling the
teacher's logits beats the same pruned model retrained on the LM loss alone, which in turn beats
a model of the same shape trained from scratch, and that the scratch model needs many times the
tokens to catch up. This bench checks that claim at toy scale, with meshlm's own commands:

1. **Teacher.** The demo hybrid (``configs/demo.yaml``: Mamba-2, attention with grouped KV heads,
   MLP and MoE blocks), or with ``--preset quick`` a narrower, shorter variant of it so that the
   whole bench fits in about ten minutes on a 2-core CPU, trained for ``--teacher-steps`` steps
   (``meshlm.train``; the demo's cosine schedule).
2. **Pruning** (``meshlm prune``, calibrated on the demo blend), two ways to about half the
   parameters: *width* (``--target-params`` = half the teacher's count: the search picks hidden,
   FFN, KV groups and Mamba heads) and *depth* (``--drop-blocks`` = half the blocks, by the loss
   each block's removal costs). Depth cannot shrink the embedding, so its model stays larger.
3. **Retraining**, for each pruned model, the same data order, seed, batch and learning rate:
   (a) ``train.init_from=PRUNED train.init_model_config=true train.distill_from=TEACHER``
   (forward KL, T = 1, pure distillation, as Minitron); (b) the same without the teacher (LM loss
   only); (c) the pruned folder's model config with fresh weights (scratch). The schedule is
   warmup then *constant* (``optim.schedule=constant``), so the first ``--steps`` steps of the
   scratch run are exactly the K-step scratch run: (c) is one run, continued up to
   ``--cap-steps`` (default 4 K) until its validation loss reaches (a)'s final one.

Every validation loss is the trainer's (``Trainer.evaluate``: the LM loss on the same
``train.eval_batches`` fixed micro-batches of the validation split; every student run has the same
data config, and the teacher is evaluated through a student-config trainer so it sees them too).
Reported: the teacher's loss and parameters, each pruned model's shape, parameters and loss right
after pruning, the losses of (a), (b), (c) after K steps, whether (a) < (b) < (c) and by how much
(nats and percent), and the first evaluated step (every ``--eval-every``) at which (c)'s loss is at
most (a)'s, in tokens and as a multiple of (a)'s K steps (``null``: not reached within the cap).
Everything runs in a temporary folder (removed afterwards). A short table goes to stderr, one JSON
object to stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
DEMO_BLEND = REPO / "data" / "demo" / "blend.json"

PRESETS = {
    # A narrower demo hybrid (hidden 128, 8 blocks of every kind) on short sequences: minutes on 2 CPU cores.
    "quick": dict(model=["model.hidden_size=128", "model.num_attention_heads=4", "model.ffn_hidden_size=384",
                         "model.moe_ffn_hidden_size=192", "model.pattern=M-*E-M-*E"],
                  teacher_steps=150, steps=40, eval_every=10, seq_len=128, batch=8, eval_batches=4, samples=32),
    # The demo model itself, as `make demo` trains it (tens of minutes on a CPU; minutes on a GPU).
    "demo": dict(model=[], teacher_steps=250, steps=100, eval_every=25, seq_len=256, batch=16, eval_batches=8,
                 samples=128),
}
STUDENT_LR, STUDENT_WARMUP = 3.0e-3, 10
"""The retraining's learning rate (the demo's peak) and warmup, the same for (a), (b) and (c)."""


def run_config(args, run_dir: Path, steps: int, extra: list[str]):
    """The demo config with the preset's model and batch, writing to ``run_dir``."""
    from meshlm.config import load_run_config

    return load_run_config(DEMO_CONFIG, [
        *args.model, f"data.blend={DEMO_BLEND}", f"train.run_dir={run_dir}", f"train.steps={steps}",
        f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}", f"train.eval_batches={args.eval_batches}",
        f"train.eval_every={args.eval_every}", f"train.device={args.device}", "train.save_every=0",
        "train.progress=false", "train.tensorboard=false", "train.plot=false", *extra])


def train_teacher(args, workdir: Path) -> Path:
    import meshlm

    run_dir = workdir / "runs" / "teacher"
    warmup = max(1, args.teacher_steps // 10)
    # no evaluation here: teacher_loss evaluates it afterwards on the students' batches
    config = run_config(args, run_dir, args.teacher_steps, [f"optim.warmup_steps={warmup}", "train.eval_every=0"])
    meshlm.train(config)
    return run_dir


def prune(args, teacher: Path, out: Path, how: list[str]) -> dict:
    """``meshlm prune TEACHER OUT`` with the given size flags; the pruned folder's shape and size."""
    from meshlm.adapt.cli import parameter_count
    from meshlm.checkpoint.model_files import read_model_config

    command = [sys.executable, "-m", "meshlm", "prune", str(teacher), str(out), "--calibration", str(DEMO_BLEND),
               "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--device", device_name(args), *how]
    subprocess.run(command, check=True, stdout=sys.stderr)
    config = read_model_config(out)
    recorded = json.loads((out / "config.json").read_text()).get("pruning", {})
    return {"flags": " ".join(how), "parameters": parameter_count(config), "hidden_size": config.hidden_size,
            "pattern": config.pattern, "num_attention_heads": config.num_attention_heads,
            "num_kv_heads": config.resolved_num_kv_heads, "ffn_hidden_size": config.resolved_ffn_hidden_size,
            "mamba_num_heads": config.resolved_mamba_num_heads, "dropped_blocks": recorded.get("dropped_blocks", [])}


def student_config(args, run_dir: Path, pruned: Path, kind: str, teacher: Path):
    """(a) distill, (b) lm_only: the pruned weights and shape; (c) scratch: the pruned shape, fresh weights.
    All share data, seed, batch and schedule (``train.steps`` = the cap, so even the sample order is shared)."""
    from meshlm.checkpoint.model_files import read_model_config
    from meshlm.models.config import TRAINING_ONLY_FIELDS, ModelConfig

    schedule = ["optim.schedule=constant", f"optim.lr={STUDENT_LR}", f"optim.warmup_steps={STUDENT_WARMUP}"]
    if kind == "scratch":
        config = run_config(args, run_dir, args.cap_steps, schedule)
        values = read_model_config(pruned).to_dict()
        values.update({name: getattr(config.model, name) for name in TRAINING_ONLY_FIELDS})
        return dataclasses.replace(config, model=ModelConfig.from_dict(values))
    initial = [f"train.init_from={pruned}", "train.init_model_config=true"]
    teacher_flags = [f"train.distill_from={teacher}"] if kind == "distill" else []
    return run_config(args, run_dir, args.cap_steps, schedule + initial + teacher_flags)


def retrain(config, steps: int, eval_every: int, stop_at: float | None = None) -> dict[int, float]:
    """Validation loss by step (at 0, every ``eval_every`` and at ``steps``); with ``stop_at``, training
    goes on past ``steps`` up to ``train.steps`` until the loss is at most ``stop_at``."""
    from meshlm.training.trainer import Trainer

    trainer = Trainer(config)
    losses = {0: trainer.evaluate()}
    last = config.train.steps if stop_at is not None else steps
    for step in range(1, last + 1):
        trainer.train_step()
        if step % eval_every == 0 or step == steps:
            losses[step] = trainer.evaluate()
            if stop_at is not None and step >= steps and losses[step] <= stop_at:
                break
    return losses


def teacher_loss(args, workdir: Path, teacher: Path) -> float:
    """The teacher's validation loss on the students' evaluation batches."""
    from meshlm.training.trainer import Trainer

    config = run_config(args, workdir / "runs" / "teacher-eval", args.cap_steps,
                        [f"train.init_from={teacher}", "train.init_model_config=true"])
    return Trainer(config).evaluate()


def compare(args, workdir: Path, teacher: Path, name: str, pruned: Path) -> dict:
    runs = {}
    for kind in ("distill", "lm_only"):
        started = time.perf_counter()
        runs[kind] = retrain(student_config(args, workdir / "runs" / f"{name}-{kind}", pruned, kind, teacher),
                             args.steps, args.eval_every)
        log(f"{name} {kind}: val loss {runs[kind][args.steps]:.4f} after {args.steps} steps "
            f"({time.perf_counter() - started:.0f} s)")
    target = runs["distill"][args.steps]
    started = time.perf_counter()
    runs["scratch"] = retrain(student_config(args, workdir / "runs" / f"{name}-scratch", pruned, "scratch", teacher),
                              args.steps, args.eval_every, stop_at=target)
    log(f"{name} scratch: val loss {runs['scratch'][args.steps]:.4f} after {args.steps} steps, "
        f"{min(runs['scratch'].values()):.4f} best by step {max(runs['scratch'])} "
        f"({time.perf_counter() - started:.0f} s)")
    return summarize(args, runs)


def summarize(args, runs: dict[str, dict[int, float]]) -> dict:
    a, b, c = (runs[kind][args.steps] for kind in ("distill", "lm_only", "scratch"))
    tokens_per_step = args.batch * args.seq_len
    reached = [step for step, loss in sorted(runs["scratch"].items()) if step > 0 and loss <= a]
    return {
        "val_loss_after_pruning": round(runs["lm_only"][0], 4),
        "val_loss": {"distill": round(a, 4), "lm_only": round(b, 4), "scratch": round(c, 4)},
        "ordering_met": {"distill<lm_only": a < b, "lm_only<scratch": b < c, "distill<lm_only<scratch": a < b < c},
        "margin": {"lm_only-distill": round(b - a, 4), "scratch-lm_only": round(c - b, 4),
                   "lm_only_over_distill_pct": round(100 * (b / a - 1), 2),
                   "scratch_over_lm_only_pct": round(100 * (c / b - 1), 2),
                   "scratch_over_distill_pct": round(100 * (c / a - 1), 2)},
        "scratch_to_match_distill": {
            "step": reached[0] if reached else None,
            "tokens": reached[0] * tokens_per_step if reached else None,
            "times_distill_tokens": round(reached[0] / args.steps, 2) if reached else None,
            "cap_steps": args.cap_steps, "resolution_steps": args.eval_every,
            "note": None if reached else f"not reached within the cap ({args.cap_steps} steps, "
                                         f"{args.cap_steps * tokens_per_step} tokens)"},
        "curves": {kind: {str(step): round(loss, 4) for step, loss in losses.items()} for kind, losses in runs.items()},
    }


def measure(args, workdir: Path) -> dict:
    from meshlm.adapt.cli import parameter_count
    from meshlm.checkpoint.locate import resolve_model_dir
    from meshlm.checkpoint.model_files import read_model_config

    started = time.perf_counter()
    teacher = train_teacher(args, workdir)
    teacher_config = read_model_config(resolve_model_dir(teacher))
    teacher_parameters = parameter_count(teacher_config)
    teacher_val = teacher_loss(args, workdir, teacher)
    log(f"teacher: {teacher_parameters:,} parameters, val loss {teacher_val:.4f} after {args.teacher_steps} steps "
        f"({time.perf_counter() - started:.0f} s)")
    ways = {"width": ["--target-params", str(teacher_parameters // 2)],
            "depth": ["--drop-blocks", str(teacher_config.num_blocks // 2)]}
    results = {}
    for name, how in ways.items():
        pruned_dir = workdir / "models" / name
        shape = prune(args, teacher, pruned_dir, how)
        shape["fraction_of_teacher"] = round(shape["parameters"] / teacher_parameters, 3)
        results[name] = {"pruned": shape, **compare(args, workdir, teacher, name, pruned_dir)}
    tokens_per_step = args.batch * args.seq_len
    return {
        "device": device_description(args), "torch": torch.__version__, "preset": args.preset,
        "teacher": {"model": dict(hidden_size=teacher_config.hidden_size, pattern=teacher_config.pattern,
                                  num_attention_heads=teacher_config.num_attention_heads,
                                  ffn_hidden_size=teacher_config.resolved_ffn_hidden_size),
                    "parameters": teacher_parameters, "steps": args.teacher_steps,
                    "tokens": args.teacher_steps * tokens_per_step, "val_loss": round(teacher_val, 4)},
        "retraining": {"steps": args.steps, "tokens": args.steps * tokens_per_step,
                       "tokens_per_step": tokens_per_step, "lr": STUDENT_LR, "warmup_steps": STUDENT_WARMUP,
                       "schedule": "constant", "distill": "forward KL, T=1, weight 1",
                       "eval_batches": args.eval_batches, "calibration_samples": args.samples},
        **results,
        "wall_seconds": round(time.perf_counter() - started),
    }


def table(report: dict) -> str:
    steps = report["retraining"]["steps"]
    lines = [f"teacher: {report['teacher']['parameters']:,} params, val loss {report['teacher']['val_loss']:.4f}",
             f"{'pruning':8} {'params':>10} {'pruned':>8} {'(a) KD':>8} {'(b) LM':>8} {'(c) scr':>8} "
             f"{'a<b<c':>6} {'(c) reaches (a)':>22}"]
    for name in ("width", "depth"):
        result = report[name]
        losses, match = result["val_loss"], result["scratch_to_match_distill"]
        reached = (f"step {match['step']} ({match['tokens']:,} tok)" if match["step"]
                   else f"> {match['cap_steps']} steps")
        lines.append(f"{name:8} {result['pruned']['parameters']:>10,} {result['val_loss_after_pruning']:>8.4f} "
                     f"{losses['distill']:>8.4f} {losses['lm_only']:>8.4f} {losses['scratch']:>8.4f} "
                     f"{str(result['ordering_met']['distill<lm_only<scratch']):>6} {reached:>22}")
    lines.append(f"(losses after {steps} retraining steps; (c) continued up to the cap)")
    return "\n".join(lines)


def device_name(args) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device


def device_description(args) -> str:
    name = device_name(args)
    if name.startswith("cuda"):
        return f"{name} ({torch.cuda.get_device_name(torch.device(name))})"
    return f"cpu ({torch.get_num_threads()} threads)"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    for flag in ("teacher_steps", "steps", "cap_steps", "eval_every", "seq_len", "batch", "eval_batches", "samples"):
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=None,
                            help="default: the preset's" + (" (cap: 4 x --steps)" if flag == "cap_steps" else ""))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.cap_steps = args.cap_steps or 4 * args.steps
    if args.cap_steps < args.steps:
        parser.error(f"--cap-steps {args.cap_steps} must be at least --steps {args.steps}.")
    with tempfile.TemporaryDirectory(prefix="minitron-") as workdir:
        report = measure(args, Path(workdir))
    log(table(report))
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
