"""The multi-process layouts on CUDA tensors equal one process on the same GPU.

Spawned ranks (``tests.helpers.distributed.run_distributed`` with ``cuda_device=0``) all put
their tensors on the one GPU, ``cuda:0``, and join a gloo process group: NCCL refuses two ranks
on one device, while gloo moves CUDA tensors through the host. Every tensor a collective moves
must then be a CUDA tensor (``meshlm/parallel/plain_collectives.py`` refuses any other), so a
tensor left on the CPU -- a loss sum, a pipeline message buffer, a token count -- fails here as
it would under NCCL on a cluster, where the CPU suite cannot see it. (``parallel.backend=gloo``
says so to the layout checks, which would otherwise assume NCCL on CUDA.)

The runs are those of tests/training/test_parallel_training.py (``train_once``, the tiny
counting corpus, 5 steps of 4 micro-batches, lr 5e-4, Adam eps 1e-6, ``check_collectives`` on)
at the GPU tier's size (hidden 64, 4 blocks, sequences of 32), in fp32 with TF32 off:

- world 4: tp2 x dp2 with sequence parallelism, for the dense and the hybrid (Mamba + attention)
  model; the dense run saves a checkpoint at step 3; and the dense model with LoRA adapters
  (``model.lora_rank=4``: the base frozen, the adapters cut like their weights) with ZeRO-1 too;
  and the MoE model with Muon (``optim.optimizer=muon``: TP and ETP shards gathered whole for
  Newton-Schulz) at tp2 x dp2 x ep2 + SP with ZeRO-1 (Distributed Muon's DP gather);
- world 2: the hybrid at pp2 x vp2 (interleaved 1F1B: point-to-point messages of CUDA
  activations), the dense and hybrid models at cp2 (ring attention and the Mamba state handed
  along the CP ring), the MoE model at ep2 (the expert token exchange), the dense model at dp2
  with ZeRO-1 (``parallel.zero_stage=1``) and at dp2 with ZeRO-3; and the step-3 checkpoint of
  the tp2 x dp2 run resumed at dp2 with ZeRO-1, and in one process.

Every step's loss and global gradient norm and the validation losses must equal the
single-process run on the same device (relative error <= 1e-5, the CPU tests' tolerance: both
sides are fp32 and differ only in summation order), and the final full parameters within 1e-4
(``PARAM_TOLERANCE``). A resumed run must reproduce steps 4-5 of the uninterrupted run at its layout.

Why 1e-4 for the parameters: on the first GPU run (an H200, 2026-11-27) every loss and gradient
norm agreed to 1e-5 but the hybrid cp2 run's ``conv1d.bias`` ended 4.9e-5 away. cuBLAS and cuDNN
choose their kernels, and so their summation order, by shape, and a rank at cp2 holds half the
sequence; a bias gradient is a sum of many terms that nearly cancel, so its last bits move, and
Adam divides each step's update by the gradient's own running size, so a bias element with a
gradient near zero keeps that difference at full relative size through the five steps.

Each layout is its own spawned call and its own test (``Layouts`` runs each once and keeps the
result for the tests that reuse it), so that on a first GPU run one broken layout fails its own
test and the others still report.

**bf16 over CP.** The dense and hybrid models also train at cp2 in bf16 (ring attention's fused
blocks and the Mamba CP scan in bf16); their losses must stay within the bf16 tolerance of
tests/gpu/test_model_kinds.py (2e-2 relative) of the fp32 single-process run.
"""

from __future__ import annotations

import shutil

import pytest

from tests.gpu.support import HELPERS, HYBRID, SIZE, losses_in_order, on_device
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed

MODELS = {"dense": HELPERS.MODELS["dense"], "hybrid": HYBRID, "moe": HELPERS.MODELS["moe"],
          "dense lora": [*HELPERS.MODELS["dense"], "model.lora_rank=4", "model.lora_alpha=8", "optim.eps=1e-4"],
          "moe muon": [*HELPERS.MODELS["moe"], "optim.optimizer=muon", "optim.lr=2e-3"]}
