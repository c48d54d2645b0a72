"""Cutting a model into pipeline stages, without processes: '|' marks, equal-FLOPs cuts, chunks
per rank, and the modules each rank keeps (single-process names, the tied-embedding copy)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.flops import block_flops, head_flops
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.pipeline.stages import (balanced_starts, check_pipeline_layout, keep_stage_modules, rank_chunks,
                                             stage_starts)

HYBRID = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, mamba_head_dim=8, mamba_state_size=8,
              mamba_num_groups=4, mamba_chunk_size=8)


def brute_force_best(costs, parts, last_extra):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = [0, *cuts, len(costs)]
        sums = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        sums[-1] += last_extra
        best = min(best, max(sums))
    return best


def test_balanced_starts_is_optimal():
    rng = random.Random(0)
    for _ in range(60):
        costs = [rng.randint(1, 20) for _ in range(rng.randint(2, 9))]
        parts = rng.randint(1, len(costs))
        extra = rng.choice([0, 5, 30])
        starts = balanced_starts(costs, parts, extra)
        assert starts[0] == 0 and len(starts) == parts and starts == sorted(set(starts))
        bounds = starts + [len(costs)]
        sums = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        sums[-1] += extra
        assert max(sums) == brute_force_best(costs, parts, extra)


def test_marked_stages_are_used_and_must_match_pp_times_vp():
    config = ModelConfig(pattern="M-M*|-M-|E-|**", moe_num_experts=4, **HYBRID)
    assert config.block_kinds == tuple("M-M*-M-E-**")  # a single process ignores the marks
    assert stage_starts(config, 4, 16) == [0, 4, 7, 9]
    with pytest.raises(ConfigError, match=r"marks 4 pipeline stages.*parallel.pp \* parallel.vp = 2"):
        stage_starts(config, 2, 16)


def test_unmarked_stages_have_near_equal_flops_with_the_head_on_the_last():
    config = ModelConfig(pattern="*-*-*-*-*-*-", **HYBRID)
    seq_len = 16
    costs = [block_flops(kind, config, seq_len).per_sequence for kind in config.block_kinds]
    head = head_flops(config, seq_len)
    for stages in (2, 3, 4, 6):
        starts = stage_starts(config, stages, seq_len)
        bounds = starts + [config.num_blocks]
        sums = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        sums[-1] += head
        assert max(sums) == brute_force_best(costs, stages, head)
    with pytest.raises(ConfigError, match="12 blocks, fewer than .* 16 pipeline stages"):
        stage_starts(config, 16, seq_len)


def test_chunk_c_of_rank_r_is_virtual_stage_c_pp_plus_r():
    config = ModelConfig(pattern="*-*-*-*-", **HYBRID)
    pp, vp = 2, 2
    seen = []
    for rank in range(pp):
        chunks = rank_chunks(config, pp, vp, rank, 16)
        assert [chunk.virtual_stage for chunk in chunks] == [c * pp + rank for c in range(vp)]
        seen += [block for chunk in chunks for block in chunk.blocks]
        assert chunks[0].is_first == (rank == 0) and chunks[-1].is_last == (rank == pp - 1)
    assert sorted(seen) == list(range(config.num_blocks))


@pytest.mark.parametrize("tie, mtp_depth", [(True, 0), (False, 1), (False, 0)])
def test_each_rank_keeps_its_modules_under_single_process_names(tie, mtp_depth):
    config = ModelConfig(pattern="M*-M|*-E-", moe_num_experts=4, tie_embeddings=tie, mtp_depth=mtp_depth, **HYBRID)
    full_names = [name for name, _ in LanguageModel(config).named_parameters()]
    union = []
    for rank in range(2):
        torch.manual_seed(0)
        model = LanguageModel(config)
        full_blocks = list(model.blocks)
        layout = keep_stage_modules(model, rank_chunks(config, 2, 1, rank, 16), rank, 2)
        names = [name for name, _ in model.named_parameters()]
        assert layout.parameter_order == full_names
        assert names == [name for name in full_names if name in names]  # same relative order
        assert all(model.state_dict()[name] is not None for name in names)
        blocks = {int(name.split(".")[1]) for name in names if name.startswith("blocks.")}
        assert blocks == ({0, 1, 2, 3} if rank == 0 else {4, 5, 6, 7})
        assert [block.kind for block in model.blocks] == list(config.block_kinds[4 * rank:4 * rank + 4])
        assert model.blocks[4 * rank] is full_blocks[4 * rank]  # global index, the same module
        has_embedding = "embedding.weight" in names
        assert has_embedding == (rank == 0 or tie or mtp_depth > 0)
        assert layout.holds_embedding_copy == (rank == 1 and (tie or mtp_depth > 0))
        assert ("final_norm.weight" in names) == (rank == 1)
        union += names
    assert set(union) == set(full_names)
    assert len(union) - len(full_names) == (1 if tie or mtp_depth else 0)  # only the embedding is held twice


def test_layout_checks():
    config = ModelConfig(pattern="*-*-", **HYBRID)
    with pytest.raises(ConfigError, match="parallel.vp=2 needs parallel.pp > 1"):
        check_pipeline_layout(ParallelConfig(vp=2), config, 16, 4)
    with pytest.raises(ConfigError, match="groups of parallel.pp=2"):
        check_pipeline_layout(ParallelConfig(pp=2, vp=2), config, 16, 3)
    with pytest.raises(ConfigError, match="4 blocks, fewer than"):
        check_pipeline_layout(ParallelConfig(pp=4, vp=2), config, 16, 4)
    check_pipeline_layout(ParallelConfig(pp=2, vp=1), config, 16, 3)  # 1F1B takes any count
