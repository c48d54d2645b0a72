"""Sliding-window attention (``model.sliding_window``, ``model.sliding_window_pattern``;
meshlm/models/attention.py): the chunked core against softmax attention under an explicit band
mask, forward and gradients in fp64; packed documents; the config's per-block windows; a whole
model's receptive field; cached generation (prefill, chunked prefill, decode steps, left padding)
against the full forward; and the FLOP count against FlopCounterMode (with the CPU flash kernel's formula filled in,
tests/helpers/flop_formulas.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from meshlm.errors import ConfigError
from meshlm.models import attention as attention_module
from meshlm.models.attention import attention_core, attention_with_dropout, windowed_attention
from meshlm.models.config import ModelConfig
from meshlm.models.flops import attended_pairs, model_flops_breakdown
from meshlm.models.language_model import LanguageModel
from tests.helpers.cached_decoding import (assert_cached_generation_equals_the_full_forward,
                                           assert_decode_step_equals_the_cached_forward)
from tests.helpers.flop_formulas import MISSING_FORMULAS
from tests.helpers.saved_tensors import LargestTensor, SavedStorages


def banded_attention(query, key, value, window, document_ids=None):
    """Softmax attention with the whole [s, s] mask written out: key j visible from query i when
    0 <= i - j < window (and, with documents, j in i's document)."""
    seq = query.shape[2]
    distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    allowed = (distance >= 0) & (distance < window)
    if document_ids is not None:
        allowed = allowed & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                          enable_gqa=query.shape[1] != key.shape[1])


def random_qkv(seq, heads=4, kv_heads=2, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, count, seq, 8, generator=generator, dtype=torch.float64, requires_grad=True)
            for count in (heads, kv_heads, kv_heads)]


CORES = {"fused": lambda q, k, v, window: attention_core(q, k, v, window=window),
         "band mask": lambda q, k, v, window: windowed_attention(q, k, v, window) if window < q.shape[2]
         else attention_core(q, k, v)}
"""The two forms of the windowed core: two causal blocks a chunk on the fused kernel, which
``attention_core`` runs for whole sequences (``sink_attention.fused_windowed_attention``), and
the band-masked chunks of ``windowed_attention``, which a soft cap, MLA's narrower value heads or
a head size no fused kernel takes fall back to."""


@pytest.mark.parametrize("core", list(CORES))
@pytest.mark.parametrize("seq, window", [(16, 4), (16, 5), (17, 4), (33, 8), (16, 1), (16, 15), (16, 16), (16, 40)])
def test_windowed_core_equals_attention_under_the_band_mask(monkeypatch, core, seq, window):
    if core == "fused":  # every window fused, as on a GPU; attention_core must not fall back to the band
        monkeypatch.setattr(attention_module, "FUSED_WINDOW_MIN_ON_CPU", 1)
        monkeypatch.setattr(attention_module, "windowed_attention", refuse)
    inputs = random_qkv(seq)
    grad_out = torch.randn(2, 4, seq, 8, dtype=torch.float64)
    ours = CORES[core](*inputs, window)
    ours_grads = torch.autograd.grad(ours, inputs, grad_out)
    expected = banded_attention(*inputs, window)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    for actual, wanted in zip(ours_grads, expected_grads):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-12)
    if window < seq:  # the window really cuts: full causal attention differs
        assert not torch.allclose(ours, attention_core(*inputs))


def refuse(*args, **kwargs):
    raise AssertionError("the band-masked windowed core ran")


def test_the_cpu_runs_small_windows_as_band_masked_chunks_and_large_ones_fused(monkeypatch):
    """``FUSED_WINDOW_MIN_ON_CPU``: below it the CPU's faster form for small windows, the band-masked
    chunks; from it on (and on any other device) the fused blocks; sinks fused whatever the window."""
    calls = []
    band, fused = attention_module.windowed_attention, attention_module.fused_windowed_attention
    monkeypatch.setattr(attention_module, "windowed_attention",
                        lambda *args, **kwargs: calls.append("band") or band(*args, **kwargs))
    monkeypatch.setattr(attention_module, "fused_windowed_attention",
                        lambda *args, **kwargs: calls.append("fused") or fused(*args, **kwargs))
    assert attention_module.FUSED_WINDOW_MIN_ON_CPU == 1024 and attention_module.fused_window_applies(4, "cuda")
    monkeypatch.setattr(attention_module, "FUSED_WINDOW_MIN_ON_CPU", 8)
    query, key, value = (tensor.detach().float() for tensor in random_qkv(40, batch=1))
    for window in (4, 7, 8, 20):
        attention_core(query, key, value, window=window)
    attention_core(query, key, value, window=4, sinks=torch.zeros(4))
    assert calls == ["band", "band", "fused", "fused", "fused"]


