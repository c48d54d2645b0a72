"""Attention sinks (``model.attention_sinks``; meshlm/models/explicit_attention.py): the explicit core
with sinks against the sink softmax written out, in fp64, forward and gradients (the sinks' too),
through every path of ``attention_core`` (causal, sliding window, packed documents, padding and a
cache, decoding, one KV head) and attention dropout's, with and without a soft cap; what the core
keeps for backward; a whole model whose sinks train, whose cached generation equals its full forward
and whose latent attention takes sinks too; and the config's refusals."""

from __future__ import annotations

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.models import explicit_attention as explicit_attention_module
from meshlm.models.attention import allowed_keys, attention_core, attention_with_dropout
from meshlm.models.config import ModelConfig
from meshlm.models.explicit_attention import explicit_attention
from meshlm.models.language_model import LanguageModel
from meshlm.models.softcap import soft_cap
from tests.helpers.cached_decoding import (assert_cached_generation_equals_the_full_forward,
                                           assert_decode_step_equals_the_cached_forward)
from tests.helpers.gradients import assert_same_with_gradients
from tests.helpers.saved_tensors import SavedStorages


def random_inputs(queries, keys=None, heads=4, kv_heads=2, batch=2, seed=0):
    """fp64 q, k, v and the heads' sinks, all requiring gradients."""
    generator = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(batch, count, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
           for count, length in ((heads, queries), (kv_heads, keys or queries), (kv_heads, keys or queries))]
    return qkv + [torch.randn(heads, generator=generator, dtype=torch.float64, requires_grad=True)]


