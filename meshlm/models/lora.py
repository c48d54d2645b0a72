"""Low-rank adapters (LoRA, Hu et al. 2021): fine-tune a model by training a few small matrices.

A frozen linear layer y = x W^T (W: [out, in]) gets a trainable detour of rank r << in, out:

    y = x W^T + s * (x A^T) B^T          A: [r, in], B: [out, r], s = lora_alpha / lora_rank

A starts like PyTorch's ``nn.Linear`` default (uniform in +-1/sqrt(in)) and B at zero, so the
model with fresh adapters *is* the model it starts from (the paper's §4.1). Only A and B (and a
reward model's new head) train: the optimizer holds moments for r (in + out) numbers per layer
instead of in x out, the frozen weights take no weight-gradient GEMM, and a checkpoint's
optimizer state shrinks with them. After training the detour folds back into the weight,
W' = W + s B A (``merged_weights``): a model with no adapters and no extra inference cost, which
``meshlm merge-lora`` writes and ``meshlm convert meshlm-to-hf`` exports.

**Where the adapters sit.** ``model.lora_targets`` names the linear layers of the blocks (MTP
depths included); ``add_adapters`` gives each an adapter at construction, on the ``meta`` device
like every tensor, so the adapters are parameters of the model: named ``...q_proj.lora.a`` and
``...q_proj.lora.b``, initialized from (seed, name), saved, resharded and loaded like the rest.
A layer's forward adds ``lora(x)`` to its output: ``AdaptedLinear`` here for a plain layer; the
tensor-parallel layers (``meshlm/parallel/tensor/layers.py``) cut A and B like the weight they
ride on -- a column-parallel layer splits B by output features (A is replicated; its gradient,
built from this rank's outputs only, is partial and summed over the group), a row-parallel layer
splits A by input features and adds this rank's partial detour before the same all-reduce as the
weight's partial product (B replicated, partial gradient). Layers that read one input together
(q, k, v; gate, up) still run their frozen weights as one GEMM (``fused_linear.py``) and add each
adapter after it.

**Dropout** (``model.lora_dropout`` p, training only): the detour reads dropout(x), x's elements
zeroed with probability p and the rest scaled by 1/(1-p), as PEFT's ``lora_dropout``; the frozen
path reads x itself. Each adapter draws its own mask from the element's global coordinates --
sample, position, input channel, and a site naming the block and the layer
(``dropout.lora_dropout_site``) -- so that every layout drops the same elements: the mixer hands
its layers the tokens' coordinates (``TokenCoordinates``, through ``adapted``), and a row-parallel
shard's adapter knows which global input channels it holds (``input_channels``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.config import LORA_DEFAULT_TARGETS, LORA_TARGETS
from meshlm.models.dropout import TokenCoordinates, apply_keep_mask, input_keep_mask, lora_dropout_site
from meshlm.models.init import constant, uniform

ADAPTER_MODULE = "lora"
"""The attribute (and name component) of a layer's adapter: ``blocks.3.mixer.q_proj.lora.a``."""


