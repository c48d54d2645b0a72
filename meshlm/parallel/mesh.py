"""From a ``ParallelConfig`` to the process groups one rank takes part in.

The world is arranged as a grid ``(dp, tp)`` (later ``(pp, dp, cp, tp)``) with tensor
parallelism innermost, as in Megatron-LM and picotron: rank = dp_rank * tp + tp_rank, so the
ranks of one TP group are adjacent -- inside one node, where the per-layer all-reduces of
tensor parallelism get the fast links -- and the ranks of one DP group are strided by tp.

    world 8, tp 2:   TP groups {0,1} {2,3} {4,5} {6,7}     DP groups {0,2,4,6} {1,3,5,7}

The groups come from ``torch.distributed.device_mesh.init_device_mesh``. Everything here is
explicit: modules receive the ``ParallelContext`` they need; nothing reads a global "current
group". With one process the context has no groups and every parallel layer is an ordinary one.

``check_layout`` refuses a layout that does not divide (the world by the product of sizes, the
heads, KV heads, FFN widths, Mamba heads and groups by tp, the sequence by tp under sequence
parallelism) with a message naming the numbers, before any collective runs.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshlm.models.config import ConfigError


@dataclass
class ParallelContext:
    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    """None when tp_size == 1."""
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: dist.ProcessGroup | None = None
    """None when dp_size == 1."""
    sequence_parallel: bool = False
    """The residual stream between blocks is sharded along the sequence over the TP group."""
    device_mesh: object | None = None
    """The ``DeviceMesh`` with dims ('dp', 'tp'), when running distributed."""

    @property
    def is_logging_rank(self) -> bool:
        """Only global rank 0 prints, logs and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_from_environment() -> tuple[int, int]:
    """(rank, world_size) as set by torchrun (1 process when unset)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def resolve_dp(parallel, world_size: int) -> int:
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    if world_size % model_parallel:
        raise ConfigError(f"the world of {world_size} processes is not divisible by tp*pp*cp = {parallel.tp}*"
                          f"{parallel.pp}*{parallel.cp} = {model_parallel}; change the process count or the sizes.")
    dp = parallel.dp if parallel.dp is not None else world_size // model_parallel
    if dp * model_parallel != world_size:
        raise ConfigError(f"parallel.dp={dp} x tp*pp*cp={model_parallel} = {dp * model_parallel} processes, but the "
                          f"world has {world_size}; set parallel.dp=null to use the rest of the world.")
    return dp


def _divides(tp: int, value: int, what: str, fix: str) -> None:
    if value % tp:
        raise ConfigError(f"{what} = {value} is not divisible by parallel.tp={tp}; {fix}")


def check_layout(parallel, model, world_size: int, seq_len: int | None = None,
                 micro_batches_per_step: int | None = None) -> int:
    """Validate the layout against the world and the model; return the data-parallel size."""
    dp = resolve_dp(parallel, world_size)
    tp = parallel.tp
    kinds = set(model.block_kinds) | (set(model.mtp_pattern) - {"|", " "} if model.mtp_depth else set())
    if tp > 1 and "*" in kinds:
        _divides(tp, model.num_attention_heads, "model.num_attention_heads", "each rank must hold whole heads.")
        kv_heads = model.resolved_num_kv_heads
        if kv_heads % tp and tp % kv_heads:
            raise ConfigError(f"model.num_kv_heads={kv_heads} and parallel.tp={tp}: KV heads are either split "
                              "(kv_heads divisible by tp) or replicated (tp divisible by kv_heads); neither holds.")
    if tp > 1 and "-" in kinds:
        _divides(tp, model.resolved_ffn_hidden_size, "model.ffn_hidden_size", "the MLP is split on its FFN width.")
    if tp > 1 and "E" in kinds:
        _divides(tp, model.resolved_moe_ffn_hidden_size, "model.moe_ffn_hidden_size",
                 "each expert is split on its FFN width.")
        if model.moe_shared_expert_ffn_hidden_size:
            _divides(tp, model.moe_shared_expert_ffn_hidden_size, "model.moe_shared_expert_ffn_hidden_size",
                     "the shared expert is split on its FFN width.")
    if tp > 1 and "M" in kinds:
        _divides(tp, model.resolved_mamba_num_heads, "the number of Mamba heads (model.mamba_num_heads)",
                 "each rank must hold whole SSM heads.")
        _divides(tp, model.mamba_num_groups, "model.mamba_num_groups",
                 "each rank must hold whole B/C groups (and normalize them locally).")
    if parallel.sp and seq_len is not None and seq_len % tp:
        raise ConfigError(f"train.seq_len={seq_len} is not divisible by parallel.tp={tp}; sequence parallelism "
                          "gives every rank an equal slice of the sequence.")
    if micro_batches_per_step is not None and micro_batches_per_step % dp:
        raise ConfigError(f"the {micro_batches_per_step} micro-batches of a step (train.global_batch_size / "
                          f"train.micro_batch_size) do not split evenly over parallel.dp={dp} ranks; make "
                          "train.global_batch_size a multiple of micro_batch_size * dp.")
    return dp


def choose_backend(parallel, device: torch.device) -> str:
    if parallel.backend != "auto":
        return parallel.backend
    return "nccl" if device.type == "cuda" else "gloo"


def build_parallel_context(parallel, model, device: torch.device, seq_len: int | None = None,
                           micro_batches_per_step: int | None = None) -> ParallelContext:
    """Check the layout, then join the process group (when launched by torchrun) and build the mesh."""
    rank, world_size = world_from_environment()
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    dp = check_layout(parallel, model, world_size, seq_len, micro_batches_per_step)
    if world_size == 1:
        return ParallelContext()
    if not dist.is_initialized():
        dist.init_process_group(choose_backend(parallel, device),
                                timeout=datetime.timedelta(seconds=parallel.timeout_s))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dp, parallel.tp), mesh_dim_names=("dp", "tp"))
    tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp")
    return ParallelContext(
        rank=rank, world_size=world_size,
        tp_size=parallel.tp, tp_rank=tp_rank, tp_group=mesh.get_group("tp") if parallel.tp > 1 else None,
        dp_size=dp, dp_rank=dp_rank, dp_group=mesh.get_group("dp") if dp > 1 else None,
        sequence_parallel=parallel.sp, device_mesh=mesh)
