"""Each SDPA attention kernel's forward + backward time on one shape, and which one meshlm's
``model.attention_kernel=auto`` runs (meshlm/models/attention_kernels.py).

    python -m bench.attention_kernels [--batch 8 --heads 16 --kv-heads 4 --seq 4096 --head-dim 128]
    python -m bench.attention_kernels --device cpu --seq 256 --batch 1   # the script itself, on a CPU

The default shape is the dense 1B model's of ``bench/gpu_throughput.py`` (micro-batch 8 x 4096
tokens, 16 query heads of 128 over 4 KV heads), causal, bf16 on a GPU. Each kernel is *forced*
(``sdpa_kernel`` with that kernel alone), so a kernel that cannot take the shape reports its error
instead of silently timing another one; then ``auto`` runs as meshlm's trainer sets it
(``prefer_attention_kernel``), and the aten operators it ran are named; the process's order is
given back after. Per kernel: the median of ``--repeats`` timed forward + backward passes
after ``--warmup``, and TFLOP/s counted as FlashAttention's papers do (forward 4 b h s^2 d, halved
for causal; backward 2.5 x forward). ``bench/gpu_throughput.py`` includes this record as
``attention_kernels``, so the choice ``auto`` makes on a GPU rests on a measurement beside the
step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from bench.timing import time_kernel
from meshlm.models.attention import attention_core
from meshlm.models.attention_kernels import PRIORITY_SUPPORTED, prefer_attention_kernel

FORCED = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}
BACKWARD_OVER_FORWARD = 2.5
"""FLOPs of attention's backward over its forward (FlashAttention-2, Dao 2023)."""


class KernelNames(TorchDispatchMode):
    """The aten SDPA operators run under it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True) -> float:
    """Forward + backward FLOPs of one attention call (module docstring)."""
    forward = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    return forward * (1 + BACKWARD_OVER_FORWARD)


def measure(device: torch.device, batch: int = 8, heads: int = 16, kv_heads: int = 4, seq: int = 4096,
            head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, warmup: int = 3, repeats: int = 10) -> dict:
    """The record: shape, and per kernel (forced ones, then ``auto``) milliseconds, TFLOP/s, or its error."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, seq, head_dim, generator=generator).to(device, dtype).requires_grad_()
    key, value = (torch.randn(batch, kv_heads, seq, head_dim, generator=generator).to(device, dtype).requires_grad_()
                  for _ in range(2))
    grad_out = torch.randn(batch, heads, seq, head_dim, generator=generator).to(device, dtype)
    flops = attention_flops(batch, heads, seq, head_dim)

    def forward_backward():
        out = attention_core(query, key, value)
        torch.autograd.grad(out, (query, key, value), grad_out)

    kernels = {}
    choices = [(name, backend) for name, backend in FORCED.items()] + [("auto", None)]
    order = torch._C._get_sdp_priority_order() if PRIORITY_SUPPORTED else None
    for name, backend in choices:
        try:
            if backend is None:  # as meshlm's trainer runs it: its preferred order, nothing switched off
                prefer_attention_kernel("auto", device)
                with KernelNames() as names:
                    forward_backward()
                seconds = time_kernel(forward_backward, device, warmup, repeats)
                ran = sorted(names.names)
            else:
                with sdpa_kernel(backend):
                    seconds = time_kernel(forward_backward, device, warmup, repeats)
                ran = None
        except RuntimeError as error:  # the kernel cannot take this shape or dtype here
            kernels[name] = {"error": str(error).strip().splitlines()[0][:200]}
            continue
        finally:
            if order is not None:
                torch._C._set_sdp_priority_order(order)  # the process's order as it was
        median = statistics.median(seconds)
        kernels[name] = {"ms": round(median * 1e3, 3), "tflops": round(flops / median / 1e12, 1),
                         **({"ran": ran} if ran is not None else {})}
    timed = {name: entry["ms"] for name, entry in kernels.items() if "ms" in entry and name in FORCED}
    return {"shape": {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seq": seq, "head_dim": head_dim,
                      "dtype": str(dtype).removeprefix("torch."), "causal": True},
            "counted": "forward 4bhs^2d/2 (causal) + backward 2.5x forward", "repeats": repeats,
            "kernels": kernels, "fastest": min(timed, key=timed.get) if timed else None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    for name in ("batch", "heads", "kv_heads", "seq", "head_dim", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    record = measure(device, args.batch, args.heads, args.kv_heads, args.seq, args.head_dim,
                     torch.bfloat16 if device.type == "cuda" else torch.float32, args.warmup, args.repeats)
    print(json.dumps({"bench": "attention_kernels", "device": torch.cuda.get_device_name(device)
                      if device.type == "cuda" else "cpu", "torch": torch.__version__, **record}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
