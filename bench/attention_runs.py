"""What the attention-layer benches share (``softcap``, ``sliding_window``, ``latent_attention``):
their device options, the run's header and how the JSON comes out.

Each runs one layer on one device -- fp32 on a CPU, bf16 on a GPU -- with ``--threads`` CPU
threads, repeats interleaved runs ``--repeats`` times (``bench/timing.py``), prints its results as
JSON and, with ``--out``, writes them there too (atomically).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from meshlm.checkpoint.files import write_json_atomic


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--repeats``, ``--threads``, ``--device`` and ``--out``."""
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")


def run_setting(args) -> tuple[torch.device, torch.dtype, dict]:
    """Set the CPU threads; (the device, its dtype, the results' header naming both)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "threads": args.threads, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__}
    return device, dtype, header


def emit(results: dict, out: Path | None) -> dict:
    """Print ``results`` as JSON and, given ``out``, write them there; returns them."""
    print(json.dumps(results, indent=2))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, results)
    return results


__all__ = ["add_run_options", "emit", "run_setting"]
