"""Weight initialization, one tensor at a time, each from its own generator.

The rules. Linear and embedding weights are drawn from N(0, init_std); biases start at zero;
norm weights at one. The output projection of every block -- the matrix that writes into the
residual stream (attention ``o_proj``, MLP ``down_proj``, Mamba ``out_proj``, expert down
weights) -- uses init_std / sqrt(2 * num_blocks), so that the residual stream's variance does
not grow with depth (GPT-2, Radford et al. 2019; Megatron-LM). The depthwise convolution keeps
PyTorch's default (uniform in +-1/sqrt(fan_in)). Modules with parameters of their own kind
(Mamba's A_log, dt_bias, D; stacked expert weights; a router's expert bias) say how to fill them
in ``init_rules(config)``: {attribute name: rule}.

Why one generator per tensor. A model too large for one host is never built whole: every rank
builds it on the ``meta`` device, keeps its shards, and only then fills them
(``meshlm/checkpoint/materialize.py``). For the values not to depend on the layout -- a run must
be the same on 1 process or 512 -- each tensor's values must not depend on which other tensors
a rank happens to create, nor in which order. So each tensor draws from a generator seeded by
(seed, its single-process name), e.g. ``blocks.7.mixer.in_proj.weight``: a rank that holds a
slice of it computes the whole tensor (one tensor at a time, never the model) and keeps its
slice, and a rank that holds none of it never draws it. The generator is always a CPU one, so
the same seed gives the same model on a CPU and on a GPU; the values are moved after.

``LanguageModel(config, seed)`` calls ``initialize_weights`` with the same rules, so a model
built whole in one process equals, tensor for tensor, one assembled from shards.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch
from torch import nn

OUTPUT_PROJECTION_NAMES = ("o_proj", "down_proj", "out_proj")

InitRule = Callable[[torch.Tensor, torch.Generator], None]
"""Fills a full (single-process-shaped) fp32 tensor in place, drawing only from the generator."""


def normal(std: float) -> InitRule:
    return lambda tensor, generator: tensor.normal_(0.0, std, generator=generator)


def uniform(low: float, high: float) -> InitRule:
    return lambda tensor, generator: tensor.uniform_(low, high, generator=generator)


def constant(value: float) -> InitRule:
    return lambda tensor, generator: tensor.fill_(value)


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` in a model seeded with ``seed`` (63 bits of SHA-256)."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def tensor_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))


def draw_seed() -> int:
    """A model seed from torch's global CPU generator (``torch.manual_seed`` makes it repeatable)."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def module_rule(module: nn.Module, module_name: str, attribute: str, config) -> InitRule:
    """The rule for ``module``'s parameter or buffer ``attribute``; a KeyError names what has none."""
    own = module.init_rules(config) if hasattr(module, "init_rules") else {}
    if attribute in own:
        return own[attribute]
    if attribute == "bias":
        return constant(0.0)
    if isinstance(module, nn.Linear):
        is_output = module_name.rsplit(".", 1)[-1] in OUTPUT_PROJECTION_NAMES
        return normal(config.output_init_std if is_output else config.init_std)
    if isinstance(module, nn.Embedding):
        return normal(config.init_std)
    if isinstance(module, nn.Conv1d):  # PyTorch's default: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in))
        bound = 1.0 / math.sqrt(module.weight.shape[1] * module.weight.shape[2])
        return uniform(-bound, bound)
    if attribute == "weight" and "Norm" in type(module).__name__:
        return constant(1.0)
    raise KeyError(f"{type(module).__name__}.{attribute} ({module_name}) has no initialization rule; "
                   "give the module an init_rules(config) method.")


def own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own parameters and persistent buffers (not its children's), by attribute name."""
    tensors = dict(module.named_parameters(recurse=False))
    tensors.update((name, buffer) for name, buffer in module.named_buffers(recurse=False)
                   if name not in module._non_persistent_buffers_set)
    return tensors


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once) and persistent buffer of ``model``, by name: what is
    initialized, saved and loaded."""
    tensors, seen = {}, set()
    for module_name, module in model.named_modules():
        for attribute, tensor in own_tensors(module).items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors[f"{module_name}.{attribute}" if module_name else attribute] = tensor
    return tensors


def init_rules(model: nn.Module, config) -> dict[str, InitRule]:
    """{single-process name: rule} for every parameter and persistent buffer of ``model``."""
    rules = {}
    for module_name, module in model.named_modules():
        for attribute in own_tensors(module):
            full_name = f"{module_name}.{attribute}" if module_name else attribute
            rules[full_name] = module_rule(module, module_name, attribute, config)
    return rules


@torch.no_grad()
def initialize_own_tensors(module: nn.Module, config) -> None:
    """Apply ``module.init_rules(config)`` to its own tensors, drawing from torch's global
    generator: how a module built on its own (a test, a benchmark) starts. Inside a
    ``LanguageModel`` the tensors are drawn again, per tensor, by ``initialize_weights``."""
    tensors = own_tensors(module)
    for attribute, rule in module.init_rules(config).items():
        tensor = tensors.get(attribute)  # an optional tensor may be None (e.g. an ungated MLP's gate)
        if tensor is not None and not tensor.is_meta:
            tensor.copy_(drawn(rule, tensor.shape, torch.default_generator))


def drawn(rule: InitRule, shape, generator: torch.Generator) -> torch.Tensor:
    """A new fp32 CPU tensor of ``shape`` filled by ``rule`` from ``generator``."""
    value = torch.empty(tuple(shape), dtype=torch.float32, device="cpu")
    rule(value, generator)
    return value


def initial_value(rule: InitRule, name: str, shape, seed: int) -> torch.Tensor:
    """The full fp32 CPU value of tensor ``name`` (one tensor, never the model)."""
    return drawn(rule, shape, tensor_generator(seed, name))


@torch.no_grad()
def initialize_weights(model: nn.Module, config, seed: int) -> None:
    """Fill every parameter and persistent buffer of ``model`` (not on ``meta``) by its rule."""
    tensors = state_tensors(model)
    for name, rule in init_rules(model, config).items():
        tensor = tensors[name]
        if not tensor.is_meta:
            tensor.copy_(initial_value(rule, name, tensor.shape, seed))


__all__ = ["InitRule", "OUTPUT_PROJECTION_NAMES", "constant", "draw_seed", "drawn", "init_rules", "initial_value",
           "initialize_own_tensors", "initialize_weights", "normal", "own_tensors", "state_tensors", "tensor_generator",
           "tensor_seed", "uniform"]
