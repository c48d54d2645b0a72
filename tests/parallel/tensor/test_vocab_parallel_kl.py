"""Vocabulary-parallel distillation losses against the gathered computation, forward and adjoint.

``vocab_parallel_distillation`` on logits split by vocabulary must give, per token, what plain
torch gives on the full logits (``F.kl_div`` of temperature log-softmaxes times T^2, or
``1 - F.cosine_similarity``), and its custom backward must be the adjoint of its forward:

* per-token losses and the gradient of sum_t u_t loss_t (random u, ignored tokens included) on
  every rank's slice equal the gathered reference's (autograd through the plain formulas);
* the dot-product test: <gradient, v> summed over the ranks equals the directional derivative
  (f(x + eps v) - f(x - eps v)) / 2 eps of the vocab-parallel forward itself, in float64.

The vocabulary (61 ids) never divides the group: at tp 2 it is padded to 62, at tp 4 to 64, and
with ``vocab_pad_multiple`` 32 at tp 4 to 128 (ranks 2 and 3 hold only padding); the padded
logits hold garbage, which only masking keeps out. One spawned world of 4 runs tp 2 (two groups
side by side) and tp 4; in one process the function is checked with ``torch.autograd.gradcheck``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from meshlm.parallel.tensor.sharding import shard_tensor
from meshlm.parallel.tensor.vocab_parallel import (
    padded_vocab_size,
    vocab_parallel_distillation,
)
from tests.helpers.distributed import run_distributed

VOCAB, TOKENS = 61, 12
KINDS = [("kl", 1.0), ("forward_kl", 2.0), ("reverse_kl", 1.0), ("reverse_kl", 0.5), ("cosine", 1.0)]


def reference_losses(student: torch.Tensor, teacher: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """Per-token losses from the plain torch formulas on the full logits [tokens, vocab]."""
    if kind == "cosine":
        return 1 - F.cosine_similarity(student, teacher, dim=-1)
    log_q, log_p = F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1)
    pair = (log_q, log_p) if kind in ("kl", "forward_kl") else (log_p, log_q)
    return F.kl_div(*pair, log_target=True, reduction="none").sum(-1) * temperature ** 2


def example(seed: int):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(TOKENS, VOCAB, generator=generator, dtype=torch.float64) * 2
    teacher = torch.randn(TOKENS, VOCAB, generator=generator, dtype=torch.float64) * 3
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[[2, 7]] = -100
    weights = torch.randn(TOKENS, generator=generator, dtype=torch.float64)
    return student, teacher, labels, weights


@pytest.mark.parametrize("kind, temperature", KINDS)
def test_one_process_equals_torch_and_passes_gradcheck(kind, temperature):
    student, teacher, labels, _ = example(0)
    context = ParallelContext()
    loss = vocab_parallel_distillation(student, teacher, labels, context, VOCAB, kind, temperature)
    expected = reference_losses(student, teacher, kind, temperature)[labels != -100].mean()
    assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
    student32 = student.float().requires_grad_()
    loss32 = vocab_parallel_distillation(student32, teacher.float(), labels, context, VOCAB, kind, temperature)
    loss32.backward()  # fp32 (the run's dtype) within fp32 rounding of the float64 value
    assert loss32.dtype == torch.float32 and abs(loss32.item() - expected.item()) <= 1e-6 * expected.item()
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_distillation(x, teacher, labels, context, VOCAB, kind, temperature, "none"),
        (student.clone().requires_grad_(),))


def check_layout(tp: int, pad_multiple: int) -> dict[str, float]:
    context = build_parallel_context(ParallelConfig(tp=tp), ModelConfig(), torch.device("cpu"))
    padded = padded_vocab_size(VOCAB, tp, pad_multiple)
    errors = {}
    for number, (kind, temperature) in enumerate(KINDS):
        student, teacher, labels, weights = example(number)
        full = student.clone().requires_grad_()
        expected = reference_losses(full, teacher, kind, temperature).masked_fill(labels == -100, 0.0)
        (expected * weights).sum().backward()

        def local(tensor, fill):  # this rank's vocabulary slice, padded with garbage
            padding = torch.full((TOKENS, padded - VOCAB), fill, dtype=tensor.dtype)
            return shard_tensor(torch.cat((tensor.detach(), padding), dim=-1), 1, [padded], context.tp_rank, tp)

        def forward(student_local, teacher_local=local(teacher, 30.0), labels=labels, kind=kind,
                    temperature=temperature):
            return vocab_parallel_distillation(student_local, teacher_local, labels, context, VOCAB, kind,
                                               temperature, reduction="none")

        student_local = local(student, 40.0).requires_grad_()
        losses = forward(student_local)
        (losses * weights).sum().backward()
        full_grad = torch.cat((full.grad, torch.zeros(TOKENS, padded - VOCAB, dtype=full.grad.dtype)), dim=-1)
        expected_grad = shard_tensor(full_grad, 1, [padded], context.tp_rank, tp)
        name = f"tp{tp} pad{padded} {kind} T={temperature}"
        errors[f"{name} losses"] = float((losses - expected).abs().max() / expected.abs().max())
        errors[f"{name} grad"] = float((student_local.grad - expected_grad).abs().max() / full.grad.abs().max())
        # dot-product test: <grad, v> over the whole vocabulary vs the forward's directional derivative
        direction = local(torch.randn(TOKENS, VOCAB, generator=torch.Generator().manual_seed(99),
                                      dtype=torch.float64), 0.0)
        eps = 1e-6
        with torch.no_grad():
            derivative = ((forward(student_local + eps * direction) - forward(student_local - eps * direction))
                          * weights).sum() / (2 * eps)
            dot = (student_local.grad * direction).sum()
            all_reduce_(dot, context.tp_group)
        errors[f"{name} adjoint"] = float((dot - derivative).abs() / derivative.abs())
    return errors


def run_layouts() -> dict[str, float]:
    errors = {}
    for tp, pad_multiple in ((2, 1), (4, 1), (4, 32)):
        errors.update(check_layout(tp, pad_multiple))
    return errors


def test_sharded_losses_gradients_and_adjoint_equal_the_gathered_computation():
    for rank, errors in enumerate(run_distributed(run_layouts, 4)):
        assert len(errors) == 3 * len(KINDS) * 3
        bad = {case: error for case, error in errors.items() if not error <= 1e-8}
        assert not bad, f"rank {rank}: {bad}"
