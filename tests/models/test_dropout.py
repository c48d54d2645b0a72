"""Layout-independent dropout (meshlm/models/dropout.py): the counter-based hash, its masks, the
modules, and the model in training and eval mode.

The statistical checks use fixed seeds, so their values are fixed numbers: each bound is
several standard deviations of an ideal generator wide (it could only fail if the hash were
biased), yet tight enough to catch a broken mix (a constant, a lost coordinate, a shared mask).
"""

from __future__ import annotations

import math

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.models.attention import attention_core, attention_with_dropout
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.dropout import (DropoutKey, HiddenDropout, attention_keep_mask, dropout_site, hidden_keep_mask,
                                   mix32, multiply_mod32)
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.mesh import ParallelContext

BATCH, SEQ, WIDTH = 4, 128, 256
ELEMENTS = BATCH * SEQ * WIDTH


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 on Python integers (the reference for the tensor version)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def key(seed=1234, step=7, samples=range(BATCH)) -> DropoutKey:
    return DropoutKey(seed, step, torch.tensor(list(samples)))


def positions(batch=BATCH, seq=SEQ) -> torch.Tensor:
    return torch.arange(seq).expand(batch, seq)


def mask(p=0.5, site=dropout_site("block_output", 3), **key_fields) -> torch.Tensor:
    return hidden_keep_mask(key(**key_fields), site, positions(), WIDTH, p)


def within_sigmas(observed: float, expected: float, count: int, sigmas: float = 5.0) -> bool:
    return abs(observed - expected) <= sigmas * math.sqrt(expected * (1 - expected) / count)


# --- the hash ---------------------------------------------------------------------------------------

def test_tensor_hash_equals_the_integer_reference_without_overflow():
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([torch.tensor([0, 1, 2**16 - 1, 2**16, 2**31, 2**32 - 1]),
                        torch.randint(0, 2**32, (4000,), generator=generator)])
    assert [int(v) for v in mix32(values)] == [lowbias32(int(v)) for v in values]
    for constant in (0x7FEB352D, 0x846CA68B, 2**32 - 1):
        assert [int(v) for v in multiply_mod32(values, constant)] == [(int(v) * constant) % 2**32 for v in values]


def test_hash_bits_are_uniform():
    """Chi-square of the top byte of every element's 32-bit hash over 256 bins (255 degrees of
    freedom: mean 255, sd 22.6) and the mean of each of the 32 bits."""
    from meshlm.models.dropout import fold

    rows = key().row_states(dropout_site("block_output", 0), torch.device("cpu"))
    tokens = fold(rows[:, None], positions())
    bits = mix32(tokens[..., None] ^ mix32(torch.arange(WIDTH)))
    counts = torch.bincount((bits >> 24).flatten(), minlength=256).double()
    expected = ELEMENTS / 256
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 255 + 5 * math.sqrt(2 * 255), chi_square
    for bit in range(32):
        assert within_sigmas(float(((bits >> bit) & 1).double().mean()), 0.5, ELEMENTS), bit


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    assert within_sigmas(float(mask(p).double().mean()), 1 - p, ELEMENTS)


@pytest.mark.parametrize("change", [{"site": dropout_site("block_output", 4)}, {"site": dropout_site("embedding")},
                                    {"step": 8}, {"seed": 1235}, {"samples": range(BATCH, 2 * BATCH)}])
def test_masks_of_different_sites_steps_seeds_and_samples_are_independent(change):
    """Two masks at p = 0.5 agree on a fraction 1/2 of elements and both drop 1/4, as
    independent draws do."""
    first, second = mask(), mask(**change)
    assert within_sigmas(float((first == second).double().mean()), 0.5, ELEMENTS)
    assert within_sigmas(float((~first & ~second).double().mean()), 0.25, ELEMENTS)


def test_neighbouring_positions_channels_and_rows_are_uncorrelated():
    keep = mask(p=0.5).double() * 2 - 1  # +-1 per element: correlation = mean of products
    pairs = {"position": (keep[:, 1:], keep[:, :-1]), "channel": (keep[..., 1:], keep[..., :-1]),
             "row": (keep[1:], keep[:-1]), "position + channel": (keep[:, 1:, 1:], keep[:, :-1, :-1])}
    for what, (a, b) in pairs.items():
        correlation = float((a * b).mean())
        assert abs(correlation) <= 5 / math.sqrt(a.numel()), (what, correlation)


