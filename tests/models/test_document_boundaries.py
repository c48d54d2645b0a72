"""Packed documents kept apart: a packed row equals its documents run one by one.

For every block kind, a batch of two rows, each packing three documents (with different
boundaries, one on a Mamba chunk boundary, one document a single token), gives the same logits,
losses and parameter gradients as running each document alone, in fp32 (the exactness test of
``data.document_boundaries``; the labels at the boundaries are ignored, as the data does).
"""

import pytest
import torch

from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext, positions_in_documents
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import IGNORE_INDEX
from meshlm.models.mtp import shift_left
from meshlm.models.ssd import ssd_chunked_scan
from meshlm.models.ssd_fast import ssd_chunked_scan_fast

VOCAB = 64
DOCUMENT_LENGTHS = [[7, 11, 6], [8, 1, 15]]  # 24 tokens a row; chunk size 8 puts one boundary on a chunk's edge

KINDS = {
    "attention": dict(pattern="**", num_attention_heads=4, num_kv_heads=2),
    "mamba_reference": dict(pattern="MM", mamba_scan="reference"),
    "mamba_fast": dict(pattern="MM", mamba_scan="pytorch"),
    "mlp": dict(pattern="--"),
    "moe": dict(pattern="EE", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32),
    "mtp": dict(pattern="*-", mtp_depth=2, mtp_pattern="*M"),
    "hybrid": dict(pattern="M*-E", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32),
}


def tiny_model(**overrides) -> LanguageModel:
    values = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, mamba_head_dim=8, mamba_state_size=8,
                  mamba_chunk_size=8, ffn_hidden_size=64)
    values.update(overrides)
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**values), seed=0).double().float()
    for name, parameter in model.named_parameters():  # non-trivial norms and biases
        if "norm" in name:
            parameter.data.add_(0.1 * torch.randn_like(parameter))
    return model


def packed_batch():
    """input_ids, labels (boundaries ignored) and document_ids [2, 24], and each row's documents."""
    generator = torch.Generator().manual_seed(1)
    rows = [[torch.randint(1, VOCAB, (length + 1,), generator=generator) for length in lengths]
            for lengths in DOCUMENT_LENGTHS]  # each document's tokens and the one after its last input
    input_ids = torch.stack([torch.cat([tokens[:-1] for tokens in row]) for row in rows])
    labels = torch.stack([torch.cat([torch.cat((tokens[1:-1], torch.tensor([IGNORE_INDEX]))) for tokens in row])
                          for row in rows])
    document_ids = torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                                for lengths in DOCUMENT_LENGTHS])
    return input_ids, labels, document_ids


def term_counts(labels: torch.Tensor, document_ids: torch.Tensor, names) -> dict[str, int]:
    """How many targets each loss term averages over ('lm', 'mtp_k': k tokens on, same document)."""
    counts = {"lm": int((labels != IGNORE_INDEX).sum())}
    for name in names:
        if name.startswith("mtp_"):
            steps = int(name[4:])
            same_document = shift_left(document_ids, steps, -1) == document_ids
            counts[name] = int(((shift_left(labels, steps, IGNORE_INDEX) != IGNORE_INDEX) & same_document).sum())
    return counts


def objective(output, names) -> torch.Tensor:
    """The sum of the LM and per-depth MTP terms (each a mean over its targets)."""
    return sum(output.losses[name] for name in names)


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


