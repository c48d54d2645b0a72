"""What every Hugging Face architecture adapter shares: tensor maps, config helpers, checks.

A Hugging Face (HF) checkpoint and a meshlm model hold the same numbers under different names
and, for MoE experts, in different layouts: HF's files keep one ``nn.Linear`` weight per expert
(``...experts.{e}.up_proj.weight``, [F, d]) where meshlm keeps one stacked tensor per block
(``blocks.{i}.mixer.experts.up_weight``, [E, F, d]). An adapter therefore describes the
correspondence once, as a list of ``TensorMap`` entries (our name <- their name, or their E
names stacked on a new leading axis), and the two directions are the same list read forwards
and backwards, so import and export cannot drift apart.

On import the map is checked against the HF files *and* against the shapes the meshlm config
implies, so a missing, unexpected or mis-shaped tensor is reported by its HF name (the one the
user can find in their files), not as a failure deep inside ``load_state_dict``.

Config translation is explicit code per architecture; the helpers here read HF's RoPE settings
(``rope_parameters`` in transformers v5, ``rope_theta`` + ``rope_scaling`` before), decode the
``{"__float__": "Infinity"}`` tags transformers writes for infinite floats, map activation names
and collect the reasons a meshlm config cannot be written as a given architecture.

Dropout is a training-time setting: HF's ``attention_dropout`` (every architecture with
attention) is meshlm's ``attention_dropout`` both ways, and Nemotron-H's ``hidden_dropout`` is
meshlm's ``hidden_dropout``. The other architectures have no residual-stream dropout field, so a
model trained with ``hidden_dropout`` is exported without it: the weights compute the same
function at inference, where dropout is off.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

# HF activation name -> meshlm mlp_activation for non-gated MLPs ("relu2" is Nemotron-H's squared ReLU).
ACTIVATION_FROM_HF = {"relu2": "squared_relu", "relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu"}
ACTIVATION_TO_HF = {"squared_relu": "relu2", "relu": "relu", "gelu": "gelu", "silu": "silu"}
MAX_LISTED = 8


@dataclass(frozen=True)
class TensorMap:
    """One meshlm tensor and where it lives in an HF checkpoint.

    ``theirs`` holds one HF name (a rename), several names stacked along a new dim 0
    (``stacked``: the per-expert weights of an MoE block), or nothing (a meshlm buffer HF does
    not have, such as the unused expert bias of a softmax router: zeros on import, dropped on
    export).
    """

    ours: str
    theirs: tuple[str, ...]
    stacked: bool = False

    def describe_theirs(self) -> str:
        if not self.stacked or len(self.theirs) < 2:
            return ", ".join(self.theirs) or "(none)"
        return f"{self.theirs[0]} .. {self.theirs[-1]} ({len(self.theirs)} experts)"


def rename(ours: str, theirs: str) -> TensorMap:
    return TensorMap(ours, (theirs,))


def stack(ours: str, theirs: list[str]) -> TensorMap:
    return TensorMap(ours, tuple(theirs), stacked=True)


def ours_only(ours: str) -> TensorMap:
    return TensorMap(ours, ())


@dataclass(frozen=True)
class Architecture:
    """An HF causal-LM architecture meshlm can read and write (see the per-architecture modules)."""

    name: str
    """The ``architectures`` entry of an HF config.json, e.g. 'LlamaForCausalLM'."""
    model_type: str
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    tensor_maps: Callable[[ModelConfig], list[TensorMap]]
    unsupported: Callable[[ModelConfig], list[str]]
    """Reasons (one per blocking field) why a meshlm config cannot be written as this
    architecture; empty when it can."""
    normalize_hf_tensors: Callable[[dict], dict] = field(default=lambda tensors: tensors)
    """Rewrites alternative HF layouts (other prefixes, fused expert tensors) into the
    canonical per-expert hub layout the tensor maps use."""

    def state_from_hf(self, tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        return state_from_hf_tensors(self.normalize_hf_tensors(dict(tensors)), config, self.tensor_maps(config),
                                     self.name)

    def state_to_hf(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        return state_to_hf_tensors(state, config, self.tensor_maps(config), self.name)

    def check_expressible(self, config: ModelConfig) -> None:
        reasons = self.unsupported(config)
        if reasons:
            raise ConfigError(f"this model cannot be written as {self.name}: " + "; ".join(reasons) + ".")


# --- tensors ------------------------------------------------------------------------------------
def expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Name -> shape of every tensor a meshlm model with ``config`` saves (built on 'meta', free)."""
    with torch.device("meta"):
        model = LanguageModel(config)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    if config.tie_embeddings:
        shapes.pop("output.weight", None)
    return shapes


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" ... ({len(names)} in all)" if len(names) > MAX_LISTED else "")


