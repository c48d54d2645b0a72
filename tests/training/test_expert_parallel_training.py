"""The trainer under expert parallelism (folded onto dp, tp, cp; with pp) equals one process.

An MoE hybrid (Mamba, attention, two MoE blocks of 4 experts, top-2, a gated shared expert, aux and
z-losses on) trains for 5 steps of 4 micro-batches at expert layouts on 4 spawned gloo ranks --
EP folded onto DP, onto TP with and without SP, onto CP, inside a pipeline stage; ETP 1 and 2;
each dispatcher; with and without the distributed optimizer (ZeRO-1 over dp_cp for dense
weights, over edp for experts).
Every step's loss and global gradient norm, the validation loss and the final full parameters
must equal the single-process run (relative error <= 1e-5). 8-rank layouts and checkpoints are
in test_expert_parallel_folding_training.py; the helpers are test_parallel_training.py's.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.distributed import import_test_file, run_distributed


HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""
MOE_HYBRID = ["model.pattern=ME*E", "model.moe_num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32",
              "model.moe_shared_expert_ffn_hidden_size=32", "model.moe_shared_expert_gate=true",
              "model.moe_aux_loss_coeff=0.01",
              "model.moe_z_loss_coeff=0.001", "model.mamba_head_dim=8", "model.mamba_state_size=8",
              "model.mamba_num_groups=4", "model.mamba_chunk_size=8"]
DIST_OPT = "parallel.distributed_optimizer=true"
GATHER = "parallel.moe_dispatcher=all_gather"
LAYOUTS = {  # world 4
    "ep4": ["parallel.ep=4"],
    "ep2 etp2 all-gather": ["parallel.ep=2", "parallel.etp=2", GATHER],
    "ep2 edp2 dist-opt all-gather": ["parallel.ep=2", DIST_OPT, GATHER],
    "tp2 sp ep2 (etp=tp) dist-opt": ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", DIST_OPT],
    "tp2 ep2 etp1 edp2 dist-opt": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1", DIST_OPT],
    "cp2 ep2 edp2": ["parallel.cp=2", "parallel.ep=2"],
    "pp2 tp2 sp ep2 etp1 dist-opt": ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.ep=2",
                                     "parallel.etp=1", DIST_OPT],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The single-process reference, then every layout in one spawned world of 4."""
    root = tmp_path_factory.mktemp("expert-parallel-training")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    single = HELPERS.train_once(blend, root / "single", MOE_HYBRID)
    layouts = [(name, [*MOE_HYBRID, *overrides]) for name, overrides in LAYOUTS.items()]
    return dict(single=single, by_rank=run_distributed(HELPERS.train_runs, 4, str(blend), str(root), layouts,
                                                        timeout_s=300))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_training_equals_single_process(runs, layout):
    for rank, results in enumerate(runs["by_rank"]):
        HELPERS.assert_same_run(results[layout], runs["single"], f"{layout} rank {rank}")
