"""Delayed scaling: per-tensor FP8 scales from the amaxes of past steps (``precision.recipe=fp8_delayed``).

Current scaling (``fp8_tensorwise``) needs a tensor's amax before the tensor can be cast: one
extra pass over it, and under tensor or context parallelism a collective per GEMM operand.
Transformer Engine's *delayed scaling* (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", §4.3; NVIDIA Transformer Engine's ``DelayedScaling`` recipe) takes the scale from the
largest amax seen over the last N steps instead, and records this step's amax for later:

    scale_t = max(amax_{t-N} .. amax_{t-1}) / format max         (values beyond it saturate)

Each quantized linear layer keeps one ``DelayedScaling``: a history ``[N, 3]`` (newest first) for
its three tensors -- the input, the weight and the output gradient -- and the running max of the
step under way. The step's amaxes are reduced (max) over every rank that holds the layer -- the
tensor-, context- and data-parallel groups -- once per step, in one collective per group for all
layers together (``finish_step``), so every rank, in any layout, rolls the same history as one
process that ran all the micro-batches. A step's amax is recorded by the training forward and
backward only (evaluation does not change the state); a non-finite amax (an overflowed step) is
recorded as 0, so it cannot wipe out the scale.

Each operand's scale (the window's amax over its FP8 format's largest value) is made once each
time the history moves -- when a step begins and when it has been pushed -- in each operand's
format (``formats``, as the recipe assigns them), and every GEMM of the step reads it
(``scales``). The first step (an empty history) scales from the current amax, as
``fp8_tensorwise`` does.
The histories are training state: a checkpoint saves them (``recipe/NAME/amax_history``, whole
tensors, replicated) and a resume at any layout restores them; a checkpoint without them
(e.g. of a run without this recipe) starts from empty histories.

**Experts.** A stacked expert weight (``quantized_experts.py``) runs E separate linear layers, so
its history is ``[N, E, 3]``: one column set per expert, indexed by the expert's *global*
number. Under expert parallelism a rank records only its own experts' rows (the others stay 0);
the step's max over the data-parallel group -- which the expert-parallel ranks are folded into
-- then fills in every expert, so every rank keeps the whole, identical history, and a
checkpoint of it reshards to any expert layout like a replicated tensor. An expert may receive
no tokens for a while: an (expert, operand) whose window holds no amax yet scales from its
current amax (``filled``, refreshed by ``begin_step``), where a dense layer's history is either
empty or filled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshlm.precision.formats.fp8 import scale_from_amax

OPERANDS = ("input", "weight", "grad_output")
"""The tensors of a linear layer whose amaxes a history tracks, in its column order."""


class DelayedScaling:
    """One linear layer's amax history ``[history_length, 3]``, or a stacked expert weight's
    ``[history_length, num_experts, 3]`` (see the module docstring)."""

    def __init__(self, history_length: int, device: torch.device, num_experts: int = 0, *, formats: tuple):
        experts = (num_experts,) if num_experts else ()
        if len(formats) != len(OPERANDS):
            raise ValueError(f"formats: one FP8 format per operand ({', '.join(OPERANDS)}), got {len(formats)}")
        self.history = torch.zeros(history_length, *experts, len(OPERANDS), dtype=torch.float32, device=device)
        """Reduced amaxes of past steps, newest first; columns as ``OPERANDS`` (per global expert)."""
        self.step_amax = torch.zeros(*experts, len(OPERANDS), dtype=torch.float32, device=device)
        """This rank's running max of the step under way (not yet reduced)."""
        self.formats = tuple(formats)
        """Each operand's FP8 format, in ``OPERANDS`` order (as the recipe assigns them)."""
        self.scales = tuple(torch.ones(experts, dtype=torch.float32, device=device) for _ in OPERANDS)
        """Each operand's scale from its window (0-dim; experts: [E], per global expert):
        ``scale_from_amax`` of ``window_amax`` in its format. Made whenever the history moves
        (``begin_step``, ``finish_step``: ``refresh_scales``) and read by every GEMM of the step,
        which would otherwise each reduce the window and divide again: small kernels, several per
        operand and micro-batch, that a compiled step launches one after another. One tensor per
        operand, not columns of one: a column is a view 4 or 8 bytes into its storage, which
        ``torch._scaled_mm`` takes as a scale eagerly only once copied (``fp8_gemm._aligned``) and
        which Inductor's lowering of it on CUDA refused (torch 2.11, H200: "LoweringException:
        AssertionError", and the whole block ran eagerly); each tensor here starts its own storage."""
        self.empty = True
        """No step recorded yet: quantize with current scaling (refreshed by ``begin_step``)."""
        self.filled: list[list[bool]] | None = None
        """Experts: per global expert and operand, whether its window holds an amax (host-side,
        refreshed by ``begin_step``); None: none does yet."""

    @property
    def per_expert(self) -> bool:
        return self.history.dim() == 3

    def record(self, operand: str, amax: torch.Tensor, experts: torch.Tensor | None = None) -> None:
        """Note this step's ``amax`` of ``operand``; experts: ``amax [pieces]`` of the pieces that
        belong to global experts ``experts [pieces]`` (several pieces may share an expert)."""
        index = OPERANDS.index(operand)
        if experts is None:
            self.step_amax[index] = torch.maximum(self.step_amax[index], amax.detach().float())
            return
        column = self.step_amax[:, index]
        column.scatter_reduce_(0, experts.to(column.device), amax.detach().float(), reduce="amax")

    def scale(self, operand: str) -> torch.Tensor:
        """``operand``'s scale from its window (0-dim fp32; experts: [E]), as of ``refresh_scales``."""
        return self.scales[OPERANDS.index(operand)]

    @torch.no_grad()
    def refresh_scales(self) -> None:
        """``scales`` from the history as it stands, in place (a compiled graph reads the same tensor)."""
        for scale, operand, fmt in zip(self.scales, OPERANDS, self.formats):
            scale.copy_(scale_from_amax(self.window_amax(operand), fmt))

    def window_amax(self, operand: str) -> torch.Tensor:
        """The largest recorded amax of ``operand`` over the history (0-dim fp32; experts: [E])."""
        return self.history[..., OPERANDS.index(operand)].amax(0)

    def is_filled(self, operand: str, expert: int) -> bool:
        """Experts: whether global ``expert``'s window of ``operand`` holds an amax."""
        return self.filled is not None and self.filled[expert][OPERANDS.index(operand)]


