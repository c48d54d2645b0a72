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

The first step (an empty history) scales from the current amax, as ``fp8_tensorwise`` does.
The histories are training state: a checkpoint saves them (``recipe/NAME/amax_history``, whole
tensors, replicated) and a resume at any layout restores them; a checkpoint without them
(e.g. of a run without this recipe) starts from empty histories.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

OPERANDS = ("input", "weight", "grad_output")
"""The tensors of a linear layer whose amaxes a history tracks, in its column order."""


class DelayedScaling:
    """One linear layer's amax history ``[history_length, 3]`` (see the module docstring)."""

    def __init__(self, history_length: int, device: torch.device):
        self.history = torch.zeros(history_length, len(OPERANDS), dtype=torch.float32, device=device)
        """Reduced amaxes of past steps, newest first; columns as ``OPERANDS``."""
        self.step_amax = torch.zeros(len(OPERANDS), dtype=torch.float32, device=device)
        """This rank's running max of the step under way (not yet reduced)."""
        self.empty = True
        """No step recorded yet: quantize with current scaling (refreshed by ``begin_step``)."""

    def record(self, operand: str, amax: torch.Tensor) -> None:
        index = OPERANDS.index(operand)
        self.step_amax[index] = torch.maximum(self.step_amax[index], amax.detach().float())

    def window_amax(self, operand: str) -> torch.Tensor:
        """The largest recorded amax of ``operand`` over the history (0-dim fp32)."""
        return self.history[:, OPERANDS.index(operand)].amax()


def delayed_scalings(model: nn.Module) -> list[tuple[str, DelayedScaling]]:
    """(module name, state) of every layer of ``model`` that scales with a history, in module order."""
    found = []
    for name, module in model.named_modules():
        quantization = getattr(module, "quantization", None)
        if quantization is not None and quantization.delayed is not None:
            found.append((name, quantization.delayed))
    return found


def begin_step(model: nn.Module) -> None:
    """Before a step: note which histories are still empty (one host sync for all of them)."""
    states = [state for _, state in delayed_scalings(model)]
    if states:
        filled = torch.stack([state.history.amax() for state in states]).gt(0).tolist()
        for state, is_filled in zip(states, filled):
            state.empty = not is_filled


@torch.no_grad()
def finish_step(model: nn.Module, groups=(), reduce_max: Callable | None = None) -> None:
    """After a step's backward: reduce its amaxes (max) over ``groups`` (the TP, CP and DP groups;
    None entries skipped) with ``reduce_max(tensor, group)`` (the run's all-reduce with op='max')
    and push them into every history."""
    states = [state for _, state in delayed_scalings(model)]
    if not states:
        return
    amaxes = torch.stack([state.step_amax for state in states])
    for group in groups:
        if group is not None and group.size > 1:
            reduce_max(amaxes, group)
    amaxes = torch.where(torch.isfinite(amaxes), amaxes, torch.zeros_like(amaxes))
    for state, amax in zip(states, amaxes):
        state.history.copy_(torch.cat([amax[None], state.history[:-1]]))
        state.step_amax.zero_()
        state.empty = False


__all__ = ["DelayedScaling", "OPERANDS", "begin_step", "delayed_scalings", "finish_step"]
