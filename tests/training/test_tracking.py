"""W&B tracking (meshlm/training/tracking.py): a real offline wandb run, read back from its .wandb file.

wandb 0.31 has no Python reader for the run files its Go core writes, so ``wandb_records`` reads
the format directly: a 7-byte header (``:W&B``, magic, version), then LevelDB-log records (32 KiB
blocks, each chunk: CRC32, length, type FULL/FIRST/MIDDLE/LAST) holding wandb's own protobuf
``Record`` messages.
"""

from __future__ import annotations

import ast
import json
import struct
import sys
import time
from pathlib import Path

import pytest

import meshlm
from meshlm.errors import ConfigError
from meshlm.training.metrics import read_metrics
from meshlm.training.tracking import RUN_ID_FILE, read_run_id
from meshlm.training.trainer import Trainer, train

pytest.importorskip("wandb")

BLOCK = 32768
FULL, LAST = 1, 4


def wandb_records(path: Path):
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            yield Record.FromString(pending)
            pending = b""


def history_row(record) -> dict:
    """One history record as a dict; an image's fields (nested keys) as a dict of their own."""
    row = {}
    for item in record.history.item:
        *parents, name = list(item.nested_key) or [item.key]
        place = row
        for parent in parents:
            place = place.setdefault(parent, {})
        place[name] = json.loads(item.value_json)
    return row


def finished_records(run_file: Path, timeout: float = 30.0) -> list:
    """The run file's records once wandb-core has written the last one (``exit``): run.finish()
    in offline mode can return while the core is still writing."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(run_file))
        if records and records[-1].WhichOneof("record_type") == "exit" or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def read_offline_run(run_dir: Path) -> dict:
    """The one offline run under RUN_DIR/wandb: id, name, project, config and history rows."""
    (run_file,) = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    records = finished_records(run_file)
    (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    history = [history_row(record) for record in records if record.WhichOneof("record_type") == "history"]
    exit_code = records[-1].exit.exit_code
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    return {"id": run.run_id, "name": run.display_name, "project": run.project, "config": config,
            "history": history, "dir": run_file.parent, "exit_code": exit_code}


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    """wandb offline, with everything it writes outside the run directory kept in tmp_path."""
    for variable, folder in (("WANDB_DIR", "dir"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                             ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home" / folder))
    monkeypatch.setenv("WANDB_MODE", "offline")


class SimulatedCrash(RuntimeError):
    pass


def test_offline_run_gets_config_metrics_and_plot_and_a_resume_continues_it(make_config, offline_wandb,
                                                                             monkeypatch, tmp_path, capsys):
    config = make_config("train.steps=4", "train.save_every=2", "train.eval_every=2", "train.plot=true",
                         "train.wandb=true", "train.wandb_project=tiny")
    run_dir = Path(config.train.run_dir)
    original = Trainer.after_step

    def crash_after_step_3(self, *args):
        original(self, *args)
        if self.state.step == 3:
            raise SimulatedCrash("killed after step 3")

    with monkeypatch.context() as patch:  # steps 1-3 logged; the checkpoint is at step 2
        patch.setattr(Trainer, "after_step", crash_after_step_3)
        with pytest.raises(SimulatedCrash):
            train(config)
    first = read_offline_run(run_dir)
    assert read_run_id(run_dir) == first["id"] and not (run_dir / (RUN_ID_FILE + ".tmp")).exists()
    assert first["name"] == "run" and first["project"] == "tiny"  # the run directory's name
    assert first["config"]["train"]["steps"] == 4 and first["config"]["model"]["hidden_size"] == 32
    assert first["config"]["precision"]["dtype"] == "fp32"  # resolved from auto
    assert first["exit_code"] == 1  # the crash marks the W&B run failed
    assert f"meshlm train: W&B run tiny/run (id {first['id']}), offline in {first['dir']}" in capsys.readouterr().err

    for path in run_dir.glob("wandb/offline-run-*"):  # keep the crashed process's files aside
        path.rename(tmp_path / path.name)
    result = train(config)
    assert sorted(result.losses) == [3, 4]  # resumed from the step-2 checkpoint
    resumed = read_offline_run(run_dir)
    assert resumed["id"] == first["id"] and resumed["exit_code"] == 0  # the same W&B run, continued and finished

    # Every number metrics.jsonl holds, under TensorBoard's names, against our own step metric.
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r]
    logged = {(row["step"], tag): value for row in first["history"] + resumed["history"]
              for tag, value in row.items() if not tag.startswith("_") and tag != "step"}
    for record in records:
        for key, value in record.items():
            tag = "valid/loss" if key == "val_loss" else f"loss/{key[5:]}" if key.startswith("loss_") else f"train/{key}"
            if key != "step" and not isinstance(value, (bool, list)):
                assert logged[(record["step"], tag)] == pytest.approx(value, rel=1e-12), (record["step"], tag)
    last_train = [row for row in resumed["history"] if "train/loss" in row][-1]
    assert last_train["step"] == 4 and last_train["train/loss"] == pytest.approx(result.losses[4], rel=1e-12)
    assert [row["step"] for row in first["history"] if "train/loss" in row] == [1, 2, 3]
    assert [row["step"] for row in resumed["history"] if "valid/loss" in row] == [4]

    # loss.png, last, as an image of the final step.
    plot_row = resumed["history"][-1]
    assert plot_row["step"] == 4 and plot_row["plots/loss"]["_type"] == "image-file"
    assert (resumed["dir"] / "files" / plot_row["plots/loss"]["path"]).stat().st_size > 1000


def test_wandb_missing_is_one_clear_sentence(make_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ConfigError, match=r"train.wandb=true needs the wandb package: pip install meshlm\[tracking\] "
                                          r"\(or pip install wandb\), or set train.wandb=false\."):
        Trainer(make_config("train.wandb=true"))


def import_time_imports(tree: ast.Module):
    """The import statements a module runs when imported (those inside functions run later)."""
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or ""
        nodes.extend(ast.iter_child_nodes(node))


def test_wandb_is_imported_only_inside_functions():
    """No module of meshlm imports wandb when it is imported: a run without train.wandb never loads it."""
    package = Path(meshlm.__file__).parent
    found = [f"{path.relative_to(package)}: {name}" for path in sorted(package.rglob("*.py"))
             for name in import_time_imports(ast.parse(path.read_text())) if name.split(".")[0] == "wandb"]
    assert found == []
    tracking = ast.parse((package / "training" / "tracking.py").read_text())
    assert "wandb" in {alias.name for node in ast.walk(tracking) if isinstance(node, ast.Import) for alias in node.names}
