"""Checkpoints across pipeline, context and expert parallelism: pp2 x dp2 (tied embedding, ZeRO-1)
-> dp4, cp2 x dp2 -> tp2 x dp2 (Mamba), ep2 (ZeRO-1) -> ep1 with experts split by TP, ep1 -> ep4.

The same checks as ``test_reshard.py`` (whose ``train_recorded`` runs them): steps 4-5 after
resuming A's step-3 checkpoint at B equal the uninterrupted run at B (fp32, <= 1e-5), and A's
checkpoint re-saved at B holds exactly A's tensors. Pipeline stages write only their own
parameters, the last stage's copy of the tied embedding not at all (with a vocabulary of 512 the
embedding straddles the ZeRO-1 shards of both stages, at different places: writing both copies
would give overlapping chunks, which DCP refuses); CP ranks hold the same
shards as their DP peers; expert shards map back through ``expert_parallel`` metadata.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import import_test_file


reshard = import_test_file(Path(__file__).parent / "test_reshard.py", "meshlm_reshard_tests")
helpers = reshard.helpers
MODELS, DIST_OPT = helpers.MODELS, reshard.DIST_OPT
TIED = [*MODELS["dense"], "model.tie_embeddings=true", "model.vocab_size=512"]
RUNS = {
    "tied pp2xdp2 zero": TIED + ["parallel.pp=2", "parallel.dp=2"] + DIST_OPT,
    "tied dp4": TIED + ["parallel.dp=4"],
    "hybrid cp2xdp2": MODELS["hybrid"] + ["parallel.cp=2", "parallel.dp=2"],
    "hybrid tp2xdp2": MODELS["hybrid"] + reshard.LAYOUTS["tp2xdp2"],
    "moe ep2 zero": MODELS["moe"] + ["parallel.dp=4", "parallel.ep=2"] + DIST_OPT,
    "moe tp2xdp2": MODELS["moe"] + reshard.LAYOUTS["tp2xdp2"],
    "moe dp4": MODELS["moe"] + ["parallel.dp=4"],
    "moe ep4": MODELS["moe"] + ["parallel.dp=4", "parallel.ep=4"],
}
RESHARDS = [("tied pp2xdp2 zero", "tied dp4"), ("hybrid cp2xdp2", "hybrid tp2xdp2"),
            ("moe ep2 zero", "moe tp2xdp2"), ("moe dp4", "moe ep4")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return reshard.train_reshard_plan(tmp_path_factory.mktemp("reshard-pp-cp-ep"), RUNS, RESHARDS)


@pytest.mark.parametrize("saved, resumed", RESHARDS)
def test_resumed_run_continues_the_uninterrupted_run(runs, saved, resumed):
    reshard.assert_resumed_continues(runs, saved, resumed)


@pytest.mark.parametrize("saved, resumed", RESHARDS)
def test_resaving_at_the_new_layout_keeps_every_tensor(runs, saved, resumed):
    before, after = reshard.resaved_tensors(runs, saved, resumed)
    assert any(key.startswith("optim/") for key in before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
