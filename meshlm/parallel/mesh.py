"""From a ``ParallelConfig`` to the process groups one rank takes part in.

Two grids over the same ranks (Megatron Core's "MoE parallel folding", Liu et al. 2025):

    dense layers (attention, Mamba, MLP, embedding, head):   (pp, dp, cp, tp)   tp innermost
    expert layers (the routed experts of MoE blocks):        (pp, edp, ep, etp) etp innermost

rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, so the ranks of one TP group
are adjacent -- inside one node, where the per-layer all-reduces of tensor parallelism get the
fast links -- then context parallelism, then data parallelism, and pipeline stages outermost
(their point-to-point traffic is the lightest). Within one pipeline stage the same
``tp * cp * dp`` ranks are split again as ``edp * ep * etp`` for the experts, so an expert-
parallel group may span ranks that are TP or CP ranks of attention.

    world 8, tp 2, dp 4:   TP groups {0,1} {2,3} {4,5} {6,7}     DP groups {0,2,4,6} {1,3,5,7}
    ... with ep 4, etp 1:  EP groups {0,1,2,3} {4,5,6,7}          expert-DP groups {0,4} {1,5} ...

Gradients of a dense parameter are summed over ``dp_cp`` (the DP and CP ranks together hold the
same shard and saw different samples or different parts of the sequences); those of an expert
over ``edp``. The groups come from ``torch.distributed.device_mesh.init_device_mesh``, each
wrapped in a ``Group`` (``groups.py``) named after its dim ("tp", "dp", "dp_cp", "edp", ...,
and "world") that carries the run's device and, under ``parallel.check_collectives``, the run's
``CollectiveLog``: what every collective checks (``collectives.py``).
Everything here is explicit: modules receive the ``ParallelContext`` they need; nothing reads a
global "current group". With one process the context has no groups and every parallel layer is
an ordinary one; a group of size 1 is ``None``.

``check_layout`` refuses a layout that does not divide (the world by the product of sizes, the
heads, KV heads, FFN widths, Mamba heads and groups by tp, the sequence by tp under sequence
parallelism and by 2*cp under context parallelism, the experts by ep) with a message naming the
numbers, before any collective runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshlm.errors import ConfigError
from meshlm.parallel.collective_log import CollectiveLog
from meshlm.parallel.data.low_communication import check_dp_sync
from meshlm.parallel.groups import Group, group_of
from meshlm.parallel.pipeline.stages import check_pipeline_layout
from meshlm.parallel.simulated_link import parse_link


@dataclass
class ParallelContext:
    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Group | None = None
    """None when tp_size == 1 (so for every group below)."""
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: Group | None = None
    """Ranks that read different samples (same pp, cp and tp coordinates)."""
    sequence_parallel: bool = False
    """The residual stream between blocks is sharded along the sequence over the TP group."""
    device_mesh: object | None = None
    """The dense ``DeviceMesh`` with dims ('pp', 'dp', 'cp', 'tp'), when running distributed."""
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Group | None = None
    pp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's pipeline, in stage order (for point-to-point sends)."""
    vp_size: int = 1
    """Virtual pipeline stages (model chunks) per rank, for the interleaved schedule."""
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Group | None = None
    cp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's CP group, in cp-rank order (for the ring's sends)."""
    dp_cp_size: int = 1
    dp_cp_rank: int = 0
    dp_cp_group: Group | None = None
    """DP and CP together: the ranks holding the same dense shards; dense gradients are summed here."""
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Group | None = None
    """Expert parallelism: each rank of this group holds num_experts / ep experts."""
    etp_size: int = 1
    etp_rank: int = 0
    etp_group: Group | None = None
    """Expert tensor parallelism: each expert's FFN width is split over this group."""
    edp_size: int = 1
    edp_rank: int = 0
    edp_group: Group | None = None
    """Expert data parallelism: ranks holding the same expert shards; expert gradients are summed here."""
    moe_dispatcher: str = "all_to_all"
    """How MoE blocks move tokens to their experts' ranks (``parallel.moe_dispatcher``)."""
    expert_mesh: object | None = field(default=None, repr=False)
    """The expert ``DeviceMesh`` with dims ('pp', 'edp', 'ep', 'etp'), when running distributed."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """The run's device: every tensor a collective over the groups below moves must live here."""
    world_group: Group | None = None
    """Every rank (the global gradient norm, barriers, the collective checks); None in one process."""
    replica_group: Group | None = None
    """Under ``parallel.dp_sync`` (other than every_step): the ranks of this rank's DP replica --
    every rank with its dp coordinate (pp x cp x tp) -- where the replica's gradient norm is
    reduced; None otherwise, or when a replica is one rank."""
    collective_log: CollectiveLog | None = field(default=None, repr=False)
    """This rank's record of its collectives under ``parallel.check_collectives`` (every group
    above holds it too; ``meshlm/parallel/collective_checks.py`` compares the ranks'), else None."""

    @property
    def is_logging_rank(self) -> bool:
        """Only global rank 0 prints, logs and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def world_from_environment() -> tuple[int, int]:
    """(rank, world_size) as set by torchrun (1 process when unset)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def resolve_dp(parallel, world_size: int) -> int:
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    if world_size == 1 and model_parallel > 1:
        raise ConfigError(f"tp*pp*cp = {parallel.tp}*{parallel.pp}*{parallel.cp} = {model_parallel} needs that many "
                          "processes, but this run is one process; start it with torchrun --nproc_per_node "
                          f"{model_parallel} (or a multiple) -m meshlm ..., or set parallel.tp, pp and cp to 1.")
    if world_size % model_parallel:
        raise ConfigError(f"the world of {world_size} processes is not divisible by tp*pp*cp = {parallel.tp}*"
                          f"{parallel.pp}*{parallel.cp} = {model_parallel}; change the process count or the sizes.")
    dp = parallel.dp if parallel.dp is not None else world_size // model_parallel
    if dp * model_parallel != world_size:
        raise ConfigError(f"parallel.dp={dp} x tp*pp*cp={model_parallel} = {dp * model_parallel} processes, but the "
                          f"world has {world_size}; set parallel.dp=null to use the rest of the world.")
    return dp


