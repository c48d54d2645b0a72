"""``meshlm eval RUN --every-checkpoint`` (meshlm/evaluation/checkpoint_series.py): every checkpoint
scored as ``meshlm eval`` scores it alone, kept by step in RUN/evaluations.jsonl, not scored twice,
the same on two data-parallel ranks, and drawn by ``meshlm plot``."""

from __future__ import annotations

import argparse
import json

import pytest

from meshlm.cli import main
from meshlm.config import load_run_config
from meshlm.training.metrics import EVALUATIONS_FILE, read_metrics
from meshlm.training.trainer import train
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed

QUESTIONS = [{"context": f"t{start} t{start + 3}", "choices": [f"t{start + 6}", f"t{start + 7}", f"t{start + 1}"],
              "answer": 0} for start in range(0, 40, 4)]


def tiny_run(corpus_blend, run_dir, steps: int):
    overrides = ["model.vocab_size=64", "model.hidden_size=32", "model.pattern=*-", "model.num_attention_heads=4",
                 "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={steps}",
                 "train.log_every=1", "train.eval_every=0", "train.save_every=1", "train.keep_checkpoints=0",
                 "train.progress=false", "train.tensorboard=false", "train.plot=false", "train.device=cpu",
                 f"train.run_dir={run_dir}", f"data.blend={corpus_blend}", "optim.lr=1e-2", "optim.warmup_steps=0"]
    train(load_run_config(None, overrides))


@pytest.fixture(scope="module")
def run_and_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("series")
    blend = write_corpus(root / "corpus")
    tiny_run(blend, root / "run", steps=4)  # 4 checkpoints: more than the default train.keep_checkpoints keeps
    task = root / "counting.jsonl"
    task.write_text("".join(json.dumps(question) + "\n" for question in QUESTIONS))
    return blend, root / "run", task, root / "corpus" / "corpus"


def single_model_figures(checkpoint, task, store, capsys) -> list[dict]:
    assert main(["eval", str(checkpoint), "--task", str(task), "--data", str(store), "--json", "--device", "cpu"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_every_checkpoint_is_scored_as_alone_kept_by_step_and_never_twice(run_and_task, tmp_path, capsys):
    blend, run, task, store = run_and_task
    arguments = ["eval", str(run), "--every-checkpoint", "--task", str(task), "--data", str(store), "--device", "cpu"]
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "step 1: counting.jsonl" not in out and f"step 1: {task}: 10 questions" in out
    assert out.strip().endswith(f"4 checkpoint(s) evaluated, 0 already in {run / EVALUATIONS_FILE}")
    records = read_metrics(run / EVALUATIONS_FILE)
    assert [record["step"] for record in records] == [1, 2, 3, 4]  # train.keep_checkpoints=0 kept them all
    for record in records:
        alone = single_model_figures(record["checkpoint"], task, store, capsys)
        assert record["eval_corpus_loss"] == pytest.approx(alone[0]["loss"], rel=1e-12)
        assert record["eval_counting_acc"] == alone[1]["acc"]
        assert record["eval_counting_acc_norm"] == alone[1]["acc_norm"]
    assert records[0]["eval_corpus_loss"] != records[-1]["eval_corpus_loss"]  # the model changed between them
    assert main(arguments) == 0  # nothing new: nothing scored
    assert "0 checkpoint(s) evaluated, 4 already in" in capsys.readouterr().out
    assert len(read_metrics(run / EVALUATIONS_FILE)) == 4
    assert main([*arguments, "--seq-len", "8"]) == 0  # other settings: scored again, kept apart
    assert len(read_metrics(run / EVALUATIONS_FILE)) == 8
    capsys.readouterr()
    assert main(["plot", str(run), "--metric", "eval_counting_acc", "eval_corpus_loss",
                 "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_a_run_that_trained_on_is_scored_only_where_new(run_and_task, tmp_path, capsys):
    blend, _, task, _ = run_and_task
    run = tmp_path / "growing"
    tiny_run(blend, run, steps=1)
    arguments = ["eval", str(run), "--every-checkpoint", "--task", str(task), "--device", "cpu", "--json"]
    assert main(arguments) == 0
    tiny_run(blend, run, steps=2)  # resumed: one more checkpoint
    capsys.readouterr()
    assert main(arguments) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [record["step"] for record in printed] == [2]
    assert [record["step"] for record in read_metrics(run / EVALUATIONS_FILE)] == [1, 2]


def test_a_run_without_checkpoints_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty"), "--every-checkpoint", "--task", "x.jsonl"]) == 2
    assert "holds no checkpoints (checkpoints/step_N); --every-checkpoint takes a run directory" in \
        capsys.readouterr().err


def series_on_ranks(run: str, task: str, store: str) -> list[dict]:
    from meshlm.evaluation.checkpoint_series import evaluate_series

    args = argparse.Namespace(checkpoint=run, tokenizer=None, device="cpu", tp=1, seq_len=None, data=[store],
                              task=[task], text_key="text", append_eos=False, txt_documents="paragraph",
                              batch_size=3, json=True)
    evaluate_series(args)
    return read_metrics(f"{run}/{EVALUATIONS_FILE}")


def test_two_data_parallel_ranks_give_one_processs_figures(run_and_task, tmp_path, capsys):
    blend, _, task, store = run_and_task
    run = tmp_path / "dp"
    tiny_run(blend, run, steps=2)
    single = series_on_ranks(str(run), str(task), str(store))
    (run / EVALUATIONS_FILE).unlink()
    ranks = run_distributed(series_on_ranks, 2, str(run), str(task), str(store), timeout_s=300)
    assert ranks[0] == ranks[1] and len(ranks[0]) == 2  # rank 0 alone wrote, once per checkpoint
    for mine, theirs in zip(ranks[0], single):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert mine[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