def sink_reference(query, key, value, sinks, allowed, cap=None, scale=None):
    """softmax over [scores, sink] (masked, capped if ``cap``), the sink's column dropped, times v."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ key.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    scores = (scores if cap is None else soft_cap(scores, cap)).masked_fill(~allowed, float("-inf"))
    sink_column = sinks[:, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1] @ value


CHUNKINGS = {"one chunk": 2 ** 22, "chunks of 3 rows": 2 * 4 * 24 * 3}


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (30, None), (None, 1.0), (5, 1.0)])
def test_the_core_with_sinks_equals_the_sink_softmax_written_out(monkeypatch, chunking, window, cap):
    monkeypatch.setattr(explicit_attention_module, "SCORES_PER_CHUNK", CHUNKINGS[chunking])
    *qkv, sinks = inputs = random_inputs(24)
    ours = attention_core(*qkv, window=window, softcap=cap, scale=0.4, sinks=sinks)
    expected = sink_reference(*qkv, sinks, allowed_keys(24, 24, None, "cpu", window=window), cap, scale=0.4)
    assert_same_with_gradients(ours, expected, inputs)
    assert not torch.allclose(ours, attention_core(*qkv, window=window, softcap=cap, scale=0.4))  # the sinks bite


def test_packed_documents_padding_a_cache_and_decoding_keep_their_masks_with_sinks():
    *qkv, sinks = inputs = random_inputs(20)
    documents = torch.tensor([[0] * 7 + [1] * 13, [0] * 12 + [1] * 8])
    for window in (None, 4):
        ours = attention_core(*qkv, document_ids=documents, window=window, sinks=sinks)
        allowed = allowed_keys(20, 20, None, "cpu", documents, window)
        assert_same_with_gradients(ours, sink_reference(*qkv, sinks, allowed), inputs)
    *cached, cached_sinks = cached_inputs = random_inputs(3, keys=11)  # 3 new queries over 11 keys, row 0 padded
    key_mask = torch.ones(2, 11, dtype=torch.bool)
    key_mask[0, :4] = False
    for window in (None, 4):
        ours = attention_core(*cached, key_mask, window=window, sinks=cached_sinks)
        expected = sink_reference(*cached, cached_sinks, allowed_keys(3, 11, key_mask, "cpu", window=window))
        assert_same_with_gradients(ours, expected, cached_inputs)
    *decoding, decoding_sinks = decoding_inputs = random_inputs(1, keys=9)
    assert_same_with_gradients(attention_core(*decoding, sinks=decoding_sinks),
                               sink_reference(*decoding, decoding_sinks, torch.ones(1, 9, dtype=torch.bool)),
                               decoding_inputs)
    # one KV head while decoding: the heads become the rows of one head's attention, the sinks with them
    *shared, shared_sinks = shared_inputs = random_inputs(1, keys=9, kv_heads=1)
    for mask in (None, key_mask[:, :9]):
        allowed = allowed_keys(1, 9, mask, "cpu")
        assert_same_with_gradients(attention_core(*shared, mask, sinks=shared_sinks),
                                   sink_reference(*shared, shared_sinks, allowed), shared_inputs)


def test_attention_dropout_path_takes_the_sinks_too():
    *qkv, sinks = random_inputs(12)
    keep_all = torch.ones(2, 4, 12, 12, dtype=torch.bool)
    ours = attention_with_dropout(*qkv, None, keep_all, 0.0, window=5, sinks=sinks)
    expected = sink_reference(*qkv, sinks, allowed_keys(12, 12, None, "cpu", window=5))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)  # (its softmax runs in fp32)


def test_a_row_with_no_visible_key_gives_zero_and_a_sink_of_minus_infinity_changes_nothing():
    *qkv, sinks = random_inputs(4)
    hidden = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    out = explicit_attention(*qkv, hidden, sinks=sinks[:, None])
    assert torch.equal(out, torch.zeros_like(out))  # all weight on the sink, whose value is zero
    no_sink = torch.full((4, 1), float("-inf"), dtype=torch.float64)
    plain = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(explicit_attention(*qkv, is_causal=True, sinks=no_sink), plain, rtol=0, atol=1e-12)


def test_the_core_keeps_only_its_inputs_the_output_and_one_lse_per_row(monkeypatch):
    seq, rows = 64, 8
    monkeypatch.setattr(explicit_attention_module, "SCORES_PER_CHUNK", 4 * seq * rows)
    query, key, value = (torch.randn(1, heads, seq, 8, requires_grad=True) for heads in (4, 2, 2))
    sinks = torch.randn(4, 1, requires_grad=True)
    with SavedStorages() as saved:
        out = explicit_attention(query, key, value, is_causal=True, sinks=sinks)
        out.sum().backward()
    inputs = {tensor.untyped_storage().data_ptr() for tensor in (query, key, value, sinks)}
    extra = sum(size for pointer, size in saved.storages.items() if pointer not in inputs)
    assert extra == out.numel() * 4 + 4 * seq * 4, extra  # the output and 4 x 64 fp32 lse beside the inputs
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0


@pytest.mark.parametrize("seq, window, kv_heads", [(24, None, 2), (24, 5, 2), (23, 6, 1), (24, 1, 4), (9, 3, 2)])
def test_sinks_over_whole_sequences_run_a_fused_kernel_keeping_what_it_keeps(monkeypatch, seq, window, kv_heads):
    """No mask, no cache, with or without a window (the last chunk padded or not, a window of one):
    the fused kernel's rows with the sink merged after (meshlm/models/sink_attention.py), never the
    explicit core; it keeps q, k, v, its output and an fp32 lse per row; in bf16 it is as close to
    fp32 attention as bf16 SDPA is."""
    def refuse(*args):
        raise AssertionError("the explicit core ran")

    monkeypatch.setattr(explicit_attention_module._ExplicitAttention, "apply", refuse)
    *qkv, sinks = inputs = random_inputs(seq, kv_heads=kv_heads)
    allowed = allowed_keys(seq, seq, None, "cpu", window=window)
    assert_same_with_gradients(attention_core(*qkv, window=window, sinks=sinks, scale=0.4),
                               sink_reference(*qkv, sinks, allowed, scale=0.4), inputs)
    query, key, value, sinks = (tensor.detach().float().requires_grad_() for tensor in inputs)
    with SavedStorages() as saved:
        out = attention_core(query, key, value, window=window, sinks=sinks)
        out.sum().backward()
    held = {tensor.untyped_storage().data_ptr() for tensor in (query, key, value, sinks)}
    extra = sum(size for pointer, size in saved.storages.items() if pointer not in held)
    assert extra == out.numel() * 4 + 2 * 4 * seq * 4, extra  # the output and 2 x 4 x seq fp32 lse
    exact = sink_reference(query, key, value, sinks, allowed).detach()
    low = [tensor.detach().bfloat16() for tensor in (query, key, value, sinks)]
    ours = attention_core(*low[:3], window=window, sinks=low[3]).float()
    plain_error = (attention_core(*low[:3], window=window).float()
                   - attention_core(query, key, value, window=window)).abs().max()
    assert (ours - exact).abs().max() <= 2 * plain_error + 2e-3


def sink_model(**overrides) -> LanguageModel:
    values = dict(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                  attention_sinks=True, sliding_window=4, sliding_window_pattern="SF", init_std=0.2)
    values.update(overrides)
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**values))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)  # trained sinks are far from their zero start
    return model.eval()


def test_a_model_with_sinks_trains_them_and_generates_with_a_cache_as_without():
    model = sink_model().train()
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens).loss.backward()
    sinks = [param for name, param in model.named_parameters() if name.endswith("sinks")]
    assert len(sinks) == 2 and all(param.shape == (4,) and param.grad.abs().sum() > 0 for param in sinks)
    model.eval()
    assert_cached_generation_equals_the_full_forward(model)
    assert_decode_step_equals_the_cached_forward(model)


def test_latent_attention_takes_sinks_in_training_and_in_its_cached_decoding():
    model = sink_model(attention_type="mla", mla_kv_lora_rank=16, mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=4,
                       mla_v_head_dim=8, num_kv_heads=None, sliding_window=None, sliding_window_pattern="S")
    assert model.blocks[0].mixer.sinks.shape == (4,)
    assert_cached_generation_equals_the_full_forward(model)


def test_sinks_need_attention_blocks():
    with pytest.raises(ConfigError, match="model.attention_sinks=true applies to attention blocks"):
        ModelConfig(pattern="M-", attention_sinks=True).validate()