def resolve_etp(parallel) -> int:
    """Expert tensor-parallel size: ``parallel.etp``, or tp when unset (Megatron's default)."""
    return parallel.tp if parallel.etp is None else parallel.etp


def resolve_edp(parallel, dp: int) -> int:
    """Expert data-parallel size: the ranks of one stage, ``tp * cp * dp``, over ``ep * etp``."""
    stage_ranks, expert_model = parallel.tp * parallel.cp * dp, parallel.ep * resolve_etp(parallel)
    if stage_ranks % expert_model:
        raise ConfigError(f"the {stage_ranks} ranks of a pipeline stage (tp*cp*dp = {parallel.tp}*{parallel.cp}*{dp})"
                          f" are not divisible by ep*etp = {parallel.ep}*{resolve_etp(parallel)} = {expert_model}; "
                          "expert groups fold onto the same ranks as attention's, so choose ep and etp that "
                          "divide tp*cp*dp.")
    return stage_ranks // expert_model


def _seq_len_choices(seq_len: int, multiple: int) -> str:
    """``train.seq_len`` rounded down and up to a multiple of ``multiple``, as config values."""
    lower, upper = seq_len // multiple * multiple, -(-seq_len // multiple) * multiple
    return " or ".join(f"train.seq_len={n}" for n in (lower, upper) if n > 0)


def _divides(size: int, value: int, what: str, reason: str, size_name: str = "parallel.tp",
             size_key: str | None = None) -> None:
    """Refuse a ``value`` that ``size`` does not divide, naming both ways out: the largest size that
    divides both (it also divides the world the given size did, so the layout stays whole), or a
    value that is a multiple of the size."""
    if value % size:
        fitting = math.gcd(value, size)
        raise ConfigError(f"{what} = {value} is not divisible by {size_name}={size}; {reason} Use "
                          f"{size_key or size_name}={fitting}, or set {what} to a multiple of {size}.")


