"""How many floating-point operations a meshlm model does per token: the numerator of MFU.

Model FLOPs utilization (MFU, Chowdhery et al. 2022 "PaLM", appendix B) is the FLOPs the *model*
needs per second of training, divided by the hardware's peak. "The model needs" is a convention,
and this file is its one definition:

- **Only matmuls count**, at 2 FLOPs per multiply-add (a [m x k] by [k x n] product is 2mkn).
  Norms, activations, softmax, RoPE and the SSD decay masks are O(width) per token and are left
  out, as in every paper below; so are biases. Embedding lookups cost nothing (a gather).
- **Backward = 2 x forward.** A matmul's backward is two matmuls of the same size (grad of the
  input and grad of the weight), so one training step is 3 x forward. Work redone by activation
  recomputation or by a fused attention kernel's backward is *not* counted: that is the
  "hardware FLOPs" of Korthikanti et al. 2022 (§5), not model FLOPs.
- **Per token, for sequences of ``seq_len`` tokens.** Projections cost the same for every token;
  attention's scores and weighted sum grow with the sequence, and the SSD scan depends on how the
  sequence splits into chunks, so per-token cost depends on ``seq_len``.

For a dense transformer this gives the familiar formulas: each weight matrix of N parameters
costs 2N per token forward, hence 6N per token for training (Kaplan et al. 2020, §2.1), plus
attention's sequence term. Narayanan et al. 2021 (appendix, "floating-point operations") count
the scores Q K^T and the weighted sum over values as 2 s^2 h each per layer and sequence, i.e.
the **full s x s square** although causal attention needs only the lower half; PaLM does the
same (6N + 12 L H Q T). We follow them, and that also matches
``torch.utils.flop_counter.FlopCounterMode``, which counts every SDPA kernel (flash, memory
efficient, cuDNN) as two full-square batched matmuls whatever the mask. (Its table has no entry
for the CPU flash kernel, nor for the MoE grouped GEMM, and overcounts depthwise-conv weight
gradients; ``tests/models/test_flops.py`` fills those in to compare.)

Per block kind, for a sequence of T tokens (h hidden, a/k query/KV heads of width d):

- attention ``*``: q, k, v, o projections 2h(a d + 2 k d + a d) T (grouped-query aware) plus
  scores and weighted sum 2 a d T^2 each.
- MLP ``-``: 2 h F T per projection; SwiGLU has three (gate, up, down), the others two.
- MoE ``E``: router 2 h E T, plus top_k experts per token, plus the shared expert and the
  LatentMoE in/out projections. We count the *nominal* top_k: a capacity limit that drops
  assignments lowers the work actually done but not the model FLOPs.
- Mamba-2 ``M``: in_proj and out_proj, the depthwise causal convolution (K multiply-adds per
  channel and token over d_inner + 2 G N channels), and the SSD scan (Dao & Gu 2024, §6) as
  ``ssd_fast.py`` computes it, with c = ceil(T / Q) chunks of Q tokens (the last one
  zero-padded and computed in full): per chunk, scores C B^T 2 Q^2 N once per B/C *group*, and
  per chunk and head scores times x 2 Q^2 P, chunk states B^T x 2 Q N P, state to output
  C h 2 Q N P; and the inter-chunk recurrence as one (c+1) x c matmul per head over [P x N]
  states, 2 (c+1) c P N (an initial state, as under context parallelism, adds an elementwise
  term). Per token that is about 2 Q (G N + H P) + 4 H N P, linear in T for the sequence as a
  whole, plus the state passing 2 H (c+1) c P N / T, which grows like
  T / Q^2 per token and stays small until the sequence has hundreds of chunks (mamba_ssm's
  fused kernels pass states with a sequential, elementwise scan over chunks instead, which is
  no matmul at all). (The reference ``ssd.py`` repeats B and C for every head and so computes
  the scores H / G times.)
- linear ``L``: its one hidden x hidden matrix, 2 h^2 T; no-op ``0``: nothing.
- the output head costs 2 h V per token (tied or not), and each multi-token-prediction depth
  adds its 2h -> h projection, its blocks and another pass through the head.

Every block is measured with its own sizes, ``config.for_block(index)`` (``model.block_overrides``):
a heterogeneous stack's FLOPs are the sum of its blocks', and pipeline stages are balanced by them.

The SSD scan counts its padded last chunk, as our implementation computes it, so that
FlopCounterMode agrees exactly; the conv's multiply-adds are elementwise ops, which
FlopCounterMode does not see (``causal_conv.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.mlp import is_gated
from meshlm.models.pattern import LINEAR, NO_OP, parse_pattern

BACKWARD_TO_FORWARD = 2
"""Backward matmul FLOPs per forward matmul FLOP (grad of input + grad of weight)."""


@dataclass(frozen=True)
class BlockFlops:
    """Forward matmul FLOPs of one block over one sequence, by term (exact integers)."""

    kind: str
    seq_len: int
    terms: dict[str, int]

    @property
    def per_sequence(self) -> int:
        return sum(self.terms.values())

    @property
    def per_token(self) -> float:
        return self.per_sequence / self.seq_len


def linear_flops(in_features: int, out_features: int, tokens: int) -> int:
    """A [tokens x in] by [in x out] matmul: one multiply-add per weight per token."""
    return 2 * in_features * out_features * tokens


def mlp_terms(hidden_size: int, ffn_size: int, activation: str, tokens: int) -> dict[str, int]:
    """Dense MLP (or one expert): gate (when gated), up and down projections."""
    terms = {"up_proj": linear_flops(hidden_size, ffn_size, tokens),
             "down_proj": linear_flops(ffn_size, hidden_size, tokens)}
    if is_gated(activation):
        terms["gate_proj"] = linear_flops(hidden_size, ffn_size, tokens)
    return terms


def attention_terms(config: ModelConfig, seq_len: int) -> dict[str, int]:
    hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads,
                                         config.resolved_num_kv_heads, config.resolved_head_dim)
    return {
        "q_proj": linear_flops(hidden, heads * head_dim, seq_len),
        "kv_proj": 2 * linear_flops(hidden, kv_heads * head_dim, seq_len),
        # Full square (see the module docstring): every query against every key, then values.
        "scores": 2 * heads * seq_len * seq_len * head_dim,
        "attend": 2 * heads * seq_len * seq_len * head_dim,
        "o_proj": linear_flops(heads * head_dim, hidden, seq_len),
    }


def moe_terms(config: ModelConfig, seq_len: int) -> dict[str, int]:
    hidden, latent = config.hidden_size, config.moe_latent_size
    expert_width = latent or hidden
    expert = mlp_terms(expert_width, config.resolved_moe_ffn_hidden_size, config.mlp_activation,
                       tokens=seq_len * config.moe_top_k)
    terms = {"router": linear_flops(hidden, config.moe_num_experts, seq_len),
             "experts": sum(expert.values())}
    if latent:
        terms["latent_in_proj"] = linear_flops(hidden, latent, seq_len)
        terms["latent_out_proj"] = linear_flops(latent, hidden, seq_len)
    if config.moe_shared_expert_ffn_hidden_size:
        shared = mlp_terms(hidden, config.moe_shared_expert_ffn_hidden_size, config.mlp_activation, seq_len)
        terms["shared_expert"] = sum(shared.values())
    return terms


def ssd_scan_terms(seq_len: int, chunk_size: int, num_heads: int, head_dim: int,
                   state_size: int, num_groups: int) -> dict[str, int]:
    """The five matmuls of ``ssd_fast.ssd_chunked_scan_fast`` for one sequence (see the module docstring)."""
    chunks = math.ceil(seq_len / chunk_size)
    per_chunk_and_head = 2 * num_heads * chunks  # times the matmul sizes below
    return {
        "ssd_scores": 2 * num_groups * chunks * chunk_size * chunk_size * state_size,
        "ssd_diagonal_output": per_chunk_and_head * chunk_size * chunk_size * head_dim,
        "ssd_chunk_states": per_chunk_and_head * chunk_size * head_dim * state_size,
        "ssd_state_passing": 2 * num_heads * (chunks + 1) * chunks * head_dim * state_size,
        "ssd_state_output": per_chunk_and_head * chunk_size * state_size * head_dim,
    }


def mamba_terms(config: ModelConfig, seq_len: int) -> dict[str, int]:
    hidden, inner, heads = config.hidden_size, config.mamba_inner_size, config.resolved_mamba_num_heads
    bc_size = config.mamba_num_groups * config.mamba_state_size
    conv_channels, kernel = inner + 2 * bc_size, config.mamba_conv_kernel
    terms = {
        "in_proj": linear_flops(hidden, 2 * inner + 2 * bc_size + heads, seq_len),
        # Depthwise: one multiply-add per channel, tap and token.
        "conv": 2 * conv_channels * kernel * seq_len,
        "out_proj": linear_flops(inner, hidden, seq_len),
    }
    terms.update(ssd_scan_terms(seq_len, config.mamba_chunk_size, heads, config.mamba_head_dim,
                                config.mamba_state_size, config.mamba_num_groups))
    return terms


def block_flops(kind: str, config: ModelConfig, seq_len: int) -> BlockFlops:
    """Forward matmul FLOPs of one block of ``kind`` over ``seq_len`` tokens, sized by ``config``
    (for block i of a model: ``config.for_block(i)``, as ``model_block_flops`` does)."""
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ConfigError(f"seq_len={seq_len!r} must be a positive integer (tokens per sequence).")
    if kind == "*":
        terms = attention_terms(config, seq_len)
    elif kind == "-":
        terms = mlp_terms(config.hidden_size, config.resolved_ffn_hidden_size, config.mlp_activation, seq_len)
    elif kind == "E":
        terms = moe_terms(config, seq_len)
    elif kind == "M":
        terms = mamba_terms(config, seq_len)
    elif kind == LINEAR:
        terms = {"linear": linear_flops(config.hidden_size, config.hidden_size, seq_len)}
    elif kind == NO_OP:
        terms = {}
    else:
        raise ConfigError(f"block kind {kind!r} is not one of M * - E L 0.")
    return BlockFlops(kind, seq_len, terms)


def model_block_flops(config: ModelConfig, seq_len: int) -> list[BlockFlops]:
    """Forward FLOPs of each block of the main stack, each with its own sizes (``config.for_block``)."""
    return [block_flops(kind, config.for_block(index), seq_len) for index, kind in enumerate(config.block_kinds)]


def head_flops(config: ModelConfig, seq_len: int) -> int:
    """The output projection hidden -> vocab (the embedding lookup itself costs no matmul)."""
    return linear_flops(config.hidden_size, config.vocab_size, seq_len)


def mtp_depth_flops(config: ModelConfig, seq_len: int) -> int:
    """One multi-token-prediction depth: its 2h -> h projection, its blocks and the shared head."""
    kinds = parse_pattern(config.mtp_pattern, "model.mtp_pattern").kinds
    blocks = sum(block_flops(kind, config, seq_len).per_sequence for kind in kinds)
    return linear_flops(2 * config.hidden_size, config.hidden_size, seq_len) + blocks + head_flops(config, seq_len)


def model_flops_breakdown(config: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward FLOPs of one sequence by part: 'blocks.{i}', 'head', 'mtp.{k}'."""
    parts = {f"blocks.{index}": flops.per_sequence for index, flops in enumerate(model_block_flops(config, seq_len))}
    parts["head"] = head_flops(config, seq_len)
    for depth in range(config.mtp_depth):
        parts[f"mtp.{depth}"] = mtp_depth_flops(config, seq_len)
    return parts


def model_flops_per_sequence(config: ModelConfig, seq_len: int, include_backward: bool = True) -> int:
    """Model FLOPs of one sequence of ``seq_len`` tokens: forward, or forward + backward (3x)."""
    forward = sum(model_flops_breakdown(config, seq_len).values())
    return forward * (1 + BACKWARD_TO_FORWARD) if include_backward else forward


def model_flops_per_token(config: ModelConfig, seq_len: int, include_backward: bool = True) -> float:
    """Model FLOPs per token for training on sequences of ``seq_len`` tokens (the MFU numerator).

    MFU = model_flops_per_token * tokens_per_second / peak_flops_per_second.
    """
    return model_flops_per_sequence(config, seq_len, include_backward) / seq_len


__all__ = ["BlockFlops", "block_flops", "model_block_flops", "model_flops_breakdown", "model_flops_per_sequence",
           "model_flops_per_token", "ssd_scan_terms", "BACKWARD_TO_FORWARD"]
