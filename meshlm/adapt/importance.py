"""Which units of a trained model matter: activation-based importance on calibration samples.

Minitron (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge
Distillation"; Sreenivas et al. 2024, "LLM Pruning and Distillation in Practice") ranks every
prunable unit by how strongly it is activated on a few hundred calibration samples, from
forward passes alone (no gradients). The activation a unit is scored on:

    embedding channel i   the output of every norm (each block's pre-norm and the final norm), channel i
    attention head j      head j's slice of the attention output, the input of o_proj
    MLP neuron k          channel k after the activation (and gating): the input of down_proj
    Mamba head m          head m's channels of the gated, normed SSM output: the input of out_proj
    expert e              how often the router sends a token to e (routing frequency)

**Aggregation** (the paper's best, "batch=L2, seq=mean"). Within one sample, a unit's value is
the mean over the sequence of the magnitude of its activation -- |a| for a channel or neuron,
the L2 norm over the head's channels for a head -- so signs do not cancel. Over samples the
values are combined by their L2 norm: score = sqrt(sum_samples value^2). An embedding channel's
per-sample value is the sum of its values at every norm of the model.

**Depth.** A block's importance is what is lost when it is skipped (the identity in its place):
with ``metric="loss"`` (Minitron's choice), the increase of the language-model loss on the
calibration samples (one extra forward per block and batch); with ``metric="cosine"`` (ShortGPT's
"block influence", Men et al. 2024), the mean over tokens of 1 - cos(h_in, h_out) between the
block's input and output (free: taken from the same forward). A block that does nothing scores 0
under both.

**Several processes.** Every score is a sum over samples until ``finish`` (square roots,
normalization), so data-parallel ranks each score their share of the samples and the sums are
added (``reduce``, an all-reduce) before it. Under tensor parallelism (without sequence
parallelism) a rank holds a contiguous slice of every block's query heads, MLP neurons and
Mamba heads (``meshlm/parallel/tensor/``): their sums are concatenated over the TP group
(``gather``, an all-gather in rank order); the norms' outputs, the blocks' inputs and outputs,
the routing counts and the loss are the same on every TP rank, so the other sums are too. Under
pipeline parallelism each stage scores its own blocks and the stages' scores are combined
(``meshlm/adapt/importance_pipeline.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from meshlm.adapt.importance_pipeline import stage_blocks
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel

DEPTH_METRICS = ("loss", "cosine")
SHARDED_UNITS = ("heads", "neurons", "mamba_heads")
"""The units a tensor-parallel rank scores a contiguous slice of (its own heads, neurons)."""


@dataclass
class Importance:
    """Scores of one model's units (higher = more important), each a CPU fp32 tensor."""

    hidden: torch.Tensor
    """[hidden_size]: embedding channels."""
    heads: dict[int, torch.Tensor] = field(default_factory=dict)
    """block index -> [num_attention_heads]: query heads of each attention block."""
    neurons: dict[int, torch.Tensor] = field(default_factory=dict)
    """block index -> [ffn_hidden_size]: neurons of each dense MLP block."""
    mamba_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    """block index -> [mamba heads]: heads of each Mamba block."""
    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    """block index -> [moe_num_experts]: fraction of the token assignments each expert received."""
    blocks: torch.Tensor | None = None
    """[num_blocks]: what skipping each block costs (``depth_metric``); None when not measured."""
    depth_metric: str | None = None
    samples: int = 0