def _check_tensor_parallel(tp: int, model, kind: str, where: str = "") -> None:
    """The sizes of a ``kind`` block of config ``model`` split over tp; ``where`` names an overridden block."""
    if tp > 1 and kind == "*":
        _divides(tp, model.num_attention_heads, f"model.num_attention_heads{where}", "each rank must hold whole heads.")
        kv_heads = model.resolved_num_kv_heads
        if kv_heads % tp and tp % kv_heads:
            raise ConfigError(f"model.num_kv_heads{where}={kv_heads} and parallel.tp={tp}: KV heads are either split "
                              "(kv_heads divisible by tp) or replicated (tp divisible by kv_heads); neither holds.")
    if tp > 1 and kind == "-":
        _divides(tp, model.resolved_ffn_hidden_size, f"model.ffn_hidden_size{where}",
                 "the MLP is split on its FFN width.")
    if tp > 1 and kind == "E" and model.moe_shared_expert_ffn_hidden_size:
        _divides(tp, model.moe_shared_expert_ffn_hidden_size, "model.moe_shared_expert_ffn_hidden_size",
                 "the shared expert is split on its FFN width.")
    if tp > 1 and kind == "M":
        _divides(tp, model.resolved_mamba_num_heads, f"the number of Mamba heads (model.mamba_num_heads{where})",
                 "each rank must hold whole SSM heads.")
        _divides(tp, model.mamba_num_groups, "model.mamba_num_groups",
                 "each rank must hold whole B/C groups (and normalize them locally).")


def _check_experts(parallel, model, kind: str, where: str = "") -> None:
    if kind != "E":
        return
    etp = resolve_etp(parallel)
    _divides(etp, model.resolved_moe_ffn_hidden_size, f"model.moe_ffn_hidden_size{where}",
             "each expert is split on its FFN width over the expert tensor-parallel group.",
             "parallel.etp" if parallel.etp is not None else "parallel.etp (null: parallel.tp) = parallel.tp",
             "parallel.etp")
    _divides(parallel.ep, model.moe_num_experts, f"model.moe_num_experts{where}",
             "each expert-parallel rank holds whole experts.", "parallel.ep")


def _check_block_sizes(parallel, model) -> None:
    """Every block's sizes (its own under ``model.block_overrides``) split over tp, etp and ep."""
    plain = {kind for index, kind in enumerate(model.block_kinds) if index not in model.block_overrides}
    if model.mtp_depth:
        plain |= set(model.mtp_pattern) - {"|", " "}
    checks = [(model, kind, "") for kind in sorted(plain)]
    checks += [(model.for_block(index), model.block_kinds[index], f" of block {index} (model.block_overrides)")
               for index in model.block_overrides]
    for config, kind, where in checks:
        _check_tensor_parallel(parallel.tp, config, kind, where)
        _check_experts(parallel, config, kind, where)


