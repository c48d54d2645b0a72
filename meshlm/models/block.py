"""One residual block: ``h + dropout(mixer(norm(h)))``, the mixer chosen by a pattern symbol.

With ``model.residual_multiplier`` m the output is scaled before the add, ``h + m dropout(...)``
(Granite; muP-style depth scaling).

With ``model.block_output_norm`` the mixer's output is normalized too before it is added,
``h + dropout(norm2(mixer(norm(h))))`` (Gemma 2 and 3's post-attention and post-feedforward norms);
without ``model.block_input_norm`` the first norm goes, ``h + dropout(norm2(mixer(h)))`` (OLMo 2).

With ``model.parallel_residual`` an attention block and the MLP, MoE or Mamba-2 block right after it
read the same input (GPT-J, GPT-NeoX; attention beside Mamba is Falcon-H1's parallel hybrid):
``h + attn(norm1(h)) + mlp(norm2(h))``. They stay two blocks --
two norms, two residual adds, their own names, caches, recomputation and compiled steps -- and the
attention block hands its input to its partner through the ``SequenceContext``: the first adds
``attn(norm1(h))`` to h, the second adds ``mlp(norm2(h))`` to that sum. Autograd sees the same
graph as the fused layer, so gradients are the paired layer's. With
``model.parallel_residual_shared_norm`` the pair has one norm, the attention block's: the partner
has none of its own and applies that one to the shared input (the norm is computed twice, a
small cost for keeping the blocks apart). Where the attention block is skipped (the identity, as
when an importance score leaves one block out), its input is the partner's own, which the partner
then reads.

The pattern (``meshlm/models/pattern.py``) names one block per symbol: ``*`` attention, ``-`` MLP,
``M`` Mamba-2, ``E`` Mixture-of-Experts, ``L`` linear, ``0`` no-op. Every block is pre-norm (the norm acts on the block's
input, the residual stream is never normalized in place), as in GPT-2 and Llama. The main stack
(``language_model.py``) and every multi-token-prediction depth (``mtp.py``) are built from these.
Full recomputation (``training.recompute=full``) keeps only the block input and reruns norm and
mixer in backward.

Each block is built from its own config, ``config.for_block(index)`` (``model.block_overrides``),
so the sizes of a heterogeneous stack live in the modules themselves. The two replacement kinds
of Puzzle (Bercovich et al. 2024) are blocks too: ``L`` is ``h + W norm(h)`` with one hidden x
hidden matrix and no bias (the norm kept, as in Llama-Nemotron's linear replacements), and ``0``
is ``h`` -- no norm, no mixer, no parameters, no cache.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from meshlm.models.attention import SelfAttention
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.dropout import HiddenDropout, dropout_site
from meshlm.models.latent_attention import LatentAttention
from meshlm.models.lora import adapted, lora_coordinates
from meshlm.models.mamba2 import Mamba2Mixer
from meshlm.models.mlp import MLP
from meshlm.models.moe.layer import MoELayer
from meshlm.models.norms import model_norm
from meshlm.models.pattern import LINEAR, NO_OP, parallel_residual_pairs


class LinearMixer(nn.Module):
    """Puzzle's linear replacement of a mixer: y = x W^T, W [hidden, hidden], no bias. Named
    ``out_proj`` because it writes into the residual stream (scaled init, ``models/init.py``)."""

    parallel_context = None
    """Set by tensor parallelism: under SP the input is this rank's slice of the sequence."""

    def __init__(self, hidden_size: int, lora_dropout: float = 0.0):
        super().__init__()
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.lora_dropout = lora_dropout

    def forward(self, x: torch.Tensor, context=None) -> torch.Tensor:
        return adapted(self.out_proj, x, lora_coordinates(self, context, self.parallel_context))


def build_mixer(kind: str, config: ModelConfig, layer_index: int) -> nn.Module:
    """The module behind one pattern symbol."""
    if kind == "*":
        return LatentAttention(config, layer_index) if config.attention_type == "mla" else SelfAttention(config, layer_index)
    if kind == "-":
        return MLP(config.hidden_size, config.resolved_ffn_hidden_size, config.mlp_activation, config.mlp_bias,
                   config.lora_dropout, config.swiglu_limit, config.swiglu_alpha)
    if kind == "M":
        return Mamba2Mixer(config, layer_index)
    if kind == "E":
        return MoELayer(config)
    if kind == LINEAR:
        return LinearMixer(config.hidden_size, config.lora_dropout)
    raise ValueError(f"unknown block kind {kind!r}")


