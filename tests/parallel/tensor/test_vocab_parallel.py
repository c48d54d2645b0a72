"""Vocabulary-parallel embedding and cross-entropy against ``nn.Embedding`` + ``F.cross_entropy``.

The vocabulary (61 ids) never divides the group, so it is padded: to 62 at tp 2, to 64 at tp 4,
and with ``vocab_pad_multiple`` 64 at tp 2 to 128 -- where rank 1's whole shard is padding. The
padded logits are filled with large garbage values: only masking them out keeps the loss right.
Labels include ignored positions (-100). One spawned world of 4 ranks runs tp 2 (two groups side
by side) and tp 4, sequence parallelism off and on; every rank computes the single-process
reference itself, and the parent asserts relative errors <= 1e-5.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from meshlm.parallel.tensor.sharding import gather_full_tensor, shard_tensor
from meshlm.parallel.tensor.vocab_parallel import (VocabParallelEmbedding, gather_vocab_logits, padded_vocab_size,
                                                   vocab_parallel_cross_entropy)
from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_checks import sequence_slice

TOLERANCE = 1e-5
VOCAB, HIDDEN, BATCH, SEQ = 61, 16, 2, 8
LAYOUTS = [(2, 1), (4, 1), (2, 64)]  # (tp, vocab_pad_multiple)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |actual - expected| / max |scale| (scale: expected itself, or the full tensor that
    expected is a shard of -- a shard of padding is all zeros)."""
    scale = expected if scale is None else scale
    return float((actual.detach() - expected.detach()).abs().max() / scale.detach().abs().max())


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_embedding(context, padded: int, seed: int) -> dict:
    full = nn.Embedding(VOCAB, HIDDEN)
    with torch.no_grad():
        full.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator(seed)))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator(seed + 1))
    ids[0, :3] = torch.tensor([0, VOCAB - 1, VOCAB // 2])  # both ends of the vocabulary
    upstream = torch.randn(BATCH, SEQ, HIDDEN, generator=generator(seed + 2))
    layer = VocabParallelEmbedding.from_full(full, context, padded)
    (full(ids) * upstream).sum().backward()
    out = layer(ids)
    (out * sequence_slice(upstream, context)).sum().backward()
    full_grad = gather_full_tensor(layer.weight, layer.weight.grad, context)
    assert layer.weight.shape[0] == padded // context.tp_size and full_grad.shape == (VOCAB, HIDDEN)
    return {"embedding output": relative_error(out, sequence_slice(full(ids), context)),
            "embedding weight grad": relative_error(full_grad, full.weight.grad)}


def check_cross_entropy(context, padded: int, seed: int) -> dict:
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=generator(seed)).requires_grad_()
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator(seed + 1))
    labels[0, :2] = torch.tensor([0, VOCAB - 1])
    labels[1, 3:6] = -100
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    expected.backward()
    expected_per_token = F.cross_entropy(logits.detach().flatten(0, 1), labels.flatten(), reduction="none")

    garbage = torch.full((BATCH, SEQ, padded - VOCAB), 50.0)  # must be masked out, never counted
    padded_logits = torch.cat((logits.detach(), garbage), dim=-1)
    local = shard_tensor(padded_logits, 2, [padded], context.tp_rank, context.tp_size).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, context, VOCAB)
    loss.backward()
    local_grad = torch.cat((logits.grad, torch.zeros_like(garbage)), dim=-1)
    per_token = vocab_parallel_cross_entropy(local.detach(), labels, context, VOCAB, reduction="none")
    return {"loss": relative_error(loss, expected),
            "per-token losses": relative_error(per_token.flatten(), expected_per_token),
            "logits grad": relative_error(local.grad, shard_tensor(local_grad, 2, [padded], context.tp_rank,
                                                                     context.tp_size), scale=logits.grad),
            "gathered logits": relative_error(gather_vocab_logits(local, context, VOCAB), logits)}


def run_all_cases() -> dict:
    errors = {}
    for tp, pad_multiple in LAYOUTS:
        for sp in (False, True):
            context = build_parallel_context(ParallelConfig(tp=tp, sp=sp), ModelConfig(), torch.device("cpu"))
            padded = padded_vocab_size(VOCAB, tp, pad_multiple)
            for check in (check_embedding, check_cross_entropy):
                for quantity, error in check(context, padded, seed=len(errors)).items():
                    errors[f"tp={tp} pad to {padded} sp={sp}: {quantity}"] = error
    dist.barrier()
    return errors


def test_vocab_parallel_embedding_and_cross_entropy_match_single_process():
    every_rank = run_distributed(run_all_cases, 4)
    for rank, errors in enumerate(every_rank):
        assert len(errors) == len(LAYOUTS) * 2 * 6
        bad = {case: error for case, error in errors.items() if not error <= TOLERANCE}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("vocab, tp, multiple, expected", [(61, 2, 1, 62), (61, 4, 1, 64), (64, 4, 1, 64),
                                                            (61, 2, 64, 128), (61, 1, 1, 61)])
def test_padded_vocab_size(vocab, tp, multiple, expected):
    assert padded_vocab_size(vocab, tp, multiple) == expected


def test_single_process_cross_entropy_masks_padding():
    """With one rank the function is an ordinary cross-entropy over the unpadded vocabulary."""
    logits = torch.randn(3, 5, 8, generator=generator(0))
    labels = torch.tensor([[1, 4, -100, 0, 3], [2, 2, 2, -100, 4], [0, 1, 2, 3, 4]])
    padded = torch.cat((logits, torch.full((3, 5, 3), 1e4)), dim=-1)
    loss = vocab_parallel_cross_entropy(padded, labels, ParallelContext(), vocab_size=8)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert relative_error(loss, expected) <= TOLERANCE
