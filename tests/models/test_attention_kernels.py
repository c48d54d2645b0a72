"""model.attention_kernel: the SDPA kernel attention prefers (meshlm/models/attention_kernels.py).

The kernels themselves run only on a GPU (tests/gpu/test_fused_paths.py compares each with the
explicit softmax there, and checks which one ran); here: the order each choice asks for, by device
and GPU generation; that it is set process-wide without switching kernels on or off; and that bad
values and context parallelism are refused. (tests/training/test_trainer.py: the trainer sets it.)
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

import meshlm.models.attention_kernels as kernels
from meshlm.config import RunConfig, load_run_config
from meshlm.errors import ConfigError
from meshlm.models.config import TRAINING_ONLY_FIELDS, ModelConfig

CUDA = torch.device("cuda", 0)
ALL = {SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH}


@pytest.fixture
def gpu_generation(monkeypatch):
    """Pretend to be on a GPU of the given compute capability major."""
    def set_major(major: int):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    return set_major


@pytest.mark.parametrize("major, first", [(9, SDPBackend.CUDNN_ATTENTION), (8, None), (10, None), (12, None)])
def test_auto_puts_cudnn_first_on_hopper_only(gpu_generation, major, first):
    gpu_generation(major)
    order = kernels.preferred_order("auto", CUDA)
    if first is None:
        assert order is None  # PyTorch's own order
    else:
        assert order[0] == first and set(order) == ALL and len(order) == 4


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "efficient", "math"])
@pytest.mark.parametrize("major", [8, 9])
def test_a_named_kernel_goes_first_and_the_rest_follow_torch(gpu_generation, kernel, major):
    gpu_generation(major)
    order = kernels.preferred_order(kernel, CUDA)
    assert order[0] == kernels.BACKENDS[kernel] and set(order) == ALL and len(order) == 4
    rest = [backend for backend in (kernels.BACKENDS[name] for name in kernels.TORCH_ORDER)
            if backend != order[0]]
    assert order[1:] == rest


@pytest.mark.parametrize("kernel", ["auto", "flash", "cudnn", "efficient", "math"])
def test_a_cpu_keeps_torchs_own_choice(kernel):
    assert kernels.preferred_order(kernel, torch.device("cpu")) is None


def test_unknown_kernels_and_old_torch(monkeypatch):
    with pytest.raises(ValueError, match="attention kernel 'fast' is not one of auto, flash"):
        kernels.preferred_order("fast", CUDA)
    monkeypatch.setattr(kernels, "PRIORITY_SUPPORTED", False)
    assert kernels.preferred_order("cudnn", CUDA) is None


@pytest.fixture
def restored_priority():
    """Give the process's SDPA priority order back as it was."""
    before = torch._C._get_sdp_priority_order()
    yield
    torch._C._set_sdp_priority_order(before)


def test_the_order_is_set_for_the_process_without_switching_kernels(restored_priority):
    switches = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    names = kernels.set_priority_order([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION])
    assert names == ["cudnn", "flash", "efficient", "math"]
    assert torch._C._get_sdp_priority_order()[:2] == [int(SDPBackend.CUDNN_ATTENTION),
                                                       int(SDPBackend.FLASH_ATTENTION)]
    assert len(set(torch._C._get_sdp_priority_order())) == len(torch._C._get_sdp_priority_order())
    assert switches == (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
                        torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())


def test_putting_an_order_into_effect_runs_end_to_end(restored_priority, monkeypatch):
    """The whole of prefer_attention_kernel as on a GPU (its first tiny SDPA call, then the order),
    here with the CPU made to ask for one."""
    monkeypatch.setattr(kernels, "preferred_order", lambda kernel, device: [SDPBackend.MATH])
    before = torch._C._get_sdp_priority_order()
    names = kernels.prefer_attention_kernel("math", torch.device("cpu"))
    expected = [int(SDPBackend.MATH)] + [code for code in before if code != int(SDPBackend.MATH)]
    assert torch._C._get_sdp_priority_order() == expected
    by_code = {int(backend): name for name, backend in kernels.BACKENDS.items()}
    assert names == [by_code[code] for code in expected if code in by_code] and names[0] == "math"


def test_a_cpu_run_leaves_the_order_alone(restored_priority):
    before = torch._C._get_sdp_priority_order()
    assert kernels.prefer_attention_kernel("cudnn", torch.device("cpu")) is None
    assert torch._C._get_sdp_priority_order() == before


def test_bad_values_and_context_parallelism_are_refused():
    with pytest.raises(ConfigError, match="model.attention_kernel='fast' is not one of auto, flash, cudnn"):
        ModelConfig(attention_kernel="fast").validate()
    with pytest.raises(ConfigError, match=r"model.attention_kernel='cudnn' has no effect under context parallelism "
                                          r"\(parallel.cp=2"):
        load_run_config(None, ["model.attention_kernel=cudnn", "parallel.cp=2"]).validate()
    assert isinstance(load_run_config(None, ["model.attention_kernel=auto", "parallel.cp=2"]), RunConfig)


def test_the_kernel_is_a_training_only_field():
    """A checkpoint may be resumed under another kernel: the function is the same."""
    assert "attention_kernel" in TRAINING_ONLY_FIELDS
