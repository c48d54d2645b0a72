"""Self-speculative decoding with a model's MTP depths against plain greedy decoding.

    python -m bench.speculative [--checkpoint RUN_OR_MODEL_DIR] [--steps 100] [--repeats 5]
                                [--max-new-tokens 64] [--data-dir data/demo] [--temperature T --top-k K]

Without ``--checkpoint`` the script builds the demo corpus (``meshlm data demo`` into
``--data-dir``; skipped when it is there) and trains ``configs/demo-mtp.yaml`` -- the demo's
hybrid (Mamba-2, attention, MLP, MoE) with two MTP depths -- for ``--steps`` steps with the
real trainer into a temporary run directory (at most ``--train-minutes``; the default run
takes about five minutes on two CPU cores, most of it training).

Then it decodes the demo prompts greedily, ``--max-new-tokens`` each, one prompt at a time
(speculative decoding runs batch 1), three ways: plain greedy decoding, and speculative
decoding drafting one token (depth 1) and two tokens (depths 1 and 2) a step. The three are
timed alternately, ``--repeats`` times after a warm-up, so machine noise hits all alike; the
report has the medians of decode tokens/s, the speed-up over plain decoding (median of the
per-repeat ratios), the acceptance rate (accepted / drafted), the tokens emitted per forward
of the main model, and whether every token equals plain greedy decoding's. With
``--temperature`` (and ``--top-k``) every way samples instead, speculative decoding by the
speculative-sampling rule: its tokens share plain sampling's distribution, not its draws, so
the report has no token comparison then. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshlm.checkpoint.model_files import load_model
from meshlm.config import load_run_config
from meshlm.data.demo_corpus import build_demo_corpus
from meshlm.data.tokenizer import load_tokenizer
from meshlm.demo import PROMPTS
from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.inference.stats import GenerationStats
from meshlm.training.trainer import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo-mtp.yaml"
GREEDY = SamplingConfig(greedy=True)


def train_mtp_model(data_dir: Path, run_dir: Path, steps: int, minutes: float) -> dict:
    """Train configs/demo-mtp.yaml for ``steps`` steps (at most ``minutes``); returns a summary."""
    build_demo_corpus(data_dir, workers=2)
    overrides = [f"data.blend={data_dir / 'blend.json'}", f"train.steps={steps}", f"train.run_dir={run_dir}",
                 "train.eval_every=0", "train.save_every=0", "train.tensorboard=false", "train.progress=false",
                 "train.plot=false", f"optim.warmup_steps={max(steps // 10, 1)}",
                 f"train.time_limit_minutes={minutes}"]
    started = time.perf_counter()
    result = train(load_run_config(CONFIG, overrides))
    last_step = max(result.losses)
    return {"config": CONFIG.name, "steps": result.step, "train_seconds": round(time.perf_counter() - started, 1),
            "final_loss": round(result.losses[last_step], 4)}


def decode_all(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id, valid_vocab_size: int,
               draft_tokens: int | None, sampling: SamplingConfig = GREEDY) -> tuple[list[list[int]], GenerationStats]:
    """Every prompt decoded alone, plain (``draft_tokens`` None) or speculatively; tokens and stats."""
    stats, outputs = GenerationStats(), []
    speculative = None if draft_tokens is None else "mtp"
    for prompt in prompts:
        outputs += generate(model, [prompt], max_new_tokens, sampling, eos_token_id=eos_token_id,
                            valid_vocab_size=valid_vocab_size, speculative=speculative,
                            draft_tokens=draft_tokens, stats=stats)
    return outputs, stats


def measure(model, tokenizer, max_new_tokens: int, repeats: int, sampling: SamplingConfig = GREEDY) -> dict:
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    valid_vocab_size = min(tokenizer.vocab_size, model.config.vocab_size)
    methods = {"plain": None, **{f"mtp_{k}_drafts": k for k in range(1, model.config.mtp_depth + 1)}}
    rates: dict[str, list[float]] = {name: [] for name in methods}
    totals = {name: GenerationStats() for name in methods}
    outputs = {}
    for repeat in range(repeats + 1):  # the first round warms up and is not counted
        for name, draft_tokens in methods.items():
            outputs[name], stats = decode_all(model, prompts, max_new_tokens, tokenizer.eos_token_id,
                                              valid_vocab_size, draft_tokens, sampling)
            if repeat:
                rates[name].append(stats.decode_tokens / stats.decode_seconds)
                for field in ("decode_tokens", "drafted_tokens", "accepted_tokens", "verify_forwards"):
                    setattr(totals[name], field, getattr(totals[name], field) + getattr(stats, field))
    plain = rates["plain"]
    report = {"plain": {"decode_tokens_per_s": round(statistics.median(plain), 1)}}
    for name in methods:
        if name == "plain":
            continue
        total = totals[name]
        report[name] = {
            "decode_tokens_per_s": round(statistics.median(rates[name]), 1),
            "speedup": round(statistics.median(s / p for s, p in zip(rates[name], plain)), 3),
            "acceptance_rate": round(total.accepted_tokens / total.drafted_tokens, 3),
            "tokens_per_verify_forward": round((total.accepted_tokens + total.verify_forwards) / total.verify_forwards,
                                               3),
        }
        if sampling.greedy:
            report[name]["same_tokens_as_plain"] = outputs[name] == outputs["plain"]
    report["setup"] = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "repeats": repeats,
                       "sampling": "greedy" if sampling.greedy else {"temperature": sampling.temperature,
                                                                     "top_k": sampling.top_k},
                       "generated_tokens_per_run": totals["plain"].decode_tokens // repeats,
                       "threads": torch.get_num_threads(), "parameters": model.num_parameters()}
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="a model trained with MTP (model dir or run dir); default: train one")
    parser.add_argument("--data-dir", default="data/demo", help="where the demo corpus is (or is built)")
    parser.add_argument("--steps", type=int, default=100, help="training steps of the model trained here")
    parser.add_argument("--train-minutes", type=float, default=4.0, help="stop training after this long")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k most likely tokens")
    args = parser.parse_args(argv)
    sampling = GREEDY if args.temperature is None else SamplingConfig(temperature=args.temperature, top_k=args.top_k)
    with tempfile.TemporaryDirectory() as directory:
        training = None
        checkpoint = args.checkpoint
        if checkpoint is None:
            print(f"training {CONFIG.name} for {args.steps} steps ...", file=sys.stderr, flush=True)
            checkpoint = Path(directory) / "run"
            training = train_mtp_model(Path(args.data_dir), checkpoint, args.steps, args.train_minutes)
        model_dir = resolve_model_dir(checkpoint)
        model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
        print("decoding ...", file=sys.stderr, flush=True)
        report = {"training": training, **measure(model, tokenizer, args.max_new_tokens, args.repeats, sampling)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
