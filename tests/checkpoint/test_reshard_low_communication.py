"""A low-communication run's checkpoint (``parallel.dp_sync``) resumes at another model layout.

Between two syncs the DP replicas differ, so a checkpoint holds each replica's own weights,
moments (``replicaR/...``) and the outer state: the global copy (``outer/global/``) and the
outer optimizer's momentum (``outer/momentum/``, sharded over DP like a ZeRO-1 segment). Each run
here trains the tiny dense model of ``tests/checkpoint/test_reshard.py`` for 5 steps at dp2 with
H=2 (DiLoCo syncs after steps 2 and 4; PALSGD, after a 2-step warm-up, after step 4; each run
closes with one) and saves at step 3, between two syncs; the
checkpoint saved at tp2 x dp2 (+SP) is resumed at pp2 x dp2 and the other way round. Checked, as
for every other reshard:

* steps 4-5 (losses, gradient norms, final validation loss, final parameters) equal the
  uninterrupted run at the new layout (relative error <= 1e-5 in fp32);
* re-saved at the new layout before training on, the checkpoint holds exactly the tensors of the
  original -- every replica's weights and moments, the global copy and the outer momentum.

The DP size stays 2: a run at another DP size has other replicas, so no uninterrupted run could
be its reference (the loader starts a replica the checkpoint lacks as replica 0 and drops the
ones this run lacks). Such a resume says so in one note; checked at dp1 in this process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.distributed import import_test_file

reshard = import_test_file(Path(__file__).parent / "test_reshard.py", "meshlm_reshard_helpers")
helpers = reshard.helpers
SYNCS = {
    "diloco": ["parallel.dp_sync=diloco", "parallel.sync_every=2"],
    "palsgd": ["parallel.dp_sync=palsgd", "parallel.sync_every=2", "parallel.palsgd_warmup=2",
               "parallel.palsgd_p=0.4"],
}
LAYOUTS = {
    "tp2xdp2": ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true"],
    "pp2xdp2": ["parallel.pp=2", "parallel.dp=2"],
}
RUNS = {f"{sync} {layout}": [*helpers.MODELS["dense"], *LAYOUTS[layout], *SYNCS[sync]]
        for sync in SYNCS for layout in LAYOUTS}
RESHARDS = [("diloco tp2xdp2", "diloco pp2xdp2"), ("palsgd pp2xdp2", "palsgd tp2xdp2")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return reshard.train_reshard_plan(tmp_path_factory.mktemp("reshard_low_communication"), RUNS, RESHARDS)


@pytest.mark.parametrize("saved, resumed", RESHARDS)
def test_resumed_run_continues_the_uninterrupted_run(runs, saved, resumed):
    reshard.assert_resumed_continues(runs, saved, resumed)


@pytest.mark.parametrize("saved, resumed", RESHARDS)
def test_resaving_at_the_new_layout_keeps_every_replica_and_the_outer_state(runs, saved, resumed):
    before, after = reshard.resaved_tensors(runs, saved, resumed)
    for prefix in ("replica1/model/", "replica1/optim/", "outer/global/", "outer/momentum/"):
        assert any(key.startswith(prefix) for key in before), prefix
    replica0 = {key: value for key, value in before.items() if key.startswith("model/")}
    assert any(not before[f"replica1/{key}"].equal(value) for key, value in replica0.items()), \
        "saved between two syncs, the replicas should differ"
    for key, value in before.items():
        assert after[key].dtype == value.dtype and after[key].equal(value), key


def test_resuming_at_fewer_replicas_says_that_the_others_are_dropped(runs, tmp_path):
    run_dir = tmp_path / "diloco dp1"
    shutil.copytree(runs["root"] / "diloco tp2xdp2" / "checkpoints" / "step_3", run_dir / "checkpoints" / "step_3")
    with pytest.warns(UserWarning, match=r"saved by 2 DP replicas training apart \(parallel.dp_sync=diloco\); at "
                                         r"parallel.dp=1 replica 1 is dropped with the progress since the last sync"):
        result = helpers.train_once(runs["blend"], run_dir, [*helpers.MODELS["dense"], *SYNCS["diloco"]])
    assert sorted(result["losses"]) == [4, 5]
