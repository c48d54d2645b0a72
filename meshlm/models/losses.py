"""Output projection and cross-entropy fused, one chunk of tokens at a time, without full logits.

The language-model loss is

    loss = 1/N * sum_t [ logsumexp_v(z_tv) - z_t,y_t ],      z = H W^T (+ b)   ([tokens, vocab])

over the N tokens whose label is not ignored. Written the obvious way it materializes z in
fp32, then its log-softmax, and in backward a gradient of the same size: for 2048 tokens and a
vocabulary of 8192 that is three 64 MB tensors per step, and with a vocabulary of 128k it is the
largest activation of the whole model. Yet every one of them is only needed briefly, because the
gradient of the loss with respect to the logits has a closed form that the forward pass already
has all the ingredients for:

    dloss/dz_t = (softmax(z_t) - onehot(y_t)) / N             (0 for ignored tokens)
    dloss/dH   = dloss/dz W            dloss/dW = (dloss/dz)^T H        dloss/db = sum_t dloss/dz_t

So the forward pass walks over the tokens a chunk at a time (a chunk's logits are a few MB): it
computes the chunk's logits, their fp32 log-softmax and the chunk's loss terms and, when
gradients are wanted, turns the log-probabilities into (softmax - onehot) / N in place and
immediately multiplies them into the chunk's rows of dloss/dH and into the running sum dloss/dW.
The backward pass has nothing left to do but scale those two stored gradients by the incoming
gradient of the (scalar) loss. The head's memory falls from several [tokens, vocab] tensors to
two reused [chunk, vocab] buffers plus one weight-sized gradient, and with it the time spent
allocating, zero-filling and sweeping those tensors (on the 25M-parameter benchmark model, 2048
tokens x 8192 vocabulary, the head's forward + backward went from ~410 to ~340 ms in fp32 and
from ~190 to ~115 ms in bf16 on 2 CPU cores; the matmuls are unchanged). This is the "fused
linear cross entropy" of the Liger kernels (Hsu et al. 2024, "Liger Kernel: Efficient Triton
Kernels for LLM Training"), here in plain PyTorch, so it runs on any device. (PyTorch 2.13 adds
``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``; on that benchmark it was
slower than the unfused loss, and the project supports older PyTorch.)

**How big a chunk** depends on the device (``default_tokens_per_chunk``). On a CPU small chunks
win: a chunk's logits stay in cache, and a matmul of 256 rows is as efficient as a big one. On a
GPU each chunk costs more than its arithmetic: its three matmuls each re-read the whole
[vocab, hidden] weight, its dozen kernels are launched one by one, and the fp32 sum of the weight
gradient reads and writes a weight-sized tensor. With the CPU's rule, the 1B Llama shape of
``bench/gpu_throughput.py`` (32768 tokens a micro-batch, vocabulary 32000) took 128 chunks of
256 tokens. By our estimate (bytes moved at an H200's 4.8 TB/s, not a measurement) the fp32 sums
of the weight gradient alone moved 84 GB, about 17 ms, and matmuls of 256 rows run below full
speed: some 20-30 ms of the 0.49 s step, against the 43 ms by which meshlm trailed the plain
PyTorch loop there. So an accelerator takes chunks of about 2^27 logits (4194 tokens
at that vocabulary: 8 chunks, 0.8 GB of chunk buffers in bf16 + fp32) and never fewer than 1024
tokens, which keeps each matmul compute-bound even at a 256k vocabulary. ``linear_cross_entropy``
then evens the chunks out (32768 tokens in 8 chunks of 4096, not 7 of 4194 and one of 3410).

**The softmax part, compiled.** Between its matmuls a chunk's eager kernels sweep the [chunk,
vocab] logits several times: the log-softmax reads them twice and writes fp32 log-probabilities,
the probabilities are exponentiated in place, the one-hot subtracted, the scale multiplied in
and the result cast back -- some 22 bytes per logit. On the H200 the fused loss of the 1B dense
shape took 33 ms, of which its matmuls at the step's measured matmul rate account for 18.
``softmax_cross_entropy_chunk`` is the same arithmetic as one function of plain ops (the
log-sum-exp, the label's logit, then ``(exp(z - lse) - onehot) * scale`` in one expression),
which Inductor turns into a reduction and one pointwise kernel: the logits read twice and the
gradient written once, about 6 bytes per logit. ``train.compile=true`` hands the compiled
function to the model (``meshlm/training/compile.py``); without it the eager kernels run.

Precision: the matmuls run in the inputs' dtype (as ``F.linear`` would, so bf16 logits are
rounded exactly as in the unfused path), the log-softmax, softmax and loss are fp32, the weight gradient is summed over chunks in fp32, and the gradients come back
in the inputs' dtypes. Like ``F.cross_entropy`` with mean reduction, a batch whose labels are
all ignored gives a nan loss and zero gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from meshlm.models.softcap import soft_cap, soft_cap_slope, soft_cap_slope_

IGNORE_INDEX = -100
"""Label value that contributes neither to the loss nor to the token count."""

DISTILL_LOSSES = ("kl", "forward_kl", "reverse_kl", "cosine")
"""Per-token distillation losses (``train.distill_loss``; computed by ``vocab_parallel_distillation``
in meshlm/parallel/tensor/vocab_parallel.py): 'kl' is 'forward_kl', KL(teacher || student)."""

CHUNK_ELEMENTS = 2 ** 22
"""Logits per chunk on a CPU (16 MB in fp32): a few chunk-sized buffers instead of several
full-size ones."""

MIN_TOKENS_PER_CHUNK = 256
"""Floor for large vocabularies on a CPU: every chunk re-reads the whole weight, and a chunk's
matmuls only stay compute-bound (rather than bound by reading the weight) over enough tokens."""

ACCELERATOR_CHUNK_ELEMENTS = 2 ** 27
"""Logits per chunk on a GPU (512 MB in fp32): few chunks, so that the weight is re-read, the
kernels launched and the weight gradient summed a handful of times a step (module docstring)."""

ACCELERATOR_MIN_TOKENS_PER_CHUNK = 1024
"""Floor on a GPU: a matmul of 1024 rows re-reading a bf16 weight does about 1000 FLOPs a byte, well
above what keeps an H100's tensor cores busy (about 300)."""


