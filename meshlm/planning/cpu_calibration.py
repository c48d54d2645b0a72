"""Measured rates for the planner's ``cpu`` row: what this CPU does with *this* model's blocks.

On a GPU the model's FLOPs run at a fraction of the tensor-core peak that changes little from
one model to the next, so ``hardware.py`` keeps one achievable fraction per op class. On a CPU
that does not hold: the memory-bound work around the matmuls (norms, activations, rotary,
softmax, routing, the Mamba scan's gating and cumulative sums) and autograd's per-op cost take
as long as the matmuls themselves at the small widths a CPU trains, and the share differs per
block kind -- an attention or MLP block of hidden 128 reaches about half of the matmul rate, a
Mamba block a sixth. A FLOP rate per op class then misses the step time by a factor of two.

So ``plan --gpu cpu`` calibrates on the model it plans, once, before predicting (a short
micro-benchmark, about a second for a small model):

- **per block kind** of the config (``*``, ``-``, ``M``, ``E``, ...): one real block
  (``meshlm.models.block.Block``, the trainer's own module) runs forward and backward on a
  micro-batch of the configured shape (tokens capped at ``MAX_TOKENS`` so a large model's plan
  stays quick) and on half as many tokens; the line through the two (model FLOPs, median time)
  points gives the kind's rate and a fixed part per block and micro-batch (each op's dispatch
  and autograd's bookkeeping, which do not shrink when tp or cp divide the work);
- **the head**: final norm, output projection and cross-entropy, forward and backward, fitted alike;
- **the optimizer**: torch's AdamW step (fused where the trainer uses it) on one flat tensor,
  as bytes of parameter state per second (the step is memory-bound).

The planner then divides each block's FLOPs on a rank (its tp/cp share) by its kind's rate and
adds the kind's fixed part, which carries the measured proportion of memory-bound work and of
per-op cost over to every layout. Timings run
with the threads one of ``processes`` ranks gets (``cores // processes``), as the ranks of a
multi-process CPU run share the cores.
"""

from __future__ import annotations

import os
import statistics
import time

MAX_TOKENS = 2048
"""Calibration micro-batches are cut to at most this many tokens (micro-batch x sequence)."""

OPTIMIZER_ELEMENTS = 1 << 20
"""Parameters in the optimizer calibration's tensor (4 MiB of fp32)."""

OPTIMIZER_STATE_BYTES = 16
"""Bytes per parameter the AdamW step reads and writes besides the gradient: fp32 weight, exp_avg and
exp_avg_sq read and written (``step_time``'s optimizer term counts 16 + 2 x dtype bytes)."""


