"""Distributed checkpoints in spawned gloo worlds of 4: bf16 masters under ZeRO-1 across layouts,
asynchronous save equal to synchronous save, and bad checkpoints refused alike on every rank.

Runs are those of ``tests/training/test_parallel_training.py`` (dense model, 5 steps, a
checkpoint at step 3), reused through ``tests/checkpoint/test_reshard.py``'s ``train_recorded``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.errors import CheckpointError
from tests.helpers.distributed import import_test_file, run_distributed
from tests.helpers.tiny_training import relative_error


reshard = import_test_file(Path(__file__).parent / "test_reshard.py", "meshlm_reshard_tests")
helpers = reshard.helpers
BF16 = [*helpers.MODELS["dense"], "precision.dtype=bf16"]
RUNS = {
    "bf16 tp2xdp2 zero": BF16 + reshard.LAYOUTS["tp2xdp2"] + reshard.DIST_OPT,
    "bf16 tp2xdp2 zero async": BF16 + reshard.LAYOUTS["tp2xdp2"] + reshard.DIST_OPT + ["train.async_save=true"],
    "bf16 dp4": BF16 + reshard.LAYOUTS["dp4"],
}
RESUMED = [("bf16 tp2xdp2 zero", "bf16 tp2xdp2 zero"), ("bf16 tp2xdp2 zero", "bf16 dp4")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distributed-checkpoints")
    blend = helpers.write_tiny_corpus(root / "corpus")
    plan = [(name, None, overrides) for name, overrides in RUNS.items()]
    plan += [(f"{saved} -> {resumed}", saved, RUNS[resumed]) for saved, resumed in RESUMED]
    by_rank = run_distributed(reshard.train_recorded, 4, str(blend), str(root), plan, timeout_s=300)
    return {"root": root, "blend": blend, "by_rank": by_rank}


def test_asynchronous_save_writes_what_synchronous_save_writes(runs):
    for step in (3, 5):
        sync = read_global_tensors(runs["root"] / "bf16 tp2xdp2 zero" / "checkpoints" / f"step_{step}")
        background = read_global_tensors(runs["root"] / "bf16 tp2xdp2 zero async" / "checkpoints" / f"step_{step}")
        assert set(sync) == set(background) and any(key.startswith("master/") for key in sync)
        for key, value in sync.items():
            assert torch.equal(background[key], value), (step, key)
    for results in runs["by_rank"]:
        assert results["bf16 tp2xdp2 zero async"]["losses"] == results["bf16 tp2xdp2 zero"]["losses"]


def test_bf16_resume_at_the_same_layout_is_bitwise(runs):
    for results in runs["by_rank"]:
        again, whole = results["bf16 tp2xdp2 zero -> bf16 tp2xdp2 zero"], results["bf16 tp2xdp2 zero"]
        assert again["losses"] == {step: whole["losses"][step] for step in (4, 5)}
        for name, value in whole["params"].items():
            assert torch.equal(again["params"][name], value), name


def test_bf16_masters_and_moments_move_exactly_to_another_layout(runs):
    """ZeRO-1 segments of fp32 masters and moments at tp2 x dp2 -> whole masters at dp4 (no ZeRO):
    re-saved at dp4 they are bit for bit the saved ones; training continues the curve (bf16
    rounding differs between layouts, so the losses agree to bf16 precision)."""
    before = read_global_tensors(runs["root"] / "bf16 tp2xdp2 zero" / "checkpoints" / "step_3")
    after = read_global_tensors(runs["root"] / "bf16 tp2xdp2 zero -> bf16 dp4" / "checkpoints" / "step_3")
    assert set(before) == set(after)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    for results in runs["by_rank"]:
        again, whole = results["bf16 tp2xdp2 zero -> bf16 dp4"], results["bf16 dp4"]
        assert sorted(again["losses"]) == [4, 5]
        assert relative_error([again["losses"][s] for s in (4, 5)], [whole["losses"][s] for s in (4, 5)]) <= 1e-2


def resume_damaged(blend: str, root: str, source: str, cases: list[tuple[str, list[str]]]) -> list[str]:
    """In each spawned rank: for each (case, overrides), resume a copy of ``source``'s step-3
    checkpoint damaged as ``case`` says; return every rank's error message."""
    messages = []
    for case, overrides in cases:
        run_dir = Path(root) / f"damaged {case}"
        step = run_dir / "checkpoints" / "step_3"
        if dist.get_rank() == 0:
            shutil.copytree(Path(root) / source / "checkpoints" / "step_3", step)
            if case == "truncated shard":
                (step / "__1_0.distcp").write_bytes((step / "__1_0.distcp").read_bytes()[:1000])
            elif case == "flipped byte":
                data = bytearray((step / "__2_0.distcp").read_bytes())
                data[len(data) // 2] ^= 0xFF
                (step / "__2_0.distcp").write_bytes(bytes(data))
        dist.barrier()
        try:
            helpers.train_once(Path(blend), run_dir, overrides)
            messages.append("no error")
        except CheckpointError as error:
            messages.append(str(error))
    return messages


def test_damaged_or_foreign_checkpoints_fail_on_every_rank(runs):
    layout = RUNS["bf16 tp2xdp2 zero"]
    cases = [("truncated shard", layout), ("flipped byte", RUNS["bf16 dp4"]),
             ("other model", [*layout, "model.hidden_size=48"])]
    messages = run_distributed(resume_damaged, 4, str(runs["blend"]), str(runs["root"]), "bf16 tp2xdp2 zero", cases)
    for truncated, flipped, other in messages:  # every rank raised, with the same message
        assert "__1_0.distcp: 1000 bytes, but" in truncated and "truncated or overwritten" in truncated
        assert "__2_0.distcp: corrupted" in flipped
        assert "model.hidden_size: checkpoint 32 vs config 48" in other
    assert len({tuple(rank_messages) for rank_messages in messages}) == 1
