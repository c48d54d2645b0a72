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

Both directions produce a *plan*, {name: ``PlannedTensor(shape, dtype, produce)``}, checked
from the shapes alone and read only when the writer asks for each tensor in turn
(``meshlm/checkpoint/safetensors_stream.py``). The HF tensors can be handles into the files
(``StoredTensor``: only the tensor's bytes, or one expert's rows, are read when it is produced)
or tensors in memory; a stacked meshlm tensor is assembled in place, expert by expert. So a
conversion holds one output tensor, plus the one input it is read from, at a time.

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
from functools import partial, reduce
from typing import Callable

import torch

from meshlm.checkpoint.model_files import expected_shapes
from meshlm.checkpoint.safetensors_stream import PlannedTensor, load
from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.config import ModelConfig

# HF activation name -> meshlm mlp_activation for non-gated MLPs ("relu2" is Nemotron-H's squared ReLU).
ACTIVATION_FROM_HF = {"relu2": "squared_relu", "relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu",
                      "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
ACTIVATION_TO_HF = {"squared_relu": "relu2", "relu": "relu", "gelu": "gelu", "silu": "silu",
                    "gelu_tanh": "gelu_pytorch_tanh"}
ACTIVATION_TO_HF_GELU_NEW = {**ACTIVATION_TO_HF, "gelu_tanh": "gelu_new"}
"""``ACTIVATION_TO_HF`` for classes whose configs name GELU's tanh approximation ``gelu_new`` (Phi, GPT-J)."""
MAX_LISTED = 8


@dataclass(frozen=True)
class TensorMap:
    """One meshlm tensor and where it lives in an HF checkpoint.

    ``theirs`` holds one HF name (a rename), several names stacked along a new dim 0
    (``stacked``: the per-expert weights of an MoE block, StableLM's per-head QK LayerNorms), or
    nothing (a meshlm buffer HF does not have, such as the unused expert bias of a softmax router:
    zeros on import, dropped on export).
    """

    ours: str
    theirs: tuple[str, ...]
    stacked: bool = False
    rows: tuple[int, int] | None = None
    """Rows [start, stop) of the one HF tensor that hold this meshlm tensor, when HF fuses several
    (Phi-3's qkv_proj and gate_up_proj): cut out on import, concatenated back on export."""
    rows_dim: int = 0
    """The dim ``rows`` counts along: 1 for the halves of stacked experts' fused [E, 2F, d] gate
    and up weights (Granite MoE's ``input_linear``)."""
    transposed: bool = False
    """The HF tensor is this meshlm weight transposed, [in, out] (GPT-2's ``Conv1D`` layers); with
    ``rows``, those are rows of the transposed tensor (columns of the HF one)."""

    def describe_theirs(self) -> str:
        if not self.stacked or len(self.theirs) < 2:
            return ", ".join(self.theirs) or "(none)"
        return f"{self.theirs[0]} .. {self.theirs[-1]} ({len(self.theirs)} stacked: experts, or heads' norms)"


def rename(ours: str, theirs: str) -> TensorMap:
    return TensorMap(ours, (theirs,))


def stack(ours: str, theirs: list[str]) -> TensorMap:
    return TensorMap(ours, tuple(theirs), stacked=True)


def rows_of(ours: str, theirs: str, start: int, stop: int, dim: int = 0) -> TensorMap:
    return TensorMap(ours, (theirs,), rows=(start, stop), rows_dim=dim)


def fused_rows(pieces: list[tuple[str, int]], theirs: str, dim: int = 0) -> list[TensorMap]:
    """Maps of meshlm tensors ``pieces`` ((name, rows), in order) fused along ``dim`` into HF ``theirs``."""
    maps, start = [], 0
    for ours, rows in pieces:
        maps.append(rows_of(ours, theirs, start, start + rows, dim))
        start += rows
    return maps


def _row_slice(tensor, start: int, stop: int, dim: int = 0):
    """Entries [start, stop) along ``dim`` of a tensor or a ``StoredTensor`` (read later, by slice)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, stop - start)
    return tensor.split([start, stop - start, tensor.shape[dim] - stop], dim)[1]


def transposed(ours: str, theirs: str, rows: tuple[int, int] | None = None) -> TensorMap:
    """A meshlm weight [out, in] stored by HF as [in, out] (or its ``rows`` of such a fused tensor)."""
    return TensorMap(ours, (theirs,), rows=rows, transposed=True)


def _transposed_columns(tensor, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of an HF [in, out] tensor (or ``StoredTensor``), as a meshlm [out, in] weight."""
    return load(tensor)[:, start:stop].t().contiguous()


def _transposed(produce: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``produce()``'s meshlm [out, in] weight as HF stores it, [in, out]."""
    return produce().t().contiguous()


def half_from_interleaved(rope_dim: int) -> torch.Tensor:
    """The interleaved positions of the rotate-half channels: [0, 2, 4, ..., 1, 3, 5, ...]. A
    checkpoint that rotates interleaved pairs (2j, 2j + 1) at frequency j (DeepSeek-V3, GPT-J,
    Command R) gives meshlm's rotate-half layout, pairs (j, j + d/2), when its query and key rows are
    taken in this order: the same permutation on q and k leaves every score unchanged."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def query_key_tensors(config: ModelConfig) -> list[tuple[str, str, int]]:
    """(meshlm name, HF name, heads) of the q_proj and k_proj weight (and bias, with
    ``model.attention_bias``) of every layer of a '*-' stack under Llama's HF names: the tensors
    whose rows a class rotating interleaved pairs reorders (``deinterleaved_rotary_rows``)."""
    out = []
    for layer in range(config.num_blocks // 2):
        for projection, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.resolved_num_kv_heads)):
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                out.append((f"blocks.{2 * layer}.mixer.{projection}.{kind}",
                            f"model.layers.{layer}.self_attn.{projection}.{kind}", heads))
    return out


def deinterleaved_rotary_rows(heads: int, head_dim: int, rotary: int, offset: int = 0) -> torch.Tensor:
    """The row order (row r is the checkpoint's row ``order[r]``) of a query or key projection of
    ``heads`` heads of ``head_dim`` rows whose ``rotary`` channels from ``offset`` in each head are
    stored in interleaved pairs: those rows in ``half_from_interleaved`` order, the others as they are."""
    head = torch.arange(head_dim)
    head[offset:offset + rotary] = offset + half_from_interleaved(rotary)
    return torch.cat([index * head_dim + head for index in range(heads)])


def grouped_qkv_row_order(heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Row r of meshlm's [q; k; v] (heads, KV heads, KV heads; head_dim rows each) is row ``order[r]``
    of a fused q/k/v laid out per KV head g: the query heads of its group, its key, its value. With
    one query head per KV head that is [q_i; k_i; v_i] head by head (GPT-NeoX, Falcon without
    multi_query); with one KV head, every query head then the key and the value (Falcon's
    multi_query); in between, Falcon's new decoder architecture."""
    group = heads // kv_heads
    blocks = ([head // group * (group + 2) + head % group for head in range(heads)]
              + [g * (group + 2) + group for g in range(kv_heads)]
              + [g * (group + 2) + group + 1 for g in range(kv_heads)])
    return (torch.tensor(blocks)[:, None] * head_dim + torch.arange(head_dim)).flatten()


def _rows_in_order(produce: Callable[[], torch.Tensor], order: torch.Tensor, dim: int) -> torch.Tensor:
    return produce().index_select(dim, order)


def _scaled_by(produce: Callable[[], torch.Tensor], factor) -> torch.Tensor:
    tensor = produce()
    return (tensor.float() * factor).to(tensor.dtype)


def scaled(entry: PlannedTensor, factor: float | torch.Tensor) -> PlannedTensor:
    """``entry`` multiplied by ``factor`` when it is produced (in fp32, then back to its dtype): a
    number, or a tensor broadcast against it (a factor per row: [rows, 1])."""
    return PlannedTensor(entry.shape, entry.dtype, partial(_scaled_by, entry.produce, factor))


def reordered(entry: PlannedTensor, order: torch.Tensor, dim: int = 0) -> PlannedTensor:
    """``entry`` with its rows (its entries along ``dim``) taken in ``order`` when it is produced
    (row r is the produced row ``order[r]``; ``torch.argsort(order)`` undoes it)."""
    return PlannedTensor(entry.shape, entry.dtype, partial(_rows_in_order, entry.produce, order, dim))


@dataclass(frozen=True)
class RegroupedRows:
    """One HF tensor whose rows meshlm holds in another order: meshlm's tensors ``ours`` ((name,
    rows), in order) concatenated are the HF tensor's rows in ``order`` (row r is HF row
    ``order[r]``). The tensor maps map them as ``fused_rows`` (or one ``rows_of``) of the HF tensor,
    which checks their shapes and joins them on export; the plans then reorder. Used where q, k and v
    are fused per head (GPT-NeoX, Falcon) and where RoPE rotates interleaved pairs (DeepSeek-V3,
    GPT-J, Command R: ``half_from_interleaved``). A map of rows, not a rename, also keeps code that
    copies renamed tensors as they are (a PEFT adapter export) from finding such a layer."""

    ours: tuple[tuple[str, int], ...]
    theirs: str
    order: torch.Tensor
    dim: int = 0
    """The dim reordered: 0, rows; 1, the channels of a per-head QK-norm weight [heads, head_dim],
    which follow its head's reordered query or key rows (Command R+); one meshlm tensor then."""

    def regroup_from_hf(self, plan: dict[str, PlannedTensor], tensors: dict, architecture: str) -> None:
        """Replace the plan's entries for ``ours`` (cut from the HF tensor as it is) by the reordered rows."""
        rows = sum(count for _, count in self.ours)
        if tensors[self.theirs].shape[self.dim] != rows:  # the maps accept a longer tensor; this one is exact
            what = "rows" if self.dim == 0 else f"entries along dim {self.dim}"
            raise CheckpointError(f"the {architecture} weights do not match their config.json: {self.theirs} has "
                                  f"{tensors[self.theirs].shape[self.dim]} {what}, but config.json implies {rows}")
        start = 0
        for name, count in self.ours:  # its rows of the whole HF tensor, in order
            whole = PlannedTensor(plan[name].shape, plan[name].dtype, partial(load, tensors[self.theirs]))
            plan[name] = reordered(whole, self.order[start:start + count], self.dim)
            start += count


def ours_only(ours: str) -> TensorMap:
    return TensorMap(ours, ())


@dataclass(frozen=True)
class DerivedTensor:
    """An HF tensor computed from stored ones when read -- dequantized (``fp8_import.py``, gpt-oss's
    MXFP4), or a part of one in meshlm's layout: its shape and dtype now, ``load()`` its values. Where
    an adapter cuts it (``split``) each piece computes the whole and keeps its part."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    def load(self) -> torch.Tensor:
        return self.produce()

    def split(self, sizes: list[int], dim: int = 0) -> list["DerivedTensor"]:
        pieces, start = [], 0
        for size in sizes:
            shape = (*self.shape[:dim], size, *self.shape[dim + 1:])
            pieces.append(DerivedTensor(shape, self.dtype, partial(_narrowed, self.produce, dim, start, size)))
            start += size
        return pieces


def _narrowed(produce: Callable[[], torch.Tensor], dim: int, start: int, size: int) -> torch.Tensor:
    return produce().narrow(dim, start, size).contiguous()


class WrittenPair:
    """Two HF tensors computed together from one meshlm tensor (a quantized weight's codes and
    scales), for two plan entries written one after the other: ``first()`` computes both and keeps
    only the second, which ``second()`` hands over, so an export still holds one tensor at a time.
    ``compute()`` returns the pair."""

    def __init__(self, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        self.compute, self.kept = compute, None

    def first(self) -> torch.Tensor:
        first, self.kept = self.compute()
        return first

    def second(self) -> torch.Tensor:
        if self.kept is None:  # asked out of order: compute again rather than guess
            self.first()
        kept, self.kept = self.kept, None
        return kept


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
    regrouped_rows: Callable[[ModelConfig], list["RegroupedRows"]] = field(default=lambda config: [])
    """The HF tensors whose rows meshlm keeps in another order (``RegroupedRows``)."""
    skipped_hf_tensors: Callable[[ModelConfig, set], Callable[[str], bool]] = field(
        default=lambda config, names: lambda name: False)
    """Which HF tensors import leaves out for a config, given the names the files hold
    (DeepSeek-V3's MTP layers past ``model.mtp_depth``, as transformers leaves them all out)."""
    fit_config: Callable[[ModelConfig, set], ModelConfig] = field(default=lambda config, names: config)
    """The config of ``config_from_hf`` fitted to the tensor names the files hold (MTP layers a
    config.json counts but a folder lacks, as transformers writes them)."""
    export_copies: Callable[[ModelConfig], list[tuple[str, str]]] = field(default=lambda config: [])
    """(meshlm name, HF name) of extra copies export writes and import skips (an MTP layer's own
    embedding and head, which repeat the model's)."""
    folded_multipliers: Callable[[dict, ModelConfig], dict[str, float | torch.Tensor]] = field(
        default=lambda hf_config, config: {})
    """Factors config.json applies to some tensors' outputs, which import folds into those tensors
    (meshlm name -> a number, or a [rows, 1] tensor of one per row): Falcon-H1's muP multipliers.
    Export writes the folded tensors with multipliers of 1."""
    quantizations: tuple[str, ...] = ()
    """``quantization_config.quant_method`` values this adapter's own ``normalize_hf_tensors`` reads
    (gpt-oss's "mxfp4"); block-wise "fp8" every adapter takes (``fp8_import.py``)."""

    def plan_from_hf(self, tensors: dict, config: ModelConfig, hf_config: dict | None = None
                     ) -> dict[str, PlannedTensor]:
        """The meshlm tensors of HF ``tensors`` (in memory or ``StoredTensor`` handles), as a plan;
        ``hf_config`` (their config.json) gives the multipliers folded in (``folded_multipliers``;
        None: all 1)."""
        tensors = self.normalize_hf_tensors(dict(tensors))
        skipped = self.skipped_hf_tensors(config, set(tensors))
        copies = {theirs for _, theirs in self.export_copies(config)}
        plan = plan_from_hf(tensors, config, self.tensor_maps(config), self.name,
                            lambda name: default_ignorable(config, name) or skipped(name) or name in copies)
        for group in self.regrouped_rows(config):
            group.regroup_from_hf(plan, tensors, self.name)
        for name, factor in (self.folded_multipliers(hf_config, config) if hf_config is not None else {}).items():
            if name in plan:
                plan[name] = scaled(plan[name], factor)
        return plan

    def plan_to_hf(self, stored: dict[str, tuple], read: Callable[[str], torch.Tensor], config: ModelConfig
                   ) -> dict[str, PlannedTensor]:
        """The HF tensors of a meshlm model ({name: (shape, dtype)}, each read by ``read``), as a plan."""
        plan = plan_to_hf(stored, read, config, self.tensor_maps(config), self.name)
        for group in self.regrouped_rows(config):  # the concatenation of group.ours, rows put back in HF's order
            plan[group.theirs] = reordered(plan[group.theirs], torch.argsort(group.order), group.dim)
        for ours, theirs in self.export_copies(config):
            shape, dtype = stored[ours]
            plan[theirs] = PlannedTensor(tuple(shape), dtype, partial(read, ours))
        return plan

    def state_from_hf(self, tensors: dict, config: ModelConfig, hf_config: dict | None = None
                      ) -> dict[str, torch.Tensor]:
        return produce_all(self.plan_from_hf(tensors, config, hf_config))

    def state_to_hf(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        stored = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}
        return produce_all(self.plan_to_hf(stored, state.__getitem__, config))

    def check_expressible(self, config: ModelConfig) -> None:
        reasons = self.unsupported(config)
        if reasons:
            raise ConfigError(f"this model cannot be written as {self.name}: " + "; ".join(reasons) + ".")


# --- tensors ------------------------------------------------------------------------------------
def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" ... ({len(names)} in all)" if len(names) > MAX_LISTED else "")


def _stacked(pieces: list, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The pieces (tensors or StoredTensors) stacked on a new dim 0, read one at a time into place."""
    out = torch.empty(shape, dtype=dtype)
    for index, piece in enumerate(pieces):
        out[index].copy_(load(piece))
    return out


def _zeros(shape: tuple) -> torch.Tensor:
    return torch.zeros(shape)


def plan_from_hf(tensors: dict, config: ModelConfig, maps: list[TensorMap], architecture: str,
                 ignorable: Callable[[str], bool] | None = None) -> dict[str, PlannedTensor]:
    """Apply ``maps`` to HF ``tensors`` (tensors or StoredTensors), from their shapes alone; raise
    CheckpointError naming every missing, unexpected or mis-shaped HF tensor."""
    shapes = expected_shapes(config)
    plan, missing, used, wrong = {}, [], set(), []
    for entry in maps:
        if not entry.theirs:
            plan[entry.ours] = PlannedTensor(tuple(shapes[entry.ours]), torch.float32,
                                             partial(_zeros, tuple(shapes[entry.ours])))
            continue
        found = [tensors.get(name) for name in entry.theirs]
        absent = [name for name, tensor in zip(entry.theirs, found) if tensor is None]
        if absent:
            missing.extend(absent)
            continue
        used.update(entry.theirs)
        if entry.transposed:
            hf_shape = tuple(found[0].shape)
            start, stop = entry.rows or (0, hf_shape[-1])
            shape = (stop - start, hf_shape[0]) if len(hf_shape) == 2 and hf_shape[1] >= stop else None
            if shape != tuple(shapes[entry.ours]):
                wrong.append(f"{entry.theirs[0]} has shape {hf_shape}, but config.json implies the transpose of "
                             f"{tuple(shapes[entry.ours])} (meshlm {entry.ours}, columns {start}:{stop})")
                continue
            plan[entry.ours] = PlannedTensor(shape, found[0].dtype, partial(_transposed_columns, found[0], start, stop))
            continue
        if entry.rows is not None:
            (start, stop), dim = entry.rows, entry.rows_dim
            if found[0].shape[dim] < stop:
                what = "rows" if dim == 0 else f"entries along dim {dim}"
                wrong.append(f"{entry.theirs[0]} has {found[0].shape[dim]} {what}, but config.json implies at least "
                             f"{stop} (meshlm {entry.ours} is {what} {start}:{stop})")
                continue
            found = [_row_slice(found[0], start, stop, dim)]
        if entry.stacked and len({tuple(tensor.shape) for tensor in found}) > 1:
            wrong.append(f"{entry.describe_theirs()} do not all have the same shape")
            continue
        shape = (len(found), *found[0].shape) if entry.stacked else tuple(found[0].shape)
        if shape != tuple(shapes[entry.ours]):
            want = tuple(shapes[entry.ours][1:] if entry.stacked else shapes[entry.ours])
            wrong.append(f"{entry.describe_theirs()} has shape {tuple(found[0].shape)}, but config.json implies "
                         f"{want} (meshlm {entry.ours})")
            continue
        dtype = reduce(torch.promote_types, [tensor.dtype for tensor in found])
        produce = partial(_stacked, found, shape, dtype) if entry.stacked else partial(load, found[0])
        plan[entry.ours] = PlannedTensor(shape, dtype, produce)
    ignorable = ignorable or partial(default_ignorable, config)
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
    unmapped = sorted(set(shapes) - set(plan))
    if unmapped:  # an adapter bug, not a user error: the map forgot part of the model
        raise RuntimeError(f"{architecture} adapter does not map meshlm tensors {_listed(unmapped)}")
    return plan


def default_ignorable(config: ModelConfig, name: str) -> bool:
    """HF tensors import may find and leave: rotary tables, a tied model's copy of its head."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")


class LastTensorRead:
    """``read(name)`` that keeps the last tensor read: the E per-expert HF tensors cut from one
    stacked meshlm tensor cost one read of it, and at most one meshlm tensor is held."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        self.read, self.name, self.value = read, None, None

    def __call__(self, name: str) -> torch.Tensor:
        if name != self.name:
            self.name = self.value = None  # let the previous one go before reading the next
            self.value, self.name = self.read(name), name
        return self.value

    def row(self, name: str, index: int) -> torch.Tensor:
        return self(name)[index].clone()  # its own memory, not a view pinning the stacked tensor


def plan_to_hf(stored: dict[str, tuple], read: Callable[[str], torch.Tensor], config: ModelConfig,
               maps: list[TensorMap], architecture: str) -> dict[str, PlannedTensor]:
    """Apply ``maps`` backwards: meshlm tensors ({name: (shape, dtype)}, read whole by ``read``)
    -> HF tensors, each produced when it is written."""
    reader, plan, used, fused = LastTensorRead(read), {}, set(), {}
    for entry in maps:
        if entry.ours not in stored:
            raise CheckpointError(f"the meshlm state has no {entry.ours}, which {architecture} needs; "
                                  "does the checkpoint match its config.json?")
        shape, dtype = stored[entry.ours]
        if entry.rows is not None:
            fused.setdefault(entry.theirs[0], []).append(entry)
        elif entry.stacked:
            for index, name in enumerate(entry.theirs):
                plan[name] = PlannedTensor(tuple(shape[1:]), dtype, partial(reader.row, entry.ours, index))
        elif entry.transposed:
            plan[entry.theirs[0]] = PlannedTensor(tuple(shape)[::-1], dtype,
                                                  partial(_transposed, partial(reader, entry.ours)))
        elif entry.theirs:  # a second HF name for the same tensor (an untied copy) is read again
            plan[entry.theirs[0]] = PlannedTensor(tuple(shape), dtype, partial(reader, entry.ours))
        used.add(entry.ours)
    for name, parts in fused.items():  # rows of one HF tensor: concatenated when it is written
        parts.sort(key=lambda entry: entry.rows[0])
        shapes, dim = [stored[entry.ours][0] for entry in parts], parts[0].rows_dim
        dtype = reduce(torch.promote_types, [stored[entry.ours][1] for entry in parts])
        shape = (*shapes[0][:dim], sum(shape[dim] for shape in shapes), *shapes[0][dim + 1:])
        concatenated = partial(_concatenated, reader, [entry.ours for entry in parts], dtype, dim)
        if parts[0].transposed:  # the rows of a Conv1D weight: joined, then stored [in, out]
            plan[name] = PlannedTensor(shape[::-1], dtype, partial(_transposed, concatenated))
        else:
            plan[name] = PlannedTensor(shape, dtype, concatenated)
    left_over = sorted(name for name in stored if name not in used
                       and not (config.tie_embeddings and name == "output.weight"))
    if left_over:
        raise CheckpointError(f"{architecture} has no place for meshlm tensors {_listed(left_over)}.")
    return plan


def _concatenated(read, names: list[str], dtype: torch.dtype, dim: int = 0) -> torch.Tensor:
    return torch.cat([read(name).to(dtype) for name in names], dim=dim)


def produce_all(plan: dict[str, PlannedTensor]) -> dict[str, torch.Tensor]:
    """Every tensor of a plan, in memory (small models and tests)."""
    return {name: entry.produce() for name, entry in plan.items()}


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


def rope_from_hf(hf_config: dict, default_theta: float, architecture: str, partial_rotary: bool = False) -> dict:
    """``ModelConfig`` RoPE fields from ``rope_parameters`` (v5) or ``rope_theta``/``rope_scaling``
    (v4): the base, and the scaling meshlm implements (``meshlm/models/rope.py``: 'linear',
    'llama3', 'yarn', with YaRN's attention factor from ``mscale``/``mscale_all_dim`` as the HF
    code derives it, and 'longrope' -- older files: 'su' -- with its short and long factors);
    with ``partial_rotary`` (a class whose attention rotates the first channels
    only, as Phi-3's does) ``partial_rotary_factor`` as ``model.rope_fraction``; anything else is
    refused by name."""
    parameters = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in ("default",) + tuple(HF_ROPE_SCALINGS):
        raise ConfigError(f"{architecture} config.json: rope type {rope_type!r} is not supported yet; meshlm "
                          f"implements {', '.join(['default', *HF_ROPE_SCALINGS])}.")
    partial = parameters.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and not partial_rotary:
        raise ConfigError(f"{architecture} config.json: partial_rotary_factor={partial} is not supported; "
                          f"{architecture}'s attention rotates the whole head.")
    fields = {"rope_theta": float(parameters.get("rope_theta", hf_config.get("rope_theta", default_theta)))}
    if partial not in (None, 1, 1.0):
        fields["rope_fraction"] = float(partial)
    if rope_type == "default":
        return fields
    factor = parameters.get("factor")
    original = (parameters.get("original_max_position_embeddings") or hf_config.get("original_max_position_embeddings")
                or hf_config.get("max_position_embeddings"))
    implicit = rope_type in ("yarn", "longrope", "su") and original and hf_config.get("max_position_embeddings")
    if factor is None and implicit:
        factor = hf_config["max_position_embeddings"] / original  # DeepSeek-V3's and Phi-3's implicit factor
    if factor is None:
        raise ConfigError(f"{architecture} config.json: rope type {rope_type!r} without a 'factor'; give the "
                          "scaling factor in rope_parameters.")
    fields.update(rope_scaling=HF_ROPE_SCALINGS[rope_type], rope_scaling_factor=float(factor))
    if rope_type in ("longrope", "su"):
        if parameters.get("short_factor") is None or parameters.get("long_factor") is None:
            raise ConfigError(f"{architecture} config.json: rope type {rope_type!r} needs its short_factor and "
                              "long_factor lists in rope_parameters (or rope_scaling).")
        fields.update(rope_original_max_positions=int(original), rope_short_factors=list(parameters["short_factor"]),
                      rope_long_factors=list(parameters["long_factor"]))
        if parameters.get("attention_factor") is not None:
            fields["rope_attention_factor"] = float(parameters["attention_factor"])
        return fields
    if rope_type in ("llama3", "yarn"):
        if not original:
            raise ConfigError(f"{architecture} config.json: rope type {rope_type!r} needs "
                              "original_max_position_embeddings (the pretraining context).")
        fields["rope_original_max_positions"] = int(original)
    if rope_type == "llama3":
        fields.update(rope_low_freq_factor=float(parameters.get("low_freq_factor", 1.0)),
                      rope_high_freq_factor=float(parameters.get("high_freq_factor", 4.0)))
    if rope_type == "yarn":
        fields.update(rope_beta_fast=float(parameters.get("beta_fast") or 32.0),
                      rope_beta_slow=float(parameters.get("beta_slow") or 1.0),
                      rope_yarn_truncate=bool(parameters.get("truncate", True)),
                      rope_attention_factor=yarn_attention_factor_from_hf(parameters, float(factor)))
    return fields


def rope_with_defaults(hf_config: dict, partial_rotary: float, theta: float, partial_key: str = "partial_rotary_factor",
                       theta_key: str = "rope_theta") -> dict:
    """``hf_config`` with its RoPE fraction and base in v5's ``rope_parameters``, where
    ``rope_from_hf`` reads them: from there, else from v4's top-level ``partial_key`` and
    ``theta_key``, else the class's defaults (``partial_rotary``, ``theta``)."""
    parameters = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    parameters.setdefault("partial_rotary_factor", hf_config.get(partial_key, partial_rotary))
    parameters.setdefault("rope_theta", hf_config.get(theta_key, theta))
    return {**hf_config, "rope_parameters": parameters, "rope_scaling": None}


def fused_qkv_tensors(config: ModelConfig, fused_name: Callable[[int], str]) -> list[tuple[list[str], str]]:
    """([meshlm q, k, v names], HF name) of each fused q/k/v weight (and bias, with
    ``model.attention_bias``), layer i's fused module named ``fused_name(i)``."""
    out = []
    for layer in range(config.num_blocks // 2):
        mixer = f"blocks.{2 * layer}.mixer"
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            out.append(([f"{mixer}.{projection}.{kind}" for projection in ("q_proj", "k_proj", "v_proj")],
                        f"{fused_name(layer)}.{kind}"))
    return out


def layered_rope_fields(hf_config: dict, architecture: str, full_theta: float, local_theta: float, v4_local_key: str,
                        sliding: bool) -> dict:
    """RoPE fields of a class whose full and sliding layers rotate differently (Gemma 3, OLMo 3):
    the full layers' base and scaling, and with ``sliding`` layers ``rope_local_theta``, their
    unscaled base. Read from v5's ``rope_parameters`` keyed by layer type, or from v4's
    ``rope_theta``, ``rope_scaling`` and ``v4_local_key`` (the sliding base; absent: ``local_theta``)."""
    parameters = hf_config.get("rope_parameters") or {}
    if FULL_ATTENTION in parameters or SLIDING_ATTENTION in parameters:
        fields = rope_from_hf({"rope_parameters": parameters.get(FULL_ATTENTION) or {},
                               "max_position_embeddings": hf_config.get("max_position_embeddings")},
                              full_theta, architecture)
        local = parameters.get(SLIDING_ATTENTION) or {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{architecture} config.json: the sliding layers' rope type {local['rope_type']!r} is "
                              "not supported; meshlm rotates them unscaled (rope_type 'default').")
        base = local.get("rope_theta", local_theta)
    else:
        fields = rope_from_hf(hf_config, full_theta, architecture)
        base = hf_config.get(v4_local_key, local_theta)
    if sliding and not (float(base) == fields["rope_theta"] and "rope_scaling" not in fields):
        fields["rope_local_theta"] = float(base)  # (the same base, unscaled everywhere: nothing to set)
    return fields


def layered_rope_to_hf(config: ModelConfig) -> dict:
    """``rope_parameters`` keyed by layer type (``layered_rope_fields`` read back), and v4's ``rope_theta``."""
    full = rope_to_hf(config)
    local = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
    return {"rope_parameters": {FULL_ATTENTION: full["rope_parameters"],
                                SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": float(local)}},
            "rope_theta": full["rope_theta"]}


HF_ROPE_SCALINGS = {"linear": "linear", "llama3": "llama3", "yarn": "yarn", "longrope": "longrope", "su": "longrope"}
"""HF ``rope_type`` -> ``model.rope_scaling``."""


def yarn_attention_factor_from_hf(parameters: dict, factor: float) -> float | None:
    """YaRN's factor on cos/sin as the HF configs give it: explicit ``attention_factor``; else, with
    ``mscale`` and ``mscale_all_dim`` (DeepSeek), m(s, mscale) / m(s, mscale_all_dim) with
    m(s, k) = 0.1 k ln(s) + 1; else None (meshlm's default, 0.1 ln(s) + 1)."""
    if parameters.get("attention_factor") is not None:
        return float(parameters["attention_factor"])
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if mscale and mscale_all_dim and factor > 1:
        return float((0.1 * mscale * math.log(factor) + 1.0) / (0.1 * mscale_all_dim * math.log(factor) + 1.0))
    return None


def rope_to_hf(config: ModelConfig) -> dict:
    """RoPE fields for an HF config.json: v5's ``rope_parameters`` (with the scaling's parameters)
    plus v4's top-level ``rope_theta``."""
    parameters = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling != "none":
        parameters.update(rope_type=config.rope_scaling, factor=float(config.rope_scaling_factor))
    if config.rope_scaling in ("llama3", "yarn", "longrope"):
        parameters["original_max_position_embeddings"] = config.rope_original_max_positions
    if config.rope_scaling == "longrope":
        parameters.update(short_factor=list(config.rope_short_factors), long_factor=list(config.rope_long_factors))
        if config.rope_attention_factor is not None:
            parameters["attention_factor"] = config.rope_attention_factor
    if config.rope_scaling == "llama3":
        parameters.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor)
    if config.rope_scaling == "yarn":
        parameters.update(beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow)
        if not config.rope_yarn_truncate:  # HF's default is to truncate
            parameters["truncate"] = False
        if config.rope_attention_factor is not None:  # DeepSeek's mscale pair arrives as this value
            parameters["attention_factor"] = config.rope_attention_factor
    return {"rope_parameters": parameters, "rope_theta": float(config.rope_theta)}


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


def common_unsupported(config: ModelConfig, supported: frozenset[str] = frozenset()) -> list[str]:
    """Fields no HF architecture here can express, and the layer features of ``LAYER_FEATURES`` that
    only some can, but for the ones named in ``supported`` (the class checks those itself)."""
    reasons = [reason for name, (present, reason) in layer_features(config).items()
               if present and name not in supported]
    if config.norm != "rmsnorm" and "norm" not in supported:
        reasons.append(f"model.norm={config.norm!r} (the HF classes here other than GPT-2, GPTBigCode, StarCoder2, "
                       "GPT-NeoX, StableLM, Falcon, Phi, GPT-J and Command R use RMSNorm)")
    if config.mtp_depth and "mtp_depth" not in supported:
        reasons.append(f"model.mtp_depth={config.mtp_depth} (only DeepseekV3ForCausalLM and Glm4MoeForCausalLM "
                       "hold multi-token-prediction layers)")
    if config.block_overrides:
        blocks = "; ".join(f"block {index} sets {', '.join(fields)}" for index, fields in config.block_overrides.items())
        reasons.append(f"model.block_overrides ({blocks}: these formats have one size per field for all layers)")
    replaced = [f"{index} ('{kind}')" for index, kind in enumerate(config.block_kinds) if kind in ("L", "0")]
    if replaced:
        reasons.append(f"linear/no-op blocks {', '.join(replaced)} in model.pattern (these formats have no "
                       "replaced or removed layers)")
    return reasons


LAYER_FEATURES = {
    "block_output_norm": "Gemma2ForCausalLM, Gemma3ForCausalLM, Olmo2ForCausalLM, Glm4ForCausalLM and "
                         "Exaone4ForCausalLM normalize each block's output",
    "block_input_norm": "Olmo2ForCausalLM and Exaone4ForCausalLM leave the blocks' inputs unnormalized",
    "qk_norm_scope": "Olmo2ForCausalLM and MiniMaxM2ForCausalLM normalize all query (and key) heads together",
    "norm_zero_centered": "GemmaForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM store norm weights as 1 + w",
    "embedding_multiplier": "GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (by sqrt(hidden_size)), "
                            "GraniteForCausalLM and the Granite MoE classes scale the embeddings",
    "residual_multiplier": "GraniteForCausalLM and the Granite MoE classes scale each block's output before the "
                           "residual add",
    "logit_divisor": "GraniteForCausalLM, the Granite MoE classes and CohereForCausalLM scale the logits "
                     "(logits_scaling, logit_scale)",
    "rope_local_theta": "Gemma3ForCausalLM and Olmo3ForCausalLM give the sliding layers a RoPE of their own",
    "attention_scale": "Gemma2ForCausalLM and Gemma3ForCausalLM (query_pre_attn_scalar), GraniteForCausalLM and "
                       "the Granite MoE classes (attention_multiplier) scale attention by other than 1/sqrt(head_dim)",
    "attention_softcap": "Gemma2ForCausalLM soft-caps attention scores",
    "final_logit_softcap": "Gemma2ForCausalLM and Gemma3ForCausalLM soft-cap the output logits",
    "position_embedding": "GPT2LMHeadModel and GPTBigCodeForCausalLM add learned position embeddings",
    "attention_type": "DeepseekV3ForCausalLM has multi-head latent attention",
    "rope_fraction": "Phi3ForCausalLM, GPTNeoXForCausalLM, StableLmForCausalLM, PhiForCausalLM, GPTJForCausalLM, "
                     "GlmForCausalLM, Glm4ForCausalLM, Glm4MoeForCausalLM, MiniMaxM2ForCausalLM and BambaForCausalLM "
                     "rotate part of each head (partial_rotary_factor, rotary_dim)",
    "parallel_residual": "GPTNeoXForCausalLM, StableLmForCausalLM, FalconForCausalLM, PhiForCausalLM, "
                         "GPTJForCausalLM and CohereForCausalLM run attention and MLP side by side",
    "parallel_residual_shared_norm": "StableLmForCausalLM's, FalconForCausalLM's, PhiForCausalLM's, "
                                     "GPTJForCausalLM's and CohereForCausalLM's parallel layers have one norm for "
                                     "attention and MLP",
    "norm_bias": "CohereForCausalLM's LayerNorms have no bias",
    "qk_norm_type": "StableLmForCausalLM, PhiForCausalLM and CohereForCausalLM normalize q and k with LayerNorms",
    "qk_norm_bias": "PhiForCausalLM's q/k LayerNorms have biases",
    "qk_norm_per_head": "StableLmForCausalLM and CohereForCausalLM give each head a q/k norm weight of its own",
    "output_bias": "PhiForCausalLM and GPTJForCausalLM have a bias on lm_head",
    "rope_pattern": "SmolLM3ForCausalLM, Cohere2ForCausalLM and Exaone4ForCausalLM leave some layers without RoPE",
    "moe_shared_expert_gate": "Qwen2MoeForCausalLM gates its shared expert",
    "query_scale_beta": "Ministral3ForCausalLM scales its queries by position (llama_4_scaling_beta)",
    "qk_norm_after_rope": "HunYuanDenseV1ForCausalLM normalizes q and k after RoPE",
    "attention_sinks": "GptOssForCausalLM adds a learned sink to each head's softmax",
    "moe_router_bias": "GptOssForCausalLM's router has a bias",
    "moe_expert_linear_bias": "GptOssForCausalLM's experts have biases",
}
"""Layer features only some HF classes hold, and which."""


def layer_features(config: ModelConfig) -> dict[str, tuple[bool, str]]:
    """{field: (whether ``config`` uses it, the reason a class without it gives)} for ``LAYER_FEATURES``."""
    used = {"block_output_norm": config.block_output_norm, "block_input_norm": not config.block_input_norm,
            "qk_norm_scope": config.qk_norm and config.qk_norm_scope != "head",
            "norm_zero_centered": config.norm_zero_centered, "embedding_multiplier": config.embedding_multiplier != 1.0,
            "rope_local_theta": config.rope_local_theta is not None,
            "attention_scale": config.attention_scale is not None,
            "residual_multiplier": config.residual_multiplier != 1.0, "logit_divisor": config.logit_divisor != 1.0,
            "attention_softcap": config.attention_softcap is not None,
            "final_logit_softcap": config.final_logit_softcap is not None,
            "position_embedding": config.position_embedding == "learned",
            "attention_type": config.attention_type == "mla" and "*" in config.block_kinds,
            "rope_fraction": config.rope_fraction != 1.0, "parallel_residual": config.parallel_residual,
            "parallel_residual_shared_norm": config.parallel_residual_shared_norm, "output_bias": config.output_bias,
            "norm_bias": not config.norm_bias, "qk_norm_type": config.qk_norm and config.qk_norm_type != "rmsnorm",
            "qk_norm_bias": config.qk_norm_bias, "qk_norm_per_head": config.qk_norm_per_head,
            "rope_pattern": config.rope_pattern != "R",
            "moe_shared_expert_gate": config.moe_shared_expert_gate and "E" in config.block_kinds,
            "query_scale_beta": config.query_scale_beta != 0 and "*" in config.block_kinds,
            "qk_norm_after_rope": config.qk_norm and config.qk_norm_after_rope,
            "attention_sinks": config.attention_sinks,
            "moe_router_bias": config.moe_router_bias, "moe_expert_linear_bias": config.moe_expert_linear_bias}
    return {name: (used[name], f"model.{name}={getattr(config, name)!r} (only {holder})")
            for name, holder in LAYER_FEATURES.items()}


# --- sliding-window attention ----------------------------------------------------------------------
SLIDING_ATTENTION, FULL_ATTENTION = "sliding_attention", "full_attention"
"""transformers' ``layer_types`` entries for a layer that attends within ``sliding_window`` and one
that attends to every earlier token."""


def shortest_period(letters: str) -> str:
    """The shortest string that, repeated, gives ``letters`` (meshlm's per-attention-block patterns)."""
    period = next(length for length in range(1, len(letters) + 1)
                  if all(letters[index] == letters[index % length] for index in range(len(letters))))
    return letters[:period]


def window_fields(window: int | None, sliding: list[bool]) -> dict:
    """meshlm's ``sliding_window`` fields for HF attention layers that slide (True) or not, in order,
    with window ``window``: the pattern is the shortest string that repeats to the layers' letters."""
    if window is None or not any(sliding):
        return {}
    return {"sliding_window": window,
            "sliding_window_pattern": shortest_period("".join("S" if slides else "F" for slides in sliding))}


def rope_pattern_fields(rotates: list[bool]) -> dict:
    """meshlm's ``rope_pattern`` for HF attention layers that apply RoPE (True) or not, in order."""
    if all(rotates):
        return {}
    return {"rope_pattern": shortest_period("".join("R" if rotate else "N" for rotate in rotates))}


def layer_rotates(config: ModelConfig) -> list[bool]:
    """Whether each main-stack attention block applies RoPE (``rope_pattern_fields`` read back)."""
    return [config.block_rotates(index) for index, kind in enumerate(config.block_kinds) if kind == "*"]


def layer_types_from_hf(hf: dict, architecture: str, full_every: int | None = None) -> list[str]:
    """Each layer's attention from an HF config: its ``layer_types``, else the class's rule -- every
    ``full_every``-th layer full and the others sliding (Gemma 3: 6, OLMo 3: 4), or with None every
    layer full; refused unless every entry is one of the two kinds."""
    layers, types = hf["num_hidden_layers"], hf.get("layer_types")
    if types is None:
        types = [SLIDING_ATTENTION if full_every and (index + 1) % full_every else FULL_ATTENTION
                 for index in range(layers)]
    if len(types) != layers or set(types) - {SLIDING_ATTENTION, FULL_ATTENTION}:
        raise ConfigError(f"{architecture} config.json: layer_types={types!r} must name {layers} layers, each "
                          f"{SLIDING_ATTENTION!r} or {FULL_ATTENTION!r}.")
    return list(types)


def layer_windows(config: ModelConfig) -> list[int | None]:
    """The window of each attention block of the main stack, in order (None: full attention)."""
    return [config.attention_window(index) for index in config.attention_blocks if index < config.num_blocks]


def layer_types_to_hf(config: ModelConfig) -> list[str]:
    """``layer_types`` of the main stack's attention blocks (``layer_types_from_hf`` read back)."""
    return [FULL_ATTENTION if window is None else SLIDING_ATTENTION for window in layer_windows(config)]


def uniform_window(config: ModelConfig) -> int | None:
    """The window every layer shares, for the classes with one ``sliding_window`` for all layers
    (their ``window_unsupported(..., uniform_only=True)`` has checked that it is shared); None: full."""
    return next(iter(layer_windows(config)), None)


def decoder_layers_unsupported(config: ModelConfig, label: str, supported: frozenset[str], fixed: dict) -> list[str]:
    """Why ``config`` is not a stack of class ``label``'s attention-then-MLP layers: what
    ``common_unsupported`` refuses but the ``supported`` layer features, a pattern other than '*-'
    repeated, and each ``fixed`` field (name -> the class's only value) it differs on."""
    reasons = common_unsupported(config, supported=supported)
    reasons += blocks_of(config, r"(\*-)+", f"{label} layers are attention then MLP: '*-' repeated")
    return reasons + fixed_fields_unsupported(config, label, fixed)


def non_gated_activation_unsupported(config: ModelConfig, label: str, to_hf: dict) -> list[str]:
    """A reason if ``config``'s MLP activation is not one of the non-gated ones class ``label``
    writes (``to_hf``: meshlm name -> HF name)."""
    if config.mlp_activation in to_hf:
        return []
    return [f"model.mlp_activation={config.mlp_activation!r} ({label}'s MLP is not gated: one of {', '.join(to_hf)})"]


def split_heads_unsupported(config: ModelConfig, label: str) -> list[str]:
    """A reason if ``config``'s query heads do not split the hidden size, as class ``label``'s do."""
    if config.resolved_head_dim * config.num_attention_heads == config.hidden_size:
        return []
    return [f"model.head_dim={config.head_dim} ({label}'s heads split the hidden size)"]


def multi_head_unsupported(config: ModelConfig, label: str) -> list[str]:
    """Why ``config``'s attention is not class ``label``'s multi-head attention: one key/value head
    per query head, the heads splitting the hidden size."""
    reasons = []
    if config.resolved_num_kv_heads != config.num_attention_heads:
        reasons.append(f"model.num_kv_heads={config.num_kv_heads} ({label} has one key/value head per query head)")
    return reasons + split_heads_unsupported(config, label)


QK_LAYERNORM_FEATURES = frozenset({"qk_norm_type", "qk_norm_bias", "qk_norm_per_head"})
"""The ``LAYER_FEATURES`` of a QK LayerNorm, which ``qk_layernorm_unsupported`` checks."""


def qk_layernorm_unsupported(config: ModelConfig, label: str, per_head: bool, bias: bool) -> list[str]:
    """Why ``config``'s QK-norm, if it has one, is not class ``label``'s optional LayerNorm on q and
    k: a weight per head (``per_head``) or one shared by the heads, with a bias or without."""
    if not config.qk_norm:
        return []
    reasons = []
    if config.qk_norm_type != "layernorm":
        reasons.append(f"model.qk_norm_type={config.qk_norm_type!r} ({label}'s QK-norm is a LayerNorm)")
    if config.qk_norm_per_head != per_head:
        reasons.append(f"model.qk_norm_per_head={config.qk_norm_per_head} ({label}'s q/k LayerNorms have "
                       f"{'a weight per head' if per_head else 'one weight shared by the heads'})")
    if config.qk_norm_bias != bias:
        reasons.append(f"model.qk_norm_bias={config.qk_norm_bias} ({label}'s q/k LayerNorms have "
                       f"{'a bias' if bias else 'no bias'})")
    return reasons


def layer_norm_maps(ours: str, theirs: str) -> list[TensorMap]:
    """weight and bias of one LayerNorm."""
    return [rename(f"{ours}.weight", f"{theirs}.weight"), rename(f"{ours}.bias", f"{theirs}.bias")]


def fixed_fields_unsupported(config: ModelConfig, label: str, fixed: dict) -> list[str]:
    """One reason per ``fixed`` field (name -> the only value class ``label`` has) ``config`` differs on."""
    return [f"model.{name}={getattr(config, name)!r} ({label} has {name}={value!r})"
            for name, value in fixed.items() if getattr(config, name) != value]


def window_unsupported(config: ModelConfig, label: str, uniform_only: bool) -> list[str]:
    """Why ``config``'s windows do not fit a class whose layers all attend to every earlier token
    (``uniform_only`` False: any window is a reason) or all slide alike (True)."""
    windows = set(layer_windows(config))
    if windows <= {None}:
        return []
    if not uniform_only:
        return [f"model.sliding_window={config.sliding_window} ({label} attends to every earlier token; "
                "MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM hold a window)"]
    if len(windows) > 1:
        return [f"model.sliding_window_pattern={config.sliding_window_pattern!r} ({label} slides in every layer "
                "or none; Qwen2ForCausalLM and Qwen3ForCausalLM take a window per layer)"]
    return []


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
