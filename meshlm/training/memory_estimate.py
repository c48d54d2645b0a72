"""How much memory one training process needs, estimated at start-up before anything is allocated.

A run that does not fit is better told so in its first second than after minutes of swapping or
an out-of-memory error deep in the first backward. The trainer estimates the peak of one process
and warns when it exceeds what the device has available (``memory_warning``); the estimate is
also printed in the start-up line. It is a simple, documented bound, accurate to a factor of
about two, not a planner: it counts the big tensors and nothing else.

**Parameter state**, from the parameter count of the single-process model (built on ``meta``,
no storage) cut by the layout: block parameters / (tp * pp), routed experts / (ep * etp * pp),
embedding and output head / tp (both counted, as if on one stage); the block parameters tensor
parallelism keeps whole on every rank, MLA's down-projections and latent norms
(``parallelize_latent_attention``), / pp only. Bytes per parameter with
AdamW (see ``meshlm/precision/mixed_precision.py``):

    fp32:       4 weight + 4 grad               + 8 Adam moments (the weights are the masters)
    bf16/fp16:  2 weight + 4 grad (+2 transient) + 4 fp32 master + 8 Adam moments
    Muon:       as above, but 4 bytes of fp32 momentum instead of the 8 of Adam's moments for the
                parameters Muon steps (``optim.optimizer=muon``: the blocks' weight matrices,
                ``meshlm.optim.muon.muon_parameter``); the others keep AdamW's. Under ZeRO the
                sharded buffers keep AdamW's layout (8 bytes / dp), the momentum in the first
                moment's place.

Under LoRA (``model.lora_rank``) only the adapters have gradients, masters and moments; the
frozen weights count their weights alone.

ZeRO (``parallel.zero_stage``, Rajbhandari et al. 2020) divides by the data-parallel size (dp * cp;
the expert-data-parallel size for experts): stage 1 the masters and moments, stage 2 also the
gradients, stage 3 also the weights. An fp32 run under ZeRO keeps its full weights and a master shard.

**Activations** of one micro-batch (backward follows each micro-batch's forward, so gradient
accumulation does not add up), as the tensors each block saves for backward. Per token, in
bytes, with d the run's dtype bytes (4 fp32, 2 bf16/fp16), h hidden, F the MLP width, q/kv the
query and key/value widths (heads * head_dim), a the attention heads, hd the head dim, D the
Mamba inner width, GN its B/C width, H its heads, N its state size, c its chunk, E the experts,
k the top-k, w the expert width:

    every block (its pre-norm)  8h + 4 + d*h     input in fp32, normalized fp32, 1/rms; output in dtype
                                                 (LayerNorm: d*h + 8 + d*h, its input, mean and 1/std)
    block output norm           8h + 4           (model.block_output_norm) its fp32 input, normalized, 1/rms
    attention   *               8hd + d(2q + 2kv) + 4a   RoPE cos/sin (hd: the rotated channels, fewer
                                                          with model.rope_fraction), q, k, v, output; LSE
                                                          (not with selective recompute); QK-norm adds
                                                          8(q + kv) + 4(a + kv heads); with a sliding window
                                                          w < s (no CP) its chunked copies, about
                                                          d(2q + 4kv) more (exactly: see the code)
    latent attention * (MLA)    8 d_r + latents + d(4q + v) + 4a (selective recompute: d(q + k
                                + 2v)): q = k = a(d_n + d_r), v = a d_v; RoPE cos/sin of the d_r
                                rotary channels; narrower value heads enter SDPA zero-padded to
                                the keys' width, so the kernel keeps v and its output q wide, and
                                o_proj's input is a copy of the output's real channels. Latents,
                                each like a pre-norm: query 8 r_q + 4 + d r_q, KV 4 r (fp32:
                                4(r + d_r), the norm's input is a slice of kv_a_proj's output) +
                                4 + 4r + d r. On the CPU, value heads wider than the query/key
                                heads take SDPA's math path, which saves fp32 scaled q and k, v
                                and the probabilities, 4(q + k + v) + 4 a s
    MLP         -               d * (4F gated / 2F)       gate, up, act(gate), product (or proj, act)
    MoE         E               (norm output in fp32: 12h + 4) + 16E + 4 (router) + k(20 + d*w + d*MLP
                                + 8w) (indices, weights, dispatched rows, experts, fp32 combine)
                                + shared expert's input (in fp32 the router's) and MLP, with
                                its gate d(1 + h) + 2 d * latent
    Mamba-2     M               d(2D + 2GN + H) + d(D + 2GN) + 12H + 4DN/c + 2dD + 4G: in_proj
                                output, conv output, dt terms, chunk states, the scan's output
                                (the gated norm's input) and out_proj's input, the norm's 1/rms
                                per group (G groups)

Under LoRA (``model.lora_rank``) the frozen layers keep only what their inputs' gradients need
(``lora_bytes``): an RMSNorm no normalized product (4h less, the QK- and latent norms' likewise),
the router no fp32 input, the routed experts neither their rows nor their down projections'
inputs, and a frozen linear that reads its input alone (o, down, Mamba's in/out, a non-gated
up, MLA's projections) no input, which its adapter keeps instead; q/k/v and gate/up run as one
GEMM that keeps its input anyway. Each adapter adds x A^T, r d, and with ``model.lora_dropout``
its masked input and the mask, (d + 1) per input channel. In fp32 a QK-norm keeps an unadapted
q or k projection's output as it is, a view that holds all of the joint q/k/v output.

(read off the tensors autograd saves with torch 2.13 on CPU and the PyTorch SSD path; equal to
them within 1% per block kind in fp32 and bf16, at every recompute setting, in one process and
at tp2 with SP: ``tests/training/test_activation_estimate.py``). The attention
score matrix [heads, seq, seq] is not stored: the SDPA kernels (flash on CPU and CUDA,
memory-efficient) never materialise it, except SDPA's math path (MLA's wider value heads on the
CPU, above); only
``model.attention_dropout > 0`` takes the explicit softmax path, which saves 5 + d bytes per score
(fp32 probabilities, the keep mask, the kept probabilities; under selective recompute the keep
mask alone, an input of the checkpointed core), the [seq, seq] mask of visible keys, and keys and
values repeated to every query head, but no LSE (the explicit core of soft-capped scores and
attention sinks, ``model.attention_softcap`` and ``model.attention_sinks``, keeps what a fused
kernel keeps: q, k, v, the output and LSE). On
CUDA the padded MLA core goes to FlashAttention-2 or cuDNN like any other (not measured here). The output
head fuses the projection with the loss (``meshlm/models/losses.py``): two fp32 [chunk, vocab] buffers, the
hidden-state gradient and an fp32 weight gradient, instead of [tokens, vocab] logits; under
tensor parallelism the vocab-parallel loss holds about three fp32 [tokens, vocab / tp]
tensors. Each MTP depth adds its blocks, 4h and another head. The peak is at the start of the
backward, and backward frees each block's tensors about as fast as it makes that block's
gradients, so no working space is added, except the block being recomputed (with
``train.recompute=full``) and the scores' temporaries in one layer (with attention dropout, or on
SDPA's math path). A tensor two blocks save counts for each, a small over-count: the RoPE tables
every attention block reads, and under ``model.parallel_residual`` the input an attention block
shares with its partner, whose norm saves it again (LayerNorm in any dtype, RMSNorm in fp32).

Layout: a rank holds seq_len / cp tokens of each sequence; inner widths (q, kv, F, D, experts)
are split by tp (etp); with sequence parallelism the norm's own tensors are split by tp too, but
not its output, which the column-parallel linear saves gathered (the whole sequence). MLA's
latents are not split: every TP rank computes them, and their norms, for the whole sequence
(``parallelize_latent_attention``). Under context parallelism MLA's ring attention pads q, k and
v to the wider head, so its core keeps 4 a max(d_n + d_r, d_v) d + the copied output + LSE. Recomputation
(``train.recompute``) keeps only the input (h) of a fully recomputed block; 'selective' reruns the
attention core, which then keeps only its inputs (q, k, v) and its output (o_proj's input): it
drops the softmax statistics (LSE) and, with attention dropout, the score matrix. Under pipeline parallelism the
first stage holds min(pp, micro-batches) micro-batches of its blocks in flight (1F1B), about the
whole model's layers of one micro-batch (Korthikanti et al. 2022, §4.2.3), times
1 + (pp - 1) / (pp * vp) with the interleaved schedule.

**Frozen models** (``frozen``): a distillation teacher (``train.distill_from``) keeps its shards
resident in the run's dtype, cut by the layout as the run's model is (its parameter count read from
its folder's config.json), plus one micro-batch's fp32 logits of each model and the two
[tokens, vocab / tp] fp32 tensors the backward needs (the student's head is then not the fused
loss: that term replaces ``head``'s chunks); block-wise (``train.distill_blocks``) the teacher's
hidden state entering and leaving each block instead of the logits. A reference model (DPO's
``train.reference_from``, default ``train.init_from``; RL's KL reference) keeps its shards resident
the same way; it runs under no_grad, keeping only its per-token log-probabilities, so only its
weights are counted.
Preference objectives run two rows per pair (``train.objective=dpo``, or ``reward`` with the
Bradley-Terry loss): the activations are those of twice the micro-batch.

Not counted: the CUDA context and allocator fragmentation, communication buffers, data batches,
the low-precision recipes' caches, and an imbalanced MoE routing (experts are assumed to get
their mean share of tokens).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.model_files import read_model_config
from meshlm.data.preference import PAIRS
from meshlm.errors import CheckpointError
from meshlm.models.attention import fused_core_applies, window_chunks
from meshlm.models.flops import attended_pairs
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import default_tokens_per_chunk
from meshlm.models.mlp import is_gated
from meshlm.models.pattern import parse_pattern
from meshlm.optim.muon import muon_parameter
from meshlm.parallel.mesh import ParallelContext
from meshlm.precision.device_defaults import parse_device
from meshlm.training.memory_usage import format_bytes
from meshlm.training.preference_data import needed_kind

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

TP_REPLICATED = ("q_a_proj", "kv_a_proj", "q_a_norm", "kv_a_norm", "shared_expert_gate")
"""Block layers tensor parallelism keeps whole on every rank: MLA's down-projections (with their
LoRA adapters) and latent norms (``meshlm/parallel/tensor/attention.py``), an MoE block's shared
expert gate (``meshlm/parallel/tensor/moe.py``)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak bytes of one training process, by what holds them."""

    weights: int
    gradients: int
    optimizer: int
    """fp32 master weights (when the model is in bf16/fp16, or sharded by ZeRO) and Adam's moments
    (Muon's momentum for the parameters it steps)."""
    activations: int
    frozen: int = 0
    """Frozen models beside the trained one (a distillation teacher): their weights and outputs."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.frozen

    def describe(self) -> str:
        parts = {"weights": self.weights, "gradients": self.gradients, "optimizer state": self.optimizer,
                 "activations": self.activations, **({"frozen models": self.frozen} if self.frozen else {})}
        listed = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts.items())
        return f"{format_bytes(self.total)} ({listed})"


# --- parameter state -----------------------------------------------------------------------------------
def counted_parameters(model_config) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(every parameter, the trainable ones, the trainable ones Muon would step) of the
    single-process model by group: 'vocab' (embedding and head), 'experts' (routed experts),
    'replicated' (``TP_REPLICATED``), 'blocks' (everything else); counted on ``meta`` in one
    build, no storage allocated.

    Trainable: all of them, or under LoRA the adapters (``meshlm/models/lora.py``). Muon's: the
    blocks' and MTP depths' weight matrices ``muon_parameter`` picks, whatever optim.optimizer is
    (the caller decides whether they count as Muon's)."""
    with torch.device("meta"):
        model = LanguageModel(model_config, seed=0)
    every, trainable, muon = ({"vocab": 0, "experts": 0, "replicated": 0, "blocks": 0} for _ in range(3))
    for name, param in model.named_parameters():
        group = ("vocab" if name in ("embedding.weight", "output.weight", "output.bias") else
                 "experts" if ".experts." in name else
                 "replicated" if any(f".{layer}." in name for layer in TP_REPLICATED) else "blocks")
        every[group] += param.numel()
        trainable[group] += param.numel() if param.requires_grad else 0
        muon[group] += param.numel() if muon_parameter(name, param) else 0
    return every, trainable, muon


def parameter_counts(model_config) -> dict[str, int]:
    """Every parameter of the single-process model by group (``counted_parameters``)."""
    return counted_parameters(model_config)[0]


def local_parameter_counts(model_config, layout) -> dict[str, float]:
    """``parameter_counts`` of one rank (``per_rank``)."""
    return per_rank(parameter_counts(model_config), layout)


def per_rank(counts: dict[str, int], layout) -> dict[str, float]:
    """Parameter ``counts`` by group cut down to one rank: blocks by tp * pp (those TP replicates
    by pp), routed experts by ep * etp * pp, embedding and head by tp."""
    return {"vocab": counts["vocab"] / layout.tp_size,
            "blocks": counts["blocks"] / (layout.tp_size * layout.pp_size),
            "replicated": counts["replicated"] / layout.pp_size,
            "experts": counts["experts"] / (layout.ep_size * layout.etp_size * layout.pp_size)}


def parameter_state_bytes(config, layout, zero_stage: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes of this rank's parameters; see the module
    docstring. A frozen parameter (LoRA's base weights) has its weight only: no gradient, no
    master, no moments. Under optim.optimizer=muon, Muon's parameters keep one fp32 momentum
    instead of Adam's two moments (without ZeRO; ZeRO keeps AdamW's sharded buffers)."""
    every, trainable, muon = (per_rank(counts, layout) for counts in counted_parameters(config.model))
    muon_steps = config.optim.optimizer == "muon"
    dtype = config.precision.dtype
    low_precision = dtype != "fp32"
    grad_bytes = 2 if zero_stage >= 2 and low_precision and not config.parallel.reduce_grads_in_fp32 else 4
    weights = gradients = optimizer = 0.0
    for group, count in every.items():
        shards = layout.edp_size if group == "experts" else layout.dp_cp_size
        zero = {stage: shards if zero_stage >= stage else 1 for stage in (1, 2, 3)}
        weights += count * DTYPE_BYTES[dtype] / zero[3]
        count = trainable[group]
        gradients += count * grad_bytes / zero[2] + (count * 2 if low_precision and zero_stage < 2 else 0)
        masters = 4 if low_precision or zero_stage >= 1 else 0  # fp32 without ZeRO: the weights are the masters
        # Muon: 4 bytes of momentum, not Adam's 8 (ZeRO keeps AdamW's buffer layout for it)
        momentum_only = muon[group] if muon_steps and zero_stage == 0 else 0
        optimizer += (count * (masters + 8) - momentum_only * 4) / zero[1]
    return int(weights), int(gradients), int(optimizer)


# --- activations ---------------------------------------------------------------------------------------
def mlp_elements(width: int, activation: str) -> int:
    """Elements per token an MLP of inner ``width`` saves: gate, up, silu(gate) and their product
    (SwiGLU); gpt-oss's clamped SwiGLU gate, up, the clamped gate, its sigmoid, their product, the
    shifted up and the output; or the projection and the activation's output."""
    if activation == "clamped_swiglu":
        return 7 * width
    return (4 if is_gated(activation) else 2) * width


def norm_bytes(h: int, dtype_bytes: int, sequence_shards: int = 1, output_bytes: int | None = None,
               norm: str = "rmsnorm") -> float:
    """Bytes per token a block's pre-norm saves on this rank's sequence shard (``sequence_shards``:
    tp with sequence parallelism) -- ``own_norm_bytes`` -- and the output the next linear reads,
    whole-sequence (under SP the gathered input of the column-parallel linear), ``output_bytes``
    per element (default: the run's dtype)."""
    return own_norm_bytes(h, dtype_bytes, norm) / sequence_shards + (
        dtype_bytes if output_bytes is None else output_bytes) * h


def latent_attention_lora_bytes(model, dtype_bytes: int, output: float, adapter, input_dropped) -> float:
    """``lora_bytes`` of an MLA block past its pre-norm (``latent_bytes``' terms; ``output``: o_proj's
    input width on this rank): the down-projections read the norm's output, which only their
    adapters keep; the frozen latent norms keep no normalized product, and their outputs stay only
    for the up-projections' adapters, as o_proj's input (a copy) for its own."""
    h, q_rank, kv_rank = model.hidden_size, model.mla_q_lora_rank, model.mla_kv_lora_rank
    if q_rank is None:
        change, query_down = adapter("q_proj", h), "q_proj"
    else:
        change, query_down = adapter("q_a_proj", h) + adapter("q_b_proj", q_rank) - 4 * q_rank \
            - input_dropped("q_b_proj", q_rank), "q_a_proj"
    change += adapter("kv_a_proj", h) + adapter("kv_b_proj", kv_rank) - 4 * kv_rank \
        - input_dropped("kv_b_proj", kv_rank)
    if input_dropped(query_down, h) and input_dropped("kv_a_proj", h):  # no adapter keeps the norm's output
        change -= h * dtype_bytes
    return change + adapter("o_proj", output) - input_dropped("o_proj", output)


def own_norm_bytes(h: int, dtype_bytes: int, norm: str = "rmsnorm", frozen: bool = False) -> float:
    """Bytes per token a norm keeps besides its output: RMSNorm (``models/norms.py``) its input in
    fp32 (a copy under bf16/fp16), the normalized fp32 product (not with a ``frozen`` weight, whose
    gradient it is for) and 1/rms; PyTorch's LayerNorm its input as it is and the mean and 1/std
    (fp32 on CUDA; the input's dtype on the CPU)."""
    if norm == "layernorm":
        return dtype_bytes * h + 8
    return (4 if frozen else 8) * h + 4


def block_activation_bytes(kind: str, config, micro_batch: int, seq: int, layout, block_model=None) -> float:
    """Bytes one block of ``kind`` saves for backward over a micro-batch of ``seq`` tokens per sequence
    (this rank's share); see the module docstring. ``block_model``: the block's own model config
    (``config.model.for_block(i)``); None: ``config.model``."""
    model = config.model if block_model is None else block_model
    mixer = mixer_activation_bytes(kind, config, micro_batch, seq, layout, model)
    mixer += lora_bytes(kind, config, model, layout) * micro_batch * seq
    if not model.block_output_norm or kind == "0":
        return mixer
    # the output norm's own tensors (own_norm_bytes), on this rank's sequence shard (under SP the
    # row-parallel output is reduce-scattered)
    shards = layout.tp_size if layout.sequence_parallel else 1
    return mixer + own_norm_bytes(model.hidden_size, DTYPE_BYTES[config.precision.dtype], model.norm,
                                  frozen=bool(model.lora_rank)) / shards * micro_batch * seq


def lora_bytes(kind: str, config, model, layout) -> float:
    """What LoRA (``model.lora_rank``) changes in the bytes per token a block of ``kind`` saves
    (module docstring): frozen layers keep less, adapters add their rank-wide activations and,
    with ``model.lora_dropout``, their masked inputs and masks. 0 without LoRA."""
    if not model.lora_rank or kind == "0":
        return 0.0
    dtype_bytes, tp, h = DTYPE_BYTES[config.precision.dtype], layout.tp_size, model.hidden_size
    shards = tp if layout.sequence_parallel else 1
    targets, dropout = set(model.lora_targets), model.lora_dropout > 0

    def adapter(name: str, width: float) -> float:
        """An adapter on the layer ``name`` whose input is ``width`` wide on this rank: x A^T (rank
        wide, b's input), and with dropout the masked input and its boolean mask."""
        if name not in targets:
            return 0.0
        return model.lora_rank * dtype_bytes + ((dtype_bytes + 1) * width if dropout else 0.0)

    def input_dropped(name: str, width: float) -> float:
        """The input of a frozen layer nothing else saves, which only its adapter without dropout keeps."""
        return 0.0 if name in targets and not dropout else width * dtype_bytes

    norm = ((own_norm_bytes(h, dtype_bytes, model.norm, frozen=True) - own_norm_bytes(h, dtype_bytes, model.norm))
            / shards if model.block_input_norm else 0.0)  # a frozen norm keeps no normalized product
    if kind == "*":
        query, key_value, _, output = attention_widths(model)
        if model.attention_type == "mla":
            return norm + latent_attention_lora_bytes(model, dtype_bytes, output / tp, adapter, input_dropped)
        change = norm + sum(adapter(name, h) for name in ("q_proj", "k_proj", "v_proj")) \
            + adapter("o_proj", output / tp)  # q/k/v run together: their GEMM saves the input anyway
        if model.qk_norm:  # their frozen weights keep no normalized product either
            change -= 4 * (query + key_value) / tp
            unadapted = [width for name, width in (("q_proj", query), ("k_proj", key_value)) if name not in targets]
            if dtype_bytes == 4 and unadapted:  # the norm keeps an unadapted one's fp32 output as it is: a
                # view of q, k and v's joint GEMM output, which it keeps whole (an adapted one is a sum of its own)
                change += 4 * (query + 2 * key_value - sum(unadapted)) / tp
        if config.train.recompute == "selective":  # o_proj's input is its own to keep, not the core's output
            change -= input_dropped("o_proj", output / tp)
        return change
    if kind in ("-", "E"):
        width = (model.resolved_ffn_hidden_size if kind == "-" else model.moe_shared_expert_ffn_hidden_size) / tp
        gated = is_gated(model.mlp_activation)  # gate and up then run together, and save the input anyway
        change = norm
        if width:
            change += adapter("up_proj", h) + adapter("gate_proj", h) * gated \
                + adapter("down_proj", width) - input_dropped("down_proj", width)
        if kind == "-":
            return change - (0.0 if gated else input_dropped("up_proj", h))
        # the frozen router keeps no fp32 input, and the frozen experts neither their rows nor the
        # products their down projections read; the norm's output stays if the shared expert keeps it
        full_inputs = 4 * h + (h * dtype_bytes if width and dtype_bytes != 4 else 0)
        shared_keeps = width and (gated or not input_dropped("up_proj", h))
        kept_inputs = h * dtype_bytes if shared_keeps or "latent_in_proj" in targets else 0
        latent = model.moe_latent_size or 0
        experts = model.moe_top_k * ((latent or h) + model.resolved_moe_ffn_hidden_size / layout.etp_size) * dtype_bytes
        if latent:  # full training's 2 d latent goes; latent_out_proj's input stays for its adapter alone
            # (theirs have no dropout: refused)
            change += adapter("latent_in_proj", h) + adapter("latent_out_proj", latent) - 2 * latent * dtype_bytes \
                + (latent * dtype_bytes if "latent_out_proj" in targets else 0)
        return change + kept_inputs - full_inputs - experts
    if kind == "M":
        inner = model.mamba_inner_size / tp
        return (norm + adapter("in_proj", h) - input_dropped("in_proj", h)
                + adapter("out_proj", inner) - input_dropped("out_proj", inner))
    if kind == "L":  # a replicated linear on this rank's tokens
        return norm + (adapter("out_proj", h) - input_dropped("out_proj", h)) / shards
    raise ValueError(f"unknown block kind {kind!r}")


def mixer_activation_bytes(kind: str, config, micro_batch: int, seq: int, layout, model) -> float:
    """``block_activation_bytes`` without the block output norm."""
    if kind == "0":  # a no-op block saves nothing
        return 0.0
    dtype_bytes, tp, h = DTYPE_BYTES[config.precision.dtype], layout.tp_size, model.hidden_size
    tokens = micro_batch * seq
    sequence_shards = tp if layout.sequence_parallel else 1
    # the pre-norm, or without one (model.block_input_norm=false) the block input the first linear saves
    residual = (norm_bytes(h, dtype_bytes, sequence_shards, norm=model.norm) if model.block_input_norm
                else dtype_bytes * h)
    if kind == "*":
        return attention_bytes(config, model, micro_batch, seq, layout, residual)
    if kind == "-":
        mlp = mlp_elements(model.resolved_ffn_hidden_size, model.mlp_activation) * dtype_bytes
        return (residual + mlp / tp) * tokens
    if kind == "E":
        experts, top_k = model.moe_num_experts, model.moe_top_k
        expert_width = model.moe_latent_size or h
        router = 16 * experts + 4  # fp32 probabilities, int64 ranks, fp32 logits, logsumexp
        norm = (norm_bytes(h, dtype_bytes, sequence_shards, output_bytes=4, norm=model.norm)  # the router: fp32
                if model.block_input_norm else 4 * h)
        routed = top_k * (8 + 8 + 4 + expert_width * dtype_bytes  # indices, weights, the dispatched rows
                          + mlp_elements(model.resolved_moe_ffn_hidden_size, model.mlp_activation) * dtype_bytes
                          / layout.etp_size
                          + 8 * expert_width)  # the experts' outputs and their weighted sum, in fp32
        shared_width = model.moe_shared_expert_ffn_hidden_size
        # the shared expert's input: in fp32 the very tensor the router keeps (counted in ``norm``)
        shared = ((h * dtype_bytes if dtype_bytes != 4 else 0)
                  + mlp_elements(shared_width, model.mlp_activation) * dtype_bytes / tp if shared_width else 0.0)
        if model.moe_shared_expert_gate:  # the gate's logit and sigmoid, the gated output
            shared += (2 + h) * dtype_bytes / sequence_shards
        latent = 2 * (model.moe_latent_size or 0) * dtype_bytes
        return (norm + router + routed + shared + latent) * tokens
    if kind == "M":
        inner, groups = model.mamba_inner_size, model.mamba_num_groups * model.mamba_state_size
        heads = model.resolved_mamba_num_heads
        projected = (2 * inner + 2 * groups + heads) * dtype_bytes  # in_proj's output (z, xBC, dt)
        convolved = (inner + 2 * groups) * dtype_bytes
        step_sizes = 3 * heads * 4  # dt + bias, softplus, clamp, in fp32
        chunk_states = 4 * inner * model.mamba_state_size / model.mamba_chunk_size
        # the scan's output y (the norm adds D x and gates in fp32 from the saved inputs) and the
        # norm's output, out_proj's input; the norm's 1/rms, one fp32 number per group
        gated_norm = 2 * inner * dtype_bytes + 4 * model.mamba_num_groups
        mamba = projected + convolved + step_sizes + chunk_states + gated_norm
        return (residual + mamba / tp) * tokens
    if kind == "L":  # the norm's terms and the replicated linear's input
        return (norm_bytes(h, dtype_bytes, sequence_shards, output_bytes=0, norm=model.norm)
                + h * dtype_bytes / sequence_shards) \
            * tokens
    raise ValueError(f"unknown block kind {kind!r}")


def attention_bytes(config, model, micro_batch: int, seq: int, layout, residual: float) -> float:
    """What an attention block saves (module docstring): its pre-norm (``residual`` bytes per
    token), the RoPE tables, MLA's latents (whole on every TP rank, which computes them for the
    whole sequence), QK-norm's terms and the core's tensors (split by heads over tp), and with
    attention dropout its score matrix."""
    dtype_bytes, tp, tokens = DTYPE_BYTES[config.precision.dtype], layout.tp_size, micro_batch * seq
    latent = model.attention_type == "mla"
    rope = 8 * model.rotary_dim if model.position_embedding == "rope" else 0  # cos, sin of the rotated channels
    core = attention_core_bytes(config, model, seq, layout)
    query, key_value = attention_widths(model)[:2]
    if model.qk_norm:  # q and k: fp32 input, normalized product, per head 1/rms (LayerNorm: mean, 1/std)
        per_head = 8 if model.qk_norm_type == "layernorm" else 4
        core += 8 * (query + key_value) + per_head * (model.num_attention_heads + model.resolved_num_kv_heads)
    scores = 0.0
    if model.attention_dropout > 0:
        # the keep mask, one byte per score (under selective recompute an input of the checkpointed
        # core); without recompute the explicit softmax's fp32 probabilities and the kept ones in the
        # run's dtype, and once per layer the [seq, seq] mask of visible keys
        selective = config.train.recompute == "selective"
        scores = (micro_batch * model.num_attention_heads / tp * seq * seq * (1 if selective else 5 + dtype_bytes)
                  + (0 if selective else seq * seq))
    latents = latent_bytes(model, dtype_bytes) if latent else 0.0
    return (residual + rope + latents + core / tp) * tokens + scores


def attention_widths(model) -> tuple[int, int, int, int]:
    """Elements per token of the attention core's query, key, value and output: heads x head widths
    (MLA: query and key heads of d_n + d_r, value and output heads of d_v)."""
    heads, kv_heads = model.num_attention_heads, model.resolved_num_kv_heads
    qk, v = model.resolved_head_dim, model.resolved_value_head_dim
    return heads * qk, kv_heads * qk, kv_heads * v, heads * v


def latent_bytes(model, dtype_bytes: int) -> float:
    """Bytes per token MLA's latents save (``latent_attention.py``): each latent norm's fp32 input,
    its normalized fp32 product, 1/rms and its output (the up-projection's input). The KV latent is
    a slice of kv_a_proj's output, so in fp32 the norm's input keeps all of it, the rotary key's
    d_r channels too; in bf16/fp16 the norm saves an fp32 copy of the slice alone."""
    rank = model.mla_kv_lora_rank
    kv_input = 4 * (rank + model.mla_qk_rope_head_dim) if dtype_bytes == 4 else 4 * rank
    key_value = kv_input + 4 + (4 + dtype_bytes) * rank
    query = norm_bytes(model.mla_q_lora_rank, dtype_bytes) if model.mla_q_lora_rank is not None else 0.0
    return query + key_value


def attention_core_bytes(config, model, seq: int, layout) -> float:
    """Bytes per token the attention core (and o_proj's input) saves on one rank before the tp
    split; which tensors depends on the path the core takes (module docstring)."""
    dtype_bytes, heads = DTYPE_BYTES[config.precision.dtype], model.num_attention_heads
    query, key, value, output = attention_widths(model)
    # o_proj's input: under GQA a view of the core's output ([b, t, heads, d] in memory, as the
    # queries are), under MLA a copy (its queries are built head-major, so the output is too)
    copied_output = output if model.attention_type == "mla" else 0
    if config.train.recompute == "selective":  # the checkpointed core keeps its inputs; o_proj its own
        return (query + key + value + output) * dtype_bytes
    if model.attention_dropout > 0:  # attention_with_dropout repeats k and v to every query head
        repeat = heads / model.resolved_num_kv_heads
        return (query + repeat * (key + value) + output) * dtype_bytes
    if layout.cp_size > 1:  # ring attention: q, k, v and its output padded to the wider head, LSE
        if copied_output:
            padded = heads * max(model.resolved_head_dim, model.resolved_value_head_dim)
            return (4 * padded + copied_output) * dtype_bytes + 4 * heads
        return (query + key + value + output) * dtype_bytes + 4 * heads
    window = model.sliding_window if model.sliding_window is not None and model.sliding_window < seq else seq
    if fused_core_applies(model.attention_softcap is not None, value == key, model.attention_sinks,
                          window if window < seq else None, parse_device(config.train.device).type):
        # sinks or a window on the fused kernel (meshlm/models/sink_attention.py): q, k, v, the
        # output and the log-sum-exp, nothing padded (a window's blocks are made again in backward);
        # a window's output is laid out [b, t, heads, d], so o_proj's input is a view of it under MLA too
        return (query + key + value + output + (0 if window < seq else copied_output)) * dtype_bytes + 4 * heads
    padded = window_chunks(seq, window) * window
    if math_path(config, model):
        return math_core_bytes(query, key, value, heads, seq, window, padded, dtype_bytes) + output * dtype_bytes
    narrower_values = not explicit_core(model) and value < key
    if narrower_values:
        # narrower value heads (MLA) enter SDPA zero-padded to the keys' width (``scaled_dot_product``):
        # the kernel keeps v and its output that wide, and o_proj's input is the copy of the real channels
        value, output = key, query
    # a fused kernel: q, k, v, the output and the softmax's log-sum-exp (LSE)
    core = (query + key + value + output + copied_output) * dtype_bytes + 4 * heads
    if window < seq:
        # windowed_attention over P = chunks * window padded positions: q, k, v padded to P, the
        # two outputs and LSEs over P rows (o_proj's input is then a copy under GQA too), and the
        # later chunks' folded queries and key/value pairs
        core += ((query + key + value) * (padded - seq) / seq + output * padded / seq - copied_output
                 + (query + 2 * (key + value)) * (padded - window) / seq) * dtype_bytes
        core += 4 * heads * (padded - seq) / seq
        if narrower_values:  # the calls keep padded copies of their values, not the values padded to P,
            # and o_proj's input is a copy of the real channels, not one of the kernel's outputs
            core -= (value * (padded - window) / seq + output - copied_output) * dtype_bytes
    return core


def math_path(config, model) -> bool:
    """Whether the core runs SDPA's math path: on the CPU, whose flash kernel wants one width for
    q, k and v, when MLA's value heads are wider than the query/key heads (narrower ones are
    zero-padded to their width, ``scaled_dot_product``; CUDA's memory-efficient kernel takes
    either; the soft-capped core is its own explicit one)."""
    wider_values = model.resolved_value_head_dim > model.resolved_head_dim
    return wider_values and not explicit_core(model) and parse_device(config.train.device).type == "cpu"


def explicit_core(model) -> bool:
    """Whether attention runs the explicit core (``meshlm/models/explicit_attention.py``: soft-capped
    scores, sinks), which takes any value width and keeps what a fused kernel keeps."""
    return model.attention_softcap is not None or model.attention_sinks


def math_core_bytes(query: int, key: int, value: int, heads: int, seq: int, window: int, padded: int,
                    dtype_bytes: int) -> float:
    """Bytes per token SDPA's math path saves on the CPU, in fp32 whatever the run's dtype: each
    call's scaled queries and keys, its values and its softmax probabilities. With a sliding window
    (``windowed_attention``, P = ``padded`` positions) the calls are the first chunk's w x w and the
    later chunks' w x 2w; the first call's values are a slice, in fp32 of the padded values
    themselves, in bf16/fp16 an fp32 copy of its w rows. Without one, w = P = seq."""
    later = padded - window
    first_values = value * (padded if dtype_bytes == 4 else window)
    pairs = attended_pairs(seq, window)  # w x w, then w x 2w per later chunk
    return 4 * (query * padded + key * (window + 2 * later) + first_values + value * 2 * later + heads * pairs) / seq


def head_bytes(config, tokens: int, layout) -> float:
    """The output head and loss: fused chunks in one process, vocab-parallel logits under TP."""
    model, dtype_bytes = config.model, DTYPE_BYTES[config.precision.dtype]
    vocab, h = model.vocab_size, model.hidden_size
    hidden_terms = 4 * h * tokens * dtype_bytes  # the last block's output, the final norm, the hidden gradient
    if layout.tp_size > 1:
        return hidden_terms + 3 * tokens * vocab / layout.tp_size * 4
    chunk = min(tokens, default_tokens_per_chunk(vocab, parse_device(config.train.device).type))
    return hidden_terms + 2 * chunk * vocab * 4 + vocab * h * 4


def activation_bytes(config, layout) -> int:
    """Bytes the activations of the micro-batches in flight take on this rank at the start of a backward."""
    return int(sum(activation_items(config, layout).values()))


def activation_items(config, layout) -> dict[str, float]:
    """``activation_bytes`` by what holds them: each block kind's saved tensors (times the
    micro-batches in flight: ``blocks *``, ``blocks -``, ...), the MTP depths (``mtp``), the output
    head and loss (``head``), the block being recomputed (``recompute``) and the attention scores'
    temporaries (``scores``)."""
    model, train = config.model, config.train
    seq, micro_batch = math.ceil(train.seq_len / layout.cp_size), train.micro_batch_size * rows_per_example(train)
    kinds = list(model.block_kinds)
    per_block = [block_activation_bytes(kind, config, micro_batch, seq, layout, model.for_block(index))
                 for index, kind in enumerate(kinds)]
    kept = list(per_block)
    if train.recompute == "full":  # a recomputed block keeps only its input
        input_bytes = micro_batch * seq * model.hidden_size * DTYPE_BYTES[config.precision.dtype]
        kept = [input_bytes if index % train.recompute_every == 0 else block_bytes
                for index, block_bytes in enumerate(per_block)]
    mtp_kinds = parse_pattern(model.mtp_pattern, "model.mtp_pattern").kinds if model.mtp_depth else ()
    mtp = model.mtp_depth * (sum(block_activation_bytes(kind, config, micro_batch, seq, layout) for kind in mtp_kinds)
                             + 4 * micro_batch * seq * model.hidden_size * DTYPE_BYTES[config.precision.dtype]
                             + head_bytes(config, micro_batch * seq, layout))
    # 1F1B: the first stage holds min(pp, micro-batches) micro-batches of its 1/pp of the blocks
    micro_batches_per_rank = train.global_batch_size // (train.micro_batch_size * layout.dp_size)
    in_flight = min(layout.pp_size, micro_batches_per_rank) / layout.pp_size
    if layout.vp_size > 1:
        in_flight *= 1 + (layout.pp_size - 1) / (layout.pp_size * layout.vp_size)
    items = {f"blocks {kind}": 0.0 for kind in dict.fromkeys(kinds)}
    for kind, block_bytes in zip(kinds, kept):
        items[f"blocks {kind}"] += in_flight * block_bytes
    items["mtp"] = in_flight * mtp
    items["head"] = head_bytes(config, micro_batch * seq, layout)
    items["recompute"] = max(per_block, default=0) if train.recompute == "full" else 0  # the block rerun in backward
    items["scores"] = score_transient_bytes(config, micro_batch, seq, layout)
    return items


def rows_per_example(train) -> int:
    """Rows of one training example: 2 for a preference pair (DPO, Bradley-Terry), else 1."""
    return 2 if needed_kind(train) == PAIRS else 1


def score_transient_bytes(config, micro_batch: int, seq: int, layout) -> float:
    """With attention dropout, the layer being computed also holds the dropout mask's int64 hashes
    and fp32 copies of its scores (masked, softmaxed) for a moment: about 28 bytes per score of one
    layer; on SDPA's math path (MLA's wider value heads on the CPU, ``math_path``) its fp32 scores before the softmax
    and the causal mask, about 6 bytes per score it computes (``attended_pairs``: a sliding window's
    chunks). Both measured on CPU."""
    model = config.model
    if "*" not in model.block_kinds:
        return 0.0
    heads = micro_batch * model.num_attention_heads / layout.tp_size
    if model.attention_dropout > 0:
        return heads * seq * seq * 28
    if math_path(config, model) and layout.cp_size == 1:  # ring attention under CP has its own core
        return heads * attended_pairs(seq, model.sliding_window) * 6
    return 0.0


# --- the estimate and the warning ----------------------------------------------------------------------
def estimate_training_memory(config, layout=None, reference: str | None = None) -> MemoryEstimate:
    """The peak memory of one process of the run ``config`` (a validated RunConfig whose
    precision.dtype is resolved) at ``layout`` (a ParallelContext; None: a single process);
    ``reference``: the folder of a frozen reference model the run keeps beside its own (default:
    DPO's, ``reference_path``; RL's KL reference is handed in by ``meshlm rl``)."""
    layout = layout if layout is not None else ParallelContext()
    zero_stage = config.parallel.sharding_stage if layout.distributed else 0
    weights, gradients, optimizer = parameter_state_bytes(config, layout, zero_stage)
    frozen = frozen_items(config, layout, reference)
    activations = activation_items(config, layout)
    if "teacher logits" in frozen:  # the student's head is the unfused vocab-parallel one, counted there
        activations["head"] = 0.0
    return MemoryEstimate(weights, gradients, optimizer, int(sum(activations.values())),
                          int(sum(frozen.values())))


def frozen_items(config, layout, reference: str | None = None) -> dict[str, float]:
    """Bytes of the frozen models beside the trained one (see the module docstring); empty without
    them, or when the folder cannot be read (the trainer then refuses it with its own message)."""
    train, items = config.train, {}
    dtype_bytes = DTYPE_BYTES[config.precision.dtype]
    reference = reference or reference_path(config)
    reference_config = readable_model_config(reference) if reference is not None else None
    if reference_config is not None:
        items["reference weights"] = sum(local_parameter_counts(reference_config, layout).values()) * dtype_bytes
    teacher = readable_model_config(train.distill_from) if train.distill_from is not None else None
    if teacher is None:
        return items
    tokens = train.micro_batch_size * math.ceil(train.seq_len / layout.cp_size)
    items["teacher weights"] = sum(local_parameter_counts(teacher, layout).values()) * dtype_bytes
    if train.distill_blocks:  # h_{i-1} and h_i of each of this stage's blocks
        blocks = teacher.num_blocks / layout.pp_size
        items["teacher states"] = (blocks + 1) * tokens * teacher.hidden_size * dtype_bytes
    else:  # fp32 logits of both models and the two backward tensors, [tokens, vocab / tp] each
        items["teacher logits"] = 4 * tokens * teacher.vocab_size / layout.tp_size * 4
    return items


def reference_path(config) -> str | None:
    """The frozen reference model's folder of a DPO run (``train.reference_from``, else
    ``train.init_from``); None without one."""
    train = config.train
    return (train.reference_from or train.init_from) if train.objective == "dpo" else None


def readable_model_config(path: str):
    """The model config of the folder ``path`` names, or None when it cannot be read (the trainer
    refuses it later with its own message)."""
    try:
        return read_model_config(resolve_model_dir(path))
    except (CheckpointError, OSError):
        return None


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still use: free memory on a CUDA device; on the CPU the host's
    available memory (psutil, else /proc/meminfo's MemAvailable) shared by the node's processes
    (LOCAL_WORLD_SIZE under torchrun); None where it cannot be known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device if device.index is not None else None)[0]  # None: the current GPU
    if device.type != "cpu":
        return None
    try:
        import psutil
        available = psutil.virtual_memory().available
    except ImportError:
        available = meminfo_available()
    if available is None:
        return None
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_warning(estimate: MemoryEstimate, available: int | None, device: torch.device, config) -> str | None:
    """One sentence when ``estimate`` exceeds ``available`` bytes: the numbers and what lowers them."""
    if available is None or estimate.total <= available:
        return None
    return (f"the estimated peak memory of this process, {estimate.describe()}, exceeds the {format_bytes(available)} "
            f"available on {device}; {memory_remedies(config)}.")


def memory_remedies(config) -> str:
    """The settings that lower a process's peak memory, with their current values: a clause for the
    estimate's warning and for the out-of-memory stop (out_of_memory.py)."""
    train = config.train
    return (f"lower train.micro_batch_size ({train.micro_batch_size}) or train.seq_len ({train.seq_len}), set "
            f"train.recompute=full (now {train.recompute}), or spread the run with parallel.tp, parallel.pp, "
            f"parallel.cp (activations) or parallel.zero_stage (now {config.parallel.sharding_stage}: optimizer state "
            "and gradients)")


__all__ = ["MemoryEstimate", "activation_bytes", "activation_items", "available_memory", "counted_parameters",
           "estimate_training_memory", "memory_remedies", "memory_warning", "parameter_counts", "parameter_state_bytes",
           "per_rank"]
