"""Soft-capping (``model.attention_softcap``, ``model.final_logit_softcap``; meshlm/models/softcap.py):
the capped attention core against capped softmax attention written out, in fp64, forward and
gradients, through every path of ``attention_core`` (causal, sliding window, packed documents,
padding and a cache, decoding) and attention dropout's; what it keeps for backward and the largest
tensor it makes; the fused cross-entropy of capped logits against ``F.cross_entropy``; a whole
model (bounded logits, the fused loss equal to the unfused one); cached and compiled-step
generation against the full forward; and the config's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshlm.errors import ConfigError
from meshlm.models import explicit_attention as explicit_attention_module
from meshlm.models.attention import allowed_keys, attention_core, attention_with_dropout
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import IGNORE_INDEX, linear_cross_entropy, softmax_cross_entropy_chunk
from meshlm.models.explicit_attention import explicit_attention
from meshlm.models.softcap import soft_cap, soft_cap_slope
from tests.helpers.cached_decoding import (assert_cached_generation_equals_the_full_forward,
                                           assert_decode_step_equals_the_cached_forward)
from tests.helpers.gradients import assert_same_with_gradients
from tests.helpers.saved_tensors import LargestTensor, SavedStorages

CAP = 1.0
"""On scores of size ~3 (unit-variance q and k, head dim 8) the tanh bends most of them."""


def capped_reference(query, key, value, allowed, cap=CAP, scale=None):
    """softmax(cap tanh(q k^T scale / cap), masked) v, written out (GQA by repeating K/V)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = soft_cap(query @ key.transpose(-1, -2) * scale, cap)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ value


def random_qkv(queries, keys=None, heads=4, kv_heads=2, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, count, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
            for count, length in ((heads, queries), (kv_heads, keys or queries), (kv_heads, keys or queries))]


def test_the_cap_bounds_values_keeps_small_ones_and_its_slope_is_its_derivative():
    values = torch.linspace(-200, 200, 401, dtype=torch.float64, requires_grad=True)
    capped = soft_cap(values, 30.0)
    assert capped.abs().max() < 30 and torch.all(capped[1:] > capped[:-1])  # bounded, increasing
    assert abs(float(soft_cap(torch.tensor(0.01, dtype=torch.float64), 30.0)) - 0.01) < 1e-8
    (slope,) = torch.autograd.grad(capped.sum(), values)
    torch.testing.assert_close(soft_cap_slope(capped.detach(), 30.0), slope, rtol=0, atol=1e-12)


CHUNKINGS = {"one chunk": 2 ** 22, "chunks of 3 rows": 2 * 4 * 24 * 3}


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("window", [None, 5, 30])
def test_the_capped_core_equals_capped_attention_written_out(monkeypatch, chunking, window):
    monkeypatch.setattr(explicit_attention_module, "SCORES_PER_CHUNK", CHUNKINGS[chunking])
    inputs = random_qkv(24)
    ours = attention_core(*inputs, window=window, softcap=CAP, scale=0.4)
    expected = capped_reference(*inputs, allowed_keys(24, 24, None, "cpu", window=window), scale=0.4)
    assert_same_with_gradients(ours, expected, inputs)
    assert not torch.allclose(ours, attention_core(*inputs, window=window, scale=0.4))  # the cap bites


def test_packed_documents_padding_and_a_cache_keep_their_masks_under_the_cap():
    inputs = random_qkv(20)
    documents = torch.tensor([[0] * 7 + [1] * 13, [0] * 12 + [1] * 8])
    for window in (None, 4):
        ours = attention_core(*inputs, document_ids=documents, window=window, softcap=CAP)
        allowed = allowed_keys(20, 20, None, "cpu", documents, window)
        assert_same_with_gradients(ours, capped_reference(*inputs, allowed), inputs)
    cached = random_qkv(3, keys=11)  # 3 new queries over 11 cached keys, the first row left-padded
    key_mask = torch.ones(2, 11, dtype=torch.bool)
    key_mask[0, :4] = False
    for window in (None, 4):
        ours = attention_core(*cached, key_mask, window=window, softcap=CAP)
        expected = capped_reference(*cached, allowed_keys(3, 11, key_mask, "cpu", window=window))
        assert_same_with_gradients(ours, expected, cached)
    decoding = random_qkv(1, keys=9)
    assert_same_with_gradients(attention_core(*decoding, softcap=CAP),
                               capped_reference(*decoding, torch.ones(1, 9, dtype=torch.bool)), decoding)


