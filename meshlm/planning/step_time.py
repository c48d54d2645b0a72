"""How long one training step takes under a layout: compute, communication, the pipeline bubble.

**Compute** comes from the model's own FLOP accounting (``meshlm/models/flops.py``), block by
block with each block's sizes, split into op classes (matmul, attention core, SSD scan) and
divided by the GPU's achievable rate for that class (``hardware.py``; on the calibrated CPU row,
by the rate measured for the block's kind). A pipeline stage's
share is the blocks ``stage_starts`` gives it (cut by FLOPs, as the trainer cuts), the head and
MTP depths on the last stage; tensor parallelism divides the work by tp, except the layers it
keeps whole on every rank (``TP_REPLICATED_TERMS``: MLA's down-projections, computed by each rank
for the whole sequence), context parallelism the tokens by cp. Backward is twice the forward;
recomputation adds the recomputed forward ('full': the whole block; 'selective': the attention
core), which is work the GPU does but not model FLOPs -- it counts in the *hardware* FLOP rate,
as PTD-P reports it.

**Communication**, alpha-beta per message (latency + bytes / bandwidth, the node's fabric when
the group fits in a node, else the network), with the byte counts ``bench/communication.py``
measures:

- TP: per block and micro-batch one all-reduce of b*s*h forward and one backward (with SP an
  all-gather plus a reduce-scatter of the same bytes), ring cost 2(t-1)/t of the message; again
  in forward when the block is recomputed. Not overlapped. A reduce-scatter moves what an
  all-gather does, (t-1)/t of the message, except where the backend reduces the whole buffer
  (``Hardware.reduce_scatter_factor``: gloo's costs an all-reduce). Once per step, after the
  pipeline, one all-reduce of the gradients that are partial on each TP rank (``tp_partial_s``:
  replicated weights applied to this rank's heads or tokens only -- norms under SP, QK-norms, KV
  projections shared by fewer KV heads than ranks, MLA's down-projections and latent norms),
  fp32, this rank's 1/S of them under ZeRO (the distributed optimizer sums its shards only).
- PP: per micro-batch and stage boundary, the b*s*h activation forward and its gradient
  backward, times vp with interleaving; on the critical path.
- DP: the gradients (fp32, all-reduce or reduce-scatter + all-gather, the same ring bytes) once
  per step, overlapped with the last micro-batch's backward; only what sticks out counts.
- CP: ring attention passes each K/V chunk around the ring (cp-1 hops) forward and again
  backward, where the chunk's fp32 dK/dV accumulator follows it home (cp hops), overlapped with
  the attention core it feeds (``meshlm/parallel/context/ring_attention.py``). A chunk is each
  block's own KV heads of its key and value widths; MLA's keys (d_n + d_r) and values (d_v) travel
  zero-padded to the wider of the two, one key and one value per head (``ring_kv_elements``).
- Where the hardware cannot overlap (``Hardware.overlaps_communication``: the CPU, whose cores do
  the collectives' copies), DP and CP communication adds in full.
- EP: an all-to-all of the routed tokens to their experts and one back, forward and backward.

**Pipeline bubble** (Narayanan et al. 2021): with m micro-batches per pipeline and p stages,
the step is (m + (p-1)/v) times the slowest stage's time per micro-batch (1F1B; interleaved
with v chunks per rank).

**Per step**, a few latency-bound all-reduces of scalars (gradient norm, logged sums, stop vote),
and the optimizer's elementwise update, bound by HBM bandwidth (AdamW's bytes per parameter).

**Muon** (``optim.optimizer=muon``, ``meshlm/optim/muon.py``) adds, after the pipeline and not
overlapped, on the busiest pipeline rank: Newton-Schulz on each matrix it steps, with the whole
matrix's shape (m <= n) ``optim.muon_ns_steps`` iterations of X X^T, A A and B X, 4 m^2 n + 2 m^3
FLOPs, fp32 matmuls at the row's 'matmul' fraction of the fp32 peak -- TF32 when
``precision.tf32`` is on (the data sheets of ``meshlm/training/metrics.py``: half the bf16 peak),
plain fp32 when off; the CPU row's rate is measured in fp32 already. The shapes are the layout's:
a stack of routed experts is E/ep matrices; the matrices TP (or ETP) cuts are dealt round-robin
over that group's t ranks, each orthogonalized whole on one of them (1/t of the Newton-Schulz per
rank) after an all-to-all of the shards in fp32, and a second returns the result's shards
(``meshlm/parallel/tensor/orthogonal_updates.py``). Under ZeRO
(Distributed Muon) one all-gather of the Muon parameters' fp32 gradient buffer over the sharding
group S (dp*cp; edp for the expert grid) comes first, and then each rank orthogonalizes and
TP-gathers only the matrices it owns a piece of, counted as 1/S of them (a matrix split between
two owners is done by both: not counted). Muon's elementwise part stays in the optimizer term,
priced as AdamW's (one momentum instead of two moments: a slight over-estimate); the
Newton-Schulz FLOPs are not counted in the hardware FLOP rate.

Not modeled: kernel-level overlap of TP communication with GEMMs, stragglers, data loading,
imbalanced expert routing.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import torch

from meshlm.models.flops import BACKWARD_TO_FORWARD, block_flops, head_flops, mtp_flops
from meshlm.models.language_model import LanguageModel
from meshlm.optim.muon import muon_parameter
from meshlm.parallel.pipeline.stages import stage_starts
from meshlm.planning.memory import planning_context, rank_parameters, sharding_groups
from meshlm.training.memory_estimate import DTYPE_BYTES
from meshlm.training.metrics import table_peak_flops

FP32 = 4

ATTENTION_TERMS = {"scores", "attend"}

TP_REPLICATED_TERMS = {"q_a_proj", "kv_a_proj"}
"""Block FLOP terms (``meshlm/models/flops.py``) that tensor parallelism does not split: MLA's
down-projections, whole on every rank (``parallelize_latent_attention``)."""


def op_class(term: str) -> str:
    if term in ATTENTION_TERMS:
        return "attention"
    if term.startswith("ssd") or term == "conv":
        return "ssd"
    return "matmul"


def block_times(config, layout, hardware, seq: int) -> list[dict]:
    """Per block of the main stack, for one sequence on one rank: forward seconds, the forward
    seconds recomputation adds, and its forward model FLOPs (this rank's share)."""
    model, recompute = config.model, config.train.recompute
    rows = []
    for index, kind in enumerate(model.block_kinds):
        terms = block_flops(kind, model.for_block(index), config.train.seq_len).terms
        share = {}
        for term, flops in terms.items():
            # CP: this rank has seq / cp of the tokens; its attention covers them against all keys
            share[term] = flops / layout.cp / (1 if term in TP_REPLICATED_TERMS else layout.tp)
        if kind in hardware.block_rates:  # measured on this CPU: forward's share of its fwd+bwd time
            forward = sum(share.values()) / hardware.block_rates[kind]
        else:
            forward = sum(flops / hardware.rate(op_class(term)) for term, flops in share.items())
        attention = sum(flops / hardware.rate("attention") for term, flops in share.items() if term in ATTENTION_TERMS)
        extra = forward if recompute == "full" else attention if recompute == "selective" else 0.0
        rows.append({"kind": kind, "forward_s": forward, "recompute_s": extra, "flops": sum(share.values()),
                     "attention_s": attention, "fixed_s": hardware.block_fixed_s.get(kind, 0.0)})
    return rows


def ring_kv_elements(block_model) -> int:
    """Elements per token of the key and value chunk ring attention passes on (all TP ranks'
    together): GQA's KV heads of head_dim each; MLA's key (d_n + d_r) and value (d_v) of every
    head, zero-padded to the wider width (``ring_attention``)."""
    heads = block_model.resolved_num_kv_heads
    if block_model.attention_type == "mla":
        return 2 * heads * max(block_model.resolved_head_dim, block_model.resolved_value_head_dim)
    return 2 * heads * block_model.resolved_head_dim


def ring_seconds(message_bytes: float, ranks: int, hardware, intra: bool, factor: float = 2.0) -> float:
    """A ring collective over ``ranks``: ``factor`` (2 for all-reduce, 1 for all-gather or
    reduce-scatter) x (ranks-1)/ranks of the message on the wire, in 2(ranks-1) latency steps."""
    if ranks <= 1:
        return 0.0
    bandwidth = (hardware.intra_gbps if intra else hardware.inter_gbps) * 1e9
    latency = hardware.intra_latency_s if intra else hardware.inter_latency_s
    return factor * (ranks - 1) / ranks * message_bytes / bandwidth + factor * (ranks - 1) * latency


def scatter_and_gather_seconds(message_bytes: float, ranks: int, hardware, intra: bool) -> float:
    """A reduce-scatter of the message and an all-gather of it (sequence parallelism around a
    block; ZeRO's gradients and parameters): an all-reduce's traffic on NCCL's ring, more where
    the backend's reduce-scatter reduces the whole buffer (``Hardware.reduce_scatter_factor``)."""
    return (ring_seconds(message_bytes, ranks, hardware, intra, factor=hardware.reduce_scatter_factor)
            + ring_seconds(message_bytes, ranks, hardware, intra, factor=1.0))


def p2p_seconds(message_bytes: float, hardware, intra: bool) -> float:
    bandwidth = (hardware.intra_gbps if intra else hardware.inter_gbps) * 1e9
    return (hardware.intra_latency_s if intra else hardware.inter_latency_s) + message_bytes / bandwidth


def step_time(config, layout, hardware, parameter_count: int, partial_count: int = 0) -> dict:
    """Seconds of one step and its parts, plus FLOP counts (see the module docstring).
    ``parameter_count``: this rank's parameters (the DP gradient volume); ``partial_count``: those
    of them whose gradients are partial over TP (``RankParameters.partial_count``)."""
    model, train = config.model, config.train
    dtype_bytes = DTYPE_BYTES[config.precision.dtype]
    micro_batch, seq = train.micro_batch_size, train.seq_len
    micro_batches = train.global_batch_size // (micro_batch * layout.dp)
    per_node = hardware.gpus_per_node
    blocks = block_times(config, layout, hardware, seq)
    num_stages = layout.pp * layout.vp
    starts = (stage_starts(model, num_stages, seq) if num_stages > 1 else [0]) + [model.num_blocks]
    head = (head_flops(model, seq) + mtp_flops(model, seq)) / layout.cp / layout.tp
    head_s = head / hardware.block_rates.get("head", hardware.rate("matmul"))
    tokens_local = micro_batch * seq / layout.cp
    activation_bytes = tokens_local * model.hidden_size * dtype_bytes
    tp_intra = layout.tp <= per_node
    # SP: an all-gather before the block's first matmul and a reduce-scatter after its last
    tp_collectives = scatter_and_gather_seconds if layout.sp else ring_seconds
    tp_block_s = tp_collectives(activation_bytes, layout.tp, hardware, tp_intra)
    moe_blocks = [index for index, kind in enumerate(model.block_kinds) if kind == "E"]
    ep_intra = layout.ep * layout.tp <= per_node

    def stage_seconds(stage: int) -> float:
        """Forward + backward (+ recompute) of one micro-batch on virtual stage ``stage``."""
        indices = range(starts[stage], starts[stage + 1])
        seconds = 0.0
        for index in indices:
            row = blocks[index]
            if row["kind"] == "0":
                continue
            compute = micro_batch * (row["forward_s"] * (1 + BACKWARD_TO_FORWARD) + row["recompute_s"])
            tp_comm = (2 + (train.recompute == "full")) * tp_block_s if row["kind"] != "L" else 0.0
            cp_comm = 0.0
            if row["kind"] == "*" and layout.cp > 1:  # K and V chunks around the ring, hidden behind attention
                elements = tokens_local * ring_kv_elements(model.for_block(index)) / layout.tp
                intra = layout.cp * layout.tp <= per_node
                # K/V: cp-1 hops forward and again backward; their fp32 dK/dV accumulators: cp hops
                ring = (2 * (layout.cp - 1) * p2p_seconds(elements * dtype_bytes, hardware, intra)
                        + layout.cp * p2p_seconds(elements * 4, hardware, intra))
                hidden_behind = micro_batch * row["attention_s"] * (1 + BACKWARD_TO_FORWARD)
                cp_comm = max(0.0, ring - hidden_behind) if hardware.overlaps_communication else ring
            ep_comm = 0.0
            if index in moe_blocks and layout.ep > 1:
                routed = tokens_local * model.moe_top_k * model.hidden_size * dtype_bytes
                ep_comm = 4 * ring_seconds(routed, layout.ep, hardware, ep_intra, factor=1.0)
            seconds += compute + row["fixed_s"] + tp_comm + cp_comm + ep_comm + hardware.overhead_s
        if stage == num_stages - 1:
            seconds += (micro_batch * head_s * (1 + BACKWARD_TO_FORWARD) + hardware.block_fixed_s.get("head", 0.0)
                        + 2 * hardware.overhead_s)
        return seconds

    per_stage = [stage_seconds(stage) for stage in range(num_stages)]
    per_rank = [sum(per_stage[chunk * layout.pp + rank] for chunk in range(layout.vp)) for rank in range(layout.pp)]
    slowest = max(per_rank)
    pp_intra = layout.world_size <= per_node
    p2p = 0.0
    if layout.pp > 1:
        message = activation_bytes / (layout.tp if layout.sp else 1)
        p2p = 2 * layout.vp * p2p_seconds(message, hardware, pp_intra)
    bubble_fraction = (layout.pp - 1) / (layout.vp * micro_batches) if layout.pp > 1 else 0.0
    pipeline_s = (micro_batches + (layout.pp - 1) / layout.vp) * (slowest + p2p)
    # DP: the gradients once per step, behind the last micro-batch's backward
    shards = layout.dp * layout.cp
    dp_intra = layout.world_size <= per_node or layout.tp * shards <= per_node
    # ZeRO: a reduce-scatter of the gradients and an all-gather of the updated parameters
    dp_collectives = scatter_and_gather_seconds if layout.zero else ring_seconds
    dp_s = dp_collectives(parameter_count * 4, shards, hardware, dp_intra)
    last_backward = slowest * BACKWARD_TO_FORWARD / (1 + BACKWARD_TO_FORWARD)
    overlapped = config.parallel.overlap_grad_reduce and hardware.overlaps_communication
    dp_exposed = max(0.0, dp_s - last_backward) if overlapped else dp_s
    optimizer_bytes = parameter_count * (16 + 2 * dtype_bytes) / (shards if layout.zero else 1)
    optimizer_s = optimizer_bytes / (hardware.hbm_gbps * 1e9)
    scalars_s = step_scalar_seconds(config, layout, hardware)
    muon_s = muon_seconds(config, layout, hardware, starts) if config.optim.optimizer == "muon" else 0.0
    tp_partial_s = tp_partial_seconds(layout, hardware, partial_count)
    total = pipeline_s + dp_exposed + optimizer_s + scalars_s + muon_s + tp_partial_s
    return {"step_time_s": total, "pipeline_s": pipeline_s, "bubble_fraction": bubble_fraction,
            "bubble_s": (layout.pp - 1) / layout.vp * (slowest + p2p), "pp_p2p_s": p2p * micro_batches,
            "dp_comm_s": dp_s, "dp_exposed_s": dp_exposed, "optimizer_s": optimizer_s, "step_scalars_s": scalars_s,
            "muon_s": muon_s, "tp_partial_s": tp_partial_s,
            "tp_comm_s": micro_batches * tp_block_s * sum(kind not in "0L" for kind in model.block_kinds)
            * 2 / layout.pp}


def tp_partial_seconds(layout, hardware, partial_count: int) -> float:
    """The all-reduce over TP of the ``partial_count`` gradients a rank holds partially, once per
    step (module docstring): fp32, this rank's 1/S share under ZeRO; none without them."""
    if layout.tp == 1 or not partial_count:
        return 0.0
    shards = layout.dp * layout.cp if layout.zero >= 1 and layout.world_size > 1 else 1
    return ring_seconds(partial_count * FP32 / shards, layout.tp, hardware, layout.tp <= hardware.gpus_per_node)


def step_scalar_seconds(config, layout, hardware) -> float:
    """The trainer's latency-bound all-reduces of a few numbers, once per step: the gradient norm
    over all ranks (when no rank holds the whole gradient: tp, pp, ep or ZeRO), the logged sums
    over DP x CP, and the stop vote (signals, time limit) over all ranks. Microseconds on a GPU's
    fabric, milliseconds through gloo."""
    if layout.world_size == 1:
        return 0.0
    intra = layout.world_size <= hardware.gpus_per_node
    latency = hardware.intra_latency_s if intra else hardware.inter_latency_s

    def tree(ranks: int) -> float:  # a few bytes: up a tree and back down, 2 log2(ranks) hops (NCCL's tree)
        return 2 * math.ceil(math.log2(ranks)) * latency if ranks > 1 else 0.0

    # the layout-level reading of grad_norm.holds_whole_gradient, which decides the trainer's norm
    whole_gradient_everywhere = layout.tp == 1 and layout.pp == 1 and layout.ep == 1 and not layout.zero
    seconds = tree(layout.world_size)  # the stop vote
    if config.train.grad_clip > 0 and not whole_gradient_everywhere:
        seconds += tree(layout.world_size)
    return seconds + tree(layout.dp * layout.cp)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """``orthogonalize`` of one rows x cols matrix: per iteration, on the wide orientation (m <= n),
    A = X X^T (2 m^2 n), A A (2 m^3) and (b A + c A A) X (2 m^2 n)."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m ** 3)


def fp32_matmul_rate(config, hardware) -> float:
    """Achievable FLOP/s of Newton-Schulz's fp32 matmuls: the row's matmul rate scaled by the data
    sheet's TF32 (``precision.tf32``) or plain-fp32 peak over its bf16 peak; a row the sheets do
    not know (the CPU, measured in fp32) keeps its matmul rate."""
    bf16 = table_peak_flops(hardware.name, "bf16", allow_tf32=False)
    fp32 = table_peak_flops(hardware.name, "fp32", allow_tf32=config.precision.tf32)
    scale = fp32[0] / bf16[0] if bf16 and fp32 else 1.0
    return hardware.rate("matmul") * scale


_WHOLE_SHAPES: dict = {}


def whole_muon_shapes(model_config) -> dict:
    """{name: single-process shape} of the parameters Muon steps (the model built on meta; cached)."""
    key = repr(model_config)
    if key not in _WHOLE_SHAPES:
        with torch.device("meta"):
            model = LanguageModel(model_config, seed=0)
        _WHOLE_SHAPES[key] = {name: param.shape for name, param in model.named_parameters()
                              if muon_parameter(name, param)}
    return _WHOLE_SHAPES[key]


def muon_seconds(config, layout, hardware, starts: list[int]) -> float:
    """Muon's Newton-Schulz and its gathers on the busiest pipeline rank (see the module
    docstring). ``starts``: each virtual stage's first block, then the number of blocks."""
    whole = whole_muon_shapes(config.model)
    # every block as the layout's TP / EP / ETP split it; the pipeline rank comes from its block
    flat = dataclasses.replace(layout, pp=1, vp=1)
    parameters = rank_parameters(config, flat)
    zero = layout.zero >= 1 and flat.world_size > 1
    per_node, steps = hardware.gpus_per_node, config.optim.muon_ns_steps
    rate = fp32_matmul_rate(config, hardware)
    dp_intra = layout.world_size <= per_node or flat.world_size <= per_node
    seconds = [0.0] * layout.pp
    for indices, shards in sharding_groups(parameters, flat, planning_context(config, flat)):
        gathered = [0] * layout.pp  # this rank's elements of the group's Muon parameters (ZeRO's gather)
        for index in indices:
            name, shape = parameters.names[index], parameters.shapes[index]
            if not parameters.muon[index]:
                continue
            rows, cols = whole[name][-2:]
            count = shape[0] if len(shape) == 3 else 1  # a stack of experts: this rank's E/ep
            cut = rows * cols // (shape[-2] * shape[-1])  # the TP (ETP) ranks its rows or columns are split over
            block = int(name.split(".")[1]) if name.startswith("blocks.") else starts[-2]  # MTP: the last stage
            rank = (bisect.bisect_right(starts, block) - 1) % layout.pp
            # dealt round-robin over the cut's ranks: 1/cut of the Newton-Schulz here, and per matrix
            # two all-to-alls of its shards, 2 (cut - 1) / cut of a shard in and out
            orthogonalize = count * newton_schulz_flops(rows, cols, steps) / rate / cut
            exchange = 2 * ring_seconds(count * rows * cols * FP32 / cut, cut, hardware, cut <= per_node, factor=1.0)
            seconds[rank] += (orthogonalize + (exchange if cut > 1 else 0.0)) / (shards if zero else 1)
            gathered[rank] += shape.numel()
        if zero:
            for rank, elements in enumerate(gathered):
                seconds[rank] += ring_seconds(elements * FP32, shards, hardware, dp_intra, factor=1.0)
    return max(seconds)