class LowRankAdapter(nn.Module):
    """The detour ``scale * (x a^T) b^T`` of one linear layer (a: [rank, in], b: [out, rank])."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float, dropout: float = 0.0,
                 site: int = 0):
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, in_features))
        self.b = nn.Parameter(torch.empty(out_features, rank))
        self.scale = scale
        self.full_in_features = in_features
        """The single-process layer's input width (a's init bound), kept when a is sharded."""
        self.dropout = dropout
        """``model.lora_dropout``: the probability of dropping an input element (training only)."""
        self.site = site
        """The dropout site of this adapter's input (``dropout.lora_dropout_site``)."""
        self.input_channels: torch.Tensor | None = None
        """The global indices of the input channels this adapter reads (set on the host, since a model
        built on ``meta`` is materialized later; moved where x is by the first forward that needs
        them): set for a row-parallel shard (a cut by input features), None for all in order."""

    def init_rules(self, config) -> dict:
        bound = 1.0 / math.sqrt(self.full_in_features)  # nn.Linear's default: kaiming_uniform(a=sqrt(5))
        return {"a": uniform(-bound, bound), "b": constant(0.0)}

    def forward(self, x: torch.Tensor, rows: slice | None = None,
                coordinates: TokenCoordinates | None = None) -> torch.Tensor:
        """The detour for input ``x`` [..., in]; ``rows``: only these output features; ``coordinates``:
        where x's tokens sit in the run (needed for dropout in training)."""
        if self.dropout and self.training:
            if coordinates is None:
                raise RuntimeError("model.lora_dropout needs the tokens' coordinates, and this layer was called "
                                   "without them; its mixer must call it through lora.adapted(layer, x, coordinates)")
            channels = self.input_channels
            if channels is None:
                channels = torch.arange(x.shape[-1], device=x.device)
            elif channels.device != x.device:  # moved once: later forwards find it where x is
                channels = self.input_channels = channels.to(x.device)
            x = apply_keep_mask(x, input_keep_mask(coordinates, self.site, channels, self.dropout), self.dropout)
        b = self.b if rows is None else self.b[rows]
        return F.linear(F.linear(x, self.a), b) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.a.shape[0]}, scale={self.scale:g}" + (f", dropout={self.dropout:g}" if self.dropout else "")


def with_adapter(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, rows: slice | None = None,
                 coordinates: TokenCoordinates | None = None) -> torch.Tensor:
    """``out`` (the layer's frozen-weight output for input ``x``, or its ``rows``) plus its adapter's
    detour, if it has one (``coordinates``: x's tokens', for its dropout)."""
    adapter = getattr(layer, ADAPTER_MODULE, None)
    return out if adapter is None else out + adapter(x, rows, coordinates)


def lora_coordinates(mixer: nn.Module, context, parallel_context=None) -> TokenCoordinates | None:
    """What a mixer hands its adaptable layers for their dropout: the coordinates of the [b, t, ...]
    activations ``context`` describes (this rank's sequence slice under a sequence-parallel
    ``parallel_context``) in training with ``model.lora_dropout`` (``mixer.lora_dropout``), else None."""
    if not (mixer.training and getattr(mixer, "lora_dropout", 0.0) and context is not None):
        return None
    return TokenCoordinates.of(context, parallel_context)  # (a training forward without a dropout key: refused)


def adapted(layer: nn.Module, x: torch.Tensor, coordinates: TokenCoordinates | None) -> torch.Tensor:
    """``layer(x)``, handing its adapter (if it has one, and there are any) the coordinates of x's
    tokens for its dropout: how a mixer calls its adaptable layers."""
    if coordinates is None or getattr(layer, ADAPTER_MODULE, None) is None:
        return layer(x)
    return layer(x, coordinates=coordinates)