def state_from_hf_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, maps: list[TensorMap],
                          architecture: str, ignorable: Callable[[str], bool] | None = None) -> dict:
    """Apply ``maps`` to HF ``tensors``; raise CheckpointError naming every missing, unexpected
    or mis-shaped HF tensor."""
    shapes = expected_shapes(config)
    state, missing, used, wrong = {}, [], set(), []
    for entry in maps:
        if not entry.theirs:
            state[entry.ours] = torch.zeros(shapes[entry.ours])
            continue
        found = [tensors.get(name) for name in entry.theirs]
        absent = [name for name, tensor in zip(entry.theirs, found) if tensor is None]
        if absent:
            missing.extend(absent)
            continue
        used.update(entry.theirs)
        if entry.stacked and len({tensor.shape for tensor in found}) > 1:
            wrong.append(f"{entry.describe_theirs()} do not all have the same shape")
            continue
        tensor = torch.stack(found) if entry.stacked else found[0]
        if tensor.shape != shapes[entry.ours]:
            shape = tuple(found[0].shape) if entry.stacked else tuple(tensor.shape)
            want = tuple(shapes[entry.ours][1:] if entry.stacked else shapes[entry.ours])
            wrong.append(f"{entry.describe_theirs()} has shape {shape}, but config.json implies {want} "
                         f"(meshlm {entry.ours})")
            continue
        state[entry.ours] = tensor
    ignorable = ignorable or (lambda name: name.endswith("rotary_emb.inv_freq")
                              or (config.tie_embeddings and name == "lm_head.weight"))
    unexpected = sorted(name for name in tensors if name not in used and not ignorable(name))
    problems = []
    if missing:
        problems.append(f"missing tensors {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_listed(unexpected)} (meshlm has no place for them)")
    if wrong:
        problems.append("; ".join(wrong[:MAX_LISTED]))
    if problems:
        raise CheckpointError(f"the {architecture} weights do not match their config.json: "
                              + " | ".join(problems))
    unmapped = sorted(set(shapes) - set(state))
    if unmapped:  # an adapter bug, not a user error: the map forgot part of the model
        raise RuntimeError(f"{architecture} adapter does not map meshlm tensors {_listed(unmapped)}")
    return state


def state_to_hf_tensors(state: dict[str, torch.Tensor], config: ModelConfig, maps: list[TensorMap],
                        architecture: str) -> dict[str, torch.Tensor]:
    """Apply ``maps`` backwards: meshlm ``state`` -> HF tensors (per-expert slices are copied so
    that every saved tensor owns its memory, as safetensors requires)."""
    tensors, used = {}, set()
    for entry in maps:
        if entry.ours not in state:
            raise CheckpointError(f"the meshlm state has no {entry.ours}, which {architecture} needs; "
                                  "does the checkpoint match its config.json?")
        tensor = state[entry.ours].detach()
        if entry.stacked:
            for index, name in enumerate(entry.theirs):
                tensors[name] = tensor[index].clone().contiguous()
        elif entry.theirs:  # a second HF name for the same tensor (an untied copy) gets its own memory
            tensors[entry.theirs[0]] = tensor.clone() if entry.ours in used else tensor.contiguous()
        used.add(entry.ours)
    left_over = sorted(name for name in state if name not in used
                       and not (config.tie_embeddings and name == "output.weight"))
    if left_over:
        raise CheckpointError(f"{architecture} has no place for meshlm tensors {_listed(left_over)}.")
    return tensors