def default_tokens_per_chunk(vocab_size: int, device_type: str = "cpu") -> int:
    """The most tokens one chunk of the fused loss takes on a device of this type (module docstring)."""
    if device_type == "cpu":
        return max(MIN_TOKENS_PER_CHUNK, CHUNK_ELEMENTS // vocab_size)
    return max(ACCELERATOR_MIN_TOKENS_PER_CHUNK, ACCELERATOR_CHUNK_ELEMENTS // vocab_size)


def even_chunks(num_tokens: int, most_tokens_per_chunk: int) -> int:
    """Tokens per chunk when ``num_tokens`` are cut into as few chunks of at most
    ``most_tokens_per_chunk`` as possible, all of nearly one size."""
    chunks = max(1, -(-num_tokens // most_tokens_per_chunk))
    return max(1, -(-num_tokens // chunks))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight^T (+ bias)`` against ``labels``, computed chunk by chunk.

    hidden [tokens, hidden_size], weight [vocab, hidden_size], bias [vocab] or None (an output
    head's bias, ``model.output_bias``), labels [tokens] (IGNORE_INDEX to skip). With
    ``compute_grads`` the forward also computes the gradients (see the module docstring); without
    it, backward is not available. ``softcap``: the logits are soft-capped
    first (``model.final_logit_softcap``), z -> c tanh(z / c), and dloss/dz carries the cap's slope.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                tokens_per_chunk: int, compute_grads: bool, chunk_softmax=None,
                softcap: float | None = None) -> torch.Tensor:
        valid = (labels != IGNORE_INDEX).unsqueeze(1)
        num_valid = valid.sum()
        grad_scale = torch.where(valid, 1.0 / num_valid, 0.0)  # dloss/dloss_t: 1/N, or 0 if ignored
        safe_labels = labels.unsqueeze(1).masked_fill(~valid, 0)
        num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
        chunk_shape = (min(tokens_per_chunk, num_tokens), vocab_size)
        logits_buffer = hidden.new_empty(chunk_shape)  # input dtype: matmul output, then dloss/dlogits
        fused = chunk_softmax is not None and compute_grads  # the compiled softmax needs no fp32 buffer
        log_probs_buffer = None if fused else hidden.new_empty(chunk_shape, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if compute_grads and ctx.needs_input_grad[0] else None
        grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) \
            if compute_grads and ctx.needs_input_grad[1] else None
        grad_bias = bias.new_zeros(bias.shape, dtype=torch.float32) \
            if bias is not None and compute_grads and ctx.needs_input_grad[2] else None
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, num_tokens, tokens_per_chunk):
            rows = slice(start, min(start + tokens_per_chunk, num_tokens))
            out = logits_buffer[: rows.stop - rows.start]
            logits = (torch.mm(hidden[rows], weight.t(), out=out) if bias is None
                      else torch.addmm(bias, hidden[rows], weight.t(), out=out))
            if fused:
                chunk_loss, grad_logits = chunk_softmax(logits, safe_labels[rows], valid[rows], grad_scale[rows],
                                                        softcap)
                loss_sum += chunk_loss
            else:
                capped = None if softcap is None else soft_cap(logits.float(), softcap)
                log_probs = torch.log_softmax(logits if capped is None else capped, dim=1, dtype=torch.float32,
                                              out=log_probs_buffer[: len(logits)])
                loss_sum -= torch.where(valid[rows], log_probs.gather(1, safe_labels[rows]), 0.0).sum()
                if not compute_grads:
                    continue
                if capped is None:
                    grad_logits = softmax_minus_onehot(log_probs, safe_labels[rows], grad_scale[rows], out=logits)
                else:  # dloss/dz = dloss/dcapped * (1 - (capped / c)^2), the slope made in place of capped
                    grad_capped = softmax_minus_onehot(log_probs, safe_labels[rows], grad_scale[rows], out=log_probs)
                    grad_logits = torch.mul(grad_capped, soft_cap_slope_(capped, softcap), out=logits)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                accumulate_weight_grad(grad_weight, grad_logits, hidden[rows])
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0, dtype=torch.float32)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                              None if grad_bias is None else grad_bias.to(bias.dtype))
        return loss_sum / num_valid

    @staticmethod
    @once_differentiable  # the stored gradients are constants: no gradient of gradients
    def backward(ctx, grad_loss: torch.Tensor):
        scaled = [None if grad is None else grad * grad_loss.to(grad.dtype) for grad in ctx.saved_tensors]
        return *scaled, None, None, None, None, None


def softmax_cross_entropy_chunk(logits: torch.Tensor, safe_labels: torch.Tensor, valid: torch.Tensor,
                                grad_scale: torch.Tensor, softcap: float | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed loss terms and dloss/dlogits, in plain ops for the compiler (module docstring).

    logits [n, vocab] (any float dtype), safe_labels [n, 1] (ignored tokens' labels replaced by any
    valid index), valid [n, 1] bool, grad_scale [n, 1] fp32. Returns the fp32 sum over valid tokens
    of ``logsumexp(z) - z[label]`` and ``(softmax(z) - onehot(label)) * grad_scale`` in the logits'
    dtype: what the eager path computes, to fp32 rounding. ``softcap``: of the capped logits, the
    gradient with respect to the uncapped ones.
    """
    logits32 = logits.float() if softcap is None else soft_cap(logits.float(), softcap)
    log_sum_exp = torch.logsumexp(logits32, dim=1, keepdim=True)
    loss_sum = torch.where(valid, log_sum_exp - logits32.gather(1, safe_labels), 0.0).sum()
    onehot = torch.arange(logits.shape[1], device=logits.device) == safe_labels
    grad = (torch.exp(logits32 - log_sum_exp) - onehot.to(torch.float32)) * grad_scale
    if softcap is not None:
        grad = grad * soft_cap_slope(logits32, softcap)
    return loss_sum, grad.to(logits.dtype)


def softmax_minus_onehot(log_probs: torch.Tensor, safe_labels: torch.Tensor, grad_scale: torch.Tensor,
                         out: torch.Tensor) -> torch.Tensor:
    """dloss/dlogits = (softmax - onehot) * grad_scale, written into ``out`` (in its dtype).

    Consumes ``log_probs``: it becomes the probabilities.
    """
    probabilities = log_probs.exp_()
    probabilities.scatter_add_(1, safe_labels, torch.full_like(safe_labels, -1, dtype=probabilities.dtype))
    return torch.mul(probabilities, grad_scale, out=out)


def accumulate_weight_grad(grad_weight_sum: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight_sum += grad_logits^T hidden, summed in fp32 across chunks."""
    if grad_weight_sum.dtype == grad_logits.dtype:
        grad_weight_sum.addmm_(grad_logits.t(), hidden)
    else:
        grad_weight_sum += torch.mm(grad_logits.t(), hidden)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         tokens_per_chunk: int | None = None, chunk_softmax=None,
                         softcap: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``F.linear(hidden, weight, bias)`` without the full logits.

    hidden [..., hidden_size], labels [...] (same leading shape), weight [vocab, hidden_size], bias
    [vocab] or None.
    Gradients are computed in the forward pass only when autograd will need them.
    ``chunk_softmax``: ``softmax_cross_entropy_chunk`` or a compiled version of it, for the
    training forward's softmax part (None: the eager kernels; module docstring). ``softcap``: of
    the logits soft-capped at it (``model.final_logit_softcap``).
    """
    hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    labels = labels.reshape(-1)
    chunk = tokens_per_chunk or even_chunks(hidden.shape[0], default_tokens_per_chunk(weight.shape[0],
                                                                                  hidden.device.type))
    compute_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                                 or (bias is not None and bias.requires_grad))
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, chunk, compute_grads, chunk_softmax, softcap)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose label is not IGNORE_INDEX."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
