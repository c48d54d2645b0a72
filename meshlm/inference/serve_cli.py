"""``meshlm serve``: the command around ``server.py`` (an OpenAI-compatible HTTP server for one model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshlm.errors import ConfigError
from meshlm.inference.cli import choose_eos, load_generation_model
from meshlm.inference.continuous_batching import DEFAULT_MAX_BATCH_SIZE, ContinuousBatcher
from meshlm.inference.server import ServedModel, make_server

DEFAULT_PORT = 8000
DEFAULT_MAX_TOKENS = 256
DEFAULT_PREFILL_CHUNK = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="model directory, training checkpoint, or run directory (latest step_N is used)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    parser.add_argument("--name", metavar="NAME",
                        help="the model's name in requests and responses (default: the checkpoint folder's name)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                        help=f"new tokens of a reply when a request names no max_tokens (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE, metavar="N",
                        help="most requests decoded together by continuous batching (default "
                             f"{DEFAULT_MAX_BATCH_SIZE}; 1: one at a time, in the order they arrive)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                        help="run an arriving prompt N tokens at a time, the running replies decoding a token "
                             f"between chunks (default {DEFAULT_PREFILL_CHUNK}; 0: whole prompts at once)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode step (torch.compile; the first requests pay for compiling; models "
                             "without MoE blocks)")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or a directory holding one")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens} leaves no room for a reply; use 1 or more.")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a port number; use 1 to 65535 (0: any free port).")
    if args.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size {args.max_batch_size} leaves no room for a request; use 1 or more.")
    if args.prefill_chunk < 0:
        raise ConfigError(f"--prefill-chunk {args.prefill_chunk} is not a number of tokens; use 1 or more, or 0 "
                          "to run whole prompts at once.")
    model_dir, tokenizer, device, model = load_generation_model(
        args, "a server takes and returns text; pass --tokenizer PATH.")
    model.eval()
    name = args.name or Path(args.checkpoint).resolve().name
    served = ServedModel(name, model, tokenizer, choose_eos(None, tokenizer, model_dir), args.max_tokens)
    server = make_server(served, args.host, args.port)
    if model.config.rope_scaling == "longrope":
        if args.compile:
            raise ConfigError("--compile compiles the batcher's decode step, and a LongRoPE model is served one "
                              "request at a time without it (its re-run past the original context cannot be "
                              "shared); drop --compile.")
        batching = "one request at a time (LongRoPE re-runs a sequence past its original context: no shared batch)"
    else:  # one at a time too, in arrival order, with --max-batch-size 1
        served.batcher = ContinuousBatcher(model, args.max_batch_size, served.valid_vocab_size,
                                           prefill_chunk=args.prefill_chunk or None, compile=args.compile)
        batching = (f"up to {args.max_batch_size} requests decoded together" if args.max_batch_size > 1
                    else "one request at a time")
        if args.compile:
            batching += ", the decode step compiled"
    host, port = server.server_address[:2]
    print(f"meshlm serve: {name} ({model_dir}, {device}) on http://{host}:{port}, {batching}: POST /v1/completions, "
          "/v1/chat/completions; GET /v1/models, /health; Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("meshlm serve: stopped", file=sys.stderr)
    finally:
        server.server_close()
        if served.batcher is not None:
            served.batcher.close()
    return 0


__all__ = ["add_arguments", "run"]