def split_fused_experts(tensors: dict, fused_suffix: str, per_expert: Callable[[str, int], list[tuple[str, int]]]
                        ) -> dict:
    """Rewrite fused expert tensors (transformers' in-memory layout, [E, out, in]) as the hub's
    per-expert tensors. ``per_expert(prefix, e)`` gives (name, rows) pieces of expert e's slice,
    split along dim 0 in order (e.g. gate then up for a fused gate_up_proj)."""
    out = {}
    for name, tensor in tensors.items():
        if not name.endswith(fused_suffix):
            out[name] = tensor
            continue
        prefix = name[: -len(fused_suffix)]
        for expert in range(tensor.shape[0]):
            pieces = per_expert(prefix, expert)
            sizes = [rows if rows > 0 else tensor.shape[1] // len(pieces) for _, rows in pieces]
            for (piece_name, _), piece in zip(pieces, tensor[expert].split(sizes, dim=0)):
                out[piece_name] = piece
    return out


# --- configs ------------------------------------------------------------------------------------
def decode_special_floats(value):
    """Turn transformers' ``{"__float__": "Infinity"}`` tags (and nested ones) into floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"].replace("Infinity", "inf"))
        return {key: decode_special_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode_special_floats(item) for item in value]
    return value


def encode_special_floats(value):
    """Inverse of ``decode_special_floats``, so the written config.json is strict JSON."""
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return {"__float__": "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, dict):
        return {key: encode_special_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [encode_special_floats(item) for item in value]
    return value


def with_defaults(hf_config: dict, defaults: dict) -> dict:
    """The HF config with each absent (or null) field replaced by the HF class default."""
    merged = dict(defaults)
    merged.update({key: value for key, value in decode_special_floats(hf_config).items() if value is not None})
    return merged


def rope_theta_from_hf(hf_config: dict, default_theta: float, architecture: str) -> float:
    """The RoPE base from ``rope_parameters`` (v5) or ``rope_theta``/``rope_scaling`` (v4);
    refuse anything but plain RoPE, which meshlm implements."""
    parameters = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{architecture} config.json: rope type {rope_type!r} is not supported yet; meshlm "
                          "implements plain RoPE only (rope_type 'default', no scaling).")
    factor = parameters.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ConfigError(f"{architecture} config.json: partial_rotary_factor={factor} is not supported; "
                          "meshlm rotates the whole head.")
    return float(parameters.get("rope_theta", hf_config.get("rope_theta", default_theta)))


def rope_to_hf(config: ModelConfig) -> dict:
    """RoPE fields for an HF config.json: v5's ``rope_parameters`` plus v4's top-level ``rope_theta``."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope_theta)},
            "rope_theta": float(config.rope_theta)}


def require(hf_config: dict, architecture: str, name: str, allowed, meaning: str) -> None:
    """Refuse an HF config value meshlm cannot reproduce; ``allowed`` is a value or a tuple of them."""
    value = hf_config.get(name)
    choices = allowed if isinstance(allowed, tuple) else (allowed,)
    if value not in choices:
        raise ConfigError(f"{architecture} config.json: {name}={value!r} is not supported yet ({meaning}).")


def blocks_of(config: ModelConfig, pattern_regex: str, description: str) -> list[str]:
    """[] if the block pattern (without '|') matches ``pattern_regex``, else one reason."""
    pattern = "".join(config.block_kinds)
    if re.fullmatch(pattern_regex, pattern):
        return []
    return [f"model.pattern={config.pattern!r} ({description})"]


def common_unsupported(config: ModelConfig) -> list[str]:
    """Fields no HF architecture here can express."""
    reasons = []
    if config.norm != "rmsnorm":
        reasons.append(f"model.norm={config.norm!r} (HF models here use RMSNorm)")
    if config.mtp_depth:
        reasons.append(f"model.mtp_depth={config.mtp_depth} (multi-token-prediction heads are not exported yet)")
    return reasons


def embedding_maps(config: ModelConfig, embedding: str, final_norm: str) -> list[TensorMap]:
    maps = [rename("embedding.weight", embedding), rename("final_norm.weight", final_norm)]
    if not config.tie_embeddings:
        maps.append(rename("output.weight", "lm_head.weight"))
    return maps


def linear_maps(ours: str, theirs: str, bias: bool) -> list[TensorMap]:
    """weight (and bias) of one nn.Linear."""
    maps = [rename(f"{ours}.weight", f"{theirs}.weight")]
    if bias:
        maps.append(rename(f"{ours}.bias", f"{theirs}.bias"))
    return maps


def hf_common_fields(config: ModelConfig, architecture: str, model_type: str) -> dict:
    """Fields every HF causal-LM config.json here carries (token ids are added by the writer)."""
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "tie_word_embeddings": config.tie_embeddings,
            "initializer_range": config.init_std, "use_cache": True}