class AdaptedLinear(nn.Linear):
    """An ``nn.Linear`` with a ``LowRankAdapter`` (a class swap: the weight and bias keep their
    names; the adapter adds ``lora.a`` and ``lora.b``)."""

    forward_is_linear = True
    """Its forward is its linear map plus its adapter, which ``fused_linear.project_together`` adds
    after running the frozen weights of several layers as one GEMM."""

    def forward(self, x: torch.Tensor, coordinates: TokenCoordinates | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora(x, coordinates=coordinates)


def adapted_layers(blocks, targets) -> list[tuple[str, nn.Linear, int]]:
    """(name, layer, its block's layer index) of every ``nn.Linear`` in ``blocks`` ((name, block)
    pairs) whose own name is in ``targets``."""
    found = []
    for block_name, block in blocks:
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                found.append((f"{block_name}.{name}", module, block.layer_index))
    return found


def add_adapters(model: nn.Module, config, blocks) -> int:
    """Give every layer of ``blocks`` ((name, block) pairs: the model's and its MTP depths') that
    ``model.lora_targets`` names an adapter of ``model.lora_rank``, and freeze everything else in
    ``model`` but a reward model's head (module docstring); returns how many layers got one. A
    target given that names no layer of this model is refused (the default list takes the
    layers the model has)."""
    if not config.lora_rank:
        return 0
    layers = adapted_layers(blocks, config.lora_targets)
    present = {name.rsplit(".", 1)[-1] for name, _, _ in layers}
    absent = [target for target in config.lora_targets if target not in present]
    if not layers or (absent and list(config.lora_targets) != list(LORA_DEFAULT_TARGETS)):  # default: those present
        raise ConfigError(f"model.lora_targets names {absent}, which no block of this model (pattern "
                          f"{config.pattern!r}) has; drop them (its layers: {sorted(present) or 'none'}).")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for name, layer, layer_index in layers:
        if type(layer) is nn.Linear:
            layer.__class__ = AdaptedLinear
        site = lora_dropout_site(layer_index, LORA_TARGETS.index(name.rsplit(".", 1)[-1]))
        layer.add_module(ADAPTER_MODULE, LowRankAdapter(layer.in_features, layer.out_features, config.lora_rank,
                                                        config.lora_scale, config.lora_dropout, site))
    head = getattr(model, "reward_head", None)
    if head is not None:  # a new head cannot be frozen: it has nothing to start from
        head.requires_grad_(True)
    return len(layers)


def is_adapter_tensor(name: str) -> bool:
    """Whether ``name`` is an adapter's tensor (``...q_proj.lora.a``)."""
    return f".{ADAPTER_MODULE}." in f".{name}"


def adapted_layer_names(names) -> list[str]:
    """The layers (``blocks.3.mixer.q_proj``) whose adapters are among tensor ``names``, sorted."""
    suffix = f".{ADAPTER_MODULE}.a"
    return sorted(name[:-len(suffix)] for name in names if name.endswith(suffix))


def without_adapters(config):
    """``config`` (a ModelConfig) with no adapters: the model a merge leaves."""
    return dataclasses.replace(config, lora_rank=0, lora_alpha=None, lora_targets=list(LORA_DEFAULT_TARGETS),
                               lora_dropout=0.0)


def merged_weights(config, stored: dict[str, tuple], read: Callable[[str], torch.Tensor]):
    """The model a LoRA model becomes with its adapters folded in, W' = W + s b a, as (its config,
    its tensors {name: (shape, dtype)}, ``read(name)`` of one merged tensor): for commands that go
    through a model one tensor at a time (``stored``/``read``: the LoRA model's). The sum is taken
    in fp32 and stored in W's dtype. A model without adapters is returned as it is."""
    if not config.lora_rank:
        return config, stored, read
    adapted = set(adapted_layer_names(stored))

    @torch.no_grad()
    def read_merged(name: str) -> torch.Tensor:
        value = read(name)
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer in adapted:
            a, b = read(f"{layer}.{ADAPTER_MODULE}.a"), read(f"{layer}.{ADAPTER_MODULE}.b")
            value = (value.float() + (b.float() @ a.float()) * config.lora_scale).to(value.dtype)
        return value

    kept = {name: entry for name, entry in stored.items() if not is_adapter_tensor(name)}
    return without_adapters(config), kept, read_merged


def merged_state(config, state: dict[str, torch.Tensor]) -> tuple:
    """(config, state) of a whole model in memory with its adapters folded in (``merged_weights``)."""
    stored = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}
    merged_config, kept, read = merged_weights(config, stored, state.__getitem__)
    return merged_config, {name: read(name) for name in kept}


def require_no_adapters(config, source, command: str) -> None:
    """CheckpointError unless the model ``config`` (read from ``source``) has no adapters: commands
    that rewrite a model's weights (``command``: upcycle, prune, adapt-vocab) take plain ones."""
    if config.lora_rank:
        raise CheckpointError(f"{source} holds a LoRA model (model.lora_rank={config.lora_rank}), and "
                              f"`meshlm {command}` rewrites plain weights: fold its adapters in first with "
                              f"`meshlm merge-lora {source} MERGED` and give MERGED.")


__all__ = ["ADAPTER_MODULE", "AdaptedLinear", "LowRankAdapter", "adapted_layer_names", "adapted_layers",
           "adapted", "add_adapters", "is_adapter_tensor", "lora_coordinates", "merged_state", "merged_weights",
           "require_no_adapters", "with_adapter",
           "without_adapters"]
