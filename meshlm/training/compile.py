"""``train.compile=true``: each block's forward runs under ``torch.compile`` (TorchDynamo + Inductor).

Why per block, and why after parallelization. The trainer compiles the model this rank holds,
once it is parallelized, materialized and wrapped for data parallelism: by then the TP layers
carry their collectives, the pipeline keeps only this rank's blocks, and ZeRO / the distributed
optimizer have hooked the blocks. Compiling each block's math, ``Block.residual_step`` =
``h + dropout(mixer(norm(h)))`` (rather than the whole model, or ``nn.Module.compile`` which would
pull the module's hooks into the graph), changes nothing of that: the block stays the same
module with the same parameter names (checkpoints do not change), its hooks still run eagerly
around the compiled forward, and the pipeline schedule calls the blocks one by one as before. A
collective inside a block (tensor parallelism) splits that block into several graphs; the math
between collectives is still fused.

Blocks of the same kind share their compiled code (Dynamo treats module parameters as inputs,
and ``residual_step`` touches no state outside its block, such as the list of MoE losses that
``Block.forward`` appends to), so a deep model compiles about one graph per block kind, for
training and once more for evaluation (no_grad). The first step pays for compiling (seconds to
a minute); later steps run the fused kernels.

When compiling is not possible -- Dynamo unsupported on this Python, no C++ compiler for
Inductor's CPU code, or Inductor failing on a block's forward or backward the first time it runs
(both are compiled at the first forward call) -- the run goes on eagerly and says once why.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from meshlm.models.block import Block
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import softmax_cross_entropy_chunk


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why torch.compile cannot run here, or None when it can."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return f"TorchDynamo does not support this platform (torch {torch.__version__})"
    if device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
            get_cpp_compiler()
        except Exception:  # InvalidCxxCompiler, or the private helper moved
            return "Inductor needs a C++ compiler for CPU code and none was found (install g++, or set CXX)"
    return None


def _backward_compiled_with_forward():
    """AOTAutograd compiles a graph's backward lazily, at the first ``backward()``: a compiler
    failure there would surface in the middle of the training step, past the point where the
    block could still run eagerly. Asking it to compile the backward together with the forward
    (its own switch, as ``torch.export``'s AOT compile uses) makes either failure happen in the
    forward call, where ``CompiledForward`` turns it into the eager fallback."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):  # an older torch: lazy as before
        return contextlib.nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


class CompiledForward:
    """A block's forward under torch.compile; on a compiler failure, the eager forward from then on."""

    def __init__(self, eager: Callable, fallback: "EagerFallback", backend="inductor", dynamic: bool | None = None,
                 what: str = "a block"):
        self.eager, self.fallback, self.what = eager, fallback, what
        self.compiled = torch.compile(eager, backend=backend, dynamic=dynamic)

    def __call__(self, *args, **kwargs):
        if self.fallback.reason is None:
            try:
                with _backward_compiled_with_forward():
                    return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as error:  # raised before the graph ran
                inner = error.inner_exception
                first_line = str(inner).splitlines()[0] if str(inner) else ""
                self.fallback.fail(f"{error.backend_name} failed to compile {self.what} "
                                   f"({type(inner).__name__}: {first_line})")
        return self.eager(*args, **kwargs)


class EagerFallback:
    """The reason the run fell back to eager (shared by all blocks), reported once."""

    def __init__(self, report: Callable[[str], None]):
        self.reason, self.report = None, report

    def fail(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.report(f"meshlm train: train.compile=true but {reason}; running eagerly.")


def compile_blocks(model: nn.Module, device: torch.device, report: Callable[[str], None],
                   backend: str = "inductor") -> int:
    """Put every ``Block`` of ``model`` (main stack and MTP depths) under torch.compile, in place,
    and the fused loss's softmax part (``losses.softmax_cross_entropy_chunk``: the chunks' sweeps
    over their logits become two kernels; static shapes, as a run's chunks all have one or two).
    ``backend`` is torch.compile's: Inductor for training; ``aot_eager`` traces the same forward and
    backward graphs (Dynamo and AOTAutograd, where a lost gradient would come from) and runs them
    without generating code, which on CPU takes seconds instead of Inductor's tens of seconds.

    Returns the number of blocks compiled (0 after falling back to eager, which ``report`` is told).
    """
    fallback = EagerFallback(report)
    reason = compile_unavailable_reason(device) if backend == "inductor" else None
    if reason is not None:
        fallback.fail(reason)
        return 0
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    # Each block kind compiles its own graph (x2: training and evaluation); never let Dynamo's
    # per-function limit silently send a deep hybrid model's later kinds back to eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(blocks))
    for block in blocks:
        block.residual_step = CompiledForward(block.residual_step, fallback, backend=backend)
    for module in model.modules():
        if isinstance(module, LanguageModel):
            module.loss_chunk_softmax = CompiledForward(softmax_cross_entropy_chunk, fallback, backend=backend,
                                                        dynamic=False, what="the fused loss's softmax")
    return len(blocks)


__all__ = ["CompiledForward", "compile_blocks", "compile_unavailable_reason"]