class ImportanceRecorder:
    """Forward hooks on one model that add each batch's per-unit values into running sums."""

    def __init__(self, model: LanguageModel):
        self.model = model
        self.sums: dict[tuple, torch.Tensor] = {}     # (kind, block) -> sum over samples of value^2 (or counts)
        self.batch: dict[tuple, torch.Tensor] = {}    # the current batch's per-sample values [b, units]
        self.block_cosine = torch.zeros(model.config.num_blocks, dtype=torch.float64)
        self.tokens = 0
        self.samples = 0
        self.handles = []

    # --- per-sample values: mean over the sequence of a magnitude ---------------------------------
    def add_channels(self, key: tuple, activation: torch.Tensor) -> None:
        """activation [b, t, units]: add mean_t |a| per sample into the batch value of ``key``."""
        value = activation.detach().float().abs().mean(dim=1)
        self.batch[key] = self.batch[key] + value if key in self.batch else value

    def add_heads(self, key: tuple, activation: torch.Tensor, heads: int) -> None:
        """activation [b, t, heads * width]: mean over t of each head's L2 norm, per sample."""
        per_head = activation.detach().float().unflatten(-1, (heads, -1)).norm(dim=-1)
        self.add_channels(key, per_head)

    def end_batch(self, batch_size: int = 0, stages=None, sequence=None) -> None:
        """L2 over samples: add each sample's squared value into the sums. Under context
        parallelism (``sequence``) each per-sample mean is first taken over the whole sequence;
        under pipeline parallelism (``stages``) the embedding channels' per-sample values are
        then summed over the stages, whose norms each saw a part of the model."""
        if sequence is not None:
            self.batch = {key: sequence.average(value) for key, value in sorted(self.batch.items(), key=str)}
        if stages is not None:
            self.batch[("hidden",)] = stages.sum_per_sample(self.batch.get(("hidden",)), batch_size,
                                                            self.model.config.hidden_size)
        for key, value in self.batch.items():
            squared = value.square().sum(dim=0).double().cpu()
            self.sums[key] = self.sums[key] + squared if key in self.sums else squared
        self.batch.clear()

    # --- hooks ------------------------------------------------------------------------------------
    def __enter__(self) -> "ImportanceRecorder":
        model = self.model
        hook = self.handles.append
        if model.final_norm is not None:  # under pipeline parallelism: the last stage's
            hook(model.final_norm.register_forward_hook(self._norm_hook))
        for index, block in stage_blocks(model):
            hook(block.register_forward_hook(partial_hook(self._block_hook, index)))
            if block.norm is not None:
                hook(block.norm.register_forward_hook(self._norm_hook))
            if block.kind == "*":
                hook(block.mixer.o_proj.register_forward_pre_hook(
                    partial_hook(self._heads_hook, ("heads", index), block.mixer.num_heads)))
            elif block.kind == "-":
                hook(block.mixer.down_proj.register_forward_pre_hook(
                    partial_hook(self._channels_hook, ("neurons", index))))
            elif block.kind == "M":
                hook(block.mixer.out_proj.register_forward_pre_hook(
                    partial_hook(self._heads_hook, ("mamba_heads", index), block.mixer.num_heads)))
            elif block.kind == "E":
                hook(block.mixer.register_forward_hook(partial_hook(self._expert_hook, ("experts", index))))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _norm_hook(self, module, inputs, output) -> None:
        self.add_channels(("hidden",), output)

    def _channels_hook(self, key, module, inputs) -> None:
        self.add_channels(key, inputs[0])

    def _heads_hook(self, key, heads, module, inputs) -> None:
        self.add_heads(key, inputs[0], heads)

    def _expert_hook(self, key, module, inputs, output) -> None:
        counts = output[1].tokens_per_expert.detach().double().cpu()
        self.sums[key] = self.sums[key] + counts if key in self.sums else counts

    def _block_hook(self, index, module, inputs, output) -> None:
        before, after = inputs[0].detach().float(), output.detach().float()
        distance = 1 - F.cosine_similarity(before, after, dim=-1, eps=1e-12)
        self.block_cosine[index] += distance.sum().double().cpu()


def partial_hook(function, *bound):
    """A hook that calls ``function(*bound, module, ...)`` (functools.partial, kept readable)."""
    return lambda *args: function(*bound, *args)


