"""What the evaluation tests compare against: a tiny model and tokenizer, and the quantities
``meshlm/evaluation`` computes, computed here the plain way (whole-sequence forwards of the
model, ``F.cross_entropy`` and ``log_softmax`` on full logits), plus the function the
multi-process tests run on every rank.

Imported by the test files as ``tests.evaluation.reference`` (pytest's importlib mode does not
let test files import each other); spawned ranks import it by the same name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshlm.checkpoint.model_files import save_model
from meshlm.data.indexed import TokenStoreWriter
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

PARAGRAPHS = [
    "the cat sat on the mat. the dog sat on the log.",
    "a café in the town sold bread, cheese and naïve little cakes.",
    "the cat and the dog are friends; they walk to the café every day.",
    "on the mat the cat slept, and the dog watched the door.",
    "bread and cheese for the dog, cakes for the cat.",
]
"""Held-out text: five documents (two with non-ASCII letters, so bytes and characters differ)."""

TASK_FILE = Path(__file__).parent / "fixtures" / "tiny_choice.jsonl"
"""Eight multiple-choice questions, read by ``meshlm eval --task`` and by the lm-evaluation-harness
task ``fixtures/meshlm_tiny_choice.yaml``."""
QUESTIONS = [json.loads(line) for line in TASK_FILE.read_text(encoding="utf-8").splitlines()]


def train_tokenizer(directory: Path) -> Path:
    """A byte-level BPE of 300 ids (with an end-of-text token) trained on the paragraphs."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(PARAGRAPHS * 4, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    return directory


def tiny_config() -> ModelConfig:
    """Attention, MLP and Mamba-2 blocks; vocab 320 > the tokenizer's 300 (a padded vocabulary)."""
    return ModelConfig(vocab_size=320, hidden_size=32, pattern="*-M-", num_attention_heads=4, num_kv_heads=2,
                       mamba_num_heads=4, mamba_head_dim=16, mamba_state_size=16, mamba_num_groups=2,
                       mamba_chunk_size=8, init_std=0.1)


def save_tiny_model(directory: Path, tokenizer_dir: Path | None, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    return save_model(LanguageModel(tiny_config(), seed=seed), directory, tokenizer_dir=tokenizer_dir)


def write_store(prefix: Path, documents: list[list[int]], vocab_size: int = 300) -> Path:
    with TokenStoreWriter(prefix, vocab_size=vocab_size) as writer:
        for document in documents:
            writer.add_document(np.asarray(document))
    return prefix


@torch.no_grad()
def forward_nll(model, tokens: list[int], seq_len: int) -> tuple[float, int]:
    """(summed loss, tokens predicted) over non-overlapping windows, from the model's own loss."""
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, seq_len):
        window = torch.tensor(tokens[start:start + seq_len + 1])[None]
        output = model(window[:, :-1], window[:, 1:])
        total += float(output.losses["lm"]) * (window.shape[1] - 1)
        count += window.shape[1] - 1
    return total, count


@torch.no_grad()
def choice_loglikelihood(model, tokenizer, context: str, choice: str) -> float:
    """log p(" " + choice | context), from one forward over the whole string."""
    whole = tokenizer.encode(context + " " + choice, add_special_tokens=False)
    context_length = len(tokenizer.encode(context, add_special_tokens=False))
    logprobs = F.log_softmax(model(torch.tensor(whole[:-1])[None]).logits[0].double(), dim=-1)
    return sum(float(logprobs[t - 1, whole[t]]) for t in range(context_length, len(whole)))


def evaluate_on_ranks(model_dir: str, data: list[str], task: str, tp: int, seq_len: int, batch_size: int) -> dict:
    """Run on every rank of a ``run_distributed`` world: perplexity of ``data`` and the task."""
    from meshlm.evaluation.loading import load_for_evaluation
    from meshlm.evaluation.multiple_choice import evaluate_task, read_task
    from meshlm.evaluation.perplexity import evaluate_perplexity, open_sources

    evaluation = load_for_evaluation(model_dir, tp=tp, device="cpu")
    perplexity = evaluate_perplexity(evaluation, open_sources(data, evaluation.tokenizer), seq_len, batch_size)
    task_result = evaluate_task(evaluation, read_task(task), seq_len, batch_size)
    return {"perplexity": [result.to_dict() for result in perplexity], "task": task_result.to_dict(with_scores=True),
            "tp_size": evaluation.context.tp_size, "dp_size": evaluation.context.dp_size}


def harness_on_ranks(model_dir: str, fixtures: str, repository: str) -> dict | None:
    """Run on every rank: lm-evaluation-harness on the local task, offline, the requests split
    over the ranks by the harness; rank 0 returns the task's metrics, the others None."""
    import os

    import lm_eval
    from lm_eval.tasks import TaskManager

    import meshlm.evaluation.lm_eval_adapter  # noqa: F401  (registers the "meshlm" model type)

    saved_directory, saved_environment = os.getcwd(), dict(os.environ)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    os.chdir(repository)  # the task's data_files path is relative to the repository root
    try:
        results = lm_eval.simple_evaluate(model="meshlm", model_args={"path": model_dir, "max_length": 32},
                                          tasks=["meshlm_tiny_choice"], batch_size=3,
                                          task_manager=TaskManager(include_path=fixtures, include_defaults=False))
    finally:
        os.chdir(saved_directory)
        os.environ.clear()
        os.environ.update(saved_environment)
    return None if results is None else results["results"]["meshlm_tiny_choice"]