class Block(nn.Module):
    """One pre-norm residual block: ``h + dropout(mixer(norm(h)))``; a no-op block (``0``) is ``h``."""

    def __init__(self, kind: str, config: ModelConfig, layer_index: int):
        super().__init__()
        self.kind = kind
        self.layer_index = layer_index
        """The block's index in the whole model (MTP blocks count on after the main blocks), on any pipeline stage."""
        config = config.for_block(layer_index)
        self.norm = model_norm(config) if config.block_input_norm and kind != NO_OP else None
        """The pre-norm; None without one (``model.block_input_norm=false``) and in a no-op block."""
        self.output_norm = model_norm(config) if config.block_output_norm and kind != NO_OP else None
        """``model.block_output_norm``: the norm on the mixer's output, before the residual add."""
        self.mixer = None if kind == NO_OP else build_mixer(kind, config, layer_index)
        self.dropout = HiddenDropout(config.hidden_dropout, dropout_site("block_output", layer_index))
        self.residual_multiplier = config.residual_multiplier
        """``model.residual_multiplier``: the factor on the block's output before the residual add."""
        self.recompute = False
        """Full recomputation (set by training.recompute): keep only the block input for backward
        and rerun norm + mixer during backward."""
        self.parallel_residual_role: str | None = None
        """``model.parallel_residual``: "first" for an attention block whose partner runs beside it,
        "second" for that partner, None for a sequential block (``pair_parallel_residual_blocks``)."""

    @property
    def input_norm(self) -> nn.Module | None:
        """The norm on the mixer's input: the block's own, or the one it shares with the attention
        block beside it (``model.parallel_residual_shared_norm``: not a submodule of this block, so
        its parameters stay the attention block's), or None."""
        return self.norm if self.norm is not None else self.__dict__.get("shared_norm")

    def norm_and_mix(self, hidden: torch.Tensor, context: SequenceContext):
        norm = self.input_norm
        mixed = self.mixer(hidden if norm is None else norm(hidden), context)
        if self.output_norm is None:
            return mixed
        if isinstance(mixed, tuple):  # an MoE block's output and auxiliary losses
            return self.output_norm(mixed[0]), mixed[1]
        return self.output_norm(mixed)

    def forward(self, hidden: torch.Tensor, context: SequenceContext) -> torch.Tensor:
        if self.mixer is None:  # a removed block
            return hidden
        prepare_context = getattr(self.mixer, "prepare_context", None)
        if prepare_context is not None:  # eagerly, outside a compiled residual_step: what blocks share
            prepare_context(context)
        mixer_input = hidden
        if self.parallel_residual_role == "first":
            context.parallel_residual_input = (self.layer_index, hidden)
        elif self.parallel_residual_role == "second":
            shared, context.parallel_residual_input = context.parallel_residual_input, None
            if shared is not None and shared[0] == self.layer_index - 1:
                mixer_input = shared[1]
            # else the partner was skipped (an importance score's identity block): its input is this one
        output, moe_losses = self.residual_step(hidden, context, mixer_input)
        if moe_losses is not None:
            context.moe_losses.append(moe_losses)
        return output

    def residual_step(self, hidden: torch.Tensor, context: SequenceContext, mixer_input: torch.Tensor):
        """``hidden + dropout(mixer(norm(mixer_input)))`` and an MoE block's auxiliary losses (None
        for other kinds); ``mixer_input`` is ``hidden`` except in the second block of a parallel
        residual pair. This is what ``train.compile`` compiles (meshlm/training/compile.py): it
        changes nothing outside the block, whereas appending to ``context.moe_losses`` inside the
        graph would make Dynamo guard on the list's length and compile each MoE block anew for
        every MoE block before it."""
        if self.recompute and torch.is_grad_enabled() and context.cache is None:
            # MoE losses come back from the first run only; the rerun in backward is discarded.
            mixed = torch.utils.checkpoint.checkpoint(self.norm_and_mix, mixer_input, context, use_reentrant=False)
        else:
            mixed = self.norm_and_mix(mixer_input, context)
        moe_losses = None
        if isinstance(mixed, tuple):  # MoE blocks also return their auxiliary losses
            mixed, moe_losses = mixed
        mixed = self.dropout(mixed, context)
        if self.residual_multiplier != 1.0:
            mixed = mixed * self.residual_multiplier
        return hidden + mixed, moe_losses


def pair_parallel_residual_blocks(blocks, config: ModelConfig) -> None:
    """Mark the blocks of one stack (the main blocks, or one MTP depth's) that run side by side
    under ``model.parallel_residual`` (``pattern.parallel_residual_pairs``); a no-op otherwise."""
    if not config.parallel_residual:
        return
    for first, second in parallel_residual_pairs([block.kind for block in blocks]):
        blocks[first].parallel_residual_role, blocks[second].parallel_residual_role = "first", "second"
        if config.parallel_residual_shared_norm:
            blocks[second].norm = None
            object.__setattr__(blocks[second], "shared_norm", blocks[first].norm)  # a reference, not a submodule


__all__ = ["Block", "LinearMixer", "build_mixer", "pair_parallel_residual_blocks"]
