"""train.eval_per_dataset: each corpus of a blend gets its own validation loss, equal to the
validation loss of a run on that corpus alone, and the same on two tensor-parallel ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.errors import ConfigError
from meshlm.training.metrics import read_metrics
from meshlm.training.trainer import Trainer, train
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory) -> Path:
    """A blend of two counting corpora (different documents, one tokenizer), weighted 3:1."""
    root = tmp_path_factory.mktemp("two_corpora")
    write_corpus(root / "first", num_documents=60)
    write_corpus(root / "second", num_documents=90, max_length=40)
    (root / "second" / "tokenizer.json").unlink()  # one tokenizer for both, named by the blend
    blend = {"tokenizer": "first/tokenizer.json", "datasets": [{"prefix": "first/corpus", "weight": 3},
                                                               {"prefix": "second/corpus", "weight": 1}]}
    (root / "blend.json").write_text(json.dumps(blend))
    return root


def validation_records(run_dir: Path) -> list[dict]:
    return [record for record in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in record]


def test_each_corpus_loss_is_that_of_a_run_on_it_alone(make_config, two_corpora, tmp_path, capsys):
    blend = two_corpora / "blend.json"
    train(make_config(f"data.blend={blend}", "train.eval_per_dataset=true", "train.steps=2", "train.eval_every=2",
                      "optim.warmup_steps=1", f"train.run_dir={tmp_path / 'both'}"))
    records = validation_records(tmp_path / "both")
    assert [record["step"] for record in records] == [0, 2]
    assert all({"val_loss_corpus", "val_loss_corpus_2"} <= set(record) for record in records)  # same file names
    assert "validation loss" in (printed := capsys.readouterr().err) and "(corpus " in printed
    for name, corpus in (("val_loss_corpus", "first"), ("val_loss_corpus_2", "second")):
        alone = tmp_path / f"alone_{corpus}"
        train(make_config(f"data.prefixes=[{two_corpora / corpus / 'corpus'}]", "data.blend=null",
                          f"data.tokenizer={two_corpora / 'first' / 'tokenizer.json'}", "train.steps=1",
                          "train.eval_every=2", "optim.warmup_steps=0", f"train.run_dir={alone}"))
        assert records[0][name] == pytest.approx(validation_records(alone)[0]["val_loss"], rel=1e-12)
    assert records[0]["val_loss_corpus"] != records[0]["val_loss_corpus_2"]


def test_settings_that_give_no_corpus_losses_are_refused(make_config):
    with pytest.raises(ConfigError, match="train.eval_per_dataset: train.eval_every=0 computes no validation loss"):
        make_config("train.eval_per_dataset=true", "train.eval_every=0")
    with pytest.raises(ConfigError, match="train.eval_per_dataset: train.objective=dpo reads preference rows"):
        make_config("train.eval_per_dataset=true", "train.objective=dpo", "train.init_from=x")


def per_dataset_on_ranks(blend: str, run_dir: str, tp: int) -> dict:
    from tests.training.test_parallel_training import run_config
    trainer = Trainer(run_config(Path(blend), Path(run_dir), "train.eval_per_dataset=true", "train.steps=2",
                                 "train.eval_every=2", "optim.warmup_steps=1", f"parallel.tp={tp}"))
    trainer.run()
    return {record["step"]: {key: value for key, value in record.items() if key.startswith("val_loss")}
            for record in validation_records(Path(run_dir))} if trainer.context.is_logging_rank else {}


def test_two_tensor_parallel_ranks_give_one_processs_corpus_losses(two_corpora, tmp_path):
    single = per_dataset_on_ranks(str(two_corpora / "blend.json"), str(tmp_path / "single"), 1)
    ranks = run_distributed(per_dataset_on_ranks, 2, str(two_corpora / "blend.json"), str(tmp_path / "tp2"), 2,
                            timeout_s=300)
    assert single.keys() == ranks[0].keys() == {0, 2} and len(single[2]) == 3
    for step, losses in single.items():
        for key, value in losses.items():
            assert ranks[0][step][key] == pytest.approx(value, rel=1e-5), (step, key)
