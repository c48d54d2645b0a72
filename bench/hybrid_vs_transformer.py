"""A Nemotron-H-style hybrid against the same-shape Transformer: training, prefill, decode, cache.

    python -m bench.hybrid_vs_transformer [--train-seq-lens 1024 4096] [--contexts 2048 8192 32768]
                                          [--repeats 3] [--config-a A.yaml --config-b B.yaml]

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
  steps, the two models' steps alternating, median ms per step;
- cache bytes per sequence at each context (KV for attention, conv + SSM state for Mamba).

Targets (issue 13, the seed papers' claims): hybrid training tokens/s >= 1.0x the Transformer's
at seq 4k; prefill at 8k <= the Transformer's time; decode at 8k >= 3x and at 32k >= 8x faster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.timing import interleaved_medians
from meshlm.config import load_run_config
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
def prefill(model: LanguageModel, context: int, chunk: int) -> tuple[float, InferenceCache, torch.Tensor]:
    """Seconds to prefill one sequence of ``context`` tokens chunk by chunk; the cache; the last logits."""
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(1))
    cache = InferenceCache(max_tokens=context + 64)
    start = time.perf_counter()
    for begin in range(0, context, chunk):
        logits = model(ids[:, begin:begin + chunk], cache=cache).logits[:, -1]
    return time.perf_counter() - start, cache, logits


@torch.inference_mode()
def decode_ms_per_token(models: dict, prefilled: dict, steps: int) -> dict[str, float]:
    """Greedy single-token steps on a batch of DECODE_BATCH copies of each model's prefilled
    sequence, the models' steps alternating; median ms per step after one warm-up step."""
    state = {}
    for name, (cache, logits) in prefilled.items():
        cache.select(torch.zeros(DECODE_BATCH, dtype=torch.long))
        state[name] = logits.argmax(-1).expand(DECODE_BATCH)
    times = {name: [] for name in models}
    for _ in range(steps + 1):
        for name, model in models.items():
            start = time.perf_counter()
            state[name] = model(state[name][:, None], cache=prefilled[name][0]).logits[:, -1].argmax(-1)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values[1:]) * 1000 for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-seq-lens", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--contexts", type=int, nargs="*", default=[2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--config-a", help="run config whose model section replaces the hybrid")
    parser.add_argument("--config-b", help="run config whose model section replaces the Transformer")
    args = parser.parse_args(argv)
    configs = {"hybrid": load_run_config(args.config_a).model if args.config_a else HYBRID,
               "transformer": load_run_config(args.config_b).model if args.config_b else TRANSFORMER}
    models = {name: build(config) for name, config in configs.items()}
    report = {"threads": torch.get_num_threads(), "dtype": "fp32",
              "models": {name: {"pattern": model.config.pattern, "parameters": model.num_parameters()}
                         for name, model in models.items()},
              "training": [], "inference": []}

    for seq_len in args.train_seq_lens:
        seconds = interleaved_medians({name: (lambda model=model: train_step_seconds(model, seq_len))
                               for name, model in models.items()}, args.repeats)
        row = {"seq_len": seq_len, **{f"{name}_tokens_per_s": round(TRAIN_BATCH * seq_len / s, 1)
                                      for name, s in seconds.items()}}
        row["hybrid_over_transformer"] = round(seconds["transformer"] / seconds["hybrid"], 2)
        report["training"].append(row)
        print(json.dumps(row), flush=True)

    for context in args.contexts:
        row = {"context": context}
        prefilled = {}
        for name, model in models.items():
            seconds, cache, logits = prefill(model, context, args.prefill_chunk)
            row[f"{name}_prefill_s"] = round(seconds, 2)
            row[f"{name}_cache_bytes_per_sequence"] = cache.nbytes
            prefilled[name] = (cache, logits)
        decode = decode_ms_per_token(models, prefilled, args.decode_steps)
        row.update({f"{name}_decode_ms_per_token": round(ms, 2) for name, ms in decode.items()})
        row["prefill_hybrid_over_transformer_time"] = round(row["hybrid_prefill_s"] / row["transformer_prefill_s"], 2)
        row["decode_speedup"] = round(decode["transformer"] / decode["hybrid"], 2)
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
        if row["context"] == 32768:
            targets["decode_32k_at_least_8x"] = row["decode_speedup"] >= 8.0
    report["targets_met"] = targets
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
