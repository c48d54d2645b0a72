"""Which SSD scan the Mamba-2 layers run on this device: the Triton kernels only once they pass a check here.

``model.mamba_scan=auto`` (the default) runs the scan's diagonal blocks in the Triton kernels of
``meshlm/kernels/ssd_diagonal.py`` wherever they apply -- CUDA tensors, Triton installed, shapes the
kernels take -- and in PyTorch elsewhere (``ssd_fast.py``). The kernels are tested against the
PyTorch path in CI, but only in Triton's interpreter: the compiled code, the GPU's own matmul
instructions and the autotuner's choices meet a real device for the first time in a user's run,
where a wrong result would not stop training, only spoil it.

So before a run's first step (``choose_scan_kernels``, called by the trainer after the model has
its values and dtype, before ``torch.compile``) each distinct layer shape -- chunk, head dim,
state size, heads per group, dtype -- is checked once per process (``scan_kernel_failure``): the
whole chunked scan on a small problem of that shape (``CHECK_CHUNKS`` chunks, an initial state, a
gradient for the final state), with the kernels and with the PyTorch path, forward and backward, under
*every* (tile, warps) the autotuner may pick for it (``ssd_diagonal.kernel_choices``: it picks by
speed, per shape, so any of them may be the one a run gets). The kernels pass when every output
and gradient agrees within ``tolerance`` of the largest magnitude: the two paths compute the same
function and differ only in the order of their roundings, while a misread layout or a broken
instruction is off by the size of the numbers themselves. Compiling the kernels is most of the
check's cost, and the run would compile them anyway.

What happens when they fail:

- ``auto``: the layers of that shape run the PyTorch scan instead, and the run says once which
  check failed and why (the same function, slower);
- ``triton`` (asked for by name): the run stops with a ConfigError saying so.

Under data, tensor or pipeline parallelism every rank checks and the verdicts are combined (a
max over the world group): if any rank's kernels failed, every rank runs PyTorch, so the ranks
never compute the same layers two ways.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from meshlm.errors import ConfigError
from meshlm.kernels import triton_installed
from meshlm.models.ssd_fast import ssd_chunked_scan_fast

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Largest allowed |kernels - PyTorch| over the largest |PyTorch| of each output and gradient. bf16
and fp16 tiles enter the matmuls rounded, at different points on the two paths (bf16: 8 bits,
2^-8 = 0.4% an operand; measured up to 0.9% in the interpreter); a failure is off by order one.
fp32 where the run allows TF32 (``precision.tf32``): ``TF32_TOLERANCE``, 10-bit operands."""
TF32_TOLERANCE = 1e-2


def tolerance(dtype: torch.dtype) -> float:
    """``TOLERANCE`` of ``dtype`` under this process's TF32 switch (both paths multiply fp32 in TF32 then)."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return TF32_TOLERANCE
    return TOLERANCE[dtype]


CHECK_CHUNKS = 16
"""Chunks of the check's sequence: each after the first reads the state the earlier ones leave (the
off-diagonal blocks). A multiple of 16, as a run's chunk count usually is (4096 / 128 = 32): Triton
specializes integer arguments on divisibility by 16, so the kernels the check compiles are the ones
a run's calls then reuse rather than compile again."""
CHECK_GROUPS = 2
"""B/C groups of the check's problem: the backward kernels walk a group's heads and sum over them."""


def _check_inputs(device: torch.device, dtype: torch.dtype, chunk: int, head_dim: int, state: int,
                  heads_per_group: int) -> dict:
    """A small scan problem of the given shape, drawn from a fixed seed: tensors that need gradients."""
    generator = torch.Generator().manual_seed(0)
    heads, length = CHECK_GROUPS * heads_per_group, CHECK_CHUNKS * chunk
    normal = lambda *shape, scale=1.0: torch.randn(*shape, generator=generator) * scale  # noqa: E731
    uniform = lambda *shape, low, high: torch.rand(*shape, generator=generator) * (high - low) + low  # noqa: E731
    return {"x": normal(1, length, heads, head_dim).to(device, dtype),
            "dt": uniform(1, length, heads, low=0.01, high=0.11).to(device),
            "A": -uniform(heads, low=0.5, high=1.5).to(device),
            "B": normal(1, length, CHECK_GROUPS, state, scale=state ** -0.5).to(device, dtype),
            "C": normal(1, length, CHECK_GROUPS, state, scale=state ** -0.5).to(device, dtype),
            "initial_state": normal(1, heads, head_dim, state, scale=0.1).to(device)}


def _scan_outputs(inputs: dict, chunk: int, use_triton: bool, kernel_config) -> dict[str, torch.Tensor]:
    """y, the final state and every input's gradient, for fixed output gradients."""
    leaves = {name: tensor.detach().clone().requires_grad_(True) for name, tensor in inputs.items()}
    y, final_state = ssd_chunked_scan_fast(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
                                           leaves["initial_state"], use_triton=use_triton, kernel_config=kernel_config)
    generator = torch.Generator().manual_seed(1)
    grad_y = torch.randn(y.shape, generator=generator).to(y.device, y.dtype)
    grad_final = torch.randn(final_state.shape, generator=generator).to(final_state.device, final_state.dtype)
    torch.autograd.backward((y, final_state), (grad_y, grad_final))
    outputs = {"y": y.detach(), "final state": final_state.detach()}
    outputs.update({f"d{name}": leaf.grad for name, leaf in leaves.items()})
    return outputs