# --- layout independence ---------------------------------------------------------------------------

def test_mask_of_an_element_depends_only_on_its_global_coordinates():
    site = dropout_site("block_output", 2)
    full = hidden_keep_mask(key(), site, positions(), WIDTH, 0.3)
    # data parallelism: rows 2 and 3 read by another rank (their global sample indices)
    assert torch.equal(hidden_keep_mask(key(samples=[2, 3]), site, positions(2), WIDTH, 0.3), full[2:])
    # context parallelism: the zigzag chunks 0 and 3 of four, with their global positions
    chunks = torch.cat([torch.arange(0, 32), torch.arange(96, 128)])
    assert torch.equal(hidden_keep_mask(key(), site, chunks.expand(BATCH, -1), WIDTH, 0.3), full[:, chunks])
    # attention heads split by tensor parallelism: global heads 2 and 3
    query_positions = positions(seq=16)
    all_heads = attention_keep_mask(key(), site, torch.arange(4), query_positions, query_positions, 0.3)
    torch_heads = attention_keep_mask(key(), site, torch.arange(2, 4), query_positions, query_positions, 0.3)
    assert torch.equal(torch_heads, all_heads[:, 2:])


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_ranks_mask_their_slices_of_the_full_mask(tp):
    x, context = torch.randn(BATCH, SEQ, WIDTH), SequenceContext(position_ids=positions(), dropout_key=key())
    whole = HiddenDropout(0.2, site=5)(x, context)
    for rank in range(tp):
        dropout = HiddenDropout(0.2, site=5)
        dropout.parallel_context = ParallelContext(tp_size=tp, tp_rank=rank, sequence_parallel=True)
        piece = x.tensor_split(tp, dim=1)[rank]
        assert torch.equal(dropout(piece, context), whole.tensor_split(tp, dim=1)[rank])


# --- the modules -----------------------------------------------------------------------------------

def test_hidden_dropout_scales_kept_elements_and_its_gradient_uses_the_same_mask():
    x = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    context = SequenceContext(position_ids=positions(), dropout_key=key())
    dropout = HiddenDropout(0.25, site=9)
    out = dropout(x, context)
    keep = hidden_keep_mask(key(), 9, positions(), WIDTH, 0.25)
    torch.testing.assert_close(out, torch.where(keep, x / 0.75, 0.0))
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, keep / 0.75)
    dropout.eval()
    assert dropout(x, context) is x


def test_attention_with_dropout_is_softmax_attention_with_the_mask_applied():
    generator = torch.Generator().manual_seed(0)
    query, key_, value = (torch.randn(2, heads, 9, 8, generator=generator) for heads in (4, 2, 2))
    padding = torch.tensor([[True] * 9, [False, False] + [True] * 7])
    everything = torch.ones(2, 4, 9, 9, dtype=torch.bool)
    torch.testing.assert_close(attention_with_dropout(query, key_, value, padding, everything, 0.0),
                               attention_core(query, key_, value, padding))
    keep = attention_keep_mask(key(samples=[0, 1]), 3, torch.arange(4), positions(2, 9), positions(2, 9), 0.4)
    grouped_key, grouped_value = key_.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    scores = (query @ grouped_key.transpose(-1, -2) / math.sqrt(8)).masked_fill(
        ~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    expected = (scores.softmax(-1) * keep / 0.6) @ grouped_value
    torch.testing.assert_close(attention_with_dropout(query, key_, value, None, keep, 0.4), expected)


# --- the model ---------------------------------------------------------------------------------------

def tiny_model(**dropout) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=64, hidden_size=32, pattern="M*-E", num_attention_heads=4,
                                     num_kv_heads=2, mamba_head_dim=8, mamba_state_size=8, mamba_chunk_size=8,
                                     moe_num_experts=4, moe_ffn_hidden_size=32, mtp_depth=1, **dropout))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return ids, ids.roll(-1, 1)


def test_eval_mode_is_deterministic_and_dropout_free():
    plain, dropped = tiny_model(), tiny_model(hidden_dropout=0.3, attention_dropout=0.3)
    ids, labels = tokens()
    dropped.eval()
    first, second = dropped(ids, labels), dropped(ids, labels)
    reference = plain.eval()(ids, labels)
    assert torch.equal(first.logits, second.logits) and torch.equal(first.logits, reference.logits)
    assert torch.equal(first.loss, reference.loss)