GLOO = ["parallel.backend=gloo"]
TP2_DP2_SP = [*GLOO, "parallel.tp=2", "parallel.dp=2", "parallel.sp=true"]
LAYOUTS = {  # name -> (world, model, layout)
    "dense tp2xdp2 sp": (4, "dense", [*TP2_DP2_SP, "train.save_every=3"]),
    "hybrid tp2xdp2 sp": (4, "hybrid", TP2_DP2_SP),
    "hybrid pp2 vp2": (2, "hybrid", [*GLOO, "parallel.pp=2", "parallel.vp=2"]),
    "dense cp2": (2, "dense", [*GLOO, "parallel.cp=2"]),
    "hybrid cp2": (2, "hybrid", [*GLOO, "parallel.cp=2"]),
    "moe ep2": (2, "moe", [*GLOO, "parallel.dp=2", "parallel.ep=2"]),
    "dense dp2 zero1": (2, "dense", [*GLOO, "parallel.dp=2", "parallel.zero_stage=1"]),
    "dense dp2 zero3": (2, "dense", [*GLOO, "parallel.dp=2", "parallel.zero_stage=3"]),
    "dense lora tp2xdp2 sp zero1": (4, "dense lora", [*TP2_DP2_SP, "parallel.zero_stage=1"]),
    "moe muon tp2xdp2 sp zero1": (4, "moe muon", [*TP2_DP2_SP, "parallel.ep=2", "parallel.zero_stage=1"]),
}
BF16_LAYOUTS = {"dense cp2 bf16": "dense cp2", "hybrid cp2 bf16": "hybrid cp2"}
"""The cp2 layouts again in bf16: name -> the fp32 layout's name."""
SAVED, RESUMED = "dense tp2xdp2 sp", "resumed dp2 zero1"
PARAM_TOLERANCE = 1e-4
"""Relative error of the final parameters (module docstring: why above the CPU's 1e-5)."""
BF16_TOLERANCE = 2e-2
"""Relative loss gap of a bf16 run from fp32 (tests/gpu/test_model_kinds.py explains the figure)."""


def overrides(model: str, layout: list[str], device, dtype: str = "fp32") -> list[str]:
    return [*MODELS[model], *SIZE, *on_device(device, dtype), *layout]


class Layouts:
    """The module's runs, each made once on first use: single-process references and layouts."""

    def __init__(self, root, device):
        self.root, self.device = root, device
        self.blend = write_corpus(root / "corpus")
        self.singles, self.by_rank = {}, {}

    def single(self, model: str) -> dict:
        if model not in self.singles:
            self.singles[model] = HELPERS.train_once(self.blend, self.root / f"single {model}",
                                                     overrides(model, [], self.device))
        return self.singles[model]

    def spawned(self, name: str, world: int, run_overrides: list[str]) -> list[dict]:
        """Run ``name`` in ``world`` ranks sharing the device; its results by rank."""
        if name not in self.by_rank:
            results = run_distributed(HELPERS.train_runs, world, str(self.blend), str(self.root),
                                      [(name, run_overrides)], timeout_s=600,
                                      cuda_device=self.device.index if self.device.type == "cuda" else None)
            self.by_rank[name] = [result[name] for result in results]
        return self.by_rank[name]

    def layout(self, name: str, dtype: str = "fp32") -> list[dict]:
        world, model, layout = LAYOUTS[name]
        return self.spawned(name if dtype == "fp32" else f"{name} {dtype}", world,
                            overrides(model, layout, self.device, dtype))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, gpu_device) -> Layouts:
    return Layouts(tmp_path_factory.mktemp("gpu-layouts"), gpu_device)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_on_gpu_equals_one_process(layouts, name):
    expected = layouts.single(LAYOUTS[name][1])
    for rank, result in enumerate(layouts.layout(name)):
        HELPERS.assert_same_run(result, expected, f"{name} rank {rank}", PARAM_TOLERANCE)


@pytest.mark.parametrize("name", list(BF16_LAYOUTS))
def test_bf16_context_parallel_follows_fp32(layouts, name):
    fp32_name = BF16_LAYOUTS[name]
    reference = layouts.single(LAYOUTS[fp32_name][1])
    for rank, result in enumerate(layouts.layout(fp32_name, "bf16")):
        for key in ("losses", "val_losses"):
            actual, expected = losses_in_order(result, key), losses_in_order(reference, key)
            gaps = [abs(a - e) / abs(e) for a, e in zip(actual, expected)]
            assert len(actual) == len(expected) and max(gaps) <= BF16_TOLERANCE, (name, rank, key, actual, expected)


def test_checkpoint_from_tp2_dp2_resumes_at_dp2_zero1_and_in_one_process(layouts, tmp_path):
    layouts.layout(SAVED)  # writes its step-3 checkpoint
    saved = layouts.root / SAVED / "checkpoints" / "step_3"
    shutil.copytree(saved, layouts.root / RESUMED / "checkpoints" / "step_3", dirs_exist_ok=True)
    uninterrupted = layouts.layout("dense dp2 zero1")
    resumed = layouts.spawned(RESUMED, 2, overrides("dense", LAYOUTS["dense dp2 zero1"][2], layouts.device))
    for rank, (result, expected) in enumerate(zip(resumed, uninterrupted)):
        HELPERS.assert_same_run(result, HELPERS.continued(expected), f"resumed at dp2 zero1 rank {rank}",
                                PARAM_TOLERANCE)
    run_dir = tmp_path / "resumed single"
    shutil.copytree(saved, run_dir / "checkpoints" / "step_3")
    alone = HELPERS.train_once(layouts.blend, run_dir, overrides("dense", [], layouts.device))
    assert sorted(alone["losses"]) == [4, 5]
    HELPERS.assert_same_run(alone, HELPERS.continued(layouts.single("dense")), "resumed in one process",
                            PARAM_TOLERANCE)
