"""Checkpoints saved at one layout resume at another: tp2 x dp2 <-> dp4, ZeRO-1 at tp2 x dp2 ->
tp4, Mamba and MoE shards, vocabulary padding, bf16 masters; same-layout resume is bitwise.

Every run trains 5 steps of 4 micro-batches and saves at step 3 (``run_config`` of
``tests/training/test_parallel_training.py``, whose helpers are reused). For each pair (A, B),
A's step-3 checkpoint is copied into a new run at layout B, which loads it, re-saves it at B
(before training on), and trains steps 4-5. Checked:

* steps 4-5 (losses, global grad norms, final validation loss, final parameters) equal the
  uninterrupted run at B (relative error <= 1e-5 in fp32) -- and at the same layout bitwise;
* the re-saved checkpoint holds exactly the tensors of A's (every weight, master and moment),
  so nothing is lost or moved in the reshard;
* the samples read: steps 1-3 at A and 4-5 at B cover sample indices 0..39 once each (one
  TP rank per DP rank counted): a change of the DP size neither repeats nor skips data.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshlm.checkpoint.whole_tensors import read_global_tensors
from tests.helpers.distributed import import_test_file, run_distributed


helpers = import_test_file(Path(__file__).parents[1] / "training" / "test_parallel_training.py",
                           "meshlm_parallel_training_helpers")
MODELS = helpers.MODELS
PADDED = ["parallel.vocab_pad_multiple=3"]  # 64 -> 66 rows at tp2: padding rows inside the shards
DIST_OPT = ["parallel.distributed_optimizer=true"]
LAYOUTS = {
    "tp2xdp2": ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true"],
    "dp4": ["parallel.dp=4"],
    "tp4": ["parallel.tp=4", "parallel.sp=true"],
}
BF16 = ["precision.dtype=bf16"]
RUNS = {  # name: overrides (every run saves at step 3)
    "hybrid tp2xdp2": MODELS["hybrid"] + LAYOUTS["tp2xdp2"],
    "hybrid dp4": MODELS["hybrid"] + LAYOUTS["dp4"],
    "moe tp2xdp2 zero": MODELS["moe"] + LAYOUTS["tp2xdp2"] + DIST_OPT,
    "moe dp4": MODELS["moe"] + LAYOUTS["dp4"],
    "dense dp4": MODELS["dense"] + LAYOUTS["dp4"],
    "dense tp2xdp2 padded": MODELS["dense"] + LAYOUTS["tp2xdp2"] + PADDED,
    "dense tp2xdp2 zero padded": MODELS["dense"] + LAYOUTS["tp2xdp2"] + DIST_OPT + PADDED,
    "dense tp4 zero": MODELS["dense"] + LAYOUTS["tp4"] + DIST_OPT,
}
RESHARDS = [  # (saved by, resumed at): resumed at B must continue the uninterrupted run at B
    ("hybrid tp2xdp2", "hybrid dp4"),
    ("moe tp2xdp2 zero", "moe dp4"),
    ("dense dp4", "dense tp2xdp2 padded"),
    ("dense tp2xdp2 zero padded", "dense tp4 zero"),
    ("dense tp2xdp2 zero padded", "dense tp2xdp2 zero padded"),  # the same layout: bitwise
]


class RecordingDataset(torch.utils.data.Dataset):
    """The training dataset, remembering which sample indices this rank read, in order."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.read.append(int(index))
        return self.dataset[index]


@contextmanager
def recording_and_resaving(resave: bool):
    """Inside: the trainer's training data records its reads; with ``resave``, a Trainer's run()
    first saves the checkpoint it resumed from again, at its own layout."""
    from meshlm.training import trainer as trainer_module

    build, run, datasets = trainer_module.build_training_data, trainer_module.Trainer.run, []

    def recording_build(config):
        data = build(config)
        data.train = RecordingDataset(data.train)
        datasets.append(data.train)
        return data

    def resaving_run(self):
        if resave:
            self.checkpoints.save(self.state, self.training_parts())
        return run(self)

    trainer_module.build_training_data, trainer_module.Trainer.run = recording_build, resaving_run
    try:
        yield datasets
    finally:
        trainer_module.build_training_data, trainer_module.Trainer.run = build, run