def test_attention_dropout_path_caps_the_scores_too():
    inputs = random_qkv(12)
    keep_all = torch.ones(2, 4, 12, 12, dtype=torch.bool)
    ours = attention_with_dropout(*inputs, None, keep_all, 0.0, window=5, softcap=CAP)
    expected = capped_reference(*inputs, allowed_keys(12, 12, None, "cpu", window=5))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)  # (its softmax runs in fp32)


def test_the_capped_core_keeps_only_its_inputs_and_makes_no_sequence_by_sequence_tensor(monkeypatch):
    """Between forward and backward only q, k, v, the output and one log-sum-exp per row are held (no
    scores), and no op of forward or backward returns more than one chunk's scores."""
    seq, rows = 256, 16
    monkeypatch.setattr(explicit_attention_module, "SCORES_PER_CHUNK", 4 * seq * rows)
    query, key, value = (tensor.detach().float().requires_grad_() for tensor in random_qkv(seq, batch=1))
    with SavedStorages() as saved, LargestTensor() as largest:
        out = explicit_attention(query, key, value, is_causal=True, softcap=CAP)
        out.sum().backward()
    inputs = {tensor.untyped_storage().data_ptr() for tensor in (query, key, value)}
    assert inputs <= set(saved.storages)  # the hooks saw the inputs being kept ...
    extra = sum(size for pointer, size in saved.storages.items() if pointer not in inputs)
    assert extra == out.numel() * 4 + 4 * seq * 4, extra  # ... and beside them the output and 4 x 256 fp32 lse
    # one chunk's scores: 4 heads x 16 rows x 256 keys; [heads, s, s] would be 4 x 256 x 256
    assert largest.numel <= 4 * rows * seq, largest.numel


def test_the_fused_loss_of_capped_logits_equals_cross_entropy_of_them():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (50,), generator=generator)
    labels[[3, 17]] = IGNORE_INDEX
    expected = F.cross_entropy(soft_cap(hidden @ weight.t(), 3.0), labels, ignore_index=IGNORE_INDEX)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    for chunk_softmax in (None, softmax_cross_entropy_chunk):  # the eager chunks and the compilable function
        loss = linear_cross_entropy(hidden, weight, labels, tokens_per_chunk=16, chunk_softmax=chunk_softmax,
                                    softcap=3.0)
        torch.testing.assert_close(loss, expected.float(), rtol=1e-6, atol=0)  # (the fused loss is fp32)
        for actual, wanted in zip(torch.autograd.grad(loss, (hidden, weight)), expected_grads):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-8)


def tiny_model(**overrides) -> LanguageModel:
    torch.manual_seed(0)
    values = dict(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                  qk_norm=True, attention_softcap=2.0, final_logit_softcap=0.3)
    return LanguageModel(ModelConfig(**{**values, **overrides})).eval()


def test_a_capped_model_bounds_its_logits_and_its_fused_loss_equals_the_unfused_one():
    model = tiny_model().train()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    unfused = model(ids, labels)
    assert unfused.logits.abs().max() < 0.3
    unfused_grads = torch.autograd.grad(unfused.loss, list(model.parameters()))
    fused = model(ids, labels, return_logits=False)
    torch.testing.assert_close(fused.loss, unfused.loss, rtol=1e-6, atol=0)
    for actual, wanted in zip(torch.autograd.grad(fused.loss, list(model.parameters())), unfused_grads):
        torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-7)
    plain = LanguageModel(dataclasses.replace(model.config, attention_softcap=None, final_logit_softcap=None))
    plain.load_state_dict(model.state_dict())
    assert (plain(ids).logits - model(ids).logits).abs().max() > 0.1  # the caps bend this model


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 4, "sliding_window_pattern": "SF"}],
                         ids=["full", "alternating window"])
def test_cached_generation_equals_the_full_forward(overrides):
    assert_cached_generation_equals_the_full_forward(tiny_model(**overrides), new_tokens=10)


def test_the_decode_step_caps_like_the_cached_forward():
    assert_decode_step_equals_the_cached_forward(tiny_model(sliding_window=4, sliding_window_pattern="SF"))


@pytest.mark.parametrize("fields, message", [
    ({"attention_softcap": 0}, "model.attention_softcap=0 must be a positive number"),
    ({"final_logit_softcap": -30.0}, "model.final_logit_softcap=-30.0 must be a positive number"),
    ({"attention_softcap": True}, "model.attention_softcap=True must be a positive number"),
    ({"pattern": "MM", "attention_softcap": 50.0}, "model.attention_softcap=50.0 applies to attention blocks"),
])
def test_bad_caps_are_refused_by_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, **fields})