def test_training_mode_masks_follow_the_key():
    model, ids, labels = tiny_model(hidden_dropout=0.2, attention_dropout=0.2).train(), *tokens()
    step_3 = DropoutKey(5, 3, torch.tensor([10, 11]))
    loss = model(ids, labels, dropout_key=step_3).loss
    assert torch.equal(model(ids, labels, dropout_key=DropoutKey(5, 3, torch.tensor([10, 11]))).loss, loss)
    assert not torch.equal(model(ids, labels, dropout_key=DropoutKey(5, 4, torch.tensor([10, 11]))).loss, loss)
    assert not torch.equal(model.eval()(ids, labels).loss, loss)
    model.train()  # no key: one is drawn from torch's generator, so repeated forwards differ
    torch.manual_seed(0)
    drawn = model(ids, labels).loss
    assert not torch.equal(model(ids, labels).loss, drawn)
    torch.manual_seed(0)
    assert torch.equal(model(ids, labels).loss, drawn)


def test_recomputation_redraws_the_same_masks():
    from meshlm.training.recompute import apply_recompute

    ids, labels = tokens()
    dropout_key = DropoutKey(5, 3, torch.tensor([10, 11]))
    gradients = []
    for recompute in ("none", "full", "selective"):
        model = tiny_model(hidden_dropout=0.2, attention_dropout=0.2).train()
        apply_recompute(model, recompute, 1)
        model(ids, labels, dropout_key=dropout_key).loss.backward()
        gradients.append({name: param.grad for name, param in model.named_parameters() if param.grad is not None})
    for other in gradients[1:]:
        assert other.keys() == gradients[0].keys()
        for name, grad in gradients[0].items():
            torch.testing.assert_close(other[name], grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("field", ["hidden_dropout", "attention_dropout"])
@pytest.mark.parametrize("value", [1.0, -0.1, True, "0.1"])
def test_dropout_outside_zero_to_one_is_refused(field, value):
    with pytest.raises(ConfigError, match=f"model.{field}"):
        ModelConfig(**{field: value})


def test_attention_dropout_is_refused_under_ring_attention():
    from meshlm.parallel.context.context_parallel import check_context_parallel_model

    check_context_parallel_model(ModelConfig(attention_dropout=0.1), 1, 16)
    check_context_parallel_model(ModelConfig(pattern="M-", attention_dropout=0.1), 2, 16)  # no attention
    check_context_parallel_model(ModelConfig(hidden_dropout=0.1), 2, 16)
    with pytest.raises(ConfigError, match=r"model.attention_dropout=0.1 .*parallel.cp=2"):
        check_context_parallel_model(ModelConfig(attention_dropout=0.1), 2, 16)  # before any collective
    model, ids, labels = tiny_model(attention_dropout=0.1).train(), *tokens()
    model.blocks[1].mixer.core = lambda *args: attention_core(*args)  # what context parallelism does
    with pytest.raises(ConfigError, match="model.attention_dropout"):
        model(ids, labels)


# --- Hugging Face configs ----------------------------------------------------------------------------

def test_hugging_face_dropout_fields_map_both_ways():
    transformers = pytest.importorskip("transformers")
    from meshlm.hf import llama, nemotron_h

    config = ModelConfig(pattern="*-*-", hidden_dropout=0.1, attention_dropout=0.2)
    exported = llama.config_to_hf(config)  # no residual dropout in Llama: training-only, dropped
    assert exported["attention_dropout"] == 0.2 and "hidden_dropout" not in exported
    assert transformers.LlamaConfig(**exported).attention_dropout == 0.2
    imported = llama.config_from_hf(exported)
    assert (imported.attention_dropout, imported.hidden_dropout) == (0.2, 0.0)
    assert llama.config_from_hf({**exported, "attention_dropout": None}).attention_dropout == 0.0

    hybrid = ModelConfig(pattern="M*-", mamba_head_dim=8, position_embedding="none", mlp_activation="squared_relu",
                         hidden_dropout=0.1, attention_dropout=0.2)
    exported = nemotron_h.config_to_hf(hybrid)
    assert (exported["hidden_dropout"], exported["attention_dropout"]) == (0.1, 0.2)
    imported = nemotron_h.config_from_hf(exported)
    assert (imported.hidden_dropout, imported.attention_dropout) == (0.1, 0.2)