def train_recorded(blend: str, root: str, runs: list[tuple[str, str | None, list[str]]]) -> dict:
    """In each spawned rank: for each (name, resumed from run or None, overrides), train in root/name
    and return helpers.train_once's result plus the sample indices read (by the last Trainer built)."""
    results = {}
    for name, source, overrides in runs:
        run_dir = Path(root) / name
        if source is not None and dist.get_rank() == 0:
            shutil.copytree(Path(root) / source / "checkpoints" / "step_3", run_dir / "checkpoints" / "step_3")
        dist.barrier()
        with recording_and_resaving(resave=source is not None) as datasets:
            result = helpers.train_once(Path(blend), run_dir, [*overrides, "train.save_every=3"])
        results[name] = {**result, "read": datasets[-1].read, "rank": dist.get_rank()}
    return results


def train_reshard_plan(root: Path, runs: dict[str, list[str]], reshards: list[tuple[str, str]]) -> dict:
    """In 4 spawned ranks: every run of ``runs`` (name: overrides; each saves at step 3), then for
    each (A, B) of ``reshards`` A's step-3 checkpoint resumed at B's overrides. The module fixture
    of this file and of the other reshard tests: {root, blend, by_rank}."""
    blend = helpers.write_tiny_corpus(root / "corpus")
    plan = [(name, None, overrides) for name, overrides in runs.items()]
    plan += [(f"{saved} -> {resumed}", saved, runs[resumed]) for saved, resumed in reshards]
    by_rank = run_distributed(train_recorded, 4, str(blend), str(root), plan, timeout_s=400)
    return {"root": root, "blend": blend, "by_rank": by_rank}


def assert_resumed_continues(runs: dict, saved: str, resumed: str, bitwise: bool = False) -> None:
    """On every rank, A's checkpoint resumed at B trains steps 4-5 as the uninterrupted run at B
    (``bitwise``: the same losses, gradient norms and parameters exactly, as at the same layout)."""
    for rank, results in enumerate(runs["by_rank"]):
        again, reference = results[f"{saved} -> {resumed}"], helpers.continued(results[resumed])
        assert sorted(again["losses"]) == [4, 5]
        helpers.assert_same_run(again, reference, f"{saved} -> {resumed} rank {rank}")
        if bitwise:
            assert again["losses"] == reference["losses"] and again["grad_norms"] == reference["grad_norms"]
            for name, value in reference["params"].items():
                assert torch.equal(again["params"][name], value), name


def resaved_tensors(runs: dict, saved: str, resumed: str) -> tuple[dict, dict]:
    """(A's step-3 checkpoint, the same re-saved at B before training on), as whole tensors by key;
    asserted to hold the same keys."""
    before = read_global_tensors(runs["root"] / saved / "checkpoints" / "step_3")
    after = read_global_tensors(runs["root"] / f"{saved} -> {resumed}" / "checkpoints" / "step_3")
    assert set(before) == set(after)
    return before, after


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return train_reshard_plan(tmp_path_factory.mktemp("reshard"), RUNS, RESHARDS)


@pytest.mark.parametrize("saved, resumed", RESHARDS)
def test_resumed_run_continues_the_uninterrupted_run(runs, saved, resumed):
    assert_resumed_continues(runs, saved, resumed, bitwise=saved == resumed)


@pytest.mark.parametrize("saved, resumed", RESHARDS)
def test_resaving_at_the_new_layout_keeps_every_tensor(runs, saved, resumed):
    before, after = resaved_tensors(runs, saved, resumed)
    assert any(key.startswith("optim/") for key in before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key


def first_of_tp_group(rank: int, overrides: list[str]) -> bool:
    """Whether ``rank`` is TP rank 0 (TP groups are adjacent ranks): one reader per DP rank."""
    tp = next((int(item.split("=")[1]) for item in overrides if item.startswith("parallel.tp=")), 1)
    return rank % tp == 0


@pytest.mark.parametrize("saved, resumed", RESHARDS[:4])
def test_samples_are_read_once_across_a_change_of_dp_size(runs, saved, resumed):
    steps_saved, per_step, world = 3, 8, 4
    tp_saved = next((int(item.split("=")[1]) for item in RUNS[saved] if item.startswith("parallel.tp=")), 1)
    read = []
    for results in runs["by_rank"]:
        first, second = results[saved], results[f"{saved} -> {resumed}"]
        if first_of_tp_group(first["rank"], RUNS[saved]):  # its reads of steps 1-3
            read += first["read"][:steps_saved * per_step // (world // tp_saved)]
        if first_of_tp_group(second["rank"], RUNS[resumed]):  # steps 4-5
            read += second["read"]
    assert sorted(read) == list(range(5 * per_step))
