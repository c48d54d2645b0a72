"""The model's shape, as one typed, documented, validated dataclass.

A meshlm model is a stack of pre-norm residual blocks described by a *pattern string*, one
symbol per block (Nemotron-H's "hybrid override pattern"):

    M   Mamba-2 mixer            *   self-attention
    -   dense MLP                E   Mixture-of-Experts MLP
    |   (not a block) a pipeline-stage boundary, used by pipeline parallelism

A Llama-style model is ``"*-*-*-*-"`` (each Llama layer is an attention block followed by an
MLP block, each with its own norm); a Nemotron-H-style hybrid is ``"M-M-M*-M-"``; a hybrid MoE
is ``"ME*EME"``. Every field below is read by exactly one module, and ``validate()`` checks the
whole config once, naming the field, the value and the fix.

**Heterogeneous stacks** (Llama-Nemotron, built by Puzzle's NAS: Bercovich et al. 2024). Two more
symbols replace a block by something cheaper: ``L``, a *linear replacement* ``h + W norm(h)`` with
W one hidden x hidden matrix (Puzzle keeps the sub-block's norm, as Llama-Nemotron's
``replace_with_linear`` does), and ``0``, a *no-op* (the block is removed: the identity). And
``block_overrides`` gives single blocks their own sizes -- ``{3: {ffn_hidden_size: 128}, 5:
{num_kv_heads: 1}}`` -- of the fields in ``BLOCK_OVERRIDE_FIELDS`` that apply to the block's kind.
``for_block(i)`` is the one place they are resolved: the config block i is built, split and
measured with (everything not overridden, and the head_dim of attention blocks, stays the model's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from meshlm.errors import ConfigError, check_choice
from meshlm.kernels import triton_installed
from meshlm.models.pattern import BLOCK_KINDS, parallel_residual_pairs, parse_pattern

ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu", "squared_relu", "gelu", "gelu_tanh", "relu", "silu")
NORMS = ("rmsnorm", "layernorm")
POSITION_EMBEDDINGS = ("rope", "none", "learned")
ATTENTION_TYPES = ("gqa", "mla")
QK_NORM_SCOPES = ("head", "all")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")
MAMBA_SCANS = ("auto", "pytorch", "triton", "reference")
ATTENTION_KERNELS = ("auto", "flash", "cudnn", "efficient", "math")  # meshlm/models/attention_kernels.py
SCORE_FUNCTIONS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("micro_batch", "sequence", "global")
DROP_POLICIES = ("probs", "position")
HEADS = ("lm", "reward")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj", "out_proj",
                "latent_in_proj", "latent_out_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")
"""The linear layers of the blocks an adapter may be put on (``model.lora_targets``)."""
LORA_DEFAULT_TARGETS = LORA_TARGETS[:9]
ADAPTER_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")
"""Fields that add adapters to a model without changing its other weights: a run may start from
a folder whose model has none (``train.init_from``), and merging them removes them."""


BLOCK_OVERRIDE_FIELDS = {
    "*": ("num_attention_heads", "num_kv_heads", "head_dim"),
    "-": ("ffn_hidden_size",),
    "M": ("mamba_num_heads",),
    "E": ("moe_num_experts", "moe_ffn_hidden_size"),
}
"""The fields ``model.block_overrides`` may set for one block, by the block's pattern symbol
(linear ``L`` and no-op ``0`` blocks have none)."""

TRAINING_ONLY_FIELDS = ("hidden_dropout", "attention_dropout", "lora_dropout", "mamba_scan", "attention_kernel")
"""Fields that change neither the parameters nor the inference function: a checkpoint may be
resumed with other values (and a checkpoint written before they existed has their defaults).
mamba_scan and attention_kernel change only how the same function is computed."""


@dataclass
class ModelConfig:
    """Everything that determines a model's parameters and its forward computation."""

    # --- vocabulary, width and layer stack -------------------------------------------------
    vocab_size: int = 256
    """Number of token ids the embedding and output head cover."""
    hidden_size: int = 64
    """Width of the residual stream (h in the papers)."""
    pattern: str = "*-*-"
    """Layer stack, one symbol per pre-norm residual block: M Mamba-2, * attention, - MLP,
    E MoE, L linear (h + W norm(h), W hidden x hidden), 0 no-op (identity); '|' marks a
    pipeline-stage boundary and is not a block."""
    block_overrides: dict[int, dict] = field(default_factory=dict)
    """Per-block sizes, {block index: {field: value}}, e.g. {3: {ffn_hidden_size: 128}, 5:
    {num_kv_heads: 1}}: attention blocks may set num_attention_heads, num_kv_heads, head_dim; MLP
    blocks ffn_hidden_size; Mamba blocks mamba_num_heads; MoE blocks moe_num_experts,
    moe_ffn_hidden_size. Empty: every block of a kind has the sizes below."""

    # --- attention ---------------------------------------------------------------------------
    num_attention_heads: int = 4
    """Query heads of each attention block."""
    attention_type: str = "gqa"
    """'gqa': multi-head attention whose keys and values are projected from the residual stream,
    num_kv_heads of them, head_dim wide (grouped-query attention; plain multi-head when the counts
    agree). 'mla': multi-head latent attention (DeepSeek-V2, 2024; DeepSeek-V3, Kimi K2): keys and
    values are expanded per head from one low-rank latent of mla_kv_lora_rank channels, and one
    rotary key of mla_qk_rope_head_dim channels is shared by all heads
    (meshlm/models/latent_attention.py). Its head widths are the mla_* fields; head_dim and
    num_kv_heads do not apply."""
    mla_q_lora_rank: int | None = None
    """attention_type=mla: the width of the queries' low-rank latent (DeepSeek-V3: 1536). None:
    the queries are projected from the residual stream directly (DeepSeek-V2-Lite)."""
    mla_kv_lora_rank: int = 512
    """attention_type=mla: the width of the key/value latent, all a KV cache would need to hold
    besides the rotary key (DeepSeek-V2 and V3: 512)."""
    mla_qk_nope_head_dim: int = 128
    """attention_type=mla: the channels of each query and key head that carry no position (128)."""
    mla_qk_rope_head_dim: int = 64
    """attention_type=mla: the rotary channels appended to each query head, and of the one rotary
    key all heads share (64). Even: RoPE rotates pairs."""
    mla_v_head_dim: int = 128
    """attention_type=mla: the width of each value head, and so of each head's output (128)."""
    mla_latent_norm_eps: float | None = None
    """attention_type=mla: the epsilon of the query and key/value latents' RMSNorms. None: norm_eps.
    transformers' DeepSeek-V3 attention always uses 1e-6 there, whatever its other norms use
    (GLM-4.7-Flash: 1e-5 elsewhere)."""
    num_kv_heads: int | None = None
    """Key/value heads (GQA; 1 = MQA). None means num_attention_heads (plain multi-head)."""
    head_dim: int | None = None
    """Width of one attention head. None means hidden_size // num_attention_heads."""
    position_embedding: str = "rope"
    """'rope' (rotary, Su et al. 2021, rotate-half layout as in Llama), 'learned' (a trained table of
    max_position_embeddings vectors added to the token embeddings, as GPT-2 and BERT do;
    meshlm/models/position_embedding.py) or 'none' (Nemotron-H's attention blocks use no
    positional signal; the Mamba blocks carry order)."""
    max_position_embeddings: int | None = None
    """With position_embedding=learned: the table's length, the longest sequence the model reads
    (GPT-2: 1024). Only that setting has a table; null otherwise."""
    rope_theta: float = 10000.0
    """RoPE base: frequency i is rope_theta ** (-2i / d), d the rotated channels (rope_fraction)."""
    rope_fraction: float = 1.0
    """The fraction of each query and key head's channels RoPE rotates, the first int(head_dim *
    rope_fraction) of them; the rest carry no position (partial rotary: Phi-4-mini 0.75, GPT-NeoX
    and StableLM 0.25; transformers' partial_rotary_factor). 1: the whole head."""
    rope_scaling: str = "none"
    """How RoPE's frequencies are stretched for a context longer than pretraining's
    (meshlm/models/rope.py): 'none'; 'linear' (positions divided by rope_scaling_factor, Chen et al.
    2023); 'llama3' (Llama 3.1: low frequencies divided by the factor, high ones kept, a smooth
    ramp between, set by rope_low/high_freq_factor); 'yarn' (Peng et al. 2023: NTK-by-parts
    between rope_beta_fast and rope_beta_slow rotations, and cos/sin scaled by
    rope_attention_factor); 'longrope' (Ding et al. 2024, Phi-3.5 and Phi-4-mini: each frequency
    divided by a searched factor of its own, rope_short_factors while a sequence fits
    rope_original_max_positions, rope_long_factors beyond). `meshlm convert hf-to-meshlm` sets
    these from config.json."""
    rope_scaling_factor: float = 1.0
    """rope_scaling: how many times longer the context is than rope_original_max_positions."""
    rope_original_max_positions: int = 8192
    """rope_scaling llama3 / yarn / longrope: the context length the model was pretrained at."""
    rope_low_freq_factor: float = 1.0
    """rope_scaling=llama3: wavelengths above rope_original_max_positions / this are scaled whole."""
    rope_high_freq_factor: float = 4.0
    """rope_scaling=llama3: wavelengths below rope_original_max_positions / this are kept."""
    rope_beta_fast: float = 32.0
    """rope_scaling=yarn: dims rotating more than this many times over the original context keep
    their frequency (extrapolate)."""
    rope_beta_slow: float = 1.0
    """rope_scaling=yarn: dims rotating fewer times than this are divided by the factor (interpolate)."""
    rope_attention_factor: float | None = None
    """rope_scaling yarn / longrope: the factor on cos and sin (so on the attention logits, squared).
    None means YaRN's 0.1 ln(rope_scaling_factor) + 1, or LongRoPE's
    sqrt(1 + ln(rope_scaling_factor) / ln(rope_original_max_positions))."""
    rope_short_factors: list[float] | None = None
    """rope_scaling=longrope: one divisor per rotated pair of channels (rotary_dim / 2 of them) for a
    sequence of at most rope_original_max_positions tokens."""
    rope_long_factors: list[float] | None = None
    """rope_scaling=longrope: the divisors for a longer sequence. Which set a forward uses depends on
    its largest position, as in transformers: a sequence that grows past the original context is
    rotated anew with these."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-window attention blocks, which then rotate without rope_scaling
    (Gemma 3: 10000 in the sliding blocks, 1e6 scaled linearly in the full ones). None: every
    block uses rope_theta and rope_scaling. Needs sliding_window."""
    rope_yarn_truncate: bool = True
    """rope_scaling=yarn: round the ramp's ends to whole dims (the YaRN reference; gpt-oss does not)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys before RoPE (Qwen3, Gemma 3, OLMo 2); its reach: qk_norm_scope."""
    qk_norm_scope: str = "head"
    """What one QK-norm statistic covers: 'head' (each head's head_dim channels, one weight of
    head_dim shared by the heads: Qwen3, Gemma 3) or 'all' (all heads of the projection together,
    a weight per channel: OLMo 2 and 3; under tensor parallelism the sum of squares is all-reduced)."""
    qk_norm_type: str = "rmsnorm"
    """The QK-norm's kind: 'rmsnorm' (Qwen3, Gemma 3, OLMo 2) or 'layernorm' (mean subtracted too:
    Phi's qk_layernorm, StableLM 2 12B, Command R+), statistics in fp32 either way. LayerNorm
    needs qk_norm_scope=head."""
    qk_norm_bias: bool = False
    """With qk_norm_type=layernorm: a bias after the weight (Phi's q/k LayerNorms have one)."""
    qk_norm_per_head: bool = False
    """A weight (and bias) of its own for each query head and each key head, shapes [heads,
    head_dim] and [kv_heads, head_dim] (StableLM 2 12B, Command R+), instead of one head_dim
    weight shared by all heads. Needs qk_norm_scope=head; tensor parallelism splits them with
    the heads."""
    qk_norm_after_rope: bool = False
    """Normalize the rotated queries and keys (Hunyuan's query_layernorm and key_layernorm)
    instead of normalizing before RoPE. Needs qk_norm_scope=head."""
    attention_bias: bool = False
    """Bias terms on the q/k/v projections, and on o unless attention_output_bias says otherwise."""
    attention_output_bias: bool | None = None
    """Bias on the output projection o. None means attention_bias; false with attention_bias=true is
    Qwen2's layout (q/k/v biases, none on o)."""
    sliding_window: int | None = None
    """Sliding-window attention (Longformer, Mistral 7B): each query of a sliding attention block
    sees itself and the sliding_window - 1 tokens before it (transformers' rule), so its work and
    KV reads stop growing with the sequence. None: full causal attention in every block."""
    sliding_window_pattern: str = "S"
    """Which attention blocks slide, one letter per attention block in order (the main stack's,
    then each MTP depth's), repeated as needed: S sliding, F full causal. "S": all (Mistral 7B
    v0.1); "SF": alternating (Gemma 2, gpt-oss); "SSSSSF": five sliding to one full (Gemma 3);
    a string as long as the attention blocks lists each one (Qwen2's max_window_layers). Needs
    sliding_window."""
    rope_pattern: str = "R"
    """Which attention blocks rotate their queries and keys, one letter per attention block in order
    (as sliding_window_pattern), repeated: R with RoPE, N with no position encoding at all (NoPE,
    Kazemnejad et al. 2023: causal attention still tells positions apart). "RRRN": every fourth
    block without RoPE (SmolLM3, Llama 4); with sliding_window_pattern "SSSF", the full blocks
    (Cohere2, Command A). Needs position_embedding=rope."""
    attention_scale: float | None = None
    """The factor on the query-key products before the softmax. None: 1/sqrt(head_dim), as usual;
    Gemma 3 27B uses query_pre_attn_scalar ** -0.5 with query_pre_attn_scalar = hidden / heads."""
    query_scale_beta: float = 0.0
    """Scale the query at position p by 1 + beta * ln(1 + floor(p / query_scale_length)), after
    RoPE: attention sharpens at long range, where the scores of many distant keys would otherwise
    flatten it (Llama 4's attention temperature tuning, as Ministral 3 writes it:
    llama_4_scaling_beta, 0.1). 0 turns it off."""
    query_scale_length: int = 8192
    """Positions per step of query_scale_beta's logarithm (Ministral 3: its YaRN
    original_max_position_embeddings); the queries before it keep scale 1."""
    attention_softcap: float | None = None
    """Soft-capping of the attention scores (Gemma 2's attn_logit_softcapping, 50): each scaled
    score s becomes cap * tanh(s / cap) before the mask and softmax, so no score leaves (-cap, cap).
    SDPA has no such option, so these blocks run an explicit core, chunked over the queries
    (meshlm/models/softcap.py). None: no capping."""
    attention_sinks: bool = False
    """A learned logit per query head joins every softmax denominator of its attention, as a key that
    every query sees and whose value is zero, so a head may attend "nowhere" (gpt-oss's sinks;
    Xiao et al. 2023). The fused kernels take no such term, so these blocks run the explicit core
    (meshlm/models/explicit_attention.py). False: none."""
    final_logit_softcap: float | None = None
    """Soft-capping of the output logits (Gemma 2's final_logit_softcapping, 30): z becomes
    cap * tanh(z / cap) before the softmax, in the loss, generation and evaluation alike. None: no capping."""
    attention_kernel: str = "auto"
    """Which fused SDPA kernel attention prefers (meshlm/models/attention_kernels.py): "auto" (cuDNN's
    on Hopper GPUs, where it is faster than FlashAttention-2; PyTorch's own order elsewhere),
    "flash", "cudnn", "efficient" or "math". A preference: a call the kernel cannot serve runs on
    the next one. All compute the same function up to rounding. No effect on a CPU (PyTorch's CPU
    attention takes no priorities). Ring attention (parallel.cp > 1) takes none, so there it must
    stay "auto"."""

    # --- MLP -----------------------------------------------------------------------------------
    mlp_activation: str = "swiglu"
    """'swiglu' (gated: silu(x W_gate) * x W_up), 'geglu' (gated: gelu(x W_gate) * x W_up, GELU's
    tanh approximation as in Gemma), 'clamped_swiglu' (gated, gpt-oss's: with g = min(x W_gate,
    swiglu_limit) and u = x W_up clamped to +-swiglu_limit, g sigmoid(swiglu_alpha g) (u + 1)),
    'squared_relu' (Primer, Nemotron-H), 'gelu' (exact), 'gelu_tanh' (GELU's tanh approximation:
    GPT-2's gelu_new), 'relu' or 'silu' (non-gated). Also used by the MoE experts."""
    swiglu_limit: float = 7.0
    """With mlp_activation=clamped_swiglu: the clamp on the gate (from above) and on the up projection
    (both sides) before they combine (gpt-oss: 7)."""
    swiglu_alpha: float = 1.702
    """With mlp_activation=clamped_swiglu: the gain in the gate's g sigmoid(alpha g) (gpt-oss: 1.702,
    the sigmoid approximation of GELU's)."""
    ffn_hidden_size: int | None = None
    """Inner width of the dense MLP. None means 4*hidden for non-gated activations and
    8/3*hidden rounded up to a multiple of 64 for SwiGLU (same parameter count)."""
    mlp_bias: bool = False
    """Bias terms on the dense MLP, shared-expert and LatentMoE projections (routed experts,
    like Mixtral's, Qwen3-MoE's and Nemotron-H's, have none)."""

    # --- norms, embeddings, init ---------------------------------------------------------------
    norm: str = "rmsnorm"
    """'rmsnorm' or 'layernorm', for block pre-norms and the final norm."""
    norm_eps: float = 1e-5
    """Epsilon of every norm (block, final, QK-norm, Mamba's gated norm)."""
    norm_bias: bool = True
    """With ``norm=layernorm``: its bias (beta). False: LayerNorm without one, y = w (x - mean) / std
    (Cohere's Command R). RMSNorm has none either way."""
    norm_zero_centered: bool = False
    """RMSNorm weights hold gamma - 1: each norm (block, block output, final, QK-, MTP norms; not
    Mamba's gated norm) multiplies by 1 + weight, and the weights start at 0 (Gemma's norms;
    Megatron's zero-centered gamma). Same function, another parameterization."""
    block_input_norm: bool = True
    """The norm on each block's input (pre-norm). False: the mixer reads the residual stream as it
    is, and with block_output_norm its output is normalized instead (OLMo 2's reordered norm)."""
    block_output_norm: bool = False
    """A second norm on each block's mixer output, before the residual add: h + norm2(mixer(norm(h)))
    (Gemma 2 and 3's post-attention and post-feedforward norms, a "sandwich" norm)."""
    parallel_residual: bool = False
    """Run each attention block and the MLP or MoE block right after it side by side, both on the
    same input: h + attn(norm1(h)) + mlp(norm2(h)) in place of h' = h + attn(norm1(h)), h' +
    mlp(norm2(h')) (GPT-J; GPT-NeoX and Pythia's use_parallel_residual; PaLM). Each keeps its own
    norm. Pairs are ``*`` followed by ``-``, ``E`` or ``M`` in the pattern (and in ``mtp_pattern``):
    an attention block beside a Mamba-2 block is Falcon-H1's parallel hybrid, h + attn(norm(h)) +
    mamba(norm(h)), then its MLP in turn; other blocks stay sequential. Pipeline stages never split
    a pair."""
    parallel_residual_shared_norm: bool = False
    """With ``parallel_residual``: one norm for each pair, the attention block's, whose output both
    mixers read, h + attn(norm(h)) + mlp(norm(h)) (GPT-J, Falcon-7B, StableLM's parallel layers);
    the feed-forward block of a pair has no norm of its own."""
    embedding_multiplier: float = 1.0
    """The token embeddings are multiplied by this before the first block (Gemma: sqrt(hidden_size);
    Granite and muP-style models: a constant such as 12)."""
    residual_multiplier: float = 1.0
    """Each block's output is multiplied by this before the residual add, h + m * mixer(norm(h))
    (Granite's residual_multiplier; MiniCPM's scale_depth / sqrt(layers))."""
    logit_divisor: float = 1.0
    """The output logits are divided by this (Granite's logits_scaling; muP's width multiplier),
    before any soft-capping, in the loss, generation and evaluation alike."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the output head."""
    output_bias: bool = False
    """A bias on the output head, one per vocabulary entry, added to the logits (Phi-1, 1.5 and 2;
    GPT-J). Needs an untied head (``tie_embeddings`` false)."""
    head: str = "lm"
    """'lm' (next-token logits over the vocabulary) or 'reward' (a reward model, as Nemotron-4
    340B-Reward: the LM head is replaced by one linear map hidden -> len(reward_attributes), read
    after the final norm at each sequence's last token; trained with train.objective=reward and
    read by `meshlm score`; it has no logits, so it cannot generate or be exported to Hugging
    Face). See meshlm/models/reward_head.py."""
    reward_attributes: list[str] = field(default_factory=lambda: ["reward"])
    """With head='reward': the names of the scores the head outputs, one per attribute (e.g.
    HelpSteer's [helpfulness, correctness, coherence, complexity, verbosity]); the default is one
    scalar 'reward'."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights. Output projections of each
    block (attention o_proj, MLP/expert down_proj, Mamba out_proj) use
    init_std / sqrt(2 * num_blocks), the scaled init of GPT-2/Megatron."""

    # --- dropout (training only; masks keyed by global coordinates: meshlm/models/dropout.py) ----
    hidden_dropout: float = 0.0
    """Dropout probability on the embedding output and on every block's mixer output before the
    residual add (the regions sequence parallelism shards along the sequence). 0 turns it off."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities (an explicit softmax path instead of
    fused SDPA while training; not available under context parallelism). 0 turns it off."""

    # --- Mamba-2 -------------------------------------------------------------------------------
    mamba_state_size: int = 16
    """SSM state size N per head (d_state)."""
    mamba_head_dim: int = 16
    """Channels P per SSM head."""
    mamba_num_heads: int | None = None
    """SSM heads H. None means mamba_expand * hidden_size // mamba_head_dim."""
    mamba_num_groups: int = 1
    """Groups G sharing B and C (like KV heads in GQA); H must be divisible by G."""
    mamba_conv_kernel: int = 4
    """Width of the causal depthwise convolution over x, B and C."""
    mamba_expand: int = 2
    """Inner width factor, used only when mamba_num_heads is None."""
    mamba_chunk_size: int = 64
    """Chunk length of the SSD scan; any value gives the same result (up to rounding)."""
    mamba_scan: str = "auto"
    """How the SSD scan is computed while training and prefilling: "pytorch" (meshlm/models/ssd_fast.py:
    run-dtype matmuls, recomputation in a hand-written backward), "triton" (the same, with the
    diagonal blocks in the Triton kernels of meshlm/kernels/ssd_diagonal.py; needs Triton, and CUDA
    or TRITON_INTERPRET=1), "reference" (meshlm/models/ssd.py: fp32 einsums differentiated by
    autograd; slower, several times the activation memory), or "auto" ("triton" on CUDA tensors
    when Triton is installed and the shapes suit the kernels, else "pytorch"). All compute the
    same function up to rounding. The trainer checks the kernels against "pytorch" on its device
    before the first step (meshlm/models/scan_kernels.py): under "auto" layers whose check fails
    run "pytorch"; under "triton" the run stops."""
    mamba_conv_bias: bool = True
    """Bias on the depthwise convolution."""
    mamba_proj_bias: bool = False
    """Bias on the in/out projections."""
    mamba_gated_norm: bool = True
    """Normalize the gated SSM output, RMSNorm((y + D x) * silu(z)) per group (Mamba-2 as released,
    Nemotron-H); false hands (y + D x) * silu(z) to out_proj as it is (Falcon-H1's
    ``mamba_rms_norm: false``), with no norm weight."""
    mamba_dt_min: float = 0.001
    """Smallest time step drawn at init (dt is log-uniform in [dt_min, dt_max])."""
    mamba_dt_max: float = 0.1
    """Largest time step drawn at init."""
    mamba_dt_init_floor: float = 1e-4
    """Floor applied to the time steps drawn at init."""
    mamba_dt_clamp_min: float = 0.0
    """dt = softplus(raw + dt_bias) is clamped below at this value in the forward (Nemotron-H
    uses its time_step_min here; plain Mamba-2 uses 0)."""

    # --- Mixture of Experts --------------------------------------------------------------------
    moe_num_experts: int = 8
    """Routed experts per MoE block."""
    moe_top_k: int = 2
    """Experts each token is sent to."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one routed expert. None means ffn_hidden_size."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """Inner width of the always-on shared expert; 0 means no shared expert."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output per token by sigmoid(x w), w a learned [hidden] vector
    (Qwen1.5-MoE / Qwen2-MoE's ``shared_expert_gate``). Needs a shared expert."""
    moe_router_bias: bool = False
    """A learned bias on the router logits, one per expert, in the choice and in the weights alike
    (gpt-oss's router). Unlike the balancing expert bias (moe_bias_update_rate), it is trained by
    the gradient."""
    moe_expert_linear_bias: bool = False
    """Bias terms on the routed experts' gate, up and down projections, one set per expert
    (gpt-oss's experts; Mixtral's, Qwen3-MoE's and Nemotron-H's have none)."""
    moe_score_function: str = "softmax"
    """Router score: 'softmax' over experts, or 'sigmoid' per expert (DeepSeek-V3, Nemotron 3)."""
    moe_softmax_before_topk: bool = True
    """With softmax scores: True takes top-k of the softmax over all experts (Mixtral's weights
    before renormalization, Qwen3-MoE); False takes top-k of the logits and softmaxes over the
    k chosen."""
    moe_normalize_topk: bool = False
    """Rescale the k chosen weights of each token to sum to one."""
    moe_routed_scaling_factor: float = 1.0
    """Constant multiplier on the routed weights (DeepSeek-V3 / Nemotron 3)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V3): the experts form this many equal groups (e.g. the
    experts of one device) and a token picks its k experts inside its moe_router_group_top_k
    best groups, a group scored by the sum of its two best scores. None means no groups."""
    moe_router_group_top_k: int | None = None
    """With moe_router_num_groups: how many groups each token may route to."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (its kind: moe_aux_loss_type)."""
    moe_aux_loss_type: str = "micro_batch"
    """Which tokens the load-balancing loss balances: 'micro_batch' (Switch: all tokens of the
    micro-batch), 'sequence' (DeepSeek-V3: each sequence on its own, averaged) or 'global'
    (token counts summed over the data-parallel ranks, Qwen's global-batch balance)."""
    moe_bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): after each optimizer step every router's expert
    bias (used to choose experts, not to weight them) moves by this rate times
    sign(mean load - expert load). 0 turns it off; DeepSeek-V3 used 0.001."""
    moe_z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (mean squared logsumexp of the router logits)."""
    moe_capacity_factor: float | None = None
    """Expert capacity = ceil(capacity_factor * tokens * top_k / experts); tokens beyond it are
    dropped (they pass through the residual only). None means dropless."""
    moe_drop_policy: str = "probs"
    """Which tokens an over-full expert keeps: 'probs' (highest routing weight) or 'position'
    (earliest in the batch)."""
    moe_latent_size: int | None = None
    """LatentMoE (Nemotron 3): project tokens to this width before the experts and back after.
    None means experts work at hidden_size."""

    # --- multi-token prediction ----------------------------------------------------------------
    mtp_depth: int = 0
    """Number of multi-token-prediction depths D (0 = off). Depth k predicts token t+k+1."""
    mtp_pattern: str = "*-"
    """Blocks inside each MTP depth (same symbols as pattern, no '|')."""
    mtp_loss_coeff: float = 0.1
    """The MTP loss added to the main loss is mtp_loss_coeff * mean over depths."""

    # --- low-rank adapters (LoRA, Hu et al. 2021) ------------------------------------------------
    lora_rank: int = 0
    """Rank r of the low-rank adapter added to each targeted linear layer of the blocks (0: none).
    With r > 0 only the adapters (and a reward model's head) train; every other weight is frozen.
    See meshlm/models/lora.py."""
    lora_alpha: float | None = None
    """An adapter's output is scaled by lora_alpha / lora_rank. None means lora_rank (a scale of 1).
    Keep it fixed when trying several ranks, as the paper does, so the learning rate carries over."""
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Which linear layers of the blocks (MTP depths included) get an adapter, by name: q_proj,
    k_proj, v_proj, o_proj (attention), gate_proj, up_proj, down_proj (MLPs, shared experts),
    in_proj, out_proj (Mamba-2), latent_in_proj, latent_out_proj (LatentMoE). The default is all
    of these but the LatentMoE projections. Routed experts, routers, embeddings and the head have none."""
    lora_dropout: float = 0.0
    """Dropout on each adapter's input, training only: y = x W^T + s B A dropout(x) (PEFT's
    lora_dropout; 0.05 to 0.1 are usual). Each adapted layer draws a mask of its own, keyed by the
    element's global coordinates (meshlm/models/dropout.py), so every layout trains alike.
    Not for the LatentMoE projections."""

    # ------------------------------------------------------------------------------------------
    block_kinds: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # --- derived sizes (one place for each default) ---------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.block_kinds)

    @property
    def resolved_num_kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_attention_heads

    @property
    def resolved_attention_output_bias(self) -> bool:
        return self.attention_bias if self.attention_output_bias is None else self.attention_output_bias

    @property
    def resolved_head_dim(self) -> int:
        """The width of a query and key head (MLA: its unrotated and rotary channels together)."""
        if self.attention_type == "mla":
            return self.mla_qk_nope_head_dim + self.mla_qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The channels of each query and key head RoPE rotates: the first int(head_dim *
        rope_fraction) (MLA: its mla_qk_rope_head_dim rotary channels)."""
        if self.attention_type == "mla":
            return self.mla_qk_rope_head_dim
        return int(self.resolved_head_dim * self.rope_fraction)

    @property
    def resolved_value_head_dim(self) -> int:
        """The width of a value head, and of each head's output (MLA: mla_v_head_dim)."""
        return self.mla_v_head_dim if self.attention_type == "mla" else self.resolved_head_dim

    @property
    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.mlp_activation in ("swiglu", "geglu", "clamped_swiglu"):
            return 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        return 4 * self.hidden_size

    @property
    def resolved_moe_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.resolved_ffn_hidden_size

    @property
    def resolved_mamba_num_heads(self) -> int:
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads
        return self.mamba_expand * self.hidden_size // self.mamba_head_dim

    @property
    def mamba_inner_size(self) -> int:
        """d_inner = H * P, the width of x, z and the gated norm."""
        return self.resolved_mamba_num_heads * self.mamba_head_dim

    def for_block(self, index: int) -> "ModelConfig":
        """The config of block ``index``: this one with ``block_overrides[index]`` applied (this very
        object when the block has none, and for MTP blocks, which count on after the main ones).
        An attention block that changes its head count keeps the model's head_dim (as in
        Llama-Nemotron) unless it sets head_dim too. A full-attention block of a model with a
        sliding window (``sliding_window_pattern``) gets sliding_window None; a sliding one with
        rope_local_theta gets that base and no rope_scaling. A block without RoPE (``rope_pattern``
        N) gets position_embedding none."""
        values = dict(self.block_overrides.get(index) or {})
        letter = self._window_letter(index)
        if letter == "F":
            values.update(sliding_window=None, sliding_window_pattern="S", rope_local_theta=None)
        elif letter == "S" and self.rope_local_theta is not None:
            values.update(rope_theta=self.rope_local_theta, rope_scaling="none", rope_local_theta=None,
                          sliding_window_pattern="S", rope_short_factors=None, rope_long_factors=None)
        if self._pattern_letter(self.rope_pattern, index) == "N":
            values.update(position_embedding="none", rope_pattern="R", rope_fraction=1.0, rope_scaling="none",
                          rope_local_theta=None, rope_short_factors=None, rope_long_factors=None)
        if not values:
            return self
        if (index < self.num_blocks and self.block_kinds[index] == "*" and "head_dim" not in values
                and self.attention_type == "gqa"):
            values["head_dim"] = self.resolved_head_dim
        return dataclasses.replace(self, block_overrides={}, **values)

    @property
    def attention_blocks(self) -> list[int]:
        """Indices of the attention blocks, in order: the main stack's, then each MTP depth's (whose
        blocks count on after the main ones, ``models/mtp.py``)."""
        indices = [index for index, kind in enumerate(self.block_kinds) if kind == "*"]
        if self.mtp_depth:
            depth_kinds = parse_pattern(self.mtp_pattern, "model.mtp_pattern").kinds
            for depth in range(self.mtp_depth):
                first = self.num_blocks + depth * len(depth_kinds)
                indices += [first + offset for offset, kind in enumerate(depth_kinds) if kind == "*"]
        return indices

    def attention_window(self, index: int) -> int | None:
        """The sliding window of attention block ``index`` (``sliding_window_pattern``), None where
        it attends to every earlier token (or is no attention block)."""
        return self.sliding_window if self._window_letter(index) == "S" else None

    def _window_letter(self, index: int) -> str | None:
        """``sliding_window_pattern``'s letter for block ``index`` (S or F), None without a window or
        for a block that is no attention block."""
        if self.sliding_window is None:
            return None
        return self._pattern_letter(self.sliding_window_pattern, index)

    def _pattern_letter(self, pattern: str, index: int) -> str | None:
        """The letter of a per-attention-block ``pattern`` (repeated) for block ``index``, None for a
        block that is no attention block."""
        blocks = self.attention_blocks
        if index not in blocks:
            return None
        return pattern[blocks.index(index) % len(pattern)]

    def block_rotates(self, index: int) -> bool:
        """Whether attention block ``index`` applies RoPE (``position_embedding`` and ``rope_pattern``)."""
        return self.position_embedding == "rope" and self._pattern_letter(self.rope_pattern, index) != "N"

    @property
    def output_init_std(self) -> float:
        return self.init_std / math.sqrt(2 * max(self.num_blocks, 1))

    # --- validation -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field once; raise ConfigError naming the field, the value and the fix."""
        self.block_kinds = parse_pattern(self.pattern, field_name="model.pattern").kinds
        _positive(self, "vocab_size", "hidden_size", "num_attention_heads", "mamba_state_size",
                  "mamba_head_dim", "mamba_num_groups", "mamba_conv_kernel", "mamba_expand",
                  "mamba_chunk_size", "moe_num_experts", "moe_top_k")
        _choice(self, "mlp_activation", ACTIVATIONS)
        _choice(self, "mamba_scan", MAMBA_SCANS)
        _choice(self, "attention_kernel", ATTENTION_KERNELS)
        _choice(self, "norm", NORMS)
        _choice(self, "position_embedding", POSITION_EMBEDDINGS)
        _choice(self, "qk_norm_scope", QK_NORM_SCOPES)
        self._validate_qk_norm()
        _choice(self, "moe_score_function", SCORE_FUNCTIONS)
        _choice(self, "moe_drop_policy", DROP_POLICIES)
        _choice(self, "moe_aux_loss_type", AUX_LOSS_TYPES)
        kinds = set(self.block_kinds) | (set(parse_pattern(self.mtp_pattern, "model.mtp_pattern").kinds)
                                         if self.mtp_depth else set())
        if "*" in kinds:
            self._validate_attention()
        else:
            if self.attention_sinks:
                raise ConfigError(f"model.attention_sinks=true applies to attention blocks, and model.pattern="
                                  f"{self.pattern!r} has none; set model.attention_sinks=false.")
            for name in ("sliding_window", "attention_softcap"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"model.{name}={getattr(self, name)} applies to attention blocks, and "
                                      f"model.pattern={self.pattern!r} has none; set model.{name}=null.")
            if self.rope_pattern != "R":
                raise ConfigError(f"model.rope_pattern={self.rope_pattern!r} chooses the attention blocks that rotate, "
                                  f"and model.pattern={self.pattern!r} has none; drop model.rope_pattern.")
        _soft_cap(self, "final_logit_softcap", 30)
        if self.parallel_residual and not parallel_residual_pairs(self.block_kinds):
            raise ConfigError(f"model.parallel_residual=true runs each attention block ('*') beside the MLP, MoE or "
                              f"Mamba block ('-', 'E' or 'M') right after it, and model.pattern={self.pattern!r} has "
                              "no such pair; write the pattern as '*-*-...' or set model.parallel_residual=false.")
        if self.parallel_residual_shared_norm and not self.parallel_residual:
            raise ConfigError("model.parallel_residual_shared_norm=true shares each attention block's norm with the "
                              "block beside it, and model.parallel_residual is false; set it true too, or the shared "
                              "norm false.")
        if self.parallel_residual_shared_norm and not self.block_input_norm:
            raise ConfigError("model.parallel_residual_shared_norm=true shares the blocks' input norms, and "
                              "model.block_input_norm is false (there are none); set one of them the other way.")
        self._validate_learned_positions()
        if "M" in kinds:
            self._validate_mamba()
        if "E" in kinds:
            self._validate_moe()
        else:
            for name in ("moe_router_bias", "moe_expert_linear_bias"):
                if getattr(self, name):
                    raise ConfigError(f"model.{name}=true applies to MoE blocks, and model.pattern={self.pattern!r} "
                                      f"has none; set model.{name}=false.")
        for name in ("ffn_hidden_size", "moe_ffn_hidden_size", "head_dim", "num_kv_heads",
                     "mamba_num_heads", "moe_latent_size", "moe_router_num_groups", "moe_router_group_top_k"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"model.{name}={value!r} must be a positive integer or null (for the default).")
        if self.moe_shared_expert_ffn_hidden_size < 0:
            raise ConfigError(f"model.moe_shared_expert_ffn_hidden_size={self.moe_shared_expert_ffn_hidden_size} "
                              "must be >= 0 (0 means no shared expert).")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_ffn_hidden_size:
            raise ConfigError("model.moe_shared_expert_gate=true gates the shared expert, and there is none: set "
                              "model.moe_shared_expert_ffn_hidden_size > 0 or the gate to false.")
        if self.mtp_depth < 0:
            raise ConfigError(f"model.mtp_depth={self.mtp_depth} must be >= 0 (0 turns MTP off).")
        if self.mlp_activation == "clamped_swiglu" and not (_positive_number(self.swiglu_limit)
                                                            and _positive_number(self.swiglu_alpha)):
            raise ConfigError(f"model.swiglu_limit={self.swiglu_limit!r} and model.swiglu_alpha={self.swiglu_alpha!r} "
                              "must be positive numbers (gpt-oss: 7 and 1.702).")
        self._validate_head()
        self._validate_lora()
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"model.{name}={value!r} must be a probability in [0, 1) (0 turns it off).")
        if not self.norm_bias and self.norm != "layernorm":
            raise ConfigError(f"model.norm_bias=false drops LayerNorm's bias, and model.norm={self.norm!r} has none; "
                              "set model.norm=layernorm or model.norm_bias=true.")
        if self.norm_zero_centered and self.norm != "rmsnorm":
            raise ConfigError(f"model.norm_zero_centered=true is for RMSNorm, and model.norm={self.norm!r}; set "
                              "model.norm=rmsnorm or model.norm_zero_centered=false.")
        for name in ("residual_multiplier", "logit_divisor"):
            if not _positive_number(getattr(self, name)):
                raise ConfigError(f"model.{name}={getattr(self, name)!r} must be a positive number (1: none).")
        multiplier = self.embedding_multiplier
        if not _positive_number(multiplier):
            raise ConfigError(f"model.embedding_multiplier={multiplier!r} must be a positive number (1: none; Gemma: "
                              "sqrt(hidden_size)).")
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} and model.init_std={self.init_std} must be > 0.")
        self._validate_block_overrides()

    def _validate_qk_norm(self) -> None:
        _choice(self, "qk_norm_type", NORMS)
        shaped = {"qk_norm_scope": self.qk_norm_scope != "head", "qk_norm_type": self.qk_norm_type != "rmsnorm",
                  "qk_norm_bias": self.qk_norm_bias, "qk_norm_per_head": self.qk_norm_per_head,
                  "qk_norm_after_rope": self.qk_norm_after_rope}
        for name, changed in shaped.items():
            if changed and not self.qk_norm:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} shapes the QK-norm, and model.qk_norm is "
                                  f"false; set model.qk_norm=true or leave model.{name} at its default.")
        if self.qk_norm_bias and self.qk_norm_type != "layernorm":
            raise ConfigError("model.qk_norm_bias=true adds a LayerNorm's bias to the QK-norm, and model.qk_norm_type="
                              f"{self.qk_norm_type!r} has none; set model.qk_norm_type=layernorm or the bias false.")
        if self.qk_norm_scope == "all" and (self.qk_norm_type != "rmsnorm" or self.qk_norm_per_head):
            field = "qk_norm_type=layernorm" if self.qk_norm_type != "rmsnorm" else "qk_norm_per_head=true"
            raise ConfigError(f"model.qk_norm_scope=all normalizes all heads together with an RMSNorm, and "
                              f"model.{field} is for a norm of each head; set model.qk_norm_scope=head or drop the "
                              "other field.")
        if self.qk_norm_after_rope and (self.qk_norm_scope != "head" or self.attention_type != "gqa"):
            raise ConfigError("model.qk_norm_after_rope=true normalizes each rotated head, which needs "
                              "model.qk_norm_scope=head and model.attention_type=gqa; set it to false.")
        if self.qk_norm_type == "layernorm" and self.norm_zero_centered:
            raise ConfigError("model.norm_zero_centered=true stores RMSNorm weights as w - 1, and model.qk_norm_type="
                              "layernorm has a LayerNorm; set model.qk_norm_type=rmsnorm or norm_zero_centered=false.")

    def _validate_lora(self) -> None:
        rank = self.lora_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"model.lora_rank={rank!r} must be an integer >= 0 (0: no adapters; 8 to 64 are usual).")
        alpha = self.lora_alpha
        if alpha is not None and not _positive_number(alpha):
            raise ConfigError(f"model.lora_alpha={alpha!r} must be a positive number, or null for model.lora_rank.")
        targets = self.lora_targets
        if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets:
            raise ConfigError(f"model.lora_targets={targets!r} must be a non-empty list of layer names, e.g. "
                              "[q_proj, v_proj].")
        unknown = [name for name in targets if name not in LORA_TARGETS]
        if unknown:
            raise ConfigError(f"model.lora_targets names {unknown}, which are not linear layers of the blocks; "
                              f"choose from {list(LORA_TARGETS)}.")
        dropout = self.lora_dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ConfigError(f"model.lora_dropout={dropout!r} must be a probability in [0, 1) (0 turns it off).")
        if dropout and not rank:
            raise ConfigError(f"model.lora_dropout={dropout} drops an adapter's inputs, and model.lora_rank=0 adds "
                              "no adapters; set model.lora_rank or model.lora_dropout=0.")
        latent = [name for name in targets if name in ("latent_in_proj", "latent_out_proj")]
        if dropout and latent:
            raise ConfigError(f"model.lora_dropout={dropout} is not built for the LatentMoE projections in "
                              f"model.lora_targets ({latent}); drop them from the targets or set model.lora_dropout=0.")

    @property
    def resolved_lora_alpha(self) -> float:
        """lora_alpha, or lora_rank where it is None."""
        return self.lora_alpha if self.lora_alpha is not None else self.lora_rank

    @property
    def lora_scale(self) -> float:
        """The factor on an adapter's output: lora_alpha / lora_rank (1 when lora_alpha is None)."""
        return self.resolved_lora_alpha / self.lora_rank

    def _validate_head(self) -> None:
        _choice(self, "head", HEADS)
        attributes = self.reward_attributes
        if (not isinstance(attributes, (list, tuple)) or not attributes
                or not all(isinstance(name, str) and name for name in attributes)
                or len(set(attributes)) != len(attributes)):
            raise ConfigError(f"model.reward_attributes={attributes!r} must be a non-empty list of distinct names, "
                              "e.g. [reward] or [helpfulness, correctness].")
        self.reward_attributes = list(attributes)
        if self.output_bias and (self.tie_embeddings or self.head == "reward"):
            raise ConfigError("model.output_bias=true puts a bias on the untied language-model head, and "
                              f"model.tie_embeddings={self.tie_embeddings}, model.head={self.head!r}; set "
                              "model.tie_embeddings=false and model.head=lm, or model.output_bias=false.")
        if self.head == "reward" and self.mtp_depth:
            raise ConfigError(f"model.head=reward has no next-token logits, so model.mtp_depth={self.mtp_depth} has "
                              "nothing to predict; set model.mtp_depth=0.")

    def _validate_block_overrides(self) -> None:
        """Keys become ints (JSON writes them as strings); every override names an existing block and
        a field of its kind, and the block's resolved config must itself be valid."""
        if not isinstance(self.block_overrides, dict):
            raise ConfigError(f"model.block_overrides={self.block_overrides!r} must be a mapping from block index "
                              "to field overrides, e.g. {3: {ffn_hidden_size: 128}}.")
        every_field = sorted({name for names in BLOCK_OVERRIDE_FIELDS.values() for name in names})
        resolved = {}
        for key, overrides in self.block_overrides.items():
            index = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_blocks:
                raise ConfigError(f"model.block_overrides has block {key!r}, but model.pattern={self.pattern!r} has "
                                  f"{self.num_blocks} blocks; use an index from 0 to {self.num_blocks - 1}.")
            kind = self.block_kinds[index]
            if not isinstance(overrides, dict):
                raise ConfigError(f"model.block_overrides[{index}]={overrides!r} must be a mapping of fields, e.g. "
                                  "{ffn_hidden_size: 128}.")
            for name in overrides:
                if name not in every_field:
                    raise ConfigError(f"model.block_overrides[{index}].{name} cannot be set per block; the per-block "
                                      f"fields are {', '.join(every_field)}.")
                allowed = BLOCK_OVERRIDE_FIELDS.get(kind, ())
                if name not in allowed:
                    raise ConfigError(f"model.block_overrides[{index}].{name} does not apply to block {index}, a "
                                      f"{BLOCK_KINDS[kind]} block ('{kind}'), which takes "
                                      f"{', '.join(allowed) or 'no overrides'}.")
            resolved[index] = dict(overrides)
        self.block_overrides = dict(sorted(resolved.items()))
        for index in self.block_overrides:
            try:
                self.for_block(index)
            except ConfigError as error:
                kind = self.block_kinds[index]
                raise ConfigError(f"model.block_overrides[{index}] ({BLOCK_KINDS[kind]} block '{kind}'): {error}") from None

    def _validate_learned_positions(self) -> None:
        length = self.max_position_embeddings
        if self.position_embedding != "learned":
            if length is not None:
                raise ConfigError(f"model.max_position_embeddings={length} is the length of a learned position table, "
                                  f"and model.position_embedding={self.position_embedding!r} has none; set it to null "
                                  "or model.position_embedding=learned.")
            return
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ConfigError(f"model.position_embedding=learned needs model.max_position_embeddings, the longest "
                              f"sequence the model reads (GPT-2: 1024); got {length!r}.")
        if self.mtp_depth:
            raise ConfigError(f"model.mtp_depth={self.mtp_depth} with model.position_embedding=learned: MTP depths "
                              "embed future tokens without positions; use rope (or none), or model.mtp_depth=0.")

    def _validate_query_scale(self) -> None:
        beta, length = self.query_scale_beta, self.query_scale_length
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < math.inf:
            raise ConfigError(f"model.query_scale_beta={beta!r} must be a number >= 0 (0 turns the query scale off).")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(f"model.query_scale_length={length!r} must be a whole number of positions >= 1.")
        if beta and self.attention_type == "mla":
            raise ConfigError(f"model.query_scale_beta={beta} scales the queries of grouped-query attention; latent "
                              "attention (model.attention_type=mla) has no such scale here: set it to 0.")

    def _validate_attention(self) -> None:
        _choice(self, "attention_type", ATTENTION_TYPES)
        if self.attention_type == "mla":
            self._validate_latent_attention()
        heads, kv_heads = self.num_attention_heads, self.resolved_num_kv_heads
        if kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(f"model.num_kv_heads={kv_heads} must divide model.num_attention_heads={heads} "
                              "(each KV head serves a whole group of query heads).")
        if self.head_dim is None and self.hidden_size % heads and self.attention_type == "gqa":
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                              f"{heads}; set model.head_dim explicitly or change the head count.")
        fraction = self.rope_fraction
        if fraction != 1.0:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ConfigError(f"model.rope_fraction={fraction!r} must lie in (0, 1] (the fraction of each head "
                                  "RoPE rotates; 1: the whole head).")
            if self.position_embedding != "rope" or self.attention_type != "gqa":
                raise ConfigError(f"model.rope_fraction={fraction} rotates part of each head, which needs "
                                  "model.position_embedding=rope and model.attention_type=gqa (latent attention "
                                  "sizes its rotary channels with model.mla_qk_rope_head_dim); set it to 1.")
        if self.position_embedding == "rope" and self.attention_type == "gqa" and (
                self.rotary_dim % 2 or self.rotary_dim < 2):
            if fraction == 1.0:
                raise ConfigError(f"RoPE rotates pairs of channels, so the head dim ({self.resolved_head_dim}) must "
                                  "be even.")
            raise ConfigError(f"RoPE rotates pairs of channels, so the rotated channels of a head (head dim "
                              f"{self.resolved_head_dim} x model.rope_fraction {fraction} = {self.rotary_dim}) must "
                              "be a positive even number; change model.rope_fraction or the head dim.")
        self._validate_rope_scaling()
        self._validate_sliding_window()
        self._validate_rope_pattern()
        self._validate_query_scale()
        scale = self.attention_scale
        if scale is not None and not _positive_number(scale):
            raise ConfigError(f"model.attention_scale={scale!r} must be a positive number, or null for "
                              "1/sqrt(head_dim).")
        _soft_cap(self, "attention_softcap", 50)

    def _validate_latent_attention(self) -> None:
        """attention_type=mla: the widths are positive, and the fields of the other attention unset."""
        _positive(self, "mla_kv_lora_rank", "mla_qk_nope_head_dim", "mla_qk_rope_head_dim", "mla_v_head_dim")
        latent_eps = self.mla_latent_norm_eps
        if latent_eps is not None and not _positive_number(latent_eps):
            raise ConfigError(f"model.mla_latent_norm_eps={latent_eps!r} must be a positive number, or null for "
                              "model.norm_eps.")
        rank = self.mla_q_lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
            raise ConfigError(f"model.mla_q_lora_rank={rank!r} must be a positive integer (DeepSeek-V3: 1536), or "
                              "null to project the queries directly.")
        if self.mla_qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla_qk_rope_head_dim={self.mla_qk_rope_head_dim} must be even (RoPE rotates "
                              "pairs of channels).")
        if self.position_embedding != "rope":
            raise ConfigError(f"model.attention_type=mla carries positions in its rotary channels, and "
                              f"model.position_embedding={self.position_embedding!r}; set "
                              "model.position_embedding=rope.")
        clashes = {"head_dim": self.head_dim is not None,
                   "num_kv_heads": self.num_kv_heads not in (None, self.num_attention_heads),
                   "qk_norm": self.qk_norm, "attention_bias": self.attention_bias,
                   "attention_output_bias": bool(self.attention_output_bias)}
        for name, clash in clashes.items():
            if clash:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} does not apply to model.attention_type=mla "
                                  "(its heads are sized by the mla_* fields, every query head has its own key and "
                                  f"value head, and its projections have no bias or QK-norm); unset model.{name} or "
                                  "use model.attention_type=gqa.")
        for index, overrides in self.block_overrides.items():
            for name in ("num_kv_heads", "head_dim"):
                if name in (overrides or {}):
                    raise ConfigError(f"model.block_overrides[{index}].{name} does not apply to "
                                      "model.attention_type=mla; a latent attention block may set "
                                      "num_attention_heads only.")

    def _validate_sliding_window(self) -> None:
        window, pattern = self.sliding_window, self.sliding_window_pattern
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"model.sliding_window={window!r} must be a positive number of tokens (each query "
                              "sees itself and window - 1 before it), or null for full causal attention.")
        if not isinstance(pattern, str) or not pattern or set(pattern) - {"S", "F"}:
            raise ConfigError(f"model.sliding_window_pattern={pattern!r} must be a string of S (sliding) and F (full) "
                              "letters, one per attention block, repeated: e.g. 'S' (all), 'SF' (alternating).")
        if window is None and pattern != "S":
            raise ConfigError(f"model.sliding_window_pattern={pattern!r} chooses the blocks that slide, but "
                              "model.sliding_window is null; set model.sliding_window (e.g. 4096) or drop the pattern.")
        local = self.rope_local_theta
        if local is not None:
            if window is None or self.position_embedding != "rope":
                raise ConfigError(f"model.rope_local_theta={local} is the RoPE base of sliding-window blocks; it needs "
                                  "model.sliding_window and model.position_embedding=rope (or set it to null).")
            if not _positive_number(local):
                raise ConfigError(f"model.rope_local_theta={local!r} must be a positive number (Gemma 3: 10000).")

    def _validate_rope_pattern(self) -> None:
        pattern = self.rope_pattern
        if not isinstance(pattern, str) or not pattern or set(pattern) - {"R", "N"}:
            raise ConfigError(f"model.rope_pattern={pattern!r} must be a string of R (RoPE) and N (no position "
                              "encoding) letters, one per attention block, repeated: e.g. 'R' (all), 'RRRN'.")
        if pattern != "R" and (self.position_embedding != "rope" or self.attention_type != "gqa"):
            raise ConfigError(f"model.rope_pattern={pattern!r} leaves some attention blocks without RoPE, which needs "
                              f"model.position_embedding=rope (it is {self.position_embedding!r}) and "
                              f"model.attention_type=gqa (it is {self.attention_type!r}); drop model.rope_pattern.")

    def _validate_rope_scaling(self) -> None:
        _choice(self, "rope_scaling", ROPE_SCALINGS)
        self._validate_longrope_factors()
        if self.rope_scaling == "none":
            return
        if self.position_embedding != "rope":
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} scales RoPE, and model.position_embedding="
                              f"{self.position_embedding!r}; set model.rope_scaling=none.")
        if not self.rope_scaling_factor >= 1:
            raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be >= 1 (how many times the "
                              "pretraining context the model reads).")
        if not isinstance(self.rope_original_max_positions, int) or self.rope_original_max_positions < 1:
            raise ConfigError(f"model.rope_original_max_positions={self.rope_original_max_positions!r} must be a "
                              "positive integer (the pretraining context length).")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} and model.rope_high_freq_factor="
                              f"{self.rope_high_freq_factor} need 0 < low < high (Llama 3.1: 1 and 4).")
        if self.rope_scaling == "yarn" and not 0 < self.rope_beta_slow < self.rope_beta_fast:
            raise ConfigError(f"model.rope_beta_slow={self.rope_beta_slow} and model.rope_beta_fast="
                              f"{self.rope_beta_fast} need 0 < slow < fast (YaRN: 1 and 32).")
        if self.rope_attention_factor is not None and not self.rope_attention_factor > 0:
            raise ConfigError(f"model.rope_attention_factor={self.rope_attention_factor} must be > 0, or null for "
                              "YaRN's 0.1 ln(factor) + 1.")

    def _validate_longrope_factors(self) -> None:
        for name in ("rope_short_factors", "rope_long_factors"):
            factors = getattr(self, name)
            if self.rope_scaling != "longrope":
                if factors is not None:
                    raise ConfigError(f"model.{name} holds LongRoPE's divisors, and model.rope_scaling="
                                      f"{self.rope_scaling!r}; set model.rope_scaling=longrope or model.{name}=null.")
                continue
            pairs = self.rotary_dim // 2
            if (not isinstance(factors, (list, tuple)) or len(factors) != pairs
                    or not all(_positive_number(factor) for factor in factors)):
                raise ConfigError(f"model.{name} must list {pairs} positive numbers with model.rope_scaling=longrope, "
                                  f"one per rotated pair of channels (rotary_dim {self.rotary_dim} / 2); it is "
                                  f"{factors!r}.")

    def _validate_mamba(self) -> None:
        heads, groups = self.resolved_mamba_num_heads, self.mamba_num_groups
        if self.mamba_scan == "triton" and not triton_installed():
            raise ConfigError("model.mamba_scan='triton' needs Triton, which is not installed; install it "
                              "(pip install -e '.[triton]') or use model.mamba_scan=auto.")
        if self.mamba_num_heads is None and (self.mamba_expand * self.hidden_size) % self.mamba_head_dim:
            raise ConfigError(f"model.mamba_expand * model.hidden_size = {self.mamba_expand * self.hidden_size} is not "
                              f"divisible by model.mamba_head_dim={self.mamba_head_dim}; set model.mamba_num_heads.")
        if heads <= 0 or heads % groups:
            raise ConfigError(f"model.mamba_num_groups={groups} must divide the number of Mamba heads ({heads}).")
        if not 0 < self.mamba_dt_min <= self.mamba_dt_max:
            raise ConfigError(f"need 0 < model.mamba_dt_min ({self.mamba_dt_min}) <= model.mamba_dt_max "
                              f"({self.mamba_dt_max}).")

    def _validate_moe(self) -> None:
        if self.moe_top_k > self.moe_num_experts:
            raise ConfigError(f"model.moe_top_k={self.moe_top_k} exceeds model.moe_num_experts={self.moe_num_experts}; "
                              "a token cannot pick more experts than exist.")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ConfigError(f"model.moe_capacity_factor={self.moe_capacity_factor} must be > 0, or null for "
                              "dropless routing.")
        if self.moe_aux_loss_coeff < 0 or self.moe_z_loss_coeff < 0:
            raise ConfigError("model.moe_aux_loss_coeff and model.moe_z_loss_coeff must be >= 0.")
        if self.moe_bias_update_rate < 0:
            raise ConfigError(f"model.moe_bias_update_rate={self.moe_bias_update_rate} must be >= 0 (0 turns "
                              "aux-loss-free balancing off).")
        self._validate_router_groups()

    def _validate_router_groups(self) -> None:
        groups, group_top_k = self.moe_router_num_groups, self.moe_router_group_top_k
        if (groups is None) != (group_top_k is None):
            raise ConfigError(f"model.moe_router_num_groups={groups} and model.moe_router_group_top_k={group_top_k}: "
                              "set both for group-limited routing, or neither.")
        if groups is None:
            return
        _positive(self, "moe_router_num_groups", "moe_router_group_top_k")
        if self.moe_num_experts % groups:
            raise ConfigError(f"model.moe_router_num_groups={groups} must divide model.moe_num_experts="
                              f"{self.moe_num_experts} (the groups are equal).")
        if not 1 <= group_top_k <= groups:
            raise ConfigError(f"model.moe_router_group_top_k={group_top_k} must lie in [1, "
                              f"model.moe_router_num_groups={groups}].")
        if self.moe_top_k > group_top_k * (self.moe_num_experts // groups):
            raise ConfigError(f"model.moe_top_k={self.moe_top_k} exceeds the {group_top_k} eligible groups of "
                              f"{self.moe_num_experts // groups} experts; raise model.moe_router_group_top_k.")

    # --- (de)serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values["block_overrides"] = {index: dict(fields) for index, fields in self.block_overrides.items()}
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            import difflib
            hints = [f"{name} (did you mean {', '.join(difflib.get_close_matches(name, known, 3)) or 'nothing close'}?)"
                     for name in unknown]
            raise ConfigError("unknown model config key(s): " + "; ".join(hints))
        return cls(**values)


def _positive(config: ModelConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.{name}={value!r} must be a positive integer.")


def _soft_cap(config: ModelConfig, name: str, gemma_2: int) -> None:
    cap = getattr(config, name)
    if cap is not None and not _positive_number(cap):
        raise ConfigError(f"model.{name}={cap!r} must be a positive number (Gemma 2: {gemma_2}), or null for no "
                          "soft-capping.")


def _positive_number(value) -> bool:
    """Whether ``value`` is an int or float (not a bool) above 0 (NaN is not)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def _choice(config: ModelConfig, name: str, allowed: tuple[str, ...]) -> None:
    check_choice(f"model.{name}", getattr(config, name), allowed)


__all__ = ["ADAPTER_FIELDS", "LORA_DEFAULT_TARGETS", "LORA_TARGETS", "ModelConfig", "BLOCK_KINDS",
           "BLOCK_OVERRIDE_FIELDS", "TRAINING_ONLY_FIELDS"]
