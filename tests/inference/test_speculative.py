"""Self-speculative decoding with the MTP depths (meshlm/inference/speculative.py).

The tokens equal plain greedy decoding's, token for token, for dense, hybrid (Mamba in the main
stack and in the depths) and MoE models, with one to three depths. A random model accepts
almost no draft, so a model trained for a few steps on a repeating sequence shows the other
side: nearly every draft accepted, the same tokens, in fewer forwards. The drafts themselves
equal those of a training-style forward over the committed tokens, which checks that each
depth's cache holds exactly its true positions after every accepted or rejected step.
"""

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.inference.speculative import MTPDrafter
from meshlm.inference.stats import GenerationStats
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel

GREEDY = SamplingConfig(greedy=True)
PROMPTS = [[5, 17, 3, 42, 8, 1, 60, 22, 9], [11, 2], [70, 70, 4, 13, 96], [33]]
CYCLE = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
# (main pattern, MTP pattern, depths)
MODELS = {"dense": ("*-*-", "*-", 2), "dense_one_depth": ("*-*-", "*-", 1), "hybrid": ("M*-M-", "M*", 3),
          "moe": ("*E*-", "*E", 2)}


def tiny_mtp_model(name: str, seed: int = 0, **overrides) -> LanguageModel:
    pattern, mtp_pattern, depth = MODELS[name]
    config = ModelConfig(vocab_size=97, hidden_size=32, pattern=pattern, num_attention_heads=4, num_kv_heads=2,
                         init_std=0.1, mamba_head_dim=8, mamba_chunk_size=8, moe_num_experts=4, moe_top_k=2,
                         moe_ffn_hidden_size=32, mtp_depth=depth, mtp_pattern=mtp_pattern, **overrides)
    return LanguageModel(config, seed=seed).eval()


