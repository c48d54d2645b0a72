"""The (dp, tp) mesh: TP groups are adjacent ranks, DP groups strided by tp; layouts that do not
divide are refused before any collective, with a message naming the numbers."""

import pytest
import torch
import torch.distributed as dist

from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.mesh import build_parallel_context, check_layout
from tests.helpers.distributed import run_distributed


def group_layout(tp: int) -> dict:
    context = build_parallel_context(ParallelConfig(tp=tp), ModelConfig(pattern="*-"), torch.device("cpu"))

    def ranks(group):
        return None if group is None else tuple(dist.get_process_group_ranks(group.process_group))

    tp_sum = torch.tensor([float(context.rank)])
    all_reduce_(tp_sum, context.tp_group)  # the groups really communicate
    return {"rank": context.rank, "tp": (context.tp_size, context.tp_rank, ranks(context.tp_group)),
            "dp": (context.dp_size, context.dp_rank, ranks(context.dp_group)), "tp_sum": tp_sum.item()}


@pytest.mark.parametrize("world_size, tp", [(4, 2), (4, 4), (4, 1), (8, 4)])
def test_tensor_parallel_groups_are_adjacent_ranks(world_size, tp):
    dp = world_size // tp
    for rank, layout in enumerate(run_distributed(group_layout, world_size, tp, timeout_s=120)):
        tp_members = tuple(range(rank - rank % tp, rank - rank % tp + tp))
        dp_members = tuple(range(rank % tp, world_size, tp))
        assert layout["rank"] == rank
        assert layout["tp"] == (tp, rank % tp, tp_members if tp > 1 else None)
        assert layout["dp"] == (dp, rank // tp, dp_members if dp > 1 else None)
        assert layout["tp_sum"] == (sum(tp_members) if tp > 1 else rank)


def refusal(parallel, model, world_size=4, **sizes) -> str:
    with pytest.raises(ConfigError) as error:
        check_layout(parallel, model, world_size, **sizes)
    return str(error.value)


def test_world_and_sizes_must_multiply():
    message = refusal(ParallelConfig(tp=3), ModelConfig(pattern="-", ffn_hidden_size=96), world_size=4)
    assert "4 processes" in message and "tp*pp*cp" in message and "3" in message
    message = refusal(ParallelConfig(tp=2, dp=3), ModelConfig(pattern="-"), world_size=4)
    assert "parallel.dp=3" in message and "6 processes" in message and "has 4" in message
    assert check_layout(ParallelConfig(tp=2), ModelConfig(pattern="-"), 8) == 4
    message = refusal(ParallelConfig(tp=2, cp=2), ModelConfig(pattern="-"), world_size=1)  # no torchrun
    assert message.startswith("tp*pp*cp = 2*1*2 = 4 needs that many processes, but this run is one process; "
                              "start it with torchrun --nproc_per_node 4"), message
    assert check_layout(ParallelConfig(tp=2, dp=2), ModelConfig(pattern="-"), 4) == 2


@pytest.mark.parametrize("model_fields, names", [
    (dict(pattern="*", hidden_size=48, num_attention_heads=6), ["num_attention_heads = 6", "tp=4", "Use parallel.tp=2, or set model.num_attention_heads to a multiple of 4."]),
    (dict(pattern="*", hidden_size=48, num_attention_heads=12, num_kv_heads=6), ["num_kv_heads=6", "tp=4"]),
    (dict(pattern="-", ffn_hidden_size=30), ["ffn_hidden_size = 30", "tp=4", "Use parallel.tp=2,"]),
    (dict(pattern="E", moe_ffn_hidden_size=30),
     ["moe_ffn_hidden_size = 30", "tp=4", "Use parallel.etp=2, or set model.moe_ffn_hidden_size to a multiple of 4."]),
    (dict(pattern="E", moe_ffn_hidden_size=32, moe_shared_expert_ffn_hidden_size=18),
     ["moe_shared_expert_ffn_hidden_size = 18", "tp=4"]),
    (dict(pattern="M", mamba_num_heads=6), ["Mamba heads", "= 6", "tp=4"]),
    (dict(pattern="M", mamba_num_heads=8, mamba_num_groups=2), ["mamba_num_groups = 2", "tp=4", "Use parallel.tp=2,"]),
    (dict(pattern="M", mamba_num_heads=8, mtp_depth=1, mtp_pattern="*", num_attention_heads=6, hidden_size=48),
     ["num_attention_heads = 6"]),
], ids=["heads", "kv_heads", "ffn", "moe_ffn", "shared_expert", "mamba_heads", "mamba_groups", "mtp_blocks"])
def test_model_widths_must_divide_by_tp(model_fields, names):
    message = refusal(ParallelConfig(tp=4), ModelConfig(**model_fields))
    for name in names:
        assert name in message, message


@pytest.mark.parametrize("kv_heads, tp", [(1, 2), (1, 4), (2, 4), (2, 2), (4, 2)])
def test_kv_heads_are_split_or_replicated(kv_heads, tp):
    model = ModelConfig(pattern="*-", hidden_size=64, num_attention_heads=8, num_kv_heads=kv_heads)
    assert check_layout(ParallelConfig(tp=tp), model, tp) == 1


def test_sequence_parallel_needs_a_divisible_sequence():
    model = ModelConfig(pattern="*-")
    message = refusal(ParallelConfig(tp=4, sp=True), model, seq_len=30)
    assert "train.seq_len=30" in message and "parallel.tp=4" in message
    assert message.endswith("Use train.seq_len=28 or train.seq_len=32."), message
    assert check_layout(ParallelConfig(tp=4, sp=True), model, 4, seq_len=32) == 1
    assert check_layout(ParallelConfig(tp=4, sp=False), model, 4, seq_len=30) == 1


def test_micro_batches_must_split_over_data_parallel_ranks():
    model = ModelConfig(pattern="*-")
    message = refusal(ParallelConfig(tp=2), model, world_size=8, micro_batches_per_step=6)
    assert "6 micro-batches" in message and "parallel.dp=4" in message
    assert check_layout(ParallelConfig(tp=2), model, 8, micro_batches_per_step=8) == 4


def full_layout(**sizes) -> dict:
    model = ModelConfig(pattern="*E", moe_num_experts=4)
    context = build_parallel_context(ParallelConfig(**sizes), model, torch.device("cpu"))

    def ranks(group):
        return None if group is None else tuple(dist.get_process_group_ranks(group.process_group))

    layout = {name: ranks(getattr(context, f"{name}_group")) for name in ("tp", "dp", "cp", "pp", "dp_cp", "ep",
                                                                             "etp", "edp")}
    layout["coordinates"] = (context.pp_rank, context.dp_rank, context.cp_rank, context.tp_rank)
    layout["expert_coordinates"] = (context.pp_rank, context.edp_rank, context.ep_rank, context.etp_rank)
    layout["pp_ranks"], layout["cp_ranks"] = context.pp_ranks, context.cp_ranks
    return layout


def test_dense_and_expert_grids_fold_over_the_same_ranks():
    """world 8 = pp2 x dp1 x cp2 x tp2; experts: pp2 x edp1 x ep4 x etp1 and pp2 x edp2 x ep1 x etp2."""
    for rank, layout in enumerate(run_distributed(full_layout, 8, tp=2, pp=2, cp=2, ep=4, etp=1, timeout_s=120)):
        pp, cp, tp = rank // 4, rank // 2 % 2, rank % 2
        assert layout["coordinates"] == (pp, 0, cp, tp)
        assert layout["tp"] == (rank - tp, rank - tp + 1)
        assert layout["cp"] == layout["dp_cp"] == layout["cp_ranks"] == (rank - 2 * cp, rank - 2 * cp + 2)
        assert layout["pp"] == layout["pp_ranks"] == (rank % 4, rank % 4 + 4)
        assert layout["dp"] is None and layout["etp"] is None and layout["edp"] is None
        assert layout["ep"] == tuple(range(4 * pp, 4 * pp + 4))  # spans TP and CP ranks of attention
        assert layout["expert_coordinates"] == (pp, 0, rank % 4, 0)
    for rank, layout in enumerate(run_distributed(full_layout, 4, tp=2, dp=2, ep=1, timeout_s=120)):
        assert layout["etp"] == layout["tp"] == (rank - rank % 2, rank - rank % 2 + 1)  # etp defaults to tp
        assert layout["edp"] == layout["dp"] == layout["dp_cp"] == (rank % 2, rank % 2 + 2)


def test_expert_grid_must_fold_into_a_stage():
    message = refusal(ParallelConfig(tp=2, ep=4, etp=2), ModelConfig(pattern="E", moe_num_experts=8), world_size=4)
    assert "ep*etp = 4*2 = 8" in message and "tp*cp*dp" in message
    message = refusal(ParallelConfig(ep=4), ModelConfig(pattern="E", moe_num_experts=6), world_size=4)
    assert "moe_num_experts = 6" in message and "parallel.ep=4" in message
    assert "Use parallel.ep=2, or set model.moe_num_experts to a multiple of 4." in message
    # The size the message offers (the largest that divides both) is a layout that passes.
    assert check_layout(ParallelConfig(ep=2), ModelConfig(pattern="E", moe_num_experts=6), world_size=4) == 4


def test_context_parallel_needs_two_chunks_per_rank():
    message = refusal(ParallelConfig(cp=2), ModelConfig(pattern="*"), world_size=2, seq_len=18)
    assert "train.seq_len=18" in message and "2*cp" in message
    assert message.endswith("Use train.seq_len=16 or train.seq_len=20."), message
    message = refusal(ParallelConfig(cp=2), ModelConfig(pattern="*"), world_size=2, seq_len=3)
    assert message.endswith("Use train.seq_len=4."), message
    assert check_layout(ParallelConfig(cp=2), ModelConfig(pattern="*"), 2, seq_len=16) == 1


def test_interleaving_over_two_stages_is_refused_on_nccl():
    from meshlm.parallel.mesh import check_backend

    with pytest.raises(ConfigError, match="parallel.pp=2 with parallel.vp=2 on NCCL"):
        check_backend(ParallelConfig(pp=2, vp=2), "nccl")
    check_backend(ParallelConfig(pp=2, vp=2), "gloo")  # gloo matches by tag: allowed
    check_backend(ParallelConfig(pp=4, vp=2), "nccl")


def test_nccl_is_refused_where_it_cannot_run(monkeypatch):
    """Before init_process_group, whose NCCL failure every rank would report as a collective's."""
    from meshlm.parallel.mesh import check_backend_available

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    check_backend_available("gloo", cpu)
    check_backend_available("gloo", cuda)  # gloo over CUDA tensors: several ranks on one GPU
    if not dist.is_nccl_available():  # a CPU build of torch (this suite's)
        with pytest.raises(ConfigError, match=r"parallel.backend=nccl, but this torch .* is built without NCCL; "
                                              r"use parallel.backend=gloo"):
            check_backend_available("nccl", cuda)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)  # a CUDA build, as the GPU image's
    with pytest.raises(ConfigError, match="parallel.backend=nccl moves CUDA tensors only, but this run is on cpu"):
        check_backend_available("nccl", cpu)
    check_backend_available("nccl", cuda)


def test_longrope_under_context_parallelism_is_refused():
    longrope = ModelConfig(pattern="*-", hidden_size=32, num_attention_heads=4, rope_scaling="longrope",
                           rope_original_max_positions=8, rope_short_factors=[1.0] * 4, rope_long_factors=[2.0] * 4)
    message = refusal(ParallelConfig(cp=2), longrope, world_size=2, seq_len=16)
    assert "model.rope_scaling=longrope" in message and "use parallel.cp=1" in message
    assert check_layout(ParallelConfig(tp=2), longrope, 2, seq_len=16) == 1  # other layouts take it
