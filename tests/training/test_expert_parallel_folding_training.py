"""The trainer on 8 ranks with the expert grid folded onto tp, cp and dp; EP checkpoints.

The MoE hybrid of test_expert_parallel_training.py at tp2 x ep4 (the 8 ranks split as tp 2 x
dp 4 for attention and ep 4 x etp 2 for the experts), tp2+SP x cp2 x ep4 with etp 1 and the
distributed optimizer, and tp2+SP x ep2 x etp1 (expert-DP 4) with the distributed optimizer:
every step's loss and grad norm, the validation loss and the final parameters equal the single-
process run (<= 1e-5). The step-3 checkpoint of the last (expert moments sharded over edp 4),
resumed by one process, continues with the losses of the uninterrupted run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.distributed import import_test_file, run_distributed


HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""
EXPERT_TESTS = import_test_file(Path(__file__).parent / "test_expert_parallel_training.py", "expert_parallel_tests")
MOE_HYBRID, DIST_OPT = EXPERT_TESTS.MOE_HYBRID, EXPERT_TESTS.DIST_OPT
"""The MoE hybrid and settings of the 4-rank expert-parallel trainer tests."""
LAYOUTS = {  # world 8
    "tp2 ep4": ["parallel.tp=2", "parallel.ep=4"],
    "tp2 sp cp2 ep4 etp1 dist-opt": ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2", "parallel.ep=4",
                                     "parallel.etp=1", DIST_OPT],
    "tp2 sp ep2 etp1 edp4 dist-opt": ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "parallel.etp=1",
                                      DIST_OPT, "train.save_every=3"],
}


SAVED = "tp2 sp ep2 etp1 edp4 dist-opt"
"""Its step-3 checkpoint holds expert Adam moments sharded over edp 4 by ZeRO-1."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("expert-folding-training")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    single = HELPERS.train_once(blend, root / "single", MOE_HYBRID)
    layouts = [(name, [*MOE_HYBRID, *overrides]) for name, overrides in LAYOUTS.items()]
    by_rank = run_distributed(HELPERS.train_runs, 8, str(blend), str(root), layouts, timeout_s=300)
    shutil.copytree(root / SAVED / "checkpoints" / "step_3", root / "resumed" / "checkpoints" / "step_3")
    resumed = HELPERS.train_once(blend, root / "resumed", MOE_HYBRID)
    return dict(single=single, by_rank=by_rank, resumed=resumed)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_folded_expert_training_on_8_ranks_equals_single_process(runs, layout):
    for rank, results in enumerate(runs["by_rank"]):
        HELPERS.assert_same_run(results[layout], runs["single"], f"{layout} rank {rank}")


def test_checkpoint_with_zero1_expert_shards_resumes_in_one_process(runs):
    single = runs["single"]
    later = {**single, "losses": {step: single["losses"][step] for step in (4, 5)},
             "grad_norms": {step: single["grad_norms"][step] for step in (4, 5)},
             "val_losses": {5: single["val_losses"][5]}}
    assert sorted(runs["resumed"]["losses"]) == [4, 5]
    HELPERS.assert_same_run(runs["resumed"], later, "resumed in one process")
