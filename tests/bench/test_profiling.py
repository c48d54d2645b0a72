"""bench/profiling.py: one step under torch.profiler, its top operators and the parts of the step."""

import time

import torch

from types import SimpleNamespace

from torch.autograd import DeviceType

from bench.profiling import matches, profile_step, region_times
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel


def test_a_mark_is_a_whole_name_or_a_start():
    assert matches("_ChunkedScan", "_ChunkedScan") and not matches("_ChunkedScan", "_ChunkedScanBackward")
    assert matches("Optimizer.step#*", "Optimizer.step#AdamW.step") and not matches("Optimizer.step#*", "Optimizer")
    # an autograd function's backward, named exactly, is not also taken inside the engine's wrapper event
    assert not matches("_ChunkedScanBackward", "autograd::engine::evaluate_function: _ChunkedScanBackward")


def test_a_gpu_profile_counts_the_optimizer_range_once():
    """On a GPU the ``Optimizer.step#...`` range is also on the GPU's timeline, as a user annotation
    spanning the kernels the CPU range already holds (session 19's dense profile: 8.8 ms twice)."""
    def event(key, ms, device_type=DeviceType.CPU, annotation=False):
        return SimpleNamespace(key=key, device_time_total=ms * 1e3, device_type=device_type,
                               is_user_annotation=annotation)
    averages = [event("Optimizer.step#AdamW.step", 8.8, annotation=True),
                event("Optimizer.step#AdamW.step", 8.6, DeviceType.CUDA, annotation=True),
                event("aten::_fused_adamw_", 8.5), event("aten::_scaled_dot_product_cudnn_attention", 20.0)]
    assert region_times(averages, "device_time_total") == {"attention": 20.0, "optimizer": 8.8}


def test_an_eager_hybrid_step_is_split_into_its_parts():
    """The tiny hybrid's eager step on CPU: every part it has shows up, none longer than the step."""
    config = ModelConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, pattern="M-*-", ffn_hidden_size=64,
                         mamba_head_dim=16, mamba_state_size=16, mamba_num_groups=1, mamba_chunk_size=8)
    model = LanguageModel(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids, input_ids, return_logits=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    started = time.perf_counter()
    profile = profile_step(step, torch.device("cpu"), top=4)
    wall_ms = (time.perf_counter() - started) * 1e3
    assert set(profile["regions_ms"]) == {"loss_head", "optimizer", "attention", "ssd_scan", "mamba_conv", "gated_norm"}
    assert all(0 < ms <= wall_ms for ms in profile["regions_ms"].values()), (profile["regions_ms"], wall_ms)
    assert len(profile["top"]) == 4 and profile["measured"] == "self_cpu_time_total"
