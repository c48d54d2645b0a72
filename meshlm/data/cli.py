"""``meshlm data``: data utilities that are not tokenizing or preprocessing.

    meshlm data demo [--out data/demo] [--vocab-size 4096]   build the Shakespeare + Python corpus
    meshlm data inspect PREFIX                                describe a token store
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


def run(args) -> int:
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