def check_layout(parallel, model, world_size: int, seq_len: int | None = None,
                 micro_batches_per_step: int | None = None) -> int:
    """Validate the layout against the world and the model; return the data-parallel size."""
    dp = resolve_dp(parallel, world_size)
    resolve_edp(parallel, dp)
    check_dp_sync(parallel)
    tp = parallel.tp
    _check_block_sizes(parallel, model)
    if parallel.sp and seq_len is not None and seq_len % tp:
        raise ConfigError(f"train.seq_len={seq_len} is not divisible by parallel.tp={tp}; sequence parallelism "
                          f"gives every rank an equal slice of the sequence. Use {_seq_len_choices(seq_len, tp)}.")
    if parallel.cp > 1 and seq_len is not None and seq_len % (2 * parallel.cp * (tp if parallel.sp else 1)):
        multiple = 2 * parallel.cp * (tp if parallel.sp else 1)
        raise ConfigError(f"train.seq_len={seq_len} is not divisible by {multiple} (2*cp"
                          f"{'*tp' if parallel.sp else ''}); context parallelism splits each sequence into 2*cp "
                          f"chunks{' and sequence parallelism each chunk pair over tp' if parallel.sp else ''}. "
                          f"Use {_seq_len_choices(seq_len, multiple)}.")
    if parallel.cp > 1 and model.rope_scaling == "longrope":
        raise ConfigError("model.rope_scaling=longrope picks its factors by the largest position a forward rotates, "
                          "and context parallelism gives each rank only some chunks of the sequence (their largest "
                          "positions differ); use parallel.cp=1 with LongRoPE.")
    if micro_batches_per_step is not None and micro_batches_per_step % dp:
        raise ConfigError(f"the {micro_batches_per_step} micro-batches of a step (train.global_batch_size / "
                          f"train.micro_batch_size) do not split evenly over parallel.dp={dp} ranks; make "
                          "train.global_batch_size a multiple of micro_batch_size * dp.")
    check_pipeline_layout(parallel, model, seq_len,
                          micro_batches_per_step // dp if micro_batches_per_step is not None else None)
    if parallel.zero_stage == 3 and dp > 1 and model.parallel_residual_shared_norm:
        raise ConfigError("parallel.zero_stage=3 gathers each block's weights for its own forward alone, and "
                          "model.parallel_residual_shared_norm=true has the block beside each attention block use "
                          "that block's norm; use parallel.zero_stage=2 (or 1) with a shared norm.")
    return dp


def choose_backend(parallel, device: torch.device) -> str:
    if parallel.backend != "auto":
        return parallel.backend
    return "nccl" if device.type == "cuda" else "gloo"


def _group(mesh, name: str, device: torch.device, log: CollectiveLog | None) -> Group | None:
    """This rank's group along dim ``name`` of ``mesh`` (None when that dim has size 1)."""
    if mesh.size(mesh.mesh_dim_names.index(name)) == 1:
        return None
    return group_of(mesh.get_group(name), name, device, log)


def _ranks(group: Group | None) -> tuple[int, ...]:
    """Global ranks of a group in its own order (this rank alone for None)."""
    return (dist.get_rank(),) if group is None else group.ranks


def join_process_group(backend: str, timeout_s: float) -> None:
    """``init_process_group`` from torchrun's environment, with ``timeout_s`` on every collective.

    Under ``torchrun --max-restarts`` the workers of every attempt share the agent's TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE``), and torch 2.13 no longer separates the attempts' keys: a
    restarted rank could read a dead rank's address from the last attempt and fail to connect.
    So each attempt gets its own key prefix, as older torch did (``/worker/attempt_N``), on a
    single node only: there one agent numbers the attempts of every worker alike, while across
    nodes an agent restarting for another node's failure keeps its count.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    rank, world_size = world_from_environment()
    single_node = os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or not single_node:
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"/meshlm/attempt_{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout)


def check_backend(parallel, backend: str) -> None:
    """Layouts a backend cannot run correctly. The pipeline's point-to-point messages are matched
    by tag (meshlm/parallel/pipeline/p2p.py); NCCL ignores tags and matches by issue order per
    pair of ranks, which the interleaved schedule does not keep when pp = 2 (the two ranks carry
    activations and gradients both ways). Refused rather than risk swapped micro-batches."""
    if backend == "nccl" and parallel.pp == 2 and parallel.vp > 1:
        raise ConfigError(f"parallel.pp=2 with parallel.vp={parallel.vp} on NCCL: the interleaved schedule's "
                          "messages between two stages are matched by tag, which NCCL ignores; use "
                          "parallel.vp=1, or pp >= 3 for interleaving.")


def check_backend_available(backend: str, device: torch.device) -> None:
    """Refuse NCCL where it cannot run, before ``init_process_group`` fails in every rank with an
    error that reads like a peer's failure: NCCL is in CUDA builds of torch only, and it moves CUDA
    tensors only (a CPU run's collectives need gloo)."""
    if backend != "nccl":
        return
    if not dist.is_nccl_available():
        raise ConfigError(f"parallel.backend=nccl, but this torch ({torch.__version__}) is built without NCCL; "
                          "use parallel.backend=gloo (or auto: NCCL on CUDA, gloo otherwise).")
    if device.type != "cuda":
        raise ConfigError(f"parallel.backend=nccl moves CUDA tensors only, but this run is on {device.type}; use "
                          "parallel.backend=gloo (or auto), or train.device=cuda.")


def build_parallel_context(parallel, model, device: torch.device, seq_len: int | None = None,
                           micro_batches_per_step: int | None = None) -> ParallelContext:
    """Check the layout, then join the process group (when launched by torchrun) and build the meshes."""
    rank, world_size = world_from_environment()
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    dp = check_layout(parallel, model, world_size, seq_len, micro_batches_per_step)
    check_backend(parallel, choose_backend(parallel, device))
    if world_size == 1:
        return ParallelContext(vp_size=parallel.vp, sequence_parallel=parallel.sp,
                               moe_dispatcher=parallel.moe_dispatcher, device=device)
    if not dist.is_initialized():
        backend = choose_backend(parallel, device)
        check_backend_available(backend, device)
        join_process_group(backend, parallel.timeout_s)
    from torch.distributed.device_mesh import init_device_mesh

    tp, pp, cp, ep, etp = parallel.tp, parallel.pp, parallel.cp, parallel.ep, resolve_etp(parallel)
    edp = resolve_edp(parallel, dp)
    mesh = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp") if dp * cp > 1 else None
    expert_mesh = init_device_mesh(device.type, (pp, edp, ep, etp), mesh_dim_names=("pp", "edp", "ep", "etp"))
    log = CollectiveLog() if parallel.check_collectives else None
    dense = {name: _group(mesh, name, device, log) for name in ("pp", "dp", "cp", "tp")}
    experts = {name: _group(expert_mesh, name, device, log) for name in ("edp", "ep", "etp")}
    dp_cp_group = group_of(dp_cp.get_group(), "dp_cp", device, log) if dp_cp is not None else None
    replica_group = None  # parallel.dp_sync: each replica's own "world" (its gradient norm)
    if parallel.dp_sync != "every_step" and dp > 1 and world_size > dp:
        replica_group = group_of(mesh["pp", "cp", "tp"]._flatten("replica").get_group(), "replica", device, log)
    link = parse_link(parallel.simulate_link)  # a testing aid: the DP groups' collectives wait it out
    if link is not None:
        dense["dp"], experts["edp"], dp_cp_group = (dataclasses.replace(group, link=link) if group is not None
                                                    else None for group in (dense["dp"], experts["edp"], dp_cp_group))
    return ParallelContext(
        rank=rank, world_size=world_size,
        tp_size=tp, tp_rank=mesh.get_local_rank("tp"), tp_group=dense["tp"],
        dp_size=dp, dp_rank=mesh.get_local_rank("dp"), dp_group=dense["dp"],
        sequence_parallel=parallel.sp, device_mesh=mesh,
        pp_size=pp, pp_rank=mesh.get_local_rank("pp"), pp_group=dense["pp"], pp_ranks=_ranks(dense["pp"]),
        vp_size=parallel.vp,
        cp_size=cp, cp_rank=mesh.get_local_rank("cp"), cp_group=dense["cp"], cp_ranks=_ranks(dense["cp"]),
        dp_cp_size=dp * cp, dp_cp_rank=dp_cp.get_local_rank() if dp_cp is not None else 0,
        dp_cp_group=dp_cp_group,
        ep_size=ep, ep_rank=expert_mesh.get_local_rank("ep"), ep_group=experts["ep"],
        etp_size=etp, etp_rank=expert_mesh.get_local_rank("etp"), etp_group=experts["etp"],
        edp_size=edp, edp_rank=expert_mesh.get_local_rank("edp"), edp_group=experts["edp"],
        moe_dispatcher=parallel.moe_dispatcher, expert_mesh=expert_mesh, device=device,
        world_group=group_of(dist.group.WORLD, "world", device, log), replica_group=replica_group,
        collective_log=log)