@pytest.mark.parametrize("seq, window, kv_heads", [(64, 16, 2), (61, 12, 1), (64, 1, 4)])
def test_the_fused_window_keeps_only_its_inputs_the_output_and_lse(monkeypatch, seq, window, kv_heads):
    """What the fused windowed core keeps for backward: q, k, v, its output and an fp32 lse per row,
    nothing padded and no band of scores (the band-masked core keeps padded copies, its chunk
    pairs and the kernel's own outputs); in bf16 it is as close to fp32 attention as the band core."""
    monkeypatch.setattr(attention_module, "FUSED_WINDOW_MIN_ON_CPU", 1)
    monkeypatch.setattr(attention_module, "windowed_attention", refuse)
    query, key, value = (tensor.detach().float().requires_grad_()
                         for tensor in random_qkv(seq, kv_heads=kv_heads, batch=1))
    with SavedStorages() as saved:
        out = attention_core(query, key, value, window=window)
    held = {tensor.untyped_storage().data_ptr() for tensor in (query, key, value)}
    extra = sum(size for pointer, size in saved.storages.items() if pointer not in held)
    assert extra == out.numel() * 4 + 4 * seq * 4, extra  # the output and 4 heads x seq fp32 lse
    exact = banded_attention(query, key, value, window).detach()
    low = [tensor.detach().bfloat16() for tensor in (query, key, value)]
    fused_error = (attention_core(*low, window=window).float() - exact).abs().max()
    band_error = (windowed_attention(*low, window).float() - exact).abs().max()
    assert fused_error <= 2 * band_error + 2e-3, (fused_error, band_error)


def test_windowed_core_never_builds_a_sequence_by_sequence_tensor():
    seq, window = 512, 16
    query, key, value = (tensor.detach().float().requires_grad_() for tensor in random_qkv(seq, batch=1))
    with LargestTensor() as largest:
        out = windowed_attention(query, key, value, window)
        out.sum().backward()
    # the biggest tensors are q/k/v-sized copies (heads x seq x head_dim x 2 for the key pairs);
    # a [heads, s, s] score tensor would be 4 * 512 * 512 = 1M elements
    assert largest.numel <= 4 * seq * 8 * 2, largest.numel


def test_documents_with_a_window_attend_within_each_document_and_window():
    seq, window = 24, 5
    inputs = random_qkv(seq)
    documents = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 7 + [2] * 14])
    torch.testing.assert_close(attention_core(*inputs, document_ids=documents, window=window),
                               banded_attention(*inputs, window, documents), rtol=0, atol=1e-12)


def test_attention_dropout_path_keeps_the_window():
    # the explicit-softmax core (model.attention_dropout > 0) with nothing dropped is the band softmax
    inputs = random_qkv(18)
    keep = torch.ones(2, 4, 18, 18, dtype=torch.bool)
    torch.testing.assert_close(attention_with_dropout(*inputs, None, keep, 0.0, window=4),
                               banded_attention(*inputs, 4), rtol=0, atol=1e-6)  # its softmax is fp32


@pytest.mark.parametrize("queries", [1, 3])
def test_cached_queries_see_only_their_window(queries):
    seq, window = 20, 6
    query, key, value = random_qkv(seq)
    full = banded_attention(query, key, value, window)
    padding = torch.ones(2, seq, dtype=torch.bool)
    padding[1, :4] = False  # left padding: a real query never reaches it inside its window here
    for key_mask in (None, padding):
        latest = attention_core(query[:, :, -queries:], key, value, key_mask, window=window)
        torch.testing.assert_close(latest, full[:, :, -queries:], rtol=0, atol=1e-12)


# --- the config -------------------------------------------------------------------------------------------