def threads_per_rank(processes: int) -> int:
    """The intra-op threads one of ``processes`` ranks sharing this host's cores gets."""
    return max(1, (os.cpu_count() or 1) // processes)


def timings(run, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of ``repeats`` calls of ``run`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(run, repeats: int, warmup: int = 2) -> float:
    return statistics.median(timings(run, repeats, warmup))


def calibration_shapes(config) -> list[tuple[int, int]]:
    """Two (micro-batch, sequence length) shapes to time, the configured one (cut to
    ``MAX_TOKENS`` tokens, sequence first) and one with half its tokens (half the micro-batch, or
    half the sequence when the micro-batch is 1)."""
    seq = min(config.train.seq_len, MAX_TOKENS)
    micro_batch = max(1, min(config.train.micro_batch_size, MAX_TOKENS // seq))
    half = (micro_batch // 2, seq) if micro_batch > 1 else (1, max(1, seq // 2))
    return [(micro_batch, seq), half]


def fit_fixed_and_rate(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed seconds, FLOP/s) of the line ``seconds = fixed + flops / rate`` through two
    (flops, seconds) points; the fixed part is the per-block cost that does not shrink with the
    work (dispatching each op, autograd's bookkeeping), which a tp or cp share does not divide.
    Timing noise that tilts the line past either end (negative fixed part or slope) falls back to
    a rate alone."""
    (flops_a, seconds_a), (flops_b, seconds_b) = sorted(points)
    slope = (seconds_b - seconds_a) / (flops_b - flops_a) if flops_b > flops_a else 0.0
    fixed = seconds_b - slope * flops_b
    if slope <= 0 or fixed < 0:
        return 0.0, flops_b / seconds_b
    return fixed, 1 / slope


def block_rates(config, repeats: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """({kind: FLOP/s}, {kind: fixed seconds}) of each block kind of ``config.model`` and of the
    head (key ``'head'``), for forward + backward of one micro-batch: the model FLOPs over time,
    fitted over the two ``calibration_shapes``."""
    import torch

    from meshlm.models.block import Block
    from meshlm.models.context import SequenceContext
    from meshlm.models.flops import BACKWARD_TO_FORWARD, block_flops, head_flops
    from meshlm.models.norms import make_norm

    model = config.model
    dtype = torch.bfloat16 if config.precision.dtype == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(0)
    modules = {}
    for index, kind in enumerate(model.block_kinds):
        if kind not in modules and kind != "0":
            block_config = model.for_block(index)
            modules[kind] = (Block(kind, block_config, index).to(dtype), block_config)
    norm = make_norm(model.norm, model.hidden_size, model.norm_eps, bias=model.norm_bias).to(dtype)
    head = torch.nn.Linear(model.hidden_size, model.vocab_size, bias=False, dtype=dtype)
    points = {kind: [] for kind in [*modules, "head"]}
    for micro_batch, seq in calibration_shapes(config):
        token_ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        hidden = torch.randn(micro_batch, seq, model.hidden_size, generator=generator, dtype=dtype,
                             requires_grad=True)
        for kind, (block, block_config) in modules.items():
            def forward_backward(block=block):
                block(hidden, SequenceContext.for_tokens(token_ids)).sum().backward()

            flops = block_flops(kind, block_config, seq).per_sequence * micro_batch * (1 + BACKWARD_TO_FORWARD)
            points[kind].append((flops, median_seconds(forward_backward, repeats)))
        labels = torch.randint(0, model.vocab_size, (micro_batch * seq,), generator=generator)

        def head_forward_backward():
            logits = head(norm(hidden)).view(-1, model.vocab_size).float()
            torch.nn.functional.cross_entropy(logits, labels).backward()

        flops = head_flops(model, seq) * micro_batch * (1 + BACKWARD_TO_FORWARD)
        points["head"].append((flops, median_seconds(head_forward_backward, repeats)))
    fitted = {kind: fit_fixed_and_rate(kind_points) for kind, kind_points in points.items()}
    return ({kind: rate for kind, (_, rate) in fitted.items()},
            {kind: fixed for kind, (fixed, _) in fitted.items()})


def optimizer_bytes_per_s(repeats: int = 5) -> float:
    """Parameter-state bytes per second of the AdamW step the trainer takes (``meshlm/optim``)."""
    import torch

    from meshlm.optim.adamw import fused_supported

    parameter = torch.nn.Parameter(torch.zeros(OPTIMIZER_ELEMENTS))
    parameter.grad = torch.full_like(parameter, 1e-3)
    fused = fused_supported([parameter])
    optimizer = torch.optim.AdamW([parameter], lr=1e-3, fused=fused or None, foreach=None if fused else True)
    seconds = median_seconds(optimizer.step, repeats)
    return OPTIMIZER_ELEMENTS * (OPTIMIZER_STATE_BYTES + 2 * 4) / seconds


def measure(config, processes: int = 1, repeats: int = 5) -> dict:
    """``{'block_rates': {kind: FLOP/s}, 'block_fixed_s': {kind: seconds}, 'optimizer_bytes_per_s':
    float}`` timed with the threads one of ``processes`` ranks gets."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(processes))
    try:
        with torch.random.fork_rng():
            rates, fixed = block_rates(config, repeats)
        return {"block_rates": rates, "block_fixed_s": fixed, "optimizer_bytes_per_s": optimizer_bytes_per_s(repeats)}
    finally:
        torch.set_num_threads(previous)


__all__ = ["MAX_TOKENS", "block_rates", "calibration_shapes", "fit_fixed_and_rate", "measure", "median_seconds",
           "optimizer_bytes_per_s", "threads_per_rank", "timings"]