def forward_loss(model: LanguageModel, input_ids: torch.Tensor, labels: torch.Tensor,
                 skip: int | None = None, stages=None, sequence=None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The mean language-model loss of one batch, with block ``skip`` replaced by the identity
    (under pipeline parallelism, ``stages``: on the last stage, 0 on the others; under context
    parallelism, ``sequence``: this rank's chunks at ``position_ids``, the whole sequences' mean)."""
    if stages is not None:
        loss = stages.forward_loss(model, input_ids, labels, skip, position_ids)
    else:
        context = SequenceContext.for_tokens(input_ids, position_ids=position_ids)
        hidden = model.embed(input_ids, context)
        for index, block in enumerate(model.blocks):
            if index != skip:
                hidden = block(hidden, context)
        loss = model.head_loss(hidden, labels).float()
    return sequence.mean_loss(loss, labels) if sequence is not None else loss


@torch.no_grad()
def collect_importance(model: LanguageModel, batches: Iterable[dict[str, torch.Tensor]],
                       depth_metric: str | None = "cosine",
                       reduce: Callable[[torch.Tensor], None] | None = None,
                       gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       stages=None, sequence=None) -> Importance:
    """Scores of ``model``'s units on ``batches`` ({"input_ids", "labels"} [b, t], on the model's
    device); ``depth_metric`` None skips the depth scores' extra forwards for "loss". ``reduce``
    sums a CPU tensor in place over the processes that share the samples (None: one process);
    ``gather`` concatenates a CPU tensor over the tensor-parallel group (None: no TP); ``stages``
    (``importance_pipeline.PipelineStages``) passes the forward from stage to stage and combines
    the stages' scores (None: no pipeline); ``sequence`` (``importance_sequence.SequenceShards``)
    combines the context-parallel ranks' chunks of each sequence (batches then carry their
    ``position_ids``; None: whole sequences)."""
    if depth_metric is not None and depth_metric not in DEPTH_METRICS:
        raise ValueError(f"depth metric {depth_metric!r} is not one of {DEPTH_METRICS}")
    model.eval()
    recorder = ImportanceRecorder(model)
    loss_increase = torch.zeros(model.config.num_blocks, dtype=torch.float64)
    with recorder:
        for batch in batches:
            input_ids, labels = batch["input_ids"], batch["labels"]
            shards = dict(stages=stages, sequence=sequence, position_ids=batch.get("position_ids"))
            full = forward_loss(model, input_ids, labels, **shards)
            recorder.end_batch(input_ids.shape[0], stages, sequence)
            recorder.tokens += input_ids.numel()
            recorder.samples += input_ids.shape[0]
            if depth_metric == "loss":
                with without_hooks(recorder):
                    for index in range(model.config.num_blocks):
                        skipped = forward_loss(model, input_ids, labels, skip=index, **shards)
                        loss_increase[index] += float(skipped - full) * input_ids.shape[0]
    if sequence is not None:  # sums over tokens: every rank counted its chunks'
        tokens = torch.tensor([float(recorder.tokens)], dtype=torch.float64)
        experts = [value for key, value in sorted(recorder.sums.items(), key=str) if key[0] == "experts"]
        for tensor in (tokens, recorder.block_cosine, *experts):
            sequence.sum_(tensor)
        recorder.tokens = int(tokens.item())
    totals = torch.tensor([recorder.tokens, recorder.samples], dtype=torch.float64)
    if stages is not None:  # each block's scores from the stage that runs it, on every rank
        stages.sum_(recorder.block_cosine)
        stages.sum_(loss_increase)
        recorder.sums = stages.merged(recorder.sums)
    keys = sorted(recorder.sums, key=str)
    if reduce is not None:
        for tensor in (totals, recorder.block_cosine, loss_increase, *(recorder.sums[key] for key in keys)):
            reduce(tensor)
    if gather is not None:
        for key in keys:
            if key[0] in SHARDED_UNITS:
                recorder.sums[key] = gather(recorder.sums[key])
    return finish(recorder.sums, totals, recorder.block_cosine, loss_increase, depth_metric)


@contextlib.contextmanager
def without_hooks(recorder: ImportanceRecorder):
    """Run the skipped-block forwards without recording them."""
    handles, recorder.handles = recorder.handles, []
    for handle in handles:
        handle.remove()
    try:
        yield
    finally:
        recorder.__enter__()


def finish(sums: dict[tuple, torch.Tensor], totals: torch.Tensor, block_cosine: torch.Tensor,
           loss_increase: torch.Tensor, depth_metric: str | None) -> Importance:
    tokens, samples = float(totals[0]), int(totals[1])
    if samples == 0:
        raise ValueError("no calibration samples were read")
    importance = Importance(hidden=sums[("hidden",)].sqrt().float(), samples=samples)
    for (kind, *block), value in sums.items():
        if kind == "experts":
            importance.experts[block[0]] = (value / max(value.sum().item(), 1.0)).float()
        elif kind != "hidden":
            getattr(importance, kind)[block[0]] = value.sqrt().float()
    if depth_metric == "loss":
        importance.blocks = (loss_increase / samples).float()
    elif depth_metric == "cosine":
        importance.blocks = (block_cosine / tokens).float()
    importance.depth_metric = depth_metric
    return importance


__all__ = ["DEPTH_METRICS", "SHARDED_UNITS", "Importance", "ImportanceRecorder", "collect_importance", "forward_loss"]
