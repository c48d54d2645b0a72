import math

import torch

from meshlm.models.attention import SelfAttention, attention_core
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.norms import RMSNorm
from meshlm.models.rope import RotaryEmbedding, apply_rotary


def reference_attention(query, key, value):
    """Textbook causal softmax attention, with KV heads repeated for GQA."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    seq = query.shape[2]
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ value


def test_attention_core_matches_textbook_with_gqa():
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    torch.testing.assert_close(attention_core(query, key, value), reference_attention(query, key, value))


def test_padded_keys_are_invisible():
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    mask = torch.tensor([[False, False, True, True, True, True]])
    padded = attention_core(query, key, value, mask)
    unpadded = attention_core(query[:, :, 2:], key[:, :, 2:], value[:, :, 2:])
    torch.testing.assert_close(padded[:, :, 2:], unpadded)
    assert torch.isfinite(padded).all()


def test_rope_relative_positions():
    rotary = RotaryEmbedding(8, 10000.0)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(query_position, key_position):
        cos_q, sin_q = rotary(torch.tensor([[query_position]]))
        cos_k, sin_k = rotary(torch.tensor([[key_position]]))
        return (apply_rotary(q, cos_q, sin_q) * apply_rotary(k, cos_k, sin_k)).sum()

    torch.testing.assert_close(score(7, 3), score(14, 10))
    assert not torch.allclose(score(7, 3), score(7, 4))


def test_self_attention_module_against_manual_computation():
    config = ModelConfig(hidden_size=32, num_attention_heads=4, num_kv_heads=2, qk_norm=True, pattern="*")
    torch.manual_seed(0)
    attention = SelfAttention(config, layer_index=0)
    for parameter in attention.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    x = torch.randn(2, 7, 32)
    context = SequenceContext.for_tokens(torch.zeros(2, 7, dtype=torch.long))
    out = attention(x, context)

    def heads(projection, count):
        return projection(x).view(2, 7, count, 8).transpose(1, 2)
    q, k, v = heads(attention.q_proj, 4), heads(attention.k_proj, 2), heads(attention.v_proj, 2)
    q, k = RMSNorm.forward(attention.q_norm, q), RMSNorm.forward(attention.k_norm, k)
    cos, sin = RotaryEmbedding(8, config.rope_theta)(context.position_ids)
    o = reference_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
    torch.testing.assert_close(out, attention.o_proj(o.transpose(1, 2).reshape(2, 7, 32)))


def test_rmsnorm_matches_formula():
    norm = RMSNorm(6, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 6)
    expected = norm.weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected)


def test_a_forward_makes_the_rope_table_once_for_all_attention_blocks(monkeypatch):
    """Every attention block of one forward rotates by the same table: it is made once (and kept in
    the ``SequenceContext``), not once per block, and gives the per-block table's values."""
    from meshlm.models.language_model import LanguageModel

    made = []
    original = RotaryEmbedding.forward
    monkeypatch.setattr(RotaryEmbedding, "forward", lambda self, positions: made.append(1) or original(self, positions))
    config = ModelConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, pattern="*-*-*-", ffn_hidden_size=64)
    model = LanguageModel(config, seed=0)
    input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids, input_ids).loss.backward()
    assert len(made) == 1

    attention = model.blocks[0].mixer
    context = SequenceContext.for_tokens(input_ids)
    hidden = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    shared = attention.project(hidden, context.position_ids, context.rotary_cos_sin(attention.rotary))
    own = attention.project(hidden, context.position_ids)
    assert all(torch.equal(a, b) for a, b in zip(shared, own))
    assert context.rotary_cos_sin(attention.rotary) is context.rotary_cos_sin(attention.rotary)


def test_attention_scale_replaces_one_over_sqrt_head_dim_in_every_path():
    """``model.attention_scale``: the causal core, the windowed core, packed documents, a cache's
    masked path and the explicit-softmax (dropout) core all scale q k^T by it."""
    import torch.nn.functional as F

    from meshlm.models.attention import attention_with_dropout

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, count, 12, 8, generator=generator, dtype=torch.float64) for count in (4, 2, 2))
    scaled = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True, scale=0.7)
    assert not torch.allclose(scaled, attention_core(query, key, value))
    torch.testing.assert_close(attention_core(query, key, value, scale=0.7), scaled)
    torch.testing.assert_close(attention_core(query, key, value, window=12, scale=0.7), scaled)
    mask = torch.ones(2, 12, dtype=torch.bool)
    torch.testing.assert_close(attention_core(query[:, :, -2:], key, value, mask, scale=0.7), scaled[:, :, -2:])
    torch.testing.assert_close(attention_core(query, key, value, document_ids=torch.zeros(2, 12, dtype=torch.long),
                                              scale=0.7), scaled)
    keep = torch.ones(2, 4, 12, 12, dtype=torch.bool)
    torch.testing.assert_close(attention_with_dropout(query, key, value, None, keep, 0.0, scale=0.7), scaled,
                               rtol=1e-6, atol=1e-6)  # its softmax is fp32
    distance = torch.arange(12)[:, None] - torch.arange(12)[None, :]
    band = F.scaled_dot_product_attention(query, key, value, attn_mask=(distance >= 0) & (distance < 5),
                                          enable_gqa=True, scale=0.7)
    torch.testing.assert_close(attention_core(query, key, value, window=5, scale=0.7), band)


def test_query_scale_by_position_and_a_cache_take_the_same_positions():
    """``model.query_scale_beta``: the query at position p is scaled by 1 + beta ln(1 + floor(p / L))
    after RoPE, so the scores of q scaled by s equal attention at temperature 1/s; decoding with a
    cache scales each new query at its own position, giving the full forward's logits."""
    from meshlm.models.attention import query_position_scale
    from meshlm.models.cache import InferenceCache
    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel

    scale = query_position_scale(torch.arange(12)[None], 0.5, 4)[0, 0, :, 0]
    expected = [1 + 0.5 * math.log(1 + p // 4) for p in range(12)]
    torch.testing.assert_close(scale, torch.tensor(expected, dtype=torch.float32))
    config = ModelConfig(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         init_std=0.2, query_scale_beta=2.0, query_scale_length=3)
    model = LanguageModel(config, seed=0).eval()
    ids = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        plain = LanguageModel(ModelConfig(**{**config.to_dict(), "query_scale_beta": 0.0}), seed=0).eval()(ids).logits
        assert (full - plain).abs().max() > 1e-2  # the scale changes the model
        cache = InferenceCache(14)
        steps = [model(ids[:, position:position + 1], cache=cache).logits for position in range(14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
