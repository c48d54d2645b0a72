"""What one GPU (or this CPU) can do: the editable table the planner's predictions rest on.

Every number is per GPU and is an assumption, written once here and used for every model and
layout (the published-table benchmark holds them fixed across rows). Edit a row, or add one,
to plan for another machine.

- ``peak_tflops``: the dense bf16 tensor-core peak (the MFU denominator).
- ``achievable``: the fraction of that peak a training step reaches per *op class*, counting the
  class's model FLOPs (``meshlm/models/flops.py``) over the time of its kernels and of the
  memory-bound work around them (norms, activations, dropout, rotary, softmax): 'matmul'
  (projections, MLPs, experts, the head), 'attention' (the scores and the weighted sum, a fused
  flash kernel), 'ssd' (the Mamba-2 scan's matmuls and the causal convolution).
- links, alpha-beta: a message of n bytes takes ``latency_s + n / bandwidth`` on a link;
  'intra' is the node's fabric (NVLink: bus bandwidth of one GPU, one direction), 'inter' the
  network between nodes (InfiniBand: one NIC per GPU). A group whose ranks all sit in one node
  uses 'intra'.
- ``hbm_gbps``: memory bandwidth (the optimizer step is memory-bound).
- ``overhead_s``: fixed host time per block per micro-batch, forward and backward together
  (kernel launches and Python); it matters only for tiny models.
- ``fragmentation``: the share of the allocator's pool lost to fragmentation, added to the peak.

The CPU row is measured, not looked up: ``calibrate_cpu`` times a matmul the size of the model's
projections with the threads one process gets (the MFU denominator) and, given the config it
plans, each of the model's block kinds, its head and the optimizer step
(``cpu_calibration.py``: on a CPU the work around the matmuls is too large and too different per
block kind for op-class fractions); gloo's point-to-point latency and bandwidth are written as
constants measured once on a 2-core host (shared-memory loopback).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float
    memory_gib: float
    achievable: dict = field(default_factory=dict)
    intra_gbps: float = 450.0
    intra_latency_s: float = 5e-6
    inter_gbps: float = 50.0
    inter_latency_s: float = 10e-6
    hbm_gbps: float = 3350.0
    overhead_s: float = 30e-6
    fragmentation: float = 0.05
    comm_buffer_mib_per_group: float = 64.0
    """Workspace each communicator keeps (NCCL channels' buffers), per process group a rank joins."""
    gpus_per_node: int = 8
    overlaps_communication: bool = True
    """Whether communication can run behind compute (a GPU's copy engines and NVLink/NIC DMA); on a
    CPU the collectives' copies and reductions take the same cores as the compute, so they add."""
    reduce_scatter_factor: float = 1.0
    """A reduce-scatter's ring traffic and latency steps relative to an all-gather's: 1 for NCCL's
    ring; 2 on the CPU, where gloo's reduce-scatter costs as much as an all-reduce (measured by
    ``bench/plan_vs_measured.py --link``: 2.2-2.6 ms against 1.6-1.7 ms for an all-gather of
    4 KiB-128 KiB between 2 processes)."""
    block_rates: dict = field(default_factory=dict)
    """Measured FLOP/s per block kind (and ``'head'``), forward + backward model FLOPs over their
    time; where a kind is present it replaces the op-class rates (the calibrated CPU row only)."""
    block_fixed_s: dict = field(default_factory=dict)
    """Measured fixed seconds per block kind (and ``'head'``) and micro-batch, forward + backward:
    the part of the time that does not shrink with the work (the calibrated CPU row only)."""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2 ** 30)

    def rate(self, op_class: str) -> float:
        """Achievable FLOP/s of ``op_class``."""
        return self.peak_tflops * 1e12 * self.achievable[op_class]