def assert_relative_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tolerance: float = 1e-5):
    error = (actual - expected).norm() / expected.norm().clamp(min=1e-12)
    assert error < tolerance, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_packed_rows_equal_their_documents_run_one_by_one(kind):
    model = tiny_model(**KINDS[kind])
    input_ids, labels, document_ids = packed_batch()

    packed = model(input_ids, labels, document_ids=document_ids)
    names = ["lm"] + sorted(name for name in packed.losses if name.startswith("mtp_"))
    objective(packed, names).backward()
    packed_grads = gradients(model)
    model.zero_grad()

    # each document alone, its terms weighted by its share of the batch's targets
    totals = term_counts(labels, document_ids, names)
    alone_total, alone_logits = 0.0, torch.zeros_like(packed.logits)
    for row, lengths in enumerate(DOCUMENT_LENGTHS):
        start = 0
        for length in lengths:
            span = slice(start, start + length)
            output = model(input_ids[row:row + 1, span], labels[row:row + 1, span])
            alone_logits[row, span] = output.logits[0]
            for name, count in term_counts(labels[row:row + 1, span], document_ids[row:row + 1, span], names).items():
                if count:
                    alone_total = alone_total + output.losses[name] * count / totals[name]
            start += length
    alone_total.backward()

    assert_relative_close(packed.logits, alone_logits, "logits")
    torch.testing.assert_close(objective(packed, names), alone_total.detach(), rtol=1e-5, atol=0)
    alone_grads = gradients(model)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in alone_grads.items():
        assert_relative_close(packed_grads[name], grad, name)


@pytest.mark.parametrize("scan", [ssd_chunked_scan, ssd_chunked_scan_fast])
def test_scan_restarts_at_boundaries_continues_the_first_document_and_ends_in_the_last(scan):
    torch.manual_seed(0)
    batch, heads, head_dim, groups, state_size, chunk = 1, 4, 4, 2, 8, 4
    lengths = [3, 6, 4]  # 13 tokens: the last chunk is padded
    seq = sum(lengths)
    x = torch.randn(batch, seq, heads, head_dim)
    dt = torch.rand(batch, seq, heads) + 0.1
    A = -torch.rand(heads) - 0.5
    B, C = (torch.randn(batch, seq, groups, state_size) for _ in range(2))
    initial = torch.randn(batch, heads, head_dim, state_size)
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]

    y, final = scan(x, dt, A, B, C, chunk, initial, document_ids=documents)
    start, expected = 0, []
    for index, length in enumerate(lengths):
        span = slice(start, start + length)
        piece, piece_final = ssd_chunked_scan(x[:, span], dt[:, span], A, B[:, span], C[:, span], chunk,
                                              initial if index == 0 else None)
        expected.append(piece)
        start += length
    torch.testing.assert_close(y, torch.cat(expected, dim=1))
    torch.testing.assert_close(final, piece_final)


def test_fast_scan_gradients_with_documents_equal_the_reference():
    torch.manual_seed(0)
    batch, seq, heads, head_dim, groups, state_size, chunk = 2, 13, 4, 4, 2, 8, 4
    inputs = [torch.randn(batch, seq, heads, head_dim), torch.rand(batch, seq, heads) + 0.1, -torch.rand(heads) - 0.5,
              torch.randn(batch, seq, groups, state_size), torch.randn(batch, seq, groups, state_size),
              torch.randn(batch, heads, head_dim, state_size)]
    documents = torch.tensor([[0] * 3 + [1] * 6 + [2] * 4, [0] * 4 + [1] * 4 + [2] * 5])  # edges on and off chunks
    weights = torch.randn(batch, seq, heads, head_dim), torch.randn(batch, heads, head_dim, state_size)
    grads = []
    for scan in (ssd_chunked_scan, ssd_chunked_scan_fast):
        leaves = [tensor.clone().requires_grad_() for tensor in inputs]
        y, final = scan(*leaves[:5], chunk, leaves[5], document_ids=documents)
        ((y * weights[0]).sum() + (final * weights[1]).sum()).backward()
        grads.append([leaf.grad for leaf in leaves])
    for reference, fast in zip(*grads):
        assert_relative_close(fast, reference, "gradient")


def test_positions_restart_per_document_and_context_rejects_caches_and_padding():
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 7]])
    assert positions_in_documents(document_ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0]]
    context = SequenceContext.for_tokens(torch.zeros(2, 6, dtype=torch.long), document_ids=document_ids)
    assert torch.equal(context.rotary_positions, positions_in_documents(document_ids))
    assert context.position_ids.tolist()[0] == list(range(6))  # row positions stay (dropout keys on them)
    with pytest.raises(ValueError, match="document_ids"):
        SequenceContext.for_tokens(torch.zeros(2, 6, dtype=torch.long), token_mask=torch.ones(2, 6, dtype=torch.bool),
                                   document_ids=document_ids)