@functools.cache
def scan_kernel_failure(device: torch.device, dtype: torch.dtype, chunk: int, head_dim: int, state: int,
                        heads_per_group: int) -> str | None:
    """Why the Triton scan is wrong for this shape on ``device`` (module docstring), or None when it
    agrees with the PyTorch scan under every kernel choice. Cached per process; never raises."""
    from meshlm.kernels import ssd_diagonal

    with torch.enable_grad():
        return _first_failure(ssd_diagonal, device, dtype, chunk, head_dim, state, heads_per_group)


def _first_failure(ssd_diagonal, device, dtype, chunk, head_dim, state, heads_per_group) -> str | None:
    inputs = _check_inputs(device, dtype, chunk, head_dim, state, heads_per_group)
    expected = _scan_outputs(inputs, chunk, use_triton=False, kernel_config=(None, None))
    shape = f"chunk {chunk}, head dim {head_dim}, state {state}, {heads_per_group} heads a group, {dtype}"
    for tile, warps in ssd_diagonal.kernel_choices(chunk, device.type == "cuda"):
        choice = "" if tile is None else f", tile {tile} x {warps} warps"
        try:
            actual = _scan_outputs(inputs, chunk, use_triton=True, kernel_config=(tile, warps))
        except Exception as error:  # noqa: BLE001 -- a compiler or launch failure: the kernels cannot run here
            first_line = (str(error).strip().splitlines() or [""])[0]
            return f"the kernels raised {type(error).__name__} ({first_line}) at {shape}{choice}"
        for name, reference in expected.items():
            scale = reference.abs().max().item() or 1.0
            error = (actual[name].float() - reference.float()).abs().max().item() / scale
            if not error <= tolerance(dtype):  # NaN fails too
                return (f"{name} differs from the PyTorch scan by {error:.2g} of its largest value "
                        f"(allowed {tolerance(dtype):g}) at {shape}{choice}")
    return None


def choose_scan_kernels(model: torch.nn.Module, device: torch.device, group=None, reduce_max: Callable | None = None,
                        check: Callable = scan_kernel_failure) -> str | None:
    """Check the Triton scan for every Mamba-2 layer of ``model`` that would run it (module
    docstring) and move the layers whose shape fails to the PyTorch scan; returns what to tell the
    user (None when nothing changed). ``group``, ``reduce_max``: where several processes run the
    model, the world group and the run's all-reduce (max), so all of them decide alike.
    A failure under ``model.mamba_scan=triton`` raises ConfigError."""
    from meshlm.kernels import ssd_diagonal
    from meshlm.models.mamba2 import CHUNKED_SCANS, Mamba2Mixer

    layers: dict[tuple, list[Mamba2Mixer]] = {}  # by the arguments of ``check``: one check per shape
    for module in model.modules():
        if not isinstance(module, Mamba2Mixer):
            continue
        named = module.chunked_scan is CHUNKED_SCANS["triton"]
        if not named and not (module.chunked_scan is CHUNKED_SCANS["auto"] and device.type == "cuda"
                              and triton_installed()):
            continue  # the PyTorch or reference scan, or auto off CUDA: no kernels to check
        dtype = module.in_proj.weight.dtype
        if not ssd_diagonal.supported(module.chunk_size, module.head_dim, module.state_size, dtype):
            continue  # auto runs PyTorch for these shapes; triton refuses them at the first call
        shape = (device, dtype, module.chunk_size, module.head_dim, module.state_size,
                 module.num_heads // module.num_groups)
        layers.setdefault(shape, []).append(module)
    checked = {shape: check(*shape) for shape in layers}
    failures = {shape: reason for shape, reason in checked.items() if reason is not None}
    if group is not None and reduce_max is not None and group.size > 1:
        # one flag per process; the shapes are the same on every rank holding such layers
        failed = torch.tensor([float(bool(failures))], device=group.device)
        reduce_max(failed, group)
        if failed.item() and not failures:
            failures = {shape: "the kernels failed their check on another process of this run" for shape in checked}
    if not failures:
        return None
    moved = 0
    for shape, reason in failures.items():
        for module in layers[shape]:
            if module.chunked_scan is CHUNKED_SCANS["triton"]:
                raise ConfigError(f"model.mamba_scan=triton, but the Triton SSD kernels fail their check on {device}: "
                                  f"{reason}; use model.mamba_scan=auto (the PyTorch scan where they fail) or "
                                  "model.mamba_scan=pytorch.")
            module.chunked_scan = CHUNKED_SCANS["pytorch"]
            moved += 1
    reason = next(iter(failures.values()))
    return (f"the Triton SSD kernels fail their check on {device} ({reason}); {moved} Mamba-2 layer(s) run the "
            "PyTorch scan instead (the same function, slower). Set model.mamba_scan=pytorch to skip the check.")


__all__ = ["TOLERANCE", "choose_scan_kernels", "scan_kernel_failure", "tolerance"]