# Achievable fractions: one set per GPU generation, chosen once (see bench/plan_vs_published.py).
GPUS = {
    "a100-80gb": Hardware("a100-80gb", 312.0, 80.0, {"matmul": 0.58, "attention": 0.40, "ssd": 0.25},
                          intra_gbps=300.0, inter_gbps=25.0, hbm_gbps=2039.0),
    "h100": Hardware("h100", 989.0, 80.0, {"matmul": 0.56, "attention": 0.40, "ssd": 0.25},
                     intra_gbps=450.0, inter_gbps=50.0, hbm_gbps=3350.0),
    "h200": Hardware("h200", 989.0, 141.0, {"matmul": 0.58, "attention": 0.42, "ssd": 0.26},
                     intra_gbps=450.0, inter_gbps=50.0, hbm_gbps=4800.0),
    "b200": Hardware("b200", 2250.0, 180.0, {"matmul": 0.55, "attention": 0.40, "ssd": 0.25},
                     intra_gbps=900.0, inter_gbps=50.0, hbm_gbps=8000.0),
}

CPU_LINK = {"latency_s": 1.2e-3, "gbps": 2.0}
"""gloo over shared memory on one host, per message: latency (a collective between 2 processes on
2 shared cores costs milliseconds: both must be scheduled) and bandwidth; fitted once to
``bench/plan_vs_measured.py``'s tp2 layout."""


def calibrate_cpu(config=None, processes: int = 1, hidden_size: int | None = None, tokens: int = 1024,
                  repeats: int = 9) -> Hardware:
    """This CPU as a ``Hardware`` row for one of ``processes`` ranks sharing the cores: the peak is
    the best fp32 rate of a [tokens x h] by [h x 4h] matmul; with ``config``, the block kinds,
    head and optimizer of its model are timed too (``cpu_calibration.measure``)."""
    import torch

    from meshlm.planning import cpu_calibration

    hidden_size = hidden_size or (config.model.hidden_size if config is not None else 256)
    threads = cpu_calibration.threads_per_rank(processes)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        left, right = torch.randn(tokens, hidden_size), torch.randn(hidden_size, 4 * hidden_size)
        best = min(cpu_calibration.timings(lambda: left @ right, repeats, warmup=1))
    finally:
        torch.set_num_threads(previous)
    flops_per_s = 2 * tokens * hidden_size * 4 * hidden_size / best
    cores_share = min(1.0, (os.cpu_count() or 1) / processes / threads)
    peak_tflops = flops_per_s * cores_share / 1e12
    measured = {"block_rates": {}, "block_fixed_s": {}, "optimizer_bytes_per_s": 10e9}
    if config is not None:
        measured = cpu_calibration.measure(config, processes)
    return Hardware("cpu", peak_tflops, memory_gib=available_host_gib() / processes,
                    achievable={"matmul": 0.6, "attention": 0.3, "ssd": 0.2},
                    intra_gbps=CPU_LINK["gbps"], intra_latency_s=CPU_LINK["latency_s"],
                    inter_gbps=CPU_LINK["gbps"], inter_latency_s=CPU_LINK["latency_s"],
                    hbm_gbps=measured["optimizer_bytes_per_s"] * cores_share / 1e9,
                    overhead_s=0.0 if measured["block_rates"] else 1.5e-3, fragmentation=0.0,
                    comm_buffer_mib_per_group=0.0, gpus_per_node=max(processes, 1), overlaps_communication=False,
                    reduce_scatter_factor=2.0,
                    block_rates={kind: rate * cores_share for kind, rate in measured["block_rates"].items()},
                    block_fixed_s=measured["block_fixed_s"])


def available_host_gib() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 16.0


def hardware_named(name: str, gpus_per_node: int | None = None, processes: int = 1, config=None) -> Hardware:
    """The row for ``--gpu NAME`` (cpu: calibrated now, on ``config``'s model when given), with
    ``--nodes-of`` applied."""
    if name == "cpu":
        found = calibrate_cpu(config, processes=processes)
    elif name in GPUS:
        found = GPUS[name]
    else:
        from meshlm.errors import ConfigError
        raise ConfigError(f"--gpu {name!r} is not one of {', '.join([*GPUS, 'cpu'])}; add a row to "
                          "meshlm/planning/hardware.py for another GPU.")
    return dataclasses.replace(found, gpus_per_node=gpus_per_node) if gpus_per_node else found


__all__ = ["CPU_LINK", "GPUS", "Hardware", "calibrate_cpu", "hardware_named"]
