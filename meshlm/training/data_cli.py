"""``meshlm data``: data utilities that are not tokenizing or preprocessing.

It sits with training rather than in ``meshlm/data/`` because ``show`` builds a run's datasets
from its config as the trainer does (``sample_view.py``); the rest only calls into ``meshlm.data``.

    meshlm data demo [--out data/demo] [--vocab-size 4096]   build the Shakespeare + Python corpus
    meshlm data inspect PREFIX                                describe a token store
    meshlm data show CONFIG.yaml [overrides] [--step S]      the samples a run trains on, as text
                                                              (meshlm/training/sample_view.py)
"""

from __future__ import annotations

from meshlm.data.demo_corpus import DEFAULT_DIR, DemoSettings, build_demo_corpus
from meshlm.data.indexed import TokenStore


def add_arguments(parser) -> None:
    actions = parser.add_subparsers(dest="data_action", metavar="ACTION")
    actions.required = True
    demo = actions.add_parser("demo", help="build the demo corpus (Shakespeare + Python standard library)",
                              description="Build the demo corpus: jsonl files, tokenizer, token stores, blend.json.")
    demo.add_argument("--out", default=DEFAULT_DIR, help=f"output directory (default {DEFAULT_DIR})")
    demo.add_argument("--vocab-size", type=int, default=DemoSettings.vocab_size, help="tokenizer vocabulary size")
    demo.add_argument("--python-bytes", type=int, default=DemoSettings.python_bytes,
                      help="bytes of standard-library Python source to take")
    demo.add_argument("--max-documents", type=int, default=None, help="at most this many documents per corpus")
    demo.add_argument("--workers", type=int, default=1, help="tokenizer processes for preprocessing")
    inspect = actions.add_parser("inspect", help="print the header of a token store")
    inspect.add_argument("prefix", help="token store prefix (PREFIX.bin + PREFIX.idx)")
    show = actions.add_parser("show", help="print the samples a run trains on as text, marking what the loss counts",
                              description="Print samples of a run's data exactly as the trainer builds them: "
                                          "where each comes from, its text, and (dimmed, or between « ») the "
                                          "tokens the loss does not count.")
    show.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="the run's YAML config")
    show.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="override config values")
    where = show.add_mutually_exclusive_group()
    where.add_argument("--step", type=int, default=0, help="show the samples of this step (default 0)")
    where.add_argument("--sample", type=int, help="start at this sample index of the split's global order")
    show.add_argument("--count", type=int, default=2, help="how many samples (default 2)")
    show.add_argument("--split", choices=("train", "valid"), default="train", help="which split (default train)")
    show.add_argument("--json", action="store_true", help="one JSON object per sample: token ids and flags")
    show.add_argument("--no-color", action="store_true",
                      help="mark uncounted tokens with « » even on a terminal (the default off a terminal)")


def run(args) -> int:
    if args.data_action == "show":
        return show_samples(args)
    if args.data_action == "inspect":
        store = TokenStore(args.prefix)
        lengths = store.document_lengths
        print(f"{store.prefix}: {store.num_documents:,} documents, {store.num_tokens:,} tokens, "
              f"dtype {store.dtype.name}, vocab size {store.vocab_size:,}, "
              f"document length min/mean/max {lengths.min() if len(lengths) else 0}/"
              f"{lengths.mean() if len(lengths) else 0:.1f}/{lengths.max() if len(lengths) else 0}")
        tokenizer = store.recorded_tokenizer()
        print(f"tokenizer: {tokenizer if tokenizer is not None else 'none recorded (set data.tokenizer to train)'}")
        return 0
    settings = DemoSettings(args.vocab_size, args.python_bytes, args.max_documents)
    result = build_demo_corpus(args.out, settings, workers=args.workers, show_progress=True)
    for step in result.steps_skipped:
        print(f"skipped {step} (already built)")
    for step in result.steps_run:
        print(f"built {step}")
    print(f"demo corpus ready in {result.directory}; blend: {result.directory / 'blend.json'}")
    return 0


def show_samples(args) -> int:
    """``meshlm data show``: the run config's samples, printed (meshlm/training/sample_view.py)."""
    import sys

    from meshlm.config import load_run_config
    from meshlm.errors import ConfigError
    from meshlm.training.cli import config_and_overrides
    from meshlm.training.sample_view import print_samples, view_samples

    if args.count < 1:
        raise ConfigError(f"--count {args.count} must be at least 1.")
    for name in ("step", "sample"):
        if (getattr(args, name) or 0) < 0:
            raise ConfigError(f"--{name} {getattr(args, name)} must be >= 0.")
    config_path, overrides = config_and_overrides(args)
    if config_path is None and not overrides:
        raise ConfigError("give the run's config, e.g. `meshlm data show configs/tiny.yaml --step 10`.")
    config = load_run_config(config_path, overrides)
    batch = config.train.global_batch_size
    first = args.sample if args.sample is not None else args.step * batch if args.split == "train" else 0
    samples, tokenizer = view_samples(config, args.split, first, args.count)
    color = not args.no_color and not args.json and sys.stdout.isatty()
    print_samples(samples, tokenizer, batch, args.split, color, args.json)
    return 0