def test_the_pattern_repeats_over_the_attention_blocks_then_the_mtp_depths():
    config = ModelConfig(pattern="*-*-*-M*", sliding_window=8, sliding_window_pattern="SF", mtp_depth=2,
                         mtp_pattern="*-", mamba_head_dim=8)
    assert config.attention_blocks == [0, 2, 4, 7, 8, 10]  # main stack, then each depth's '*'
    assert [config.attention_window(index) for index in config.attention_blocks] == [8, None, 8, None, 8, None]
    assert config.attention_window(1) is None  # an MLP block
    assert config.for_block(0) is config and config.for_block(2).sliding_window is None
    assert config.for_block(10).sliding_window is None and config.for_block(8).sliding_window == 8
    model = LanguageModel(config)
    windows = [block.mixer.window for block in model.blocks if block.kind == "*"]
    windows += [block.mixer.window for depth in model.mtp.depths for block in depth.blocks if block.kind == "*"]
    assert windows == [8, None, 8, None, 8, None]
    every = ModelConfig(pattern="*-*-", sliding_window=4)
    assert [every.attention_window(index) for index in (0, 2)] == [4, 4]
    assert [ModelConfig(pattern="*-*-").attention_window(index) for index in (0, 2)] == [None, None]


@pytest.mark.parametrize("fields, message", [
    (dict(sliding_window=0), "model.sliding_window=0 must be a positive number of tokens"),
    (dict(sliding_window=2.5), "model.sliding_window=2.5 must be a positive number"),
    (dict(sliding_window=4, sliding_window_pattern="SX"), "string of S (sliding) and F (full) letters"),
    (dict(sliding_window=4, sliding_window_pattern=""), "string of S (sliding) and F (full) letters"),
    (dict(sliding_window_pattern="SF"), "model.sliding_window is null; set model.sliding_window"),
    (dict(pattern="M-M-", sliding_window=4, mamba_head_dim=8), "model.pattern='M-M-' has none"),
])
def test_bad_windows_are_refused_by_field(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**{"pattern": "*-*-", **fields})


# --- a whole model ----------------------------------------------------------------------------------------

def tiny_model(pattern="*-*-", **fields) -> LanguageModel:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, hidden_size=32, pattern=pattern, num_attention_heads=4, num_kv_heads=2,
                         init_std=0.1, mamba_head_dim=8, mamba_chunk_size=8, **fields)
    return LanguageModel(config).eval()


@torch.no_grad()
def test_a_token_reaches_only_as_far_as_the_stacked_windows():
    # two attention blocks of window 3: position p reads tokens p-2..p, which read p-4..p
    model = tiny_model(sliding_window=3)
    tokens = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % 97
    difference = (model(tokens).logits - model(changed).logits).abs().amax(-1)[0]
    assert bool((difference[:5] > 1e-6).all()) and float(difference[5:].max()) == 0.0


@torch.no_grad()
def test_a_window_no_shorter_than_the_sequence_is_full_attention():
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(tiny_model(sliding_window=12)(tokens).logits, tiny_model()(tokens).logits,
                               rtol=0, atol=0)


MODELS = {"dense": dict(pattern="*-*-", sliding_window=4),
          "alternating": dict(pattern="*-*-", sliding_window=3, sliding_window_pattern="FS"),
          "hybrid": dict(pattern="M*-M*-", sliding_window=5)}


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_generation_equals_the_full_forward(name):
    assert_cached_generation_equals_the_full_forward(tiny_model(**MODELS[name]))


def test_decode_step_reads_only_the_window_and_equals_the_cached_forward():
    assert_decode_step_equals_the_cached_forward(tiny_model(**MODELS["alternating"]))


def test_flops_count_the_chunks_the_core_computes():
    assert attended_pairs(16, None) == attended_pairs(16, 16) == attended_pairs(16, 40) == 256
    assert attended_pairs(16, 4) == 4 * 4 + 3 * 4 * 8  # the first chunk, then three w x 2w
    assert attended_pairs(17, 4) == 4 * 4 + 4 * 4 * 8  # five chunks, the last one padded
    model = tiny_model(sliding_window=5, sliding_window_pattern="SF")
    tokens = torch.randint(0, 97, (1, 23))
    with FlopCounterMode(display=False, custom_mapping=MISSING_FORMULAS) as counter:
        model(tokens)
    counted = counter.get_total_flops()
    assert counted == sum(model_flops_breakdown(model.config, 23).values())
    full = sum(model_flops_breakdown(tiny_model().config, 23).values())
    assert counted < full  # the sliding block scores 5 x 5 + 4 x (5 x 10) pairs, not 23 x 23
