"""The SSD scan and the Mamba-2 block: fast path against the reference path, speed and saved bytes.

    python -m bench.mamba_scan [--seq-lens 1024 4096 16384] [--repeats 3] [--dtype fp32|bf16]

For each sequence length, one layer's forward+backward runs alternately on the two paths
(``model.mamba_scan`` = "pytorch", meshlm/models/ssd_fast.py, and "reference", meshlm/models/ssd.py),
``--repeats`` times each after a warm-up, and the medians are reported:

- ``scan``: the SSD scan alone (x [1, T, H, P], dt, A, B, C with the issue's shapes H=16, P=32,
  N=64, one B/C group, chunk 64): tokens/s of forward+backward, and the bytes of the distinct
  storages autograd keeps for the backward (``torch.autograd.graph.saved_tensors_hooks``), per
  token and as a multiple of the input x's bytes. Target (issue 13): at most 4x on the fast path.
- on a CUDA GPU with Triton installed, a third path, "triton" (the diagonal blocks in
  ``meshlm/kernels/ssd_diagonal.py``), and its speed over the PyTorch path;
- ``block``: the whole Mamba-2 block (pre-norm, mixer, residual; hidden 256, the same heads),
  tokens/s and saved bytes as a multiple of the block input's bytes. Parameters do not count.

Machines here are noisy: the two paths are interleaved and the medians compared within one run.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from bench.timing import interleaved_medians
from meshlm.kernels import triton_installed
from meshlm.models.block import Block
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.ssd import ssd_chunked_scan
from meshlm.models.ssd_fast import ssd_chunked_scan_fast
from tests.helpers.saved_tensors import SavedStorages

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCANS = {"pytorch": ssd_chunked_scan_fast, "reference": ssd_chunked_scan}
if DEVICE.type == "cuda" and triton_installed():  # the Triton kernels run (compiled) on CUDA only
    SCANS["triton"] = partial(ssd_chunked_scan_fast, use_triton=True)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS, HEAD_DIM, STATE, GROUPS, CHUNK, HIDDEN = 16, 32, 64, 1, 64, 256


def scan_inputs(seq_len: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seq_len)
    x = torch.randn(1, seq_len, HEADS, HEAD_DIM, generator=generator).to(dtype)
    dt = torch.rand(1, seq_len, HEADS, generator=generator) * 0.1 + 0.001
    A = -torch.rand(HEADS, generator=generator) * 15 - 1
    B, C = (torch.randn(1, seq_len, GROUPS, STATE, generator=generator).to(dtype) for _ in range(2))
    return [tensor.to(DEVICE).requires_grad_() for tensor in (x, dt, A, B, C)]


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def time_scan(name: str, inputs) -> float:
    synchronize()
    start = time.perf_counter()
    y, final = SCANS[name](*inputs, CHUNK)
    (y.sum() + final.sum()).backward()
    synchronize()
    return time.perf_counter() - start


def scan_saved_bytes(name: str, inputs) -> int:
    with SavedStorages() as saved:
        SCANS[name](*inputs, CHUNK)
    return saved.nbytes


def make_block(scan: str, dtype: torch.dtype) -> Block:
    config = ModelConfig(vocab_size=64, hidden_size=HIDDEN, pattern="M", mamba_head_dim=HEAD_DIM,
                         mamba_state_size=STATE, mamba_num_groups=GROUPS, mamba_chunk_size=CHUNK, mamba_scan=scan)
    torch.manual_seed(0)
    return Block("M", config, 0).to(DEVICE, dtype)


def time_block(block: Block, hidden: torch.Tensor, context) -> float:
    synchronize()
    start = time.perf_counter()
    block(hidden, context).float().sum().backward()
    synchronize()
    return time.perf_counter() - start


def block_saved_bytes(block: Block, hidden: torch.Tensor, context) -> int:
    with SavedStorages({param.untyped_storage().data_ptr() for param in block.parameters()}) as saved:
        block(hidden, context)
    return saved.nbytes


def measure(seq_len: int, repeats: int, dtype: torch.dtype) -> dict:
    inputs = scan_inputs(seq_len, dtype)
    x_bytes = inputs[0].numel() * inputs[0].element_size()
    scan_times = interleaved_medians({name: (lambda name=name: time_scan(name, inputs)) for name in SCANS}, repeats)
    scan = {}
    for name in SCANS:
        saved = scan_saved_bytes(name, inputs)
        scan[name] = {"tokens_per_s": round(seq_len / scan_times[name], 1),
                      "saved_bytes_per_token": round(saved / seq_len, 1),
                      "saved_over_input_bytes": round(saved / x_bytes, 2)}
    scan["speedup"] = round(scan_times["reference"] / scan_times["pytorch"], 2)
    if "triton" in SCANS:
        scan["triton_over_pytorch_speed"] = round(scan_times["pytorch"] / scan_times["triton"], 2)

    hidden = torch.randn(1, seq_len, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    hidden.requires_grad_()
    context = SequenceContext.for_tokens(torch.zeros(1, seq_len, dtype=torch.long, device=DEVICE))
    blocks = {name: make_block(name, dtype) for name in SCANS}
    block_times = interleaved_medians({name: (lambda name=name: time_block(blocks[name], hidden, context))
                                for name in SCANS}, repeats)
    hidden_bytes = hidden.numel() * hidden.element_size()
    block = {}
    for name in SCANS:
        saved = block_saved_bytes(blocks[name], hidden, context)
        block[name] = {"tokens_per_s": round(seq_len / block_times[name], 1),
                       "saved_over_input_bytes": round(saved / hidden_bytes, 2)}
    block["speedup"] = round(block_times["reference"] / block_times["pytorch"], 2)
    if "triton" in SCANS:
        block["triton_over_pytorch_speed"] = round(block_times["pytorch"] / block_times["triton"], 2)
    return {"seq_len": seq_len, "scan": scan, "block": block}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    rows = [measure(seq_len, args.repeats, DTYPES[args.dtype]) for seq_len in args.seq_lens]
    fast_scan_ratio = max(row["scan"]["pytorch"]["saved_over_input_bytes"] for row in rows)
    print(json.dumps({"device": str(DEVICE), "dtype": args.dtype, "shapes": {"heads": HEADS, "head_dim": HEAD_DIM, "state": STATE,
                                                      "groups": GROUPS, "chunk": CHUNK, "hidden": HIDDEN},
                      "threads": torch.get_num_threads(), "rows": rows,
                      "target_scan_saved_over_input_at_most_4": fast_scan_ratio <= 4}, indent=1))


if __name__ == "__main__":
    main()
