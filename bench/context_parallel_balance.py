"""Causal-attention work per context-parallel rank, with and without the chunk pairing.

    python -m bench.context_parallel_balance [--measure-cp 2 4] [--measure-seq-len 64]

Under context parallelism each rank computes attention for its own queries against every key
before them (``meshlm/parallel/context/ring_attention.py``). How the sequence is cut decides how that
work is spread. The baseline cuts it into cp contiguous slices (``contiguous_chunks``): the
rank holding the end of the sequence attends to everything, the one holding the start to
almost nothing. meshlm cuts it into 2*cp chunks and gives rank i chunks i and 2cp-1-i
(``paired_chunks``). For each layout, cp and sequence length this prints, per rank:

* ``causal_flops``: the attention FLOPs causal masking actually needs -- for every (query chunk,
  key chunk) pair the ring visits, c^2 score entries for a full block (key chunk earlier) and
  c(c+1)/2 for the diagonal block, times 4 d per entry and head (q k^T and P V, forward);
* ``computed_flops``: what ``ring_attention``'s fused kernel calls count in torch's convention
  (``FlopCounterMode``'s SDPA formulas: a block is counted as its full c^2 square whatever the
  causal mask, although the fused kernel skips the masked tiles of a diagonal block), forward +
  backward: 14 d per entry and head (forward q k^T and P V; backward recomputes q k^T, then
  dV, dP, dQ, dK);

and ``max_over_min`` across ranks (1.0 = perfectly balanced; target <= 1.05 with the pairing).
The block list is the one ``ring_attention`` itself iterates (``attention_blocks``), so the
count follows the code, not a separate model of it.

Measured check: spawned gloo ranks run the real ``ring_attention`` forward and backward under
``torch.utils.flop_counter.FlopCounterMode`` for both layouts (with the CPU flash kernel's
formulas, ``tests/helpers/flop_formulas.py``, which torch's table lacks); the FLOPs each rank
counts are printed beside ``computed_flops`` for the same shapes (they must be equal) with their
max/min across ranks.
"""

from __future__ import annotations

import argparse
import json

import torch

from meshlm.parallel.context.chunks import CHUNK_LAYOUTS
from meshlm.parallel.context.ring_attention import attention_blocks
from tests.helpers.distributed import run_distributed

TARGET = 1.05
HEADS, HEAD_DIM = 32, 128
"""The analytic counts are for 32 heads of 128 channels, one sequence (a scale only: ratios do not depend on it)."""


def blocks_per_rank(cp: int, layout) -> list[list[tuple[int, int, bool]]]:
    """For each rank, every (query slot, key slot, causal) block the ring makes it compute."""
    return [[block for step in range(cp)
             for block in attention_blocks(layout(rank, cp), layout((rank - step) % cp, cp))]
            for rank in range(cp)]


def flops_per_rank(cp: int, seq_len: int, layout, heads: int = HEADS, head_dim: int = HEAD_DIM,
                   batch: int = 1) -> dict[str, list[int]]:
    chunk = seq_len // (2 * cp)
    causal, computed = [], []
    for blocks in blocks_per_rank(cp, layout):
        needed_entries = sum(chunk * (chunk + 1) // 2 if diagonal else chunk * chunk for _, _, diagonal in blocks)
        causal.append(4 * head_dim * heads * batch * needed_entries)
        computed.append(14 * head_dim * heads * batch * chunk * chunk * len(blocks))
    return {"causal_flops": causal, "computed_flops": computed}


def balance(values: list[int]) -> float:
    return max(values) / min(values) if min(values) > 0 else float("inf")


def analytic(cps: list[int], seq_lens: list[int]) -> list[dict]:
    rows = []
    for cp in cps:
        for seq_len in seq_lens:
            for name, layout in CHUNK_LAYOUTS.items():
                counts = flops_per_rank(cp, seq_len, layout)
                rows.append({"cp": cp, "seq_len": seq_len, "layout": name, **counts,
                             "causal_max_over_min": round(balance(counts["causal_flops"]), 4),
                             "computed_max_over_min": round(balance(counts["computed_flops"]), 4)})
    return rows


# --- measured -------------------------------------------------------------------------------------

MEASURE_SHAPE = dict(batch=1, heads=4, kv_heads=2, head_dim=16)


def measure_rank(cp: int, seq_len: int) -> dict[str, int]:
    """In each spawned rank: matmul FLOPs of ring attention forward + backward, per layout."""
    from torch.utils.flop_counter import FlopCounterMode

    from meshlm.config import ParallelConfig
    from meshlm.models.config import ModelConfig
    from meshlm.parallel.context.ring_attention import ring_attention
    from meshlm.parallel.mesh import build_parallel_context
    from tests.helpers.flop_formulas import MISSING_FORMULAS

    torch.set_num_threads(1)
    context = build_parallel_context(ParallelConfig(cp=cp), ModelConfig(), torch.device("cpu"))
    shape = MEASURE_SHAPE
    local = seq_len // cp
    measured = {}
    for name, layout in CHUNK_LAYOUTS.items():
        query = torch.randn(shape["batch"], shape["heads"], local, shape["head_dim"], requires_grad=True)
        key, value = (torch.randn(shape["batch"], shape["kv_heads"], local, shape["head_dim"], requires_grad=True)
                      for _ in range(2))
        with FlopCounterMode(display=False, custom_mapping=MISSING_FORMULAS) as counter:
            ring_attention(query, key, value, context, layout).sum().backward()
        measured[name] = counter.get_total_flops()
    return measured


def measured(cps: list[int], seq_len: int) -> list[dict]:
    rows = []
    for cp in cps:
        per_rank = run_distributed(measure_rank, cp, cp, seq_len, timeout_s=300)
        for name, layout in CHUNK_LAYOUTS.items():
            counts = [result[name] for result in per_rank]
            expected = flops_per_rank(cp, seq_len, layout, MEASURE_SHAPE["heads"], MEASURE_SHAPE["head_dim"],
                                      MEASURE_SHAPE["batch"])["computed_flops"]
            rows.append({"cp": cp, "seq_len": seq_len, "layout": name, "measured_flops": counts,
                         "analytic_computed_flops": expected, "equal": counts == expected,
                         "max_over_min": round(balance(counts), 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--measure-cp", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--measure-seq-len", type=int, default=64)
    args = parser.parse_args()
    rows = analytic(args.cp, args.seq_len)
    paired = [row for row in rows if row["layout"] == "paired"]
    report = {
        "target_max_over_min": TARGET,
        "paired_worst_causal_max_over_min": max(row["causal_max_over_min"] for row in paired),
        "paired_worst_computed_max_over_min": max(row["computed_max_over_min"] for row in paired),
        "contiguous_worst_causal_max_over_min": max(row["causal_max_over_min"] for row in rows
                                                    if row["layout"] == "contiguous"),
        "analytic": rows,
        "measured": measured(args.measure_cp, args.measure_seq_len) if args.measure_cp else [],
    }
    report["meets_target"] = (report["paired_worst_causal_max_over_min"] <= TARGET
                              and all(row["max_over_min"] <= TARGET for row in report["measured"]
                                      if row["layout"] == "paired"))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
