"""A Nemotron-H-style hybrid against the same-shape Transformer: training, prefill, decode, cache.

    python -m bench.hybrid_vs_transformer [--train-seq-lens 1024 4096] [--contexts 2048 8192 32768]
                                          [--repeats 3] [--config-a A.yaml --config-b B.yaml]
                                          [--only training|decode] [--compile] [--decode-steps 8]

The default pair (the issue's): 24 blocks, hidden 256, vocabulary 4096, tied embeddings,
squared-ReLU MLPs of 1024; the hybrid has 1 attention + 11 Mamba-2 + 12 MLP blocks
("M-M-M-M-M-*-M-M-M-M-M-M-"; Mamba heads 16 x 32, state 64, chunk 64, no positional encoding),
the Transformer 12 attention (4 heads, RoPE) + 12 MLP blocks ("*-" x 12). ``--config-a`` and
``--config-b`` replace them with the ``model`` sections of two run configs (a = hybrid, b = the
baseline).

Measured, fp32, each pair of runs interleaved and repeated, medians reported:

- training: forward + backward of a batch of 2 sequences (no optimizer step), tokens/s;
- prefill: one sequence of each context length through the model with the inference cache,
  in chunks of ``--prefill-chunk`` tokens (memory stays bounded), seconds (run once per length:
  the Transformer's 32k prefill alone takes minutes on 2 cores);
- decode: the prefilled cache copied to a batch of 4, then ``--decode-steps`` greedy single-token
  steps, the models' steps alternating, median ms per step after two warm-up steps. Eager:
  the model's cached forward (what ``meshlm generate`` runs). With ``--compile`` also both
  models' compiled decode step (``meshlm/inference/decode_step.py``, what ``meshlm generate
  --compile`` runs), on another copy of the same cache, its steps alternating with the eager
  ones: ``*_compiled`` fields, and each model's compile time at that context (``*_compile_s``:
  the graph's KV buffers have the context's capacity, so each context compiles anew; Inductor's
  on-disk cache makes repeats faster);
- cache bytes per sequence at each context (KV for attention, conv + SSM state for Mamba).

``--only training`` runs the training rows alone, ``--only decode`` the inference rows alone
(prefill, decode, cache: decoding needs the prefilled cache).

Targets (issue 13, the seed papers' claims): hybrid training tokens/s >= 1.0x the Transformer's
at seq 4k; prefill at 8k <= the Transformer's time; decode at 8k >= 3x and at 32k >= 8x faster.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from bench.timing import interleaved_medians
from meshlm.config import load_run_config
from meshlm.inference.decode_step import DecodeStep
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

COMMON = dict(vocab_size=4096, hidden_size=256, num_attention_heads=4, mamba_head_dim=32, mamba_state_size=64,
              mamba_chunk_size=64, mlp_activation="squared_relu", ffn_hidden_size=1024, tie_embeddings=True)
HYBRID = ModelConfig(pattern="M-M-M-M-M-*-M-M-M-M-M-M-", position_embedding="none", **COMMON)
TRANSFORMER = ModelConfig(pattern="*-" * 12, **COMMON)
TRAIN_BATCH, DECODE_BATCH = 2, 4


def build(config: ModelConfig) -> LanguageModel:
    return LanguageModel(config, seed=0).eval()


def train_step_seconds(model: LanguageModel, seq_len: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (TRAIN_BATCH, seq_len), generator=torch.Generator().manual_seed(0))
    model.train()
    start = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    model.eval()
    return elapsed


@torch.inference_mode()
def prefill(model: LanguageModel, context: int, chunk: int, room: int = 64) -> tuple[float, InferenceCache, torch.Tensor]:
    """Seconds to prefill one sequence of ``context`` tokens chunk by chunk; the cache (with room for
    ``room`` more tokens); the last logits."""
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(1))
    cache = InferenceCache(max_tokens=context + room)
    start = time.perf_counter()
    for begin in range(0, context, chunk):
        logits = model(ids[:, begin:begin + chunk], cache=cache).logits[:, -1]
    return time.perf_counter() - start, cache, logits


def batch_copy(cache: InferenceCache, batch: int) -> InferenceCache:
    """A cache holding ``batch`` copies of the one sequence ``cache`` holds (which stays as it was)."""
    copied = copy.copy(cache)
    copied.layers = {index: copy.copy(state) for index, state in cache.layers.items()}
    copied.select(torch.zeros(batch, dtype=torch.long))  # indexing copies every tensor
    return copied


@torch.inference_mode()
def decode_ms_per_token(steps_by_model: dict, first_tokens: dict, steps: int) -> dict[str, float]:
    """``steps`` greedy single-token steps of each run (``step(tokens) -> logits``), the runs' steps
    alternating; median ms per step after two warm-up steps."""
    tokens = dict(first_tokens)
    times = {name: [] for name in steps_by_model}
    for _ in range(steps + 2):
        for name, step in steps_by_model.items():
            start = time.perf_counter()
            tokens[name] = step(tokens[name]).argmax(-1)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values[2:]) * 1000 for name, values in times.items()}


@torch.inference_mode()
def decode_rows(models: dict, prefilled: dict, steps: int, compile: bool) -> dict:
    """The decode fields of one context: eager (the model's cached forward), and with ``compile`` the
    compiled decode step (compiled first, its seconds reported), each on its own copy of the caches;
    all the runs' steps alternate, so machine noise hits them alike."""
    first_tokens = {name: logits.argmax(-1).expand(DECODE_BATCH) for name, (_, logits) in prefilled.items()}
    runs, tokens = {}, {}
    for name, model in models.items():
        cache = batch_copy(prefilled[name][0], DECODE_BATCH)
        runs[name] = lambda ids, model=model, cache=cache: model(ids[:, None], cache=cache).logits[:, -1]
        tokens[name] = first_tokens[name]
    row = {}
    if compile:
        import torch._dynamo

        torch._dynamo.reset()  # the previous context's graphs hold other buffer shapes
        for name, model in models.items():
            step, cache = DecodeStep(model, compile=True), batch_copy(prefilled[name][0], DECODE_BATCH)
            if not step.compiled:
                raise RuntimeError("--compile: torch.compile is not available here (see the message above)")
            step(first_tokens[name], cache)  # compiles
            row[f"{name}_compile_s"] = round(step.compile_seconds, 1)
            runs[f"{name}_compiled"] = lambda ids, step=step, cache=cache: step(ids, cache)
            tokens[f"{name}_compiled"] = first_tokens[name]
    ms = decode_ms_per_token(runs, tokens, steps)
    row.update({f"{name}_decode_ms_per_token": round(ms[name], 2) for name in models})
    row["decode_speedup"] = round(ms["transformer"] / ms["hybrid"], 2)
    if compile:
        row.update({f"{name}_decode_ms_per_token_compiled": round(ms[f"{name}_compiled"], 2) for name in models})
        row["decode_speedup_compiled"] = round(ms["transformer_compiled"] / ms["hybrid_compiled"], 2)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-seq-lens", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--contexts", type=int, nargs="*", default=[2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--config-a", help="run config whose model section replaces the hybrid")
    parser.add_argument("--config-b", help="run config whose model section replaces the Transformer")
    parser.add_argument("--only", choices=["training", "decode"],
                        help="run only the training rows, or only the inference rows (prefill, decode, cache)")
    parser.add_argument("--compile", action="store_true",
                        help="also time both models' compiled decode step (torch.compile, Inductor)")
    args = parser.parse_args(argv)
    configs = {"hybrid": load_run_config(args.config_a).model if args.config_a else HYBRID,
               "transformer": load_run_config(args.config_b).model if args.config_b else TRANSFORMER}
    models = {name: build(config) for name, config in configs.items()}
    report = {"threads": torch.get_num_threads(), "dtype": "fp32",
              "models": {name: {"pattern": model.config.pattern, "parameters": model.num_parameters()}
                         for name, model in models.items()},
              "training": [], "inference": []}

    for seq_len in ([] if args.only == "decode" else args.train_seq_lens):
        seconds = interleaved_medians({name: (lambda model=model: train_step_seconds(model, seq_len))
                               for name, model in models.items()}, args.repeats)
        row = {"seq_len": seq_len, **{f"{name}_tokens_per_s": round(TRAIN_BATCH * seq_len / s, 1)
                                      for name, s in seconds.items()}}
        row["hybrid_over_transformer"] = round(seconds["transformer"] / seconds["hybrid"], 2)
        report["training"].append(row)
        print(json.dumps(row), flush=True)

    for context in ([] if args.only == "training" else args.contexts):
        row = {"context": context}
        prefilled = {}
        for name, model in models.items():
            seconds, cache, logits = prefill(model, context, args.prefill_chunk, room=args.decode_steps + 8)
            row[f"{name}_prefill_s"] = round(seconds, 2)
            row[f"{name}_cache_bytes_per_sequence"] = cache.nbytes
            prefilled[name] = (cache, logits)
        row["prefill_hybrid_over_transformer_time"] = round(row["hybrid_prefill_s"] / row["transformer_prefill_s"], 2)
        row.update(decode_rows(models, prefilled, args.decode_steps, args.compile))
        del prefilled
        report["inference"].append(row)
        print(json.dumps(row), flush=True)

    targets = {}
    for row in report["training"]:
        if row["seq_len"] == 4096:
            targets["training_4k_at_least_1x"] = row["hybrid_over_transformer"] >= 1.0
    for row in report["inference"]:
        if row["context"] == 8192:
            targets["prefill_8k_at_most_transformer"] = row["prefill_hybrid_over_transformer_time"] <= 1.0
            targets["decode_8k_at_least_3x"] = row["decode_speedup"] >= 3.0
            if "decode_speedup_compiled" in row:
                targets["decode_8k_at_least_3x_compiled"] = row["decode_speedup_compiled"] >= 3.0
        if row["context"] == 32768:
            targets["decode_32k_at_least_8x"] = row["decode_speedup"] >= 8.0
            if "decode_speedup_compiled" in row:
                targets["decode_32k_at_least_8x_compiled"] = row["decode_speedup_compiled"] >= 8.0
    report["targets_met"] = targets
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
