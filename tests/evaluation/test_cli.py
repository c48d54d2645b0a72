"""``meshlm eval`` (``meshlm/evaluation/cli.py``): the printed numbers are those of the
evaluation functions; a run directory resolves to its newest checkpoint; mistakes print one line."""

import json
import shutil

import pytest

from meshlm.cli import main
from meshlm.evaluation.loading import load_for_evaluation
from meshlm.evaluation.multiple_choice import evaluate_task, read_task
from meshlm.evaluation.perplexity import evaluate_perplexity, open_sources


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["eval", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_matches_the_evaluation_functions(capsys, tmp_path, model_dir, text_file, store_prefix,
                                                      task_file):
    run = tmp_path / "run"
    shutil.copytree(model_dir, run / "checkpoints" / "step_7")  # a run directory: its newest step is used
    code, out, _ = run_cli(capsys, run, "--data", text_file, store_prefix, "--task", task_file,
                           "--seq-len", 16, "--batch-size", 2, "--json")
    assert code == 0
    text, store, total, task = [json.loads(line) for line in out.splitlines()]
    evaluation = load_for_evaluation(model_dir, device="cpu")
    expected = evaluate_perplexity(evaluation, open_sources([str(text_file), str(store_prefix)],
                                                            evaluation.tokenizer), 16, 2)
    assert text == expected[0].to_dict() and store == expected[1].to_dict()
    assert total["data"] == "all" and total["tokens"] == text["tokens"] + store["tokens"]
    assert task == evaluate_task(evaluation, read_task(task_file), 16, 2, name=str(task_file)).to_dict()


def test_text_output(capsys, model_dir, text_file, task_file):
    code, out, _ = run_cli(capsys, model_dir, "--data", text_file, "--task", task_file, "--seq-len", 16)
    assert code == 0
    data_line, task_line = out.splitlines()
    assert data_line.startswith(f"{text_file}: ") and " tokens  loss " in data_line and " bits/byte " in data_line
    assert task_line.startswith(f"{task_file}: 8 questions  acc ") and " ± " in task_line and "acc_norm" in task_line


@pytest.mark.parametrize("arguments, message", [
    (["--data", "{tmp}/missing"], "{tmp}/missing: no such token store"),
    (["--task", "{tmp}/missing.jsonl"], "{tmp}/missing.jsonl: no such task file"),
    ([], "nothing to evaluate; pass --data"),
    (["--data", "{text}", "--tp", "2"], "--tp 2 does not divide the 1 processes started"),
])
def test_mistakes_print_one_line(capsys, tmp_path, model_dir, text_file, arguments, message):
    arguments = [argument.format(tmp=tmp_path, text=text_file) for argument in arguments]
    code, out, err = run_cli(capsys, model_dir, *arguments)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("meshlm eval: error: ")
    assert message.format(tmp=tmp_path) in err
