"""Fixtures for the RL tests: a character-level chat tokenizer and a tiny model folder to start from.

The tokenizer knows digits, lower-case letters, 'W', spaces, newlines and '+-*?=.' one character
per token, plus the chat markers of meshlm's default template (``<|user|>``, ``<|assistant|>``,
``<|end|>``, ...), so "What is 17 + 25?" renders as a chat prompt and replies decode to text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.model_files import save_model
from meshlm.config import load_run_config
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from tests.helpers.chat_tokenizers import write_char_tokenizer

MODEL = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, ffn_hidden_size=64)


@pytest.fixture(scope="session")
def policy_folder(tmp_path_factory) -> Path:
    """A randomly initialized tiny model (2 attention + 2 MLP blocks) with the character tokenizer."""
    root = tmp_path_factory.mktemp("policy")
    write_char_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    return save_model(LanguageModel(ModelConfig(**MODEL), seed=3), root / "model", tokenizer_dir=root / "tokenizer")


def rl_overrides(policy: Path, run_dir: Path, *extra: str) -> list[str]:
    """A tiny fp32 CPU RL run from ``policy``: 2 prompts x 4 completions a step, 6 new tokens."""
    model = [f"model.{key}={value}" for key, value in MODEL.items()]
    return [*model, f"train.init_from={policy}", f"train.run_dir={run_dir}", "train.steps=2", "train.seq_len=64",
            "train.micro_batch_size=4", "train.log_every=1", "train.eval_every=0", "train.save_every=2",
            "train.progress=false", "train.tensorboard=false", "train.plot=false", "train.device=cpu",
            "precision.dtype=fp32", "optim.lr=1e-2", "optim.warmup_steps=0", "optim.schedule=constant",
            "optim.weight_decay=0", "rl.group_size=4", "rl.prompts_per_step=2", "rl.max_new_tokens=6",
            "rl.eval_prompts=8", "data.blend=null", *extra]


@pytest.fixture
def make_rl_config(policy_folder, tmp_path):
    def make(*extra: str):
        return load_run_config(None, rl_overrides(policy_folder, tmp_path / "run", *extra))

    return make
