"""Learned absolute positions (``model.position_embedding=learned``; meshlm/models/position_embedding.py):
the table's rows reach the logits; packed documents restart their positions; cached generation,
left padding, chunked prefill and the decode step read the positions the full forward reads; the
table is not weight-decayed; and too-long sequences and bad settings are refused by field."""

from __future__ import annotations

import pytest
import torch

from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.optim.adamw import decays
from tests.helpers.cached_decoding import (PROMPTS, assert_cached_generation_equals_the_full_forward,
                                           assert_decode_step_equals_the_cached_forward)

GPT2_STYLE = dict(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4, position_embedding="learned",
                  max_position_embeddings=40, norm="layernorm", attention_bias=True, mlp_bias=True,
                  mlp_activation="gelu_tanh", tie_embeddings=True)


def tiny_model(**overrides) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**{**GPT2_STYLE, **overrides})).eval()
    with torch.no_grad():  # a trained table's rows are far apart (a fresh one's are all ~0.02)
        model.position_embedding.weight.normal_(0.0, 0.5)
    return model


def test_the_table_rows_reach_the_logits_at_each_tokens_position():
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        model.position_embedding.weight[5:].normal_(0.0, 0.5)  # new rows from position 5 on
        after = model(ids).logits
    torch.testing.assert_close(after[:, :5], before[:, :5])  # causal: earlier positions see none of it
    assert (after[:, 5:] - before[:, 5:]).abs().max() > 0.1


def test_packed_documents_restart_their_positions():
    model = tiny_model()
    first, second = torch.randint(0, 97, (1, 7)), torch.randint(0, 97, (1, 9))
    documents = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        packed = model(torch.cat([first, second], dim=1), document_ids=documents).logits
        alone = torch.cat([model(first).logits, model(second).logits], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_cached_generation_equals_the_full_forward():
    assert_cached_generation_equals_the_full_forward(tiny_model())  # left padding: each row's positions from 0


def test_the_decode_step_adds_each_rows_position():
    assert_decode_step_equals_the_cached_forward(tiny_model())


def test_the_table_is_an_embedding_not_decayed():
    model = tiny_model()
    assert not decays("position_embedding.weight", model.position_embedding.weight)
    assert decays("blocks.0.mixer.q_proj.weight", model.blocks[0].mixer.q_proj.weight)


def test_longer_sequences_than_the_table_are_refused_by_field():
    with pytest.raises(ConfigError, match=r"train.seq_len=64 needs 64 positions.*model.max_position_embeddings=40"):
        load_run_config(None, [f"model.{key}={value}" for key, value in GPT2_STYLE.items() if key != "pattern"]
                        + ["model.pattern=*-*-", "train.seq_len=64"])
    with pytest.raises(ConfigError, match="a prompt of 12 tokens and max_new_tokens=30 needs 42 positions"):
        generate(tiny_model(), PROMPTS, 30, SamplingConfig(greedy=True))


@pytest.mark.parametrize("fields, message", [
    ({"max_position_embeddings": None}, "model.position_embedding=learned needs model.max_position_embeddings"),
    ({"max_position_embeddings": 0}, "needs model.max_position_embeddings, .* got 0"),
    ({"position_embedding": "rope"}, "model.max_position_embeddings=40 is the length of a learned position table"),
    ({"mtp_depth": 1}, "model.mtp_depth=1 with model.position_embedding=learned"),
])
def test_bad_settings_are_refused_by_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**GPT2_STYLE, **fields})
