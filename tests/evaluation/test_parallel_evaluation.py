"""Evaluation under torchrun (``meshlm/evaluation/loading.py``): two data-parallel ranks, and one
tensor-parallel pair, give the perplexity and the multiple-choice scores of one process.

Real gloo processes (``tests/helpers/distributed.py``). The ranks batch different windows and
answers than one process does, so sums may differ in the last bits: compared to 1e-6."""

import pytest

from tests.evaluation.reference import evaluate_on_ranks
from tests.helpers.distributed import run_distributed

SEQ_LEN, BATCH_SIZE = 16, 3


@pytest.fixture(scope="module")
def single_process(model_dir, text_file, store_prefix, task_file):
    arguments = (str(model_dir), [str(text_file), str(store_prefix)], str(task_file))
    return arguments, evaluate_on_ranks(*arguments, tp=1, seq_len=SEQ_LEN, batch_size=BATCH_SIZE)


def assert_same_results(ranks: list[dict], reference: dict) -> None:
    for result in ranks:
        for got, expected in zip(result["perplexity"], reference["perplexity"], strict=True):
            assert (got["tokens"], got["bytes"]) == (expected["tokens"], expected["bytes"])
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
            assert got["bits_per_byte"] == pytest.approx(expected["bits_per_byte"], rel=1e-6)
        for got, expected in zip(result["task"]["loglikelihoods"], reference["task"]["loglikelihoods"], strict=True):
            assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
        for name in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
            assert result["task"][name] == reference["task"][name]


@pytest.mark.parametrize("tp", [1, 2], ids=["data-parallel", "tensor-parallel"])
def test_two_ranks_equal_one_process(single_process, tp):
    arguments, reference = single_process
    ranks = run_distributed(evaluate_on_ranks, 2, *arguments, tp=tp, seq_len=SEQ_LEN, batch_size=BATCH_SIZE)
    assert [(result["tp_size"], result["dp_size"]) for result in ranks] == [(tp, 2 // tp)] * 2
    assert_same_results(ranks, reference)
