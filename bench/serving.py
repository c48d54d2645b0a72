"""Serving many requests: continuous batching against one request at a time.

    python -m bench.serving [--requests 16] [--max-new-tokens 64] [--batch-sizes 4,16] [--repeats 3]
                            [--arrival-ms 0] [--device cpu]

The model is the demo's (``configs/demo.yaml``: a 3.1M-parameter hybrid of Mamba-2, attention,
MLP and MoE blocks) with random weights -- decoding speed does not depend on what the weights
know -- and the requests are ``--requests`` random prompts of 16 to 128 tokens, each decoded
greedily for ``--max-new-tokens`` tokens (no end token, so every reply has the same length). They
arrive all at once, or one every ``--arrival-ms`` milliseconds.

Served two ways, as ``meshlm serve`` serves them:

* ``one_at_a_time`` (``--max-batch-size 1``): each request by ``generate`` in arrival order;
* ``batched_N`` (``--max-batch-size N``, for each N of ``--batch-sizes``): ``ContinuousBatcher``,
  requests joining and leaving the batch step by step;
* with ``--compile``, ``batched_N_compiled`` too (``meshlm serve --compile``: the compiled decode
  step; it takes models without MoE blocks, so give a ``--pattern`` without ``E``). Compiling
  happens in the warm-up round, which is not counted.

With ``--long-prompt L`` the run measures chunked prefill instead: four requests are decoding
when a prompt of L tokens arrives, and the longest pause between two of their tokens is timed
while it is prefilled whole and ``--prefill-chunk`` tokens at a time (``ContinuousBatcher
(prefill_chunk=...)``), alternately, with the total time to the last reply.

The ways are timed alternately, ``--repeats`` times after a warm-up (``bench/timing.py``), so
machine noise hits them alike. For each: the median wall time from the first arrival to the
last reply, the generated tokens per second, the median over requests of the latency (arrival
to last token), the speed-up over one at a time, and whether every reply equals the one-at-a-
time reply token for token. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from meshlm.config import load_run_config
from meshlm.inference.continuous_batching import ContinuousBatcher, GenerationRequest
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.language_model import LanguageModel

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
GREEDY = SamplingConfig(greedy=True)


def random_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(vocab_size) for _ in range(generator.randint(16, 128))] for _ in range(count)]


def serve_one_at_a_time(model, prompts, new_tokens: int, arrival_s: float) -> tuple[float, list[float], list]:
    """Seconds from the first arrival to the last reply, each request's latency, and the replies."""
    started = time.perf_counter()
    latencies, replies = [], []
    for index, prompt in enumerate(prompts):
        arrival = started + index * arrival_s
        time.sleep(max(0.0, arrival - time.perf_counter()))
        replies.append(generate(model, [prompt], new_tokens, GREEDY)[0])
        latencies.append(time.perf_counter() - arrival)
    return time.perf_counter() - started, latencies, replies


def serve_batched(batcher: ContinuousBatcher, prompts, new_tokens: int, arrival_s: float
                  ) -> tuple[float, list[float], list]:
    started = time.perf_counter()
    finished = [0.0] * len(prompts)
    requests = []
    for index, prompt in enumerate(prompts):
        time.sleep(max(0.0, started + index * arrival_s - time.perf_counter()))
        request = GenerationRequest(prompt, new_tokens, GREEDY)
        request.on_done = lambda index=index: finished.__setitem__(index, time.perf_counter())
        requests.append(batcher.submit(request))
    replies = [request.wait() for request in requests]
    latencies = [finished[index] - (started + index * arrival_s) for index in range(len(prompts))]
    return max(finished) - started, latencies, replies


