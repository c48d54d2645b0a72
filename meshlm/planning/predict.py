"""One prediction per layout (memory, step time, throughput), and the ranking ``meshlm plan`` prints.

    prediction = predict(config, layout, hardware)            # micro-batch chosen
    ranked, refused = plan(config, gpus, hardware)             # every layout that divides

The micro-batch, unless given, is the one of 1, 2, 4, 8 (dividing the step's samples per DP rank)
with the most tokens/s among those that fit. MFU divides model FLOPs (no recomputation) by the
peak; the hardware rate counts the recomputed forward too (Korthikanti et al. 2022, §5; the
PTD-P paper's tables report this one).
"""

from __future__ import annotations

import dataclasses

from meshlm.planning.layouts import apply_layout, candidate_layouts, refusal
from meshlm.planning.memory import memory_items, rank_parameters
from meshlm.planning.step_time import step_flops, step_time

MICRO_BATCHES = (1, 2, 4, 8)


def resolved_for(config, hardware):
    """The config as the trainer would run it on that hardware: ``train.device`` the hardware's
    (cpu, or cuda for a GPU row: the activation estimate depends on it, e.g. the CPU's SDPA math
    path for MLA's value heads wider than its keys, the loss's chunks) and ``precision.dtype=auto``
    resolved (fp32 on the CPU, bf16 on a GPU)."""
    on_cpu = hardware.name == "cpu"
    train = dataclasses.replace(config.train, device="cpu" if on_cpu else "cuda")
    dtype = config.precision.dtype if config.precision.dtype != "auto" else "fp32" if on_cpu else "bf16"
    return dataclasses.replace(config, train=train, precision=dataclasses.replace(config.precision, dtype=dtype))


def predict_at(config, layout, hardware, micro_batch: int) -> dict:
    """The prediction for ``layout`` at ``micro_batch`` (the layout already accepted)."""
    run = apply_layout(resolved_for(config, hardware), layout, micro_batch)
    items = memory_items(run, layout, hardware)
    total = sum(items.values())
    ranks = [rank_parameters(run, layout, rank) for rank in sorted({0, layout.pp - 1})]
    times = step_time(run, layout, hardware, max(rank.count for rank in ranks),
                      max(rank.partial_count for rank in ranks))
    flops = step_flops(run, layout)
    seconds, gpus = times["step_time_s"], layout.world_size
    tokens = run.train.global_batch_size * run.train.seq_len
    model_tflops = flops["model_flops"] / seconds / gpus / 1e12
    return {"layout": layout.describe(), "micro_batch": micro_batch, "fits": total <= hardware.memory_bytes,
            "memory_bytes_per_gpu": total, "memory_items": items, "memory_capacity_bytes": hardware.memory_bytes,
            "step_time_s": seconds, "step_time_items": {key: value for key, value in times.items()
                                                        if key != "step_time_s"},
            "tokens_per_s": tokens / seconds, "model_tflops_per_gpu": model_tflops,
            "hardware_tflops_per_gpu": flops["hardware_flops"] / seconds / gpus / 1e12,
            "mfu": model_tflops / hardware.peak_tflops, "gpu": hardware.name}


def micro_batch_choices(config, layout, micro_batch: int | None) -> list[int]:
    if micro_batch is not None:
        return [micro_batch]
    per_rank = config.train.global_batch_size // layout.dp
    return [size for size in MICRO_BATCHES if per_rank % size == 0] or [1]


def predict(config, layout, hardware, micro_batch: int | None = None) -> dict:
    """The best prediction for ``layout`` over the micro-batch choices; ``refused``: the trainer's
    reason when no micro-batch is accepted."""
    best, reason = None, None
    for size in micro_batch_choices(config, layout, micro_batch):
        reason = refusal(config, layout, size)
        if reason is not None:
            continue
        candidate = predict_at(config, layout, hardware, size)
        if best is None or (candidate["fits"], candidate["tokens_per_s"]) > (best["fits"], best["tokens_per_s"]):
            best = candidate
    if best is None:
        return {"layout": layout.describe(), "micro_batch": micro_batch, "fits": False, "refused": reason}
    return best


def plan(config, gpus: int, hardware, micro_batch: int | None = None, zero_stages=(0, 1)) -> tuple[list, list]:
    """(layouts that fit, fastest first; the rest with why: refused by the trainer's rules or too big)."""
    fitting, rest = [], []
    for layout in candidate_layouts(config, gpus, hardware.gpus_per_node, zero_stages):
        prediction = predict(config, layout, hardware, micro_batch)
        if prediction.get("refused"):
            rest.append(prediction)
        elif not prediction["fits"]:
            prediction["refused"] = (f"needs {prediction['memory_bytes_per_gpu'] / 2 ** 30:.1f} GiB per GPU, "
                                     f"more than the {hardware.memory_gib:g} GiB of a {hardware.name}")
            rest.append(prediction)
        else:
            fitting.append(prediction)
    fitting.sort(key=lambda prediction: -prediction["tokens_per_s"])
    return fitting, rest


__all__ = ["MICRO_BATCHES", "plan", "predict", "predict_at"]
