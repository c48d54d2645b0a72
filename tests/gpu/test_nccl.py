"""A world of one NCCL process trains like a plain process: the smoke test of the NCCL backend.

NCCL refuses two ranks on one GPU, so the multi-process layouts of this tier run over gloo
(tests/gpu/test_layouts.py); this test makes sure NCCL itself works in the installed torch and
that meshlm runs under it. One spawned process joins an NCCL process group on ``cuda:0``
(``run_distributed(backend="nccl")``), checks that NCCL's all-reduce and all-gather move CUDA
tensors (in a world of one: sum and gather of one copy), and runs the tiny dense model's trainer
for 5 steps at dp1 with the process group initialized, as under ``torchrun --nproc-per-node 1``;
losses, gradient norms and parameters must equal a run of the same config in this process,
without any process group (relative 1e-5: the same GPU, fp32 without TF32).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.gpu.devices import require_cuda
from tests.gpu.support import HELPERS, SIZE, on_device
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed


def nccl_smoke(blend: str, run_dir: str, overrides: list[str]) -> dict:
    """In the spawned NCCL rank: the backend's own collectives on CUDA tensors, then a training run."""
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    summed = torch.arange(4.0, device="cuda:0")
    dist.all_reduce(summed)
    gathered = torch.empty(4, device="cuda:0")
    dist.all_gather_into_tensor(gathered, torch.arange(4.0, device="cuda:0"))
    torch.cuda.synchronize()
    assert summed.tolist() == gathered.tolist() == [0.0, 1.0, 2.0, 3.0]
    return HELPERS.train_once(Path(blend), Path(run_dir), overrides)


def test_a_world_of_one_nccl_process_trains_like_a_plain_process(gpu_device, tmp_path):
    require_cuda(gpu_device, "NCCL")
    blend = write_corpus(tmp_path / "corpus")
    overrides = [*HELPERS.MODELS["dense"], *SIZE, *on_device(gpu_device, "fp32")]
    plain = HELPERS.train_once(blend, tmp_path / "plain", overrides)
    [under_nccl] = run_distributed(nccl_smoke, 1, str(blend), str(tmp_path / "nccl"), overrides,
                                   backend="nccl", cuda_device=gpu_device.index, timeout_s=300)
    HELPERS.assert_same_run(under_nccl, plain, "a world of one NCCL process")