def longest_pause(model, prefill_chunk: int | None, long_prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(the longest pause between two tokens of four decoding requests while ``long_prompt``
    arrives and is prefilled, seconds to the last reply) under ``prefill_chunk``."""
    batcher = ContinuousBatcher(model, 5, prefill_chunk=prefill_chunk)
    stamps: list[list[float]] = [[] for _ in range(4)]
    started = time.perf_counter()
    try:
        running = []
        for index, prompt in enumerate(random_prompts(4, model.config.vocab_size, seed=1)):
            def stamp(token: int, index=index) -> bool:
                stamps[index].append(time.perf_counter())
                return False

            running.append(batcher.submit(GenerationRequest(prompt, new_tokens, GREEDY, on_token=stamp)))
        while min(len(times) for times in stamps) < 4:  # all four decoding
            time.sleep(0.001)
        long = batcher.submit(GenerationRequest(long_prompt, 4, GREEDY))
        for request in running + [long]:
            request.wait()
    finally:
        batcher.close()
    pause = max(later - earlier for times in stamps for earlier, later in zip(times, times[1:]))
    return pause, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="4,16", help="comma-separated --max-batch-size values")
    parser.add_argument("--arrival-ms", type=float, default=0.0, help="one request every this many ms (0: all at once)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--long-prompt", type=int, default=0, metavar="L",
                        help="measure chunked prefill: a prompt of L tokens arriving while four requests decode")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="with --long-prompt: the chunk to compare")
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("--compile", action="store_true",
                        help="also serve each batch size with the compiled decode step (models without MoE blocks)")
    parser.add_argument("--pattern", help="the model's block pattern instead of the demo's (e.g. M-M*-M-*- "
                                          "without experts, for --compile)")
    args = parser.parse_args()

    torch.manual_seed(0)
    overrides = [] if args.pattern is None else [f"model.pattern={args.pattern}"]
    model = LanguageModel(load_run_config(CONFIG, overrides).model).to(args.device).eval()
    if args.long_prompt:
        long_prompt = random_prompts(1, model.config.vocab_size, seed=2)[0] * (args.long_prompt // 16 + 1)
        long_prompt = long_prompt[:args.long_prompt]
        outcomes = {"whole": [], f"chunks_of_{args.prefill_chunk}": []}
        chunks = {"whole": None, f"chunks_of_{args.prefill_chunk}": args.prefill_chunk}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, chunk in chunks.items():
                result = longest_pause(model, chunk, long_prompt, args.max_new_tokens)
                if repeat:
                    outcomes[name].append(result)
        report({"bench": "serving", "scenario": "long prompt arriving", "device": args.device,
                "threads": torch.get_num_threads(), "long_prompt_tokens": args.long_prompt,
                "decoding_requests": 4, "new_tokens_each": args.max_new_tokens, "repeats": args.repeats,
                "ways": {name: {"longest_pause_s": round(statistics.median(r[0] for r in results), 3),
                                "seconds": round(statistics.median(r[1] for r in results), 3)}
                         for name, results in outcomes.items()}}, args.out)
        return
    prompts = random_prompts(args.requests, model.config.vocab_size)
    arrival_s = args.arrival_ms / 1000
    batchers = {f"batched_{size}": ContinuousBatcher(model, int(size)) for size in args.batch_sizes.split(",")}
    if args.compile:
        batchers |= {f"batched_{size}_compiled": ContinuousBatcher(model, int(size), compile=True)
                     for size in args.batch_sizes.split(",")}
    results: dict[str, list] = {name: [] for name in ["one_at_a_time", *batchers]}

    def timed(name):
        def run() -> float:
            if name == "one_at_a_time":
                outcome = serve_one_at_a_time(model, prompts, args.max_new_tokens, arrival_s)
            else:
                outcome = serve_batched(batchers[name], prompts, args.max_new_tokens, arrival_s)
            results[name].append(outcome)
            return outcome[0]
        return run

    try:
        for run in map(timed, results):  # warm-up, not counted
            run()
        for outcomes in results.values():
            outcomes.clear()
        for _ in range(args.repeats):
            for name in results:
                timed(name)()
    finally:
        for batcher in batchers.values():
            batcher.close()
    reference = results["one_at_a_time"][0][2]
    base_seconds = [outcome[0] for outcome in results["one_at_a_time"]]
    summary = {"bench": "serving", "device": args.device, "threads": torch.get_num_threads(),
              "model": f"configs/demo.yaml{'' if args.pattern is None else f' with pattern {args.pattern}'}, random "
                       f"weights, {sum(p.numel() for p in model.parameters())} parameters",
              "requests": args.requests, "prompt_tokens": "16-128", "new_tokens_each": args.max_new_tokens,
              "arrival_ms": args.arrival_ms, "repeats": args.repeats, "ways": {}}
    generated = args.requests * args.max_new_tokens
    for name, outcomes in results.items():
        seconds = [outcome[0] for outcome in outcomes]
        entry = {"seconds": round(statistics.median(seconds), 3),
                 "tokens_per_s": round(generated / statistics.median(seconds), 1),
                 "median_latency_s": round(statistics.median(
                     statistics.median(outcome[1]) for outcome in outcomes), 3),
                 "same_tokens_as_one_at_a_time": all(outcome[2] == reference for outcome in outcomes)}
        if name != "one_at_a_time":
            entry["speedup"] = round(statistics.median(base / own for base, own in zip(base_seconds, seconds)), 2)
            entry["largest_batch"] = batchers[name].largest_batch
        summary["ways"][name] = entry
    report(summary, args.out)


def report(summary: dict, out: str | None) -> None:
    """Print the JSON report, and write it to ``out`` if given."""
    text = json.dumps(summary, indent=1)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
