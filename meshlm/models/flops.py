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
  scores and weighted sum 2 a d T^2 each. With a sliding window w < T (``model.sliding_window``)
  they count the rectangles ``windowed_attention`` computes, as FlopCounterMode does: the first
  chunk's w x w, then w x 2w for each of the other ceil(T / w) - 1 chunks (the last one padded).
- latent attention ``*`` with ``model.attention_type=mla`` (DeepSeek-V2 §2.1,
  ``latent_attention.py``; r the KV latent, r_q the query latent, d_n + d_r the query/key head,
  d_v the value head): the query latent 2 h r_q T and its up-projection 2 r_q a (d_n + d_r) T
  (or one direct 2 h a (d_n + d_r) T), the KV latent with the shared rotary key 2 h (r + d_r) T,
  its up-projection to keys and values 2 r a (d_n + d_v) T, o 2 a d_v h T; scores 2 a (d_n + d_r)
  per query-key pair, the weighted sum 2 a d_v. Its terms carry the layer names (``q_a_proj``,
  ``kv_b_proj``, ...), so that a planner can tell the down-projections tensor parallelism
  replicates from the ones it splits.
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
- LoRA (``model.lora_rank`` r): each adapter costs 2 r (in + out) per token forward, and training
  needs no weight gradient of the frozen weights, so a step is 2 x forward + the matmuls between
  two activations (attention's scores and weighted sum, the SSD scan) + 3 x the adapters.

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
from meshlm.models.attention import window_chunks
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
    return {name: linear_flops(in_features, out_features, tokens)
            for name, in_features, out_features in mlp_layers(hidden_size, ffn_size, activation)}


def projection_flops(kind: str, config: ModelConfig, seq_len: int) -> dict[str, int]:
    """{name: forward FLOPs over ``seq_len`` tokens} of the linear layers of a ``kind`` block
    (``block_linear_layers``)."""
    return {name: linear_flops(in_features, out_features, seq_len)
            for name, in_features, out_features in block_linear_layers(kind, config)}


def attended_pairs(seq_len: int, window: int | None) -> int:
    """Query-key pairs whose scores the attention core computes over one sequence: the full square
    (see the module docstring), or with a sliding ``window`` shorter than the sequence the chunks
    of ``windowed_attention``: w x w, then w x 2w per further chunk."""
    if window is None or window >= seq_len:
        return seq_len * seq_len
    return window * window + (window_chunks(seq_len, window) - 1) * window * 2 * window


def attention_terms(config: ModelConfig, seq_len: int) -> dict[str, int]:
    """q/kv projections (MLA: one term per layer), scores, weighted sum, o (module docstring)."""
    heads = config.num_attention_heads
    projections = projection_flops("*", config, seq_len)
    pairs = attended_pairs(seq_len, config.sliding_window)  # the block's own config: None for full blocks
    if config.attention_type == "mla":
        terms = {name: flops for name, flops in projections.items() if name != "o_proj"}
    else:
        terms = {"q_proj": projections["q_proj"], "kv_proj": projections["k_proj"] + projections["v_proj"]}
    # Every query against every key it is scored with (heads of d_n + d_r under MLA), then values (d_v).
    terms["scores"] = 2 * heads * pairs * config.resolved_head_dim
    terms["attend"] = 2 * heads * pairs * config.resolved_value_head_dim
    terms["o_proj"] = projections["o_proj"]
    return terms


def moe_terms(config: ModelConfig, seq_len: int) -> dict[str, int]:
    hidden, latent = config.hidden_size, config.moe_latent_size
    expert_width = latent or hidden
    expert = mlp_terms(expert_width, config.resolved_moe_ffn_hidden_size, config.mlp_activation,
                       tokens=seq_len * config.moe_top_k)
    terms = {"router": linear_flops(hidden, config.moe_num_experts, seq_len),
             "experts": sum(expert.values())}
    if latent:
        projections = projection_flops("E", config, seq_len)
        terms.update({name: projections[name] for name in ("latent_in_proj", "latent_out_proj")})
    if config.moe_shared_expert_ffn_hidden_size:
        shared = mlp_terms(hidden, config.moe_shared_expert_ffn_hidden_size, config.mlp_activation, seq_len)
        terms["shared_expert"] = sum(shared.values())
    if config.moe_shared_expert_gate:
        terms["shared_expert_gate"] = linear_flops(hidden, 1, seq_len)
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
    inner, heads = config.mamba_inner_size, config.resolved_mamba_num_heads
    bc_size = config.mamba_num_groups * config.mamba_state_size
    conv_channels, kernel = inner + 2 * bc_size, config.mamba_conv_kernel
    projections = projection_flops("M", config, seq_len)
    terms = {
        "in_proj": projections["in_proj"],
        # Depthwise: one multiply-add per channel, tap and token.
        "conv": 2 * conv_channels * kernel * seq_len,
        "out_proj": projections["out_proj"],
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


def mtp_depth_flops(config: ModelConfig, seq_len: int, depth: int = 0) -> int:
    """Multi-token-prediction depth ``depth``: its 2h -> h projection, its blocks (each with its own
    config: they count on after the main stack's, ``config.for_block``) and the shared head."""
    kinds = parse_pattern(config.mtp_pattern, "model.mtp_pattern").kinds
    first = config.num_blocks + depth * len(kinds)
    blocks = sum(block_flops(kind, config.for_block(first + offset), seq_len).per_sequence
                 for offset, kind in enumerate(kinds))
    return linear_flops(2 * config.hidden_size, config.hidden_size, seq_len) + blocks + head_flops(config, seq_len)


def mtp_flops(config: ModelConfig, seq_len: int) -> int:
    """Every multi-token-prediction depth's forward FLOPs over one sequence."""
    return sum(mtp_depth_flops(config, seq_len, depth) for depth in range(config.mtp_depth))


def model_flops_breakdown(config: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward FLOPs of one sequence by part: 'blocks.{i}', 'head', 'mtp.{k}'."""
    parts = {f"blocks.{index}": flops.per_sequence for index, flops in enumerate(model_block_flops(config, seq_len))}
    parts["head"] = head_flops(config, seq_len)
    for depth in range(config.mtp_depth):
        parts[f"mtp.{depth}"] = mtp_depth_flops(config, seq_len, depth)
    return parts


ACTIVATION_TERMS = ("scores", "attend", "ssd_scores", "ssd_diagonal_output", "ssd_chunk_states", "ssd_state_passing",
                    "ssd_state_output")
"""Block terms whose matmuls multiply two activations (no weight): both their gradients are needed
even when every weight is frozen."""


def block_linear_layers(kind: str, config: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of the linear layers a LoRA adapter may ride on in a block
    of ``kind`` sized by ``config`` (``model.lora_targets``' names)."""
    hidden = config.hidden_size
    if kind == "*" and config.attention_type == "mla":
        return latent_attention_layers(config)
    if kind == "*":
        query, key_value = config.num_attention_heads * config.resolved_head_dim, \
            config.resolved_num_kv_heads * config.resolved_head_dim
        return [("q_proj", hidden, query), ("k_proj", hidden, key_value), ("v_proj", hidden, key_value),
                ("o_proj", query, hidden)]
    if kind == "-":
        return mlp_layers(hidden, config.resolved_ffn_hidden_size, config.mlp_activation)
    if kind == "M":
        inner, bc_size = config.mamba_inner_size, config.mamba_num_groups * config.mamba_state_size
        return [("in_proj", hidden, 2 * inner + 2 * bc_size + config.resolved_mamba_num_heads),
                ("out_proj", inner, hidden)]
    if kind == "E":
        layers = []
        if config.moe_latent_size:
            layers += [("latent_in_proj", hidden, config.moe_latent_size),
                       ("latent_out_proj", config.moe_latent_size, hidden)]
        if config.moe_shared_expert_ffn_hidden_size:
            layers += mlp_layers(hidden, config.moe_shared_expert_ffn_hidden_size, config.mlp_activation)
        return layers
    return []


def latent_attention_layers(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in, out) of a latent attention block's linear layers (``LatentAttention``): the query
    latent and its up-projection (or one direct q_proj), the KV latent with the shared rotary key,
    its up-projection to each head's unrotated key and value, and o over the value heads."""
    hidden, heads, rank = config.hidden_size, config.num_attention_heads, config.mla_kv_lora_rank
    query = heads * config.resolved_head_dim  # d_n + d_r per head
    if config.mla_q_lora_rank is None:
        layers = [("q_proj", hidden, query)]
    else:
        layers = [("q_a_proj", hidden, config.mla_q_lora_rank), ("q_b_proj", config.mla_q_lora_rank, query)]
    return layers + [("kv_a_proj", hidden, rank + config.mla_qk_rope_head_dim),
                     ("kv_b_proj", rank, heads * (config.mla_qk_nope_head_dim + config.mla_v_head_dim)),
                     ("o_proj", heads * config.mla_v_head_dim, hidden)]


def mlp_layers(hidden_size: int, ffn_size: int, activation: str) -> list[tuple[str, int, int]]:
    gate = [("gate_proj", hidden_size, ffn_size)] if is_gated(activation) else []
    return [*gate, ("up_proj", hidden_size, ffn_size), ("down_proj", ffn_size, hidden_size)]


def all_block_configs(config: ModelConfig) -> list[tuple[str, ModelConfig]]:
    """(kind, sizes) of every block: the main stack's, then each MTP depth's."""
    blocks = [(kind, config.for_block(index)) for index, kind in enumerate(config.block_kinds)]
    if config.mtp_depth:
        kinds = parse_pattern(config.mtp_pattern, "model.mtp_pattern").kinds
        blocks += [(kind, config) for _ in range(config.mtp_depth) for kind in kinds]
    return blocks


def adapter_parameters(config: ModelConfig) -> int:
    """Parameters of the model's LoRA adapters: r (in + out) per adapted layer (0 without adapters)."""
    rank, targets = config.lora_rank, set(config.lora_targets)
    return sum(rank * (in_features + out_features) for kind, sizes in all_block_configs(config)
               for name, in_features, out_features in block_linear_layers(kind, sizes) if name in targets)


def adapter_flops(config: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs of the LoRA adapters over one sequence: x a^T then (.) b^T, one multiply-add
    per adapter parameter and token (0 without adapters)."""
    return 2 * adapter_parameters(config) * seq_len


def activation_matmul_flops(config: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs of the matmuls between two activations (``ACTIVATION_TERMS``) over one sequence."""
    return sum(flops for kind, sizes in all_block_configs(config)
               for term, flops in block_flops(kind, sizes, seq_len).terms.items() if term in ACTIVATION_TERMS)


def model_flops_per_sequence(config: ModelConfig, seq_len: int, include_backward: bool = True) -> int:
    """Model FLOPs of one sequence of ``seq_len`` tokens: forward, or forward + backward (3x).

    With LoRA adapters (``model.lora_rank``) the frozen weights need no weight gradient: the
    backward is the input gradients of every matmul (1x), the second operand's gradient of the
    matmuls between activations, and the adapters' weight gradients: 2 x base + activation
    matmuls + 3 x adapters in all."""
    adapters = adapter_flops(config, seq_len)
    base = sum(model_flops_breakdown(config, seq_len).values())
    if not include_backward:
        return base + adapters
    if not adapters:
        return base * (1 + BACKWARD_TO_FORWARD)
    return 2 * base + activation_matmul_flops(config, seq_len) + (1 + BACKWARD_TO_FORWARD) * adapters


def model_flops_per_token(config: ModelConfig, seq_len: int, include_backward: bool = True) -> float:
    """Model FLOPs per token for training on sequences of ``seq_len`` tokens (the MFU numerator).

    MFU = model_flops_per_token * tokens_per_second / peak_flops_per_second.
    """
    return model_flops_per_sequence(config, seq_len, include_backward) / seq_len


__all__ = ["ACTIVATION_TERMS", "BlockFlops", "activation_matmul_flops", "adapter_flops", "adapter_parameters",
           "block_linear_layers", "block_flops", "latent_attention_layers", "model_block_flops",
           "model_flops_breakdown", "model_flops_per_sequence", "model_flops_per_token", "ssd_scan_terms",
           "BACKWARD_TO_FORWARD"]
