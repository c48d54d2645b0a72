"""The vocabulary split over the tensor-parallel group: embedding, output head and loss.

The embedding matrix and the output head are the two largest matrices of a small model, and
the logits [tokens, vocab] its largest activation. Megatron-LM (Shoeybi et al. 2019, §3) splits
all three by vocabulary: rank r owns token ids [r V'/t, (r+1) V'/t), where V' is the vocabulary
padded up to a multiple of t (times ``parallel.vocab_pad_multiple``, for GEMM-friendly shapes).

**Embedding.** Each rank looks up the ids in its range and writes zeros for the others; the sum
over the group is the full lookup (``reduce_from_group``), or, under sequence parallelism, the
reduce-scatter that hands every rank its slice of the sequence -- the residual stream starts
sharded.

**Head and loss.** The head is column-parallel over the vocabulary, so each rank holds logits
z[:, r-th block] only. Cross-entropy needs, per token, log sum_j exp z_j and the target's logit;
both are sums over the vocabulary, so they come from three per-token all-reduces of a scalar
instead of gathering [tokens, V] numbers:

    m      = max_j z_j                         all-reduce MAX   (for a stable exp)
    S      = sum_j exp(z_j - m)                all-reduce SUM
    z_y    = the target's logit (0 off-rank)   all-reduce SUM   (sent together with S)
    loss   = log S - (z_y - m)

The gradient needs no communication: d loss / d z_j = softmax_j - [j = y], and this rank has
softmax_j = exp(z_j - m) / S for its own j. Padded vocabulary entries get logit -inf, so they
take no probability and no gradient, and generation never samples them.

**Distillation** (``meshlm/training/distillation.py``) compares the student's sharded logits with
the teacher's, sharded alike, per token. With s = z_student / T and t = z_teacher / T, the
log-softmaxes need each model's max and sum-exp over the vocabulary -- all-reduces of a scalar
per token, as above -- and the KL itself is a sum over the vocabulary:

    m_s, m_t   = max_j s_j, max_j t_j                         one all-reduce MAX (both)
    S_s, S_t   = sum_j exp(s_j - m_s), sum_j exp(t_j - m_t)   one all-reduce SUM (both)
    log q_j    = s_j - m_s - log S_s,  log p_j = t_j - m_t - log S_t      (this rank's j)
    KL(p || q) = sum_j p_j (log p_j - log q_j)                a local sum, one all-reduce SUM

times T^2 (Hinton et al. 2015: the gradient's scale then does not depend on T). (Folding the KL sum into
the second all-reduce, as E_p[t - s] - Z_t + Z_s, would save one, but subtracts numbers of the
logits' size to get a KL that is often 1e-2: in fp32 it lost five digits.) The gradient
again needs no communication: d KL(p||q) / d s_j = q_j - p_j, d KL(q||p) / d s_j =
q_j (log q_j - log p_j - KL(q||p)), both from this rank's own j and the reduced scalars.
'cosine' is 1 - cos(z_student, z_teacher) per token: the dot product and both squared norms
are sums over the vocabulary, one all-reduce. The teacher gets no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.losses import DISTILL_LOSSES, IGNORE_INDEX
from meshlm.parallel.collectives import all_reduce_, gather_along, reduce_from_group, reduce_scatter_along
from meshlm.parallel.tensor.layers import ColumnParallelLinear
from meshlm.parallel.tensor.sharding import mark_shard, shard_parameter


def padded_vocab_size(vocab_size: int, tp_size: int, pad_multiple: int = 1) -> int:
    """The vocabulary rounded up to a multiple of tp * pad_multiple."""
    multiple = tp_size * pad_multiple
    return multiple * math.ceil(vocab_size / multiple)


def pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` (or a bias) with zero rows appended up to ``rows`` rows."""
    return F.pad(weight.detach(), (0, 0) * (weight.dim() - 1) + (0, rows - weight.shape[0]))


def vocab_range(local_vocab: int, context) -> tuple[int, int]:
    start = context.tp_rank * local_vocab
    return start, start + local_vocab


