"""The Triton SSD scan's check on the device (meshlm/models/scan_kernels.py): it passes the kernels
as they are, catches a kernel that computes wrong numbers or raises under any autotuner choice, and
moves the failing layers to the PyTorch scan -- on every rank of a run alike."""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")
import meshlm.kernels.ssd_diagonal as kernels  # noqa: E402
from meshlm.errors import ConfigError  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402
from meshlm.models.mamba2 import CHUNKED_SCANS, Mamba2Mixer  # noqa: E402
from meshlm.models.scan_kernels import choose_scan_kernels, scan_kernel_failure  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
"""Only named, for the decision (auto checks the kernels on CUDA); the checks here are injected."""


@pytest.fixture(autouse=True)
def fresh_verdicts():
    scan_kernel_failure.cache_clear()
    yield
    scan_kernel_failure.cache_clear()


@pytest.mark.parametrize("dtype,chunk,head_dim,state,heads_per_group", [
    (torch.float32, 16, 16, 16, 1), (torch.bfloat16, 16, 16, 16, 1),
    (torch.bfloat16, 32, 16, 32, 3),  # the larger shape in the dtype training runs it in (40 s interpreted)
])
def test_the_kernels_pass_their_check(dtype, chunk, head_dim, state, heads_per_group):
    assert scan_kernel_failure(CPU, dtype, chunk, head_dim, state, heads_per_group) is None


def test_a_kernel_computing_wrong_outputs_fails(monkeypatch):
    original = kernels.diagonal_forward

    def off_by_a_little(*args, **kwargs):  # 10% of the largest output: far beyond rounding
        y = original(*args, **kwargs)
        return y + 0.1 * y.abs().max()

    monkeypatch.setattr(kernels, "diagonal_forward", off_by_a_little)
    reason = scan_kernel_failure(CPU, torch.bfloat16, 16, 16, 16, 2)
    assert reason.startswith("y differs from the PyTorch scan by 0.1") and "allowed 0.05" in reason
    assert "chunk 16, head dim 16, state 16, 2 heads a group, torch.bfloat16" in reason


def test_a_kernel_computing_wrong_gradients_fails(monkeypatch):
    original = kernels.diagonal_backward

    def doubled_grad_B(*args, **kwargs):
        grad_x, grad_B, grad_C, grad_cs, weight_terms, grad_dt = original(*args, **kwargs)
        return grad_x, 2 * grad_B, grad_C, grad_cs, weight_terms, grad_dt

    monkeypatch.setattr(kernels, "diagonal_backward", doubled_grad_B)
    assert scan_kernel_failure(CPU, torch.float32, 16, 16, 16, 2).startswith("dB differs from the PyTorch scan")


def test_a_kernel_that_raises_fails_and_the_check_does_not(monkeypatch):
    def no_image(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device\nmore detail")

    monkeypatch.setattr(kernels, "entering_states_backward", no_image)
    reason = scan_kernel_failure(CPU, torch.float32, 16, 16, 16, 1)
    assert reason.startswith("the kernels raised RuntimeError (no kernel image is available for execution on the "
                             "device) at chunk 16")


def test_every_autotuner_choice_is_checked(monkeypatch):
    """A run may get any of the tuned (tile, warps): one wrong choice among them fails the check."""
    assert kernels.kernel_choices(128, on_cuda=True) == [(32, 4), (32, 8), (64, 4), (64, 8)]
    assert kernels.kernel_choices(128, on_cuda=False) == [(None, None)]
    assert kernels.kernel_choices(96, on_cuda=True) == [(None, None)]  # 96 takes no 64-row tile: never tuned
    original = kernels.diagonal_forward

    def wrong_with_small_tiles(u, C, B, cs, start_states=None, tile=None, warps=None):
        y = original(u, C, B, cs, start_states, tile, warps)
        return -y if tile == 16 else y

    monkeypatch.setattr(kernels, "diagonal_forward", wrong_with_small_tiles)
    monkeypatch.setattr(kernels, "kernel_choices", lambda chunk, on_cuda: [(32, 4), (16, 8)])
    reason = scan_kernel_failure(CPU, torch.float32, 32, 16, 16, 1)
    assert reason.startswith("y differs") and reason.endswith("torch.float32, tile 16 x 8 warps")


def hybrid_model(mamba_scan="auto"):
    config = ModelConfig(hidden_size=32, pattern="M*M-", num_attention_heads=2, mamba_head_dim=16,
                         mamba_state_size=16, mamba_num_groups=1, mamba_chunk_size=16, vocab_size=64,
                         mamba_scan=mamba_scan)
    return LanguageModel(config)


def scans(model):
    return [module.chunked_scan for module in model.modules() if isinstance(module, Mamba2Mixer)]


def test_failing_kernels_move_the_layers_to_the_pytorch_scan():
    model, asked = hybrid_model(), []

    def failing(*shape):
        asked.append(shape)
        return "y differs (a reason)"

    note = choose_scan_kernels(model, CUDA, check=failing)
    assert asked == [(CUDA, torch.float32, 16, 16, 16, 4)]  # one check per shape, not per layer
    assert scans(model) == [CHUNKED_SCANS["pytorch"]] * 2
    assert note.startswith("the Triton SSD kernels fail their check on cuda (y differs (a reason)); 2 Mamba-2 "
                           "layer(s) run the PyTorch scan instead")


def test_passing_kernels_and_runs_without_kernels_change_nothing():
    model = hybrid_model()
    assert choose_scan_kernels(model, CUDA, check=lambda *shape: None) is None
    assert scans(model) == [CHUNKED_SCANS["auto"]] * 2

    def never(*shape):
        raise AssertionError("auto off CUDA, or the PyTorch scan, runs no kernels: nothing to check")

    assert choose_scan_kernels(model, CPU, check=never) is None
    assert choose_scan_kernels(hybrid_model("pytorch"), CUDA, check=never) is None


def test_kernels_asked_for_by_name_that_fail_stop_the_run():
    with pytest.raises(ConfigError, match="model.mamba_scan=triton, but the Triton SSD kernels fail their check on "
                                          "cpu: broken; use model.mamba_scan=auto"):
        choose_scan_kernels(hybrid_model("triton"), CPU, check=lambda *shape: "broken")


def decide_on_rank():
    """Rank 1's kernels fail, rank 0's pass: both must run the PyTorch scan."""
    from meshlm.parallel.collectives import all_reduce_
    from meshlm.parallel.groups import group_of

    rank = dist.get_rank()
    world = group_of(dist.group.WORLD, "world", CPU)
    model = hybrid_model()
    note = choose_scan_kernels(model, CUDA, world, lambda tensor, group: all_reduce_(tensor, group, op="max"),
                               check=lambda *shape: "rank 1's failure" if rank == 1 else None)
    return note, [scan is CHUNKED_SCANS["pytorch"] for scan in scans(model)]


def test_every_rank_decides_alike():
    (note_0, moved_0), (note_1, moved_1) = run_distributed(decide_on_rank, 2)
    assert moved_0 == moved_1 == [True, True]
    assert "failed their check on another process of this run" in note_0 and "rank 1's failure" in note_1