@pytest.fixture(scope="module")
def trained_hybrid() -> LanguageModel:
    """A hybrid model with Mamba in its MTP depths, trained to continue CYCLE: drafts get accepted."""
    model = tiny_mtp_model("hybrid", mtp_loss_coeff=1.0).train()
    sequence = torch.tensor([(CYCLE * 4)[:41]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(25):
        loss = model(sequence[:, :-1], labels=sequence[:, 1:]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.mark.parametrize("name", MODELS)
def test_speculative_greedy_equals_plain_greedy(name):
    model = tiny_mtp_model(name)
    stats = GenerationStats()
    speculative = generate(model, PROMPTS, 16, GREEDY, speculative="mtp", stats=stats)
    assert speculative == generate(model, PROMPTS, 16, GREEDY)
    assert stats.verify_forwards > 0 and stats.drafted_tokens == stats.verify_forwards * MODELS[name][2]


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_sliding_window_caches_roll_back_rejected_drafts(name):
    """Windows of 3 (every attention block, the depths' too): the caches drop old keys while drafts
    are verified and rolled back, and the tokens stay plain greedy decoding's."""
    model = tiny_mtp_model(name, sliding_window=3)
    stats = GenerationStats()
    speculative = generate(model, PROMPTS, 16, GREEDY, speculative="mtp", stats=stats)
    assert speculative == generate(model, PROMPTS, 16, GREEDY)
    assert stats.verify_forwards > 0


@pytest.mark.parametrize("draft_tokens", [1, 2])
def test_fewer_drafts_than_depths(draft_tokens):
    model = tiny_mtp_model("hybrid")
    stats = GenerationStats()
    speculative = generate(model, PROMPTS, 12, GREEDY, speculative="mtp", draft_tokens=draft_tokens, stats=stats)
    assert speculative == generate(model, PROMPTS, 12, GREEDY)
    assert stats.drafted_tokens == stats.verify_forwards * draft_tokens


def test_a_trained_model_accepts_drafts_and_keeps_the_greedy_tokens(trained_hybrid):
    prompts = [CYCLE[:5], CYCLE[6:8], [CYCLE[9]]]
    stats = GenerationStats()
    speculative = generate(trained_hybrid, prompts, 24, GREEDY, speculative="mtp", stats=stats)
    assert speculative == generate(trained_hybrid, prompts, 24, GREEDY)
    assert speculative[0][:8] == (CYCLE * 3)[5:13]  # the model learned the cycle
    assert stats.accepted_tokens > 0.8 * stats.drafted_tokens
    assert stats.verify_forwards < 0.5 * 3 * 24  # fewer main-model forwards than tokens
    summary = stats.summary()
    assert summary["acceptance_rate"] > 0.8 and summary["tokens_per_verify_forward"] > 2


def test_eos_max_tokens_vocab_limit_and_prefill_chunks_as_plain_decoding(trained_hybrid):
    reference = generate(trained_hybrid, [CYCLE[:4]], 20, GREEDY)[0]
    eos = reference[7]  # accepted as a draft in the middle of a step
    for max_new_tokens in (1, 2, 5, 20):
        expected = generate(trained_hybrid, [CYCLE[:4]], max_new_tokens, GREEDY, eos_token_id=eos)
        assert generate(trained_hybrid, [CYCLE[:4]], max_new_tokens, GREEDY, eos_token_id=eos,
                        speculative="mtp", prefill_chunk=3) == expected
    model = tiny_mtp_model("moe")
    assert (generate(model, PROMPTS, 12, GREEDY, valid_vocab_size=20, speculative="mtp")
            == generate(model, PROMPTS, 12, GREEDY, valid_vocab_size=20))


def reference_drafts(model: LanguageModel, committed: list[int]) -> list[int]:
    """Drafts from a training-style forward over the committed tokens x_0..x_c: the main stack over
    x_0..x_{c-1}, then depth k over those positions with tokens x_k.. (drafts past x_c)."""
    inputs = torch.tensor([committed[:-1]])
    context = SequenceContext.for_tokens(inputs)
    hidden = model.run_blocks(model.embed(inputs, context), context)
    sequence = list(committed)
    for k, depth in enumerate(model.mtp.depths, start=1):
        future = torch.tensor([sequence[k:k + inputs.shape[1]]])
        hidden = depth(hidden, model.embed(future), context)
        sequence.append(int(model.head_logits(depth.final_norm(hidden[:, -1]), normed=True).argmax()))
    return sequence[len(committed):]


@pytest.mark.parametrize("name", ["hybrid", "moe", "trained_hybrid"])
def test_drafts_equal_a_full_forward_over_the_committed_tokens(name, request, monkeypatch):
    """After accepted and rejected steps alike, every depth's cache holds exactly its true positions."""
    model = request.getfixturevalue(name) if name == "trained_hybrid" else tiny_mtp_model(name)
    prompt = CYCLE[:3] + [50]  # the trained model rejects drafts after the foreign token, then accepts
    proposals = []
    original = MTPDrafter.draft

    def recording_draft(drafter, *args):
        drafts = original(drafter, *args)
        proposals.append((drafter.recent_start + drafter.recent_tokens.shape[1], drafts[0].tolist()))
        return drafts

    monkeypatch.setattr(MTPDrafter, "draft", recording_draft)
    generated = generate(model, [prompt], 20, GREEDY, speculative="mtp")[0]
    committed_all = prompt + generated
    assert len(proposals) > 3
    with torch.no_grad():
        for num_committed, drafts in proposals:
            assert drafts == reference_drafts(model, committed_all[:num_committed]), num_committed


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="plain", sampling=GREEDY), "model.mtp_depth=0"),
    (dict(model="mtp", sampling=GREEDY, speculative="medusa"), "'mtp'"),
    (dict(model="mtp", sampling=GREEDY, draft_tokens=3), "draft_tokens=3.*1 to 2"),
    (dict(model="mtp", sampling=GREEDY, draft_tokens=1, speculative=None), "--speculative mtp"),
])
def test_unsupported_requests_are_refused(kwargs, message):
    if kwargs["model"] == "plain":
        model = LanguageModel(ModelConfig(vocab_size=97, hidden_size=32, pattern="*-", num_attention_heads=4))
    else:
        model = tiny_mtp_model("dense")
    with pytest.raises(ConfigError, match=message):
        generate(model, PROMPTS[:1], 4, kwargs["sampling"], speculative=kwargs.get("speculative", "mtp"),
                 draft_tokens=kwargs.get("draft_tokens"))
