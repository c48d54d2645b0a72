"""``meshlm/evaluation/lm_eval_adapter.py``: lm-evaluation-harness runs a meshlm model.

A local task (``fixtures/meshlm_tiny_choice.yaml``, its data a JSON-lines file: nothing is
downloaded) run by the harness gives the accuracy ``meshlm eval --task`` gives on the same
questions; the rolling log-likelihood is the text's log-probability from plain forwards; the
generations are ``meshlm.inference.generate``'s greedy tokens, cut at the stop string."""

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install 'meshlm[eval]'")

import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from meshlm.checkpoint.model_files import load_model  # noqa: E402
from meshlm.evaluation.lm_eval_adapter import MeshLM, cut_at_stops, main  # noqa: E402
from meshlm.evaluation.loading import load_for_evaluation  # noqa: E402
from meshlm.evaluation.multiple_choice import evaluate_task, read_task  # noqa: E402
from meshlm.inference.generate import generate  # noqa: E402
from meshlm.inference.sampling import SamplingConfig  # noqa: E402
from tests.evaluation.reference import PARAGRAPHS, TASK_FILE, harness_on_ranks  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network; the harness's dataset cache in a temporary folder; only the tasks of
    ``--include_path`` indexed (indexing the ~14,000 built-in task files takes 20 s and more)."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.chdir(REPOSITORY)  # the task's data_files path is relative to the repository root
    import datasets
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    index_everything = TaskManager.__init__

    def index_included_tasks_only(self, *args, **kwargs):
        index_everything(self, *args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(TaskManager, "__init__", index_included_tasks_only)


def test_harness_accuracy_equals_meshlm_eval(offline, model_dir, tmp_path, monkeypatch):
    """Through the command-line wrapper (``python -m meshlm.evaluation.lm_eval_adapter``)."""
    monkeypatch.setattr("sys.argv", ["pytest"])  # the wrapper hands the harness its arguments in sys.argv
    main(["--model_args", f"path={model_dir},max_length=32", "--tasks", "meshlm_tiny_choice",
          "--include_path", str(FIXTURES), "--batch_size", "3", "--output_path", str(tmp_path / "out")])
    [results_file] = (tmp_path / "out").rglob("results*.json")
    harness = json.loads(results_file.read_text())["results"]["meshlm_tiny_choice"]
    ours = evaluate_task(load_for_evaluation(model_dir, device="cpu"), read_task(TASK_FILE), 32, 5)
    assert ours.questions == 8 and 0 < ours.acc < 1
    assert harness["acc,none"] == ours.acc
    assert harness["acc_norm,none"] == ours.acc_norm
    assert harness["acc_stderr,none"] == pytest.approx(ours.acc_stderr, rel=1e-12)
    assert harness["acc_norm_stderr,none"] == pytest.approx(ours.acc_norm_stderr, rel=1e-12)


def test_rolling_loglikelihood_is_the_texts_log_probability(model_dir):
    adapter = MeshLM(path=str(model_dir), max_length=16, batch_size=2)
    texts = [PARAGRAPHS[0], " ".join(PARAGRAPHS)]
    scores = adapter.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), index)
                                            for index, text in enumerate(texts)])
    model, eos = load_model(model_dir), adapter.tokenizer.eos_token_id
    for text, score in zip(texts, scores):
        tokens = adapter.tokenizer.encode(text, add_special_tokens=False)
        windows = [make_disjoint_window(window) for window in get_rolling_token_windows(tokens, eos, 16, 1)]
        assert sum(len(continuation) for _, continuation in windows) == len(tokens)  # each token scored once
        expected = sum(continuation_loglikelihood(model, context, continuation) for context, continuation in windows)
        assert score == pytest.approx(expected, rel=1e-5)
    assert len(windows) > 3


@torch.no_grad()
def continuation_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) from one plain forward over the whole window."""
    whole = context + continuation
    logprobs = torch.log_softmax(model(torch.tensor(whole[:-1])[None]).logits[0].double(), dim=-1)
    return sum(float(logprobs[t - 1, whole[t]]) for t in range(len(context), len(whole)))


def test_generation_is_greedy_decoding_cut_at_the_stop_string(model_dir):
    adapter = MeshLM(path=str(model_dir), batch_size=2)
    contexts = ["the cat sat", "a café", "the dog"]
    settings = {"until": ["."], "max_gen_toks": 6}
    outputs = adapter.generate_until([Instance("generate_until", {}, (context, settings), index)
                                      for index, context in enumerate(contexts)])
    tokenizer, model = adapter.tokenizer, load_model(model_dir)
    prompts = [tokenizer.encode(context, add_special_tokens=False) for context in contexts]
    expected = generate(model, prompts, 6, SamplingConfig(greedy=True), eos_token_id=tokenizer.eos_token_id,
                        valid_vocab_size=tokenizer.vocab_size)
    assert outputs == [cut_at_stops(tokenizer.decode(ids), ["."]) for ids in expected]
    assert cut_at_stops("ab. cd\n", ["\n", "."]) == "ab"


def test_two_ranks_split_the_requests_and_agree(model_dir):
    """Under torchrun the harness splits the requests over the ranks and gathers the results
    through the adapter's collectives; the numbers are those of one process."""
    ranks = run_distributed(harness_on_ranks, 2, str(model_dir), str(FIXTURES), str(REPOSITORY))
    assert ranks[1] is None
    ours = evaluate_task(load_for_evaluation(model_dir, device="cpu"), read_task(TASK_FILE), 32, 5)
    assert ranks[0]["acc,none"] == ours.acc and ranks[0]["acc_norm,none"] == ours.acc_norm
    assert ranks[0]["acc_stderr,none"] == pytest.approx(ours.acc_stderr, rel=1e-12)
