"""Build the Triton SSD kernels for a Hopper GPU on any machine: registers and spills per choice.

    python -m bench.ssd_kernel_build [--arch 90] [--chunk 128 --head-dim 64 --state 128] [--dtype bf16]

Triton compiles a kernel to PTX and ``ptxas`` (shipped with Triton's NVIDIA backend) assembles
it for ``sm_<arch>a`` without a GPU, so the kernels of ``meshlm/kernels/ssd_diagonal.py`` can
be checked on this CPU for what the interpreter cannot see: that they compile for the hardware
at all, and how many registers each program uses and how many bytes it spills to local memory
(a spill costs memory traffic in the innermost loop). For each kernel and each choice the
autotuner may make (``TUNED_TILES`` x 4 or 8 warps; the state-passing kernels' one tile), the
shape of the 1B hybrid of ``bench.gpu_throughput`` by default. One JSON object to stdout.

Run it without ``TRITON_INTERPRET`` (the interpreter replaces the kernels by Python functions,
which Triton cannot compile); the test suite runs it in a subprocess for that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

DTYPES = {"bf16": "*bf16", "fp32": "*fp32"}


def ptxas_path() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def build(kernel, pointer_types: dict[str, str], constants: dict, num_warps: int, arch: int) -> dict:
    """Compile ``kernel`` with ``constants`` for ``sm_<arch>a``: {'registers', 'spill_bytes'}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = kernel.arg_names
    signature = {name: pointer_types.get(name, "constexpr" if name in constants else "i32") for name in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as handle:
            handle.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas_path(), f"-arch=sm_{arch}a", "-v", ptx, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else 0}


def plan(args) -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, pointer types, constants, warps) for every kernel and autotuner choice."""
    from meshlm.kernels import SSD_MIN_LOG_DECAY
    from meshlm.kernels import ssd_diagonal as kernels
    run, fp32 = DTYPES[args.dtype], "*fp32"
    shape = {"Q": args.chunk, "P": args.head_dim, "N": args.state, "MIN_DECAY": SSD_MIN_LOG_DECAY, "DOT": "tf32"}
    diagonal = {
        "forward": (kernels._diagonal_forward, {"u_ptr": run, "C_ptr": run, "B_ptr": run, "cs_ptr": fp32,
                                                "H_ptr": run, "y_ptr": run}, {"HAS_STATES": True, "y_stride_p": 1}),
        "backward_sources": (kernels._diagonal_backward_sources,
                             {"u_ptr": run, "dy_ptr": run, "C_ptr": run, "B_ptr": run, "cs_ptr": fp32,
                              "dS_ptr": run, "du_ptr": run, "dB_ptr": fp32, "colsum_ptr": fp32,
                              "weight_terms_ptr": fp32, "dt_ptr": fp32, "ddt_ptr": fp32},
                             # dx and d dt, as the scan runs it; dx's last stride is 1, which Triton specializes
                             {"HAS_STATE_GRADS": True, "INPUT_GRADS": True, "dx_stride_p": 1}),
        "backward_targets": (kernels._diagonal_backward_targets,
                             {"u_ptr": run, "dy_ptr": run, "C_ptr": run, "B_ptr": run, "cs_ptr": fp32,
                              "H_ptr": run, "dC_ptr": fp32, "rowsum_ptr": fp32},
                             {"HAS_STATES": True}),
    }
    builds = [(f"{name} tile {tile} warps {warps}", kernel, types, {**shape, **flags, "TILE": tile}, warps)
              for name, (kernel, types, flags) in diagonal.items()
              for tile in kernels.TUNED_TILES if args.chunk % tile == 0 for warps in (4, 8)]
    passing = {"Q": args.chunk, "P": args.head_dim, "N": args.state, "N_TILE": kernels._state_tile(args.state),
               "DOT": "tf32", "TILE": kernels._tile(args.chunk)}
    builds.append((f"entering_states warps {kernels.STATE_PASSING_WARPS}", kernels._entering_states_kernel,
                   {"u_ptr": run, "B_ptr": run, "cs_ptr": fp32, "initial_ptr": fp32, "out_ptr": run, "final_ptr": fp32},
                   {**passing, "HAS_INITIAL": True}, kernels.STATE_PASSING_WARPS))
    builds.append((f"entering_states_backward warps {kernels.STATE_PASSING_WARPS}",
                   kernels._entering_states_backward_kernel,
                   {"dy_ptr": run, "C_ptr": run, "cs_ptr": fp32, "H_ptr": run, "final_grad_ptr": fp32,
                    "state_grads_ptr": run, "log_terms_ptr": fp32, "initial_grad_ptr": fp32},
                   {**passing, "HAS_FINAL_GRAD": True}, kernels.STATE_PASSING_WARPS))
    return builds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the interpreter's kernels cannot be compiled; unset it.")
    from meshlm.kernels import triton_installed
    if not triton_installed() or not os.path.exists(ptxas_path()):
        parser.error("needs Triton with its NVIDIA backend's ptxas (pip install triton).")
    results = {name: build(kernel, types, constants, warps, args.arch)
               for name, kernel, types, constants, warps in plan(args)}
    print(json.dumps({"bench": "ssd_kernel_build", "arch": f"sm_{args.arch}a", "dtype": args.dtype,
                      "shape": {"chunk": args.chunk, "head_dim": args.head_dim, "state": args.state},
                      "kernels": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
