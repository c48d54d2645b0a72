"""``model.head=reward`` (meshlm/models/reward_head.py): a linear map of the normed last token, no LM head.

The scores equal a hand computation from the model's own pieces; the model has no logits (its
forward, generation and Hugging Face export are refused in one sentence); it saves and loads
like any model; bad head settings are refused naming the field.
"""

from __future__ import annotations

import pytest
import torch

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.errors import ConfigError
from meshlm.hf.convert import export_hf
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.models.reward_head import last_token_rewards

CONFIG = dict(vocab_size=32, hidden_size=32, pattern="*-", num_attention_heads=4, head="reward",
              reward_attributes=["helpfulness", "correctness", "verbosity"])


def test_scores_are_the_head_at_each_row_s_last_token_after_the_final_norm():
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**CONFIG), seed=1)
    assert model.output is None and tuple(model.reward_head.weight.shape) == (3, 32)
    input_ids = torch.randint(0, 32, (3, 10))
    last_index = torch.tensor([9, 4, 0])
    context = SequenceContext.for_tokens(input_ids)
    hidden = model.run_blocks(model.embed(input_ids, context), context)
    scores = last_token_rewards(model.reward_head, model.final_norm(hidden), last_index)
    for row, last in enumerate(last_index.tolist()):
        normed = model.final_norm(hidden[row, last])
        assert torch.allclose(scores[row], model.reward_head.weight @ normed, atol=1e-6)
        # padding after the last token changes nothing (causal attention)
        alone = input_ids[row:row + 1, :last + 1]
        context_alone = SequenceContext.for_tokens(alone)
        hidden_alone = model.run_blocks(model.embed(alone, context_alone), context_alone)
        assert torch.allclose(scores[row], last_token_rewards(model.reward_head, model.final_norm(hidden_alone),
                                                              torch.tensor([last]))[0], atol=1e-5)


def test_a_reward_model_has_no_logits_and_no_hugging_face_form():
    model = LanguageModel(ModelConfig(**CONFIG), seed=1)
    with pytest.raises(ConfigError, match="model.head=reward.*`meshlm score`"):
        model(torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ConfigError, match="model.head=reward .*cannot|no supported Hugging Face"):
        export_hf(model)


def test_a_reward_model_saves_and_loads(tmp_path):
    model = LanguageModel(ModelConfig(**CONFIG), seed=1)
    loaded = load_model(save_model(model, tmp_path / "rm"))
    assert loaded.config.head == "reward" and loaded.config.reward_attributes == CONFIG["reward_attributes"]
    assert set(loaded.state_dict()) == set(model.state_dict()) and "output.weight" not in loaded.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


@pytest.mark.parametrize("values, message", [
    (dict(head="value"), "model.head='value'"),
    (dict(head="reward", reward_attributes=[]), "model.reward_attributes"),
    (dict(head="reward", reward_attributes=["a", "a"]), "distinct names"),
    (dict(head="reward", mtp_depth=1), "set model.mtp_depth=0"),
])
def test_bad_head_settings_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**CONFIG, **values})
