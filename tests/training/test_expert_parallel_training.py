"""The trainer under expert parallelism (folded onto tp and dp) equals the single-process trainer.

An MoE hybrid (Mamba, attention, two MoE blocks of 4 experts, top-2, a shared expert, aux and
z-losses on) trains for 5 steps of 4 micro-batches at expert layouts on 4 and 8 spawned gloo
ranks, with each dispatcher, with and without the distributed optimizer (ZeRO-1 over dp_cp for
dense weights, over edp for experts): every step's loss and global gradient norm, the validation
loss and the final full parameters must equal the single-process run (relative error <= 1e-5).
A checkpoint written at one expert layout resumes at another with the uninterrupted losses.
The helpers are ``tests/training/test_parallel_training.py``'s.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from meshlm.parallel.testing import run_distributed


def parallel_training_helpers():
    """tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""
    path = Path(__file__).parent / "test_parallel_training.py"
    spec = importlib.util.spec_from_file_location("parallel_training_helpers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # run_distributed finds its functions by module name
    spec.loader.exec_module(module)
    return module


HELPERS = parallel_training_helpers()
MOE_HYBRID = ["model.pattern=ME*E", "model.moe_num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32",
              "model.moe_shared_expert_ffn_hidden_size=32", "model.moe_aux_loss_coeff=0.01",
              "model.moe_z_loss_coeff=0.001", "model.mamba_head_dim=8", "model.mamba_state_size=8",
              "model.mamba_num_groups=4", "model.mamba_chunk_size=8"]
DIST_OPT = "parallel.distributed_optimizer=true"
GATHER = "parallel.moe_dispatcher=all_gather"
LAYOUTS = {
    4: {"ep4": ["parallel.ep=4"],
        "ep2 etp2 all-gather": ["parallel.ep=2", "parallel.etp=2", GATHER],
        "ep2 edp2 dist-opt all-gather": ["parallel.ep=2", DIST_OPT, GATHER],
        "tp2 sp ep2 (etp=tp) dist-opt": ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", DIST_OPT],
        "tp2 ep2 etp1 edp2 dist-opt": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1", DIST_OPT]},
    8: {"tp2 ep4": ["parallel.tp=2", "parallel.ep=4"],
        "tp2 sp ep2 etp1 edp4 dist-opt": ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "parallel.etp=1",
                                          DIST_OPT]},
}
SAVED = "ep4"
"""The run whose step-3 checkpoint is resumed at another expert layout."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The single-process reference, then every layout; the world-8 call also resumes the step-3
    checkpoint of the world-4 ep4 run at tp2 x ep4."""
    root = tmp_path_factory.mktemp("expert-parallel-training")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    single = HELPERS.train_once(blend, root / "single", MOE_HYBRID)
    world4 = [(name, [*MOE_HYBRID, *overrides, *(["train.save_every=3"] if name == SAVED else [])])
              for name, overrides in LAYOUTS[4].items()]
    results4 = run_distributed(HELPERS.train_runs, 4, str(blend), str(root), world4, timeout_s=300)
    shutil.copytree(root / SAVED / "checkpoints" / "step_3", root / "resumed" / "checkpoints" / "step_3")
    world8 = [(name, [*MOE_HYBRID, *overrides]) for name, overrides in LAYOUTS[8].items()]
    world8.append(("resumed", [*MOE_HYBRID, *LAYOUTS[8]["tp2 ep4"]]))
    results8 = run_distributed(HELPERS.train_runs, 8, str(blend), str(root), world8, timeout_s=300)
    return dict(single=single, by_world={4: results4, 8: results8})


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_expert_parallel_training_equals_single_process(runs, world):
    for layout in LAYOUTS[world]:
        for rank, results in enumerate(runs["by_world"][world]):
            HELPERS.assert_same_run(results[layout], runs["single"], f"{layout} rank {rank}")


def test_checkpoint_at_ep4_resumes_at_tp2_ep4(runs):
    single = runs["single"]
    later = {**single, "losses": {step: single["losses"][step] for step in (4, 5)},
             "grad_norms": {step: single["grad_norms"][step] for step in (4, 5)}, "val_losses": {5: single["val_losses"][5]}}
    for rank, results in enumerate(runs["by_world"][8]):
        assert sorted(results["resumed"]["losses"]) == [4, 5]
        HELPERS.assert_same_run(results["resumed"], later, f"resumed rank {rank}")