def step_flops(config, layout) -> dict:
    """Model FLOPs of one step (forward + backward, no recomputation) and hardware FLOPs (with
    the recomputed forward, and the tp - 1 more copies of the layers every TP rank computes whole,
    ``TP_REPLICATED_TERMS``), over the whole run."""
    from meshlm.models.flops import model_flops_per_sequence

    model, train = config.model, config.train
    sequences = train.global_batch_size
    model_flops = model_flops_per_sequence(model, train.seq_len) * sequences
    extra = 0.0
    for index, kind in enumerate(model.block_kinds):
        terms = block_flops(kind, model.for_block(index), train.seq_len).terms
        if train.recompute == "full":
            extra += sum(terms.values())
        elif train.recompute == "selective":
            extra += sum(flops for term, flops in terms.items() if term in ATTENTION_TERMS)
        replicated = sum(flops for term, flops in terms.items() if term in TP_REPLICATED_TERMS)
        extra += (layout.tp - 1) * replicated * (1 + BACKWARD_TO_FORWARD + (train.recompute == "full"))
    return {"model_flops": model_flops, "hardware_flops": model_flops + extra * sequences}


__all__ = ["TP_REPLICATED_TERMS", "block_times", "fp32_matmul_rate", "muon_seconds", "newton_schulz_flops", "op_class",
           "p2p_seconds", "ring_kv_elements", "ring_seconds", "scatter_and_gather_seconds", "step_flops",
           "step_scalar_seconds", "step_time", "tp_partial_seconds"]