class VocabParallelEmbedding(nn.Module):
    """Rows [r V'/t, (r+1) V'/t) of the padded embedding matrix; ids [b, s] -> [b, s, h] (or
    [b, s/t, h] under SP), equal to the full lookup."""

    def __init__(self, weight: nn.Parameter, context):
        super().__init__()
        self.weight = weight
        self.context = context

    @classmethod
    @torch.no_grad()
    def from_full(cls, full: nn.Embedding, context, padded_size: int) -> "VocabParallelEmbedding":
        weight = shard_parameter(pad_rows(full.weight, padded_size).requires_grad_(full.weight.requires_grad),
                                 0, context, what="VocabParallelEmbedding")
        mark_shard(weight, 0, [padded_size], unpadded_size=full.num_embeddings)
        return cls(weight, context)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, end = vocab_range(self.weight.shape[0], self.context)
        off_rank = (input_ids < start) | (input_ids >= end)
        local_ids = (input_ids - start).masked_fill(off_rank, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(off_rank[..., None], 0.0)
        if self.context.sequence_parallel:
            return reduce_scatter_along(partial, dim=1, group=self.context.tp_group)
        return reduce_from_group(partial, self.context.tp_group)

    def extra_repr(self) -> str:
        return f"local_vocab={self.weight.shape[0]}, hidden={self.weight.shape[1]}, tp={self.context.tp_size}"


@torch.no_grad()
def vocab_parallel_head(output: nn.Linear, context, padded_size: int) -> ColumnParallelLinear:
    """The untied output head (and its bias, ``model.output_bias``), padded to ``padded_size`` rows
    (a padded entry's logit is masked wherever it is read) and split by vocabulary."""
    padded = nn.Linear(output.in_features, padded_size, bias=output.bias is not None, device=output.weight.device,
                       dtype=output.weight.dtype)
    for name, param in output.named_parameters(recurse=False):  # the weight, and the bias if there is one
        getattr(padded, name).copy_(pad_rows(param, padded_size)).requires_grad_(param.requires_grad)
    head = ColumnParallelLinear.from_full(padded, context)
    for param in head.parameters(recurse=False):
        mark_shard(param, 0, [padded_size], unpadded_size=output.out_features)
    return head


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits [n, V'/t] (see the module docstring)."""

    @staticmethod
    def forward(ctx, local_logits, labels, vocab_size, context):
        logits = local_logits.float()
        local_vocab = logits.shape[-1]
        start, _ = vocab_range(local_vocab, context)
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        if bool(padding.any()):
            logits = logits.masked_fill(padding, float("-inf"))
        row_max = logits.max(dim=-1).values
        _all_reduce(row_max, context, "max")
        exp = (logits - row_max[:, None]).exp()

        valid = labels != IGNORE_INDEX
        local_target = labels - start
        on_rank = valid & (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~on_rank, 0)
        target_logit = logits.gather(1, local_target[:, None]).squeeze(1).masked_fill(~on_rank, 0.0)
        sums = torch.stack((exp.sum(dim=-1), target_logit))  # one all-reduce for both sums
        _all_reduce(sums, context, "sum")
        sum_exp, target_logit = sums

        losses = (sum_exp.log() + row_max - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, local_target, on_rank, valid)
        ctx.logits_dtype = local_logits.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local_target, on_rank, valid = ctx.saved_tensors
        grad_losses = grad_losses.masked_fill(~valid, 0.0)
        grad = softmax * grad_losses[:, None]
        rows = on_rank.nonzero().squeeze(1)
        grad[rows, local_target[rows]] -= grad_losses[rows]
        return grad.to(ctx.logits_dtype), None, None, None


def _all_reduce(tensor: torch.Tensor, context, op: str) -> None:
    if context.tp_size > 1:
        all_reduce_(tensor, context.tp_group, op=op)


def reduce_token_losses(losses: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token losses [n] (0 where the label is IGNORE_INDEX) -> 'none' (shaped like ``labels``),
    'sum', or 'mean' over the tokens with a label (as ``F.cross_entropy``)."""
    if reduction == "none":
        return losses.view(labels.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (labels != IGNORE_INDEX).sum()


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, context, vocab_size: int,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of this rank's logits [..., V'/t] against full ``labels`` [...] (IGNORE_INDEX
    skips a token), without gathering the logits. 'mean' is over the tokens with a label (as
    ``F.cross_entropy``), 'sum' sums them, 'none' gives per-token losses (0 where ignored). The
    value is the same on every rank of the group."""
    losses = _VocabParallelCrossEntropy.apply(local_logits.flatten(0, -2), labels.flatten(), vocab_size, context)
    return reduce_token_losses(losses, labels, reduction)


class _VocabParallelDistillation(torch.autograd.Function):
    """Per-token distillation loss of vocab-sharded student logits [n, V'/t] against the
    teacher's [n, V'/t] (see the module docstring); the gradient goes to the student only."""

    @staticmethod
    def forward(ctx, student_local, teacher_local, labels, vocab_size, context, kind, temperature):
        compute_dtype = torch.promote_types(student_local.dtype, torch.float32)  # fp32, or fp64 in gradchecks
        student, teacher = student_local.to(compute_dtype), teacher_local.to(compute_dtype)
        start, _ = vocab_range(student.shape[-1], context)
        padding = torch.arange(start, start + student.shape[-1], device=student.device) >= vocab_size
        valid = labels != IGNORE_INDEX
        ctx.kind, ctx.temperature, ctx.logits_dtype = kind, temperature, student_local.dtype
        if kind == "cosine":
            losses, saved = _cosine_forward(student.masked_fill(padding, 0.0), teacher.masked_fill(padding, 0.0),
                                            context)
        else:
            losses, saved = _kl_forward(student / temperature, teacher / temperature, padding, context,
                                        reverse=kind == "reverse_kl")
            losses = losses * temperature ** 2
        ctx.save_for_backward(*saved, valid)
        return losses.masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad_losses):
        *saved, valid = ctx.saved_tensors
        grad_losses = grad_losses.masked_fill(~valid, 0.0)[:, None]
        if ctx.kind == "cosine":
            student, teacher, dot, student_norm, teacher_norm = saved
            grad = (teacher / (student_norm * teacher_norm)[:, None]
                    - student * (dot / (student_norm ** 3 * teacher_norm))[:, None]).neg_()
        elif ctx.kind == "reverse_kl":
            student_probs, log_ratio, kl = saved  # log_ratio: log q - log p
            grad = student_probs * (log_ratio - kl[:, None]) * ctx.temperature
        else:
            student_probs, teacher_probs = saved
            grad = (student_probs - teacher_probs) * ctx.temperature
        return (grad * grad_losses).to(ctx.logits_dtype), None, None, None, None, None, None


def _kl_forward(student, teacher, padding, context, reverse: bool) -> tuple[torch.Tensor, tuple]:
    """KL per token of temperature-scaled logits s, t (the module docstring's pieces), and what
    the backward needs."""
    student, teacher = student.masked_fill(padding, float("-inf")), teacher.masked_fill(padding, float("-inf"))
    maxima = torch.stack((student.max(dim=-1).values, teacher.max(dim=-1).values))
    _all_reduce(maxima, context, "max")
    student_exp, teacher_exp = (student - maxima[0, :, None]).exp(), (teacher - maxima[1, :, None]).exp()
    sums = torch.stack((student_exp.sum(dim=-1), teacher_exp.sum(dim=-1)))
    _all_reduce(sums, context, "sum")
    log_normalizers = maxima + sums.log()  # Z_s, Z_t
    # log q_j - log p_j, 0 on padding (where both are -inf and both probabilities 0)
    log_ratio = ((student - log_normalizers[0, :, None]) - (teacher - log_normalizers[1, :, None])).masked_fill(
        padding, 0.0)
    student_probs = student_exp.div_(sums[0, :, None])
    if reverse:  # KL(q || p) = sum_j q_j (log q_j - log p_j)
        kl = (student_probs * log_ratio).sum(dim=-1)
        _all_reduce(kl, context, "sum")
        return kl, (student_probs, log_ratio, kl)
    teacher_probs = teacher_exp.div_(sums[1, :, None])  # KL(p || q) = sum_j p_j (log p_j - log q_j)
    kl = -(teacher_probs * log_ratio).sum(dim=-1)
    _all_reduce(kl, context, "sum")
    return kl, (student_probs, teacher_probs)


def _cosine_forward(student, teacher, context) -> tuple[torch.Tensor, tuple]:
    """1 - cos(z_student, z_teacher) per token (padding already zero), and what the backward needs."""
    sums = torch.stack(((student * teacher).sum(-1), student.square().sum(-1), teacher.square().sum(-1)))
    _all_reduce(sums, context, "sum")
    dot, student_norm, teacher_norm = sums[0], sums[1].sqrt().clamp_min(1e-8), sums[2].sqrt().clamp_min(1e-8)
    return 1.0 - dot / (student_norm * teacher_norm), (student, teacher, dot, student_norm, teacher_norm)


def vocab_parallel_distillation(student_local: torch.Tensor, teacher_local: torch.Tensor, labels: torch.Tensor,
                                context, vocab_size: int, kind: str = "kl", temperature: float = 1.0,
                                reduction: str = "mean") -> torch.Tensor:
    """Distillation loss of this rank's student logits [..., V'/t] against the teacher's (same
    shape), without gathering either: 'kl'/'forward_kl' = T^2 KL(teacher || student), 'reverse_kl'
    = T^2 KL(student || teacher) of the softmaxes at temperature T, 'cosine' = 1 - cosine
    similarity of the raw logit vectors (T has no effect). Tokens whose label is IGNORE_INDEX are
    skipped: 'mean' is over the others (as the LM loss), 'sum' sums, 'none' gives per-token
    losses. The value is the same on every rank of the TP group; the teacher gets no gradient."""
    if kind not in DISTILL_LOSSES:
        raise ValueError(f"distillation loss {kind!r} is not one of {', '.join(DISTILL_LOSSES)}.")
    kind = "forward_kl" if kind == "kl" else kind
    losses = _VocabParallelDistillation.apply(student_local.flatten(0, -2), teacher_local.detach().flatten(0, -2),
                                              labels.flatten(), vocab_size, context, kind, float(temperature))
    return reduce_token_losses(losses, labels, reduction)


def gather_vocab_logits(local_logits: torch.Tensor, context, vocab_size: int) -> torch.Tensor:
    """Full logits [..., vocab_size] from every rank's vocabulary slice, padding dropped (for
    evaluation and generation; the loss never needs them)."""
    return gather_along(local_logits, dim=-1, group=context.tp_group)[..., :vocab_size]


__all__ = ["padded_vocab_size", "VocabParallelEmbedding", "vocab_parallel_head",
           "vocab_parallel_cross_entropy", "vocab_parallel_distillation", "gather_vocab_logits", "IGNORE_INDEX"]