def delayed_scalings(model: nn.Module) -> list[tuple[str, DelayedScaling]]:
    """(name, state) of every layer of ``model`` that scales with a history, in module order: a
    linear layer's module name, or ``MODULE.WEIGHT`` for a stacked expert weight."""
    found = []
    for name, module in model.named_modules():
        quantization = getattr(module, "quantization", None)
        if quantization is not None and quantization.delayed is not None:
            found.append((name, quantization.delayed))
        for weight_name, grouped in (getattr(module, "quantizations", None) or {}).items():
            if grouped.delayed is not None:
                found.append((f"{name}.{weight_name}", grouped.delayed))
    return found


def begin_step(model: nn.Module) -> None:
    """Before a step: note which histories (experts: which windows) are still empty, with one host
    sync for all of them."""
    states = [state for _, state in delayed_scalings(model)]
    if not states:
        return
    windows = [state.history.amax(0).flatten() if state.per_expert else state.history.amax().reshape(1)
               for state in states]
    filled = torch.cat(windows).gt(0).cpu().split([window.numel() for window in windows])
    for state, is_filled in zip(states, filled):
        state.refresh_scales()  # a resumed run's history was loaded into place since the last step
        state.empty = not bool(is_filled.any())
        if state.per_expert:
            state.filled = is_filled.view(state.step_amax.shape).tolist()


@torch.no_grad()
def finish_step(model: nn.Module, groups=(), reduce_max: Callable | None = None) -> None:
    """After a step's backward: reduce its amaxes (max) over ``groups`` (the TP, CP and DP groups;
    None entries skipped) with ``reduce_max(tensor, group)`` (the run's all-reduce with op='max')
    and push them into every history."""
    states = [state for _, state in delayed_scalings(model)]
    if not states:
        return
    amaxes = torch.cat([state.step_amax.flatten() for state in states])
    for group in groups:
        if group is not None and group.size > 1:
            reduce_max(amaxes, group)
    amaxes = torch.where(torch.isfinite(amaxes), amaxes, torch.zeros_like(amaxes))
    for state, amax in zip(states, amaxes.split([state.step_amax.numel() for state in states])):
        state.history.copy_(torch.cat([amax.view(1, *state.step_amax.shape), state.history[:-1]]))
        state.step_amax.zero_()
        state.refresh_scales()  # an evaluation before the next step scales from the moved window
        state.empty = False


__all__ = ["DelayedScaling", "OPERANDS", "begin_step", "delayed_scalings", "finish_step"]
