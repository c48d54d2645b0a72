"""Multi-head latent attention (``model.attention_type=mla``; meshlm/models/latent_attention.py):
one block against MLA written out from DeepSeek-V2's equations in fp64, with and without a query
latent, with a sliding window, soft caps and a custom scale; the shapes of what it keeps; packed
documents against each document alone; selective and full recomputation; the latent KV cache
(W_kvb absorbed, one key and one value head of latents per token) and, with an adapter on W_kvb,
the expanded one, both against the full forward; cached and decode-step generation; and the
config's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.latent_attention import LatentAttention
from meshlm.models.softcap import soft_cap
from tests.helpers.cached_decoding import (assert_cached_generation_equals_the_full_forward,
                                           assert_decode_step_equals_the_cached_forward)
from tests.helpers.saved_tensors import LargestTensor

MLA = dict(vocab_size=97, hidden_size=48, pattern="*-*-", num_attention_heads=4, attention_type="mla",
           mla_q_lora_rank=24, mla_kv_lora_rank=16, mla_qk_nope_head_dim=12, mla_qk_rope_head_dim=8,
           mla_v_head_dim=10, ffn_hidden_size=64)
"""A DeepSeek-V3-shaped block, small: every width different, so a mixed-up dimension fails."""


def mla_model(**overrides) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(**{**MLA, **overrides})).double().eval()


def rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotated(x, positions, theta=10000.0):
    """Rotate-half RoPE of x [..., t, d] at integer positions [t]; the angles in fp32, as meshlm's
    (and transformers') tables are."""
    half = x.shape[-1] // 2
    frequencies = 1.0 / theta ** (torch.arange(0, x.shape[-1], 2).float() / x.shape[-1])
    angles = positions[:, None].float() * frequencies
    cos, sin = angles.cos().double(), angles.sin().double()
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def reference_mla(block: LatentAttention, x, allowed, scale=None, cap=None):
    """DeepSeek-V2 §2.1, written out with the block's weights: explicit scores, one head at a time."""
    heads, nope, rope, value_dim = block.num_heads, block.nope_dim, block.rope_dim, block.value_dim
    seq = x.shape[1]
    if block.q_proj is not None:
        queries = x @ block.q_proj.weight.T
    else:
        queries = rms(x @ block.q_a_proj.weight.T, block.q_a_norm.weight) @ block.q_b_proj.weight.T
    latent = x @ block.kv_a_proj.weight.T
    compressed, shared_key = latent[..., :block.kv_lora_rank], latent[..., block.kv_lora_rank:]
    expanded = rms(compressed, block.kv_a_norm.weight) @ block.kv_b_proj.weight.T
    positions = torch.arange(seq)
    shared_key = rotated(shared_key, positions)
    scale = (nope + rope) ** -0.5 if scale is None else scale
    outputs = []
    for head in range(heads):
        query = queries[..., head * (nope + rope):(head + 1) * (nope + rope)]
        query = torch.cat((query[..., :nope], rotated(query[..., nope:], positions)), dim=-1)
        per_head = expanded[..., head * (nope + value_dim):(head + 1) * (nope + value_dim)]
        key = torch.cat((per_head[..., :nope], shared_key), dim=-1)
        scores = query @ key.transpose(-1, -2) * scale
        if cap is not None:
            scores = soft_cap(scores, cap)
        probabilities = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outputs.append(probabilities @ per_head[..., nope:])
    return torch.cat(outputs, dim=-1) @ block.o_proj.weight.T


def block_output(block, x, **context_fields):
    from meshlm.models.context import SequenceContext
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    context = SequenceContext(position_ids=positions, **context_fields)
    return block(x, context)


def causal(seq, window=None):
    rows, columns = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = columns <= rows
    return allowed if window is None else allowed & (columns > rows - window)


@pytest.mark.parametrize("fields", [{}, {"mla_q_lora_rank": None}, {"sliding_window": 5},
                                    {"attention_softcap": 2.0, "attention_scale": 0.3}],
                         ids=["query latent", "direct queries", "window 5", "soft cap and scale"])
def test_a_block_computes_mla_as_written_with_its_gradients(fields):
    block = mla_model(**fields).blocks[0].mixer
    assert isinstance(block, LatentAttention)
    x = torch.randn(2, 13, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ours = block_output(block, x)
    expected = reference_mla(block, x, causal(13, fields.get("sliding_window")), fields.get("attention_scale"),
                             fields.get("attention_softcap"))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    grad = torch.randn(ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    parameters = [x, *block.parameters()]
    for actual, wanted in zip(torch.autograd.grad(ours, parameters, grad), torch.autograd.grad(expected, parameters,
                                                                                               grad)):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-11)


def test_the_weights_have_deepseeks_shapes_and_the_projections_their_widths():
    block = mla_model().blocks[0].mixer
    shapes = {name: tuple(parameter.shape) for name, parameter in block.named_parameters()}
    assert shapes == {"q_a_proj.weight": (24, 48), "q_a_norm.weight": (24,), "q_b_proj.weight": (4 * 20, 24),
                      "kv_a_proj.weight": (16 + 8, 48), "kv_a_norm.weight": (16,),
                      "kv_b_proj.weight": (4 * (12 + 10), 16), "o_proj.weight": (48, 4 * 10)}
    query, key, value = block.project(torch.zeros(2, 5, 48, dtype=torch.float64), torch.arange(5).expand(2, -1))
    assert query.shape == key.shape == (2, 4, 5, 20) and value.shape == (2, 4, 5, 10)
    # the rotary key is one for all heads: its channels agree across heads
    x = torch.randn(2, 5, 48, dtype=torch.float64)
    _, key, _ = block.project(x, torch.arange(5).expand(2, -1))
    assert torch.equal(key[:, 0, :, 12:], key[:, 3, :, 12:]) and not torch.equal(key[:, 0, :, :12], key[:, 3, :, :12])


def test_packed_documents_attend_as_if_each_were_alone():
    model = mla_model()
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    document_ids = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        packed = model(tokens, document_ids=document_ids).logits
        first, second = model(tokens[:, :5]).logits, model(tokens[:, 5:]).logits
    torch.testing.assert_close(packed, torch.cat((first, second), dim=1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(recompute):
    from meshlm.training.recompute import apply_recompute
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    grads = []
    for setting in (None, recompute):
        model = mla_model().train()
        if setting:
            apply_recompute(model, setting)
        model(tokens, labels=tokens).loss.backward()
        grads.append([parameter.grad for parameter in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=1e-12)


def test_cached_generation_equals_the_full_forward():
    assert_cached_generation_equals_the_full_forward(mla_model().float())


def test_the_decode_step_equals_the_cached_forward():
    assert_decode_step_equals_the_cached_forward(mla_model(sliding_window=6).float())


@pytest.mark.parametrize("fields, message", [
    ({"attention_type": "mqa"}, "model.attention_type"),
    ({"mla_qk_rope_head_dim": 7}, "mla_qk_rope_head_dim=7 must be even"),
    ({"mla_kv_lora_rank": 0}, "mla_kv_lora_rank=0 must be a positive integer"),
    ({"mla_q_lora_rank": -1}, "mla_q_lora_rank=-1"),
    ({"position_embedding": "none"}, "set model.position_embedding=rope"),
    ({"head_dim": 16}, "model.head_dim=16 does not apply to model.attention_type=mla"),
    ({"num_kv_heads": 2}, "model.num_kv_heads=2 does not apply"),
    ({"qk_norm": True}, "model.qk_norm=True does not apply"),
    ({"attention_bias": True}, "model.attention_bias=True does not apply"),
    ({"block_overrides": {0: {"head_dim": 8}}}, "block_overrides[0].head_dim does not apply"),
])
def test_bad_settings_are_refused_by_field(fields, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig(**{**MLA, **fields})


def test_blocks_may_have_their_own_head_counts_and_gqa_stays_the_default():
    model = mla_model(block_overrides={2: {"num_attention_heads": 2}})
    assert model.blocks[0].mixer.num_heads == 4 and model.blocks[2].mixer.num_heads == 2
    assert model.blocks[2].mixer.kv_b_proj.weight.shape == (2 * 22, 16)
    plain = dataclasses.replace(ModelConfig(**{**MLA, "attention_type": "gqa"}))
    assert type(LanguageModel(plain).blocks[0].mixer).__name__ == "SelfAttention"


@torch.no_grad()
def cached_logits(model, tokens):
    """Logits of a prefill of 8 tokens, then one token at a time, and the cache they leave."""
    cache = InferenceCache()
    pieces = [model(tokens[:, :8], cache=cache).logits]
    pieces += [model(tokens[:, t:t + 1], cache=cache).logits for t in range(8, tokens.shape[1])]
    return torch.cat(pieces, dim=1), cache


def test_the_cache_holds_latents_and_cached_logits_equal_the_full_forward():
    """Generation attends in latent space (W_kvb absorbed): one key head of r + d_r channels and one
    value head of r per token, the full forward's logits up to rounding (fp64)."""
    model = mla_model(sliding_window=10)
    tokens = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(5))
    logits, cache = cached_logits(model, tokens)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(tokens).logits, rtol=0, atol=1e-10)
    state = cache.layers[0]
    assert state.keys.shape == (2, 1, 13, 16 + 8) and state.values.shape == (2, 1, 13, 16)


def test_with_an_adapter_on_the_latent_up_projection_the_cache_holds_expanded_heads():
    model = mla_model(lora_rank=2, lora_targets=["kv_b_proj"])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora.b"):
                parameter.normal_()  # a trained adapter: W_kvb's effective weight is not the stored one
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(6))
    logits, cache = cached_logits(model, tokens)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(tokens).logits, rtol=0, atol=1e-10)
    assert not model.blocks[0].mixer.caches_latents
    assert cache.layers[0].keys.shape == (2, 4, 11, 20) and cache.layers[0].values.shape == (2, 4, 11, 10)


def test_training_keeps_no_score_matrix_the_value_heads_padded_for_the_fused_kernel():
    """Value heads narrower than the query/key heads go to SDPA zero-padded, so its fused kernel
    takes them: nothing of [heads, seq, seq] is made, in forward or backward, and what is saved is
    q, k, the padded v, the output and small things -- not the math path's fp32 probabilities."""
    model = mla_model().float().train()
    tokens = torch.randint(0, 97, (1, 256), generator=torch.Generator().manual_seed(7))
    scores = 4 * 256 * 256 * 4  # one fp32 [heads, seq, seq]
    with LargestTensor() as largest:
        model(tokens, labels=tokens).loss.backward()
    assert largest.bytes < scores / 4
