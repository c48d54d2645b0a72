"""The planner's predicted TFLOP/s per GPU beside published tables, with the rates held fixed.

    python -m bench.plan_vs_published [--json]

**PTD-P (Narayanan et al. 2021, Table 1; A100-80GB, Selene: 8 GPUs per node, NVLink inside,
8 x 200 Gb/s InfiniBand HDR per node).** GPT models, sequence 2048, vocabulary 51,200, fp16 with
full activation recomputation, tensor x pipeline x data parallelism as listed, no ZeRO. The
paper's TFLOP/s count the recomputed forward (4 forward-equivalents per step: 96 B s L h^2 (1 +
s/6h + V/16Lh)), so we compare the planner's *hardware* TFLOP/s. The micro-batch is not in the
table: the planner picks it. Rows as published (parameters in billions, heads, hidden, layers,
tp, pp, dp, batch, achieved TFLOP/s per GPU).

**Megatron Core on H100 (seq 4096, vocabulary 131,072, 1.7B-462B, 408-490 TFLOP/s per GPU).**
Its rows are published as a figure in the Megatron-LM README, not as text that we hold; they
are left out rather than guessed. Add them to ``MEGATRON_CORE_H100`` (same fields) to compare.

The per-GPU rates used for every row are the ``hardware.py`` rows, printed once at the top.
"""

from __future__ import annotations

import argparse
import json

from meshlm.config import load_run_config
from meshlm.planning.hardware import GPUS
from meshlm.planning.layouts import Layout
from meshlm.planning.predict import predict

# (billions, heads, hidden, layers, tp, pp, dp, batch, published TFLOP/s per GPU)
PTD_P_A100 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 32, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 32, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 32, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 32, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 32, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 24, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 15, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 9, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 6, 3072, 163),
]
MEGATRON_CORE_H100: list[tuple] = []


def gpt_config(heads: int, hidden: int, layers: int, seq: int, vocab: int, batch: int):
    return load_run_config(None, [
        f"model.vocab_size={vocab}", f"model.hidden_size={hidden}", f"model.pattern={'*-' * layers}",
        f"model.num_attention_heads={heads}", "model.mlp_activation=gelu", f"model.ffn_hidden_size={4 * hidden}",
        "model.tie_embeddings=true", "precision.dtype=bf16", f"train.seq_len={seq}",
        f"train.global_batch_size={batch}", "train.micro_batch_size=1",
        "parallel.overlap_grad_reduce=false"])


def compare(rows, gpu: str, seq: int, vocab: int) -> list[dict]:
    results = []
    for billions, heads, hidden, layers, tp, pp, dp, batch, published in rows:
        config = gpt_config(heads, hidden, layers, seq, vocab, batch)
        layout = Layout(tp=tp, sp=False, pp=pp, vp=1, dp=dp, recompute="full")
        prediction = predict(config, layout, GPUS[gpu])
        predicted = prediction.get("hardware_tflops_per_gpu", float("nan"))
        results.append({"model_b": billions, "gpus": tp * pp * dp, "layout": f"tp{tp} pp{pp} dp{dp}", "batch": batch,
                        "micro_batch": prediction.get("micro_batch"), "published_tflops": published,
                        "predicted_tflops": round(predicted, 1), "error": round(predicted / published - 1, 3),
                        "refused": prediction.get("refused")})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    tables = {"PTD-P A100 (Narayanan et al. 2021, Table 1)": compare(PTD_P_A100, "a100-80gb", 2048, 51200)}
    if MEGATRON_CORE_H100:
        tables["Megatron Core H100"] = compare(MEGATRON_CORE_H100, "h100", 4096, 131072)
    if args.json:
        print(json.dumps(tables, indent=1))
        return
    for gpu in ("a100-80gb", "h100"):
        row = GPUS[gpu]
        print(f"{gpu}: peak {row.peak_tflops} TFLOP/s, achievable {row.achievable}, NVLink {row.intra_gbps} GB/s, "
              f"network {row.inter_gbps} GB/s per GPU")
    for name, results in tables.items():
        within = sum(abs(result["error"]) <= 0.15 for result in results)
        print(f"\n{name}: {within} of {len(results)} rows within 15%")
        print(f"{'model':>8} {'GPUs':>5} {'layout':>14} {'batch':>6} {'mb':>3} {'published':>10} {'predicted':>10} "
              f"{'error':>7}")
        for result in results:
            print(f"{result['model_b']:>7}B {result['gpus']:>5} {result['layout']:>14} {result['batch']:>6} "
                  f"{result['micro_batch']!s:>3} {result['published_tflops']:>10} {result['predicted_tflops']:>10} "
                  f"{result['error']:>+7.1%}")
    if not MEGATRON_CORE_H100:
        print("\nMegatron Core H100: no rows held as text (see the module docstring); not compared.")


if __name__ == "__main__":
    main()
