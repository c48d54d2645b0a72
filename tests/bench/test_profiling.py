"""bench/profiling.py: one step under torch.profiler, its top operators and the parts of the step."""

import gzip
import os
import time

import torch

from types import SimpleNamespace

from torch.autograd import DeviceType

from bench.profiling import matches, profile_step, region_times, save_inductor_code
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


def test_inductor_code_keeps_the_graph_modules_generated_in_the_run(tmp_path):
    """Generated graph modules (they define ``call``) written since the run began, oldest first, in
    one gzip file; not a module from an older run, nor a kernel file without ``call``."""
    root, started = tmp_path / "cache", time.time()
    modules = {"ab/old.py": "def call(args):\n    old_kernel.run()\n",
               "cd/first.py": "triton_poi_fused_mul_0 = async_compile.triton('...')\ndef call(args):\n    pass\n",
               "ef/second.py": "class Runner:\n    def call(self, args):\n        triton_red_fused_sum_1.run()\n",
               "gh/kernel.py": "@triton.jit\ndef triton_poi_fused_mul_0(in_ptr0):\n    pass\n"}
    for offset, (name, text) in enumerate(modules.items()):
        path = root / name
        path.parent.mkdir(parents=True)
        path.write_text(text)
        stamp = started - 3600 if name == "ab/old.py" else started + offset
        os.utime(path, (stamp, stamp))
    out = tmp_path / "out" / "inductor.py.gz"
    assert save_inductor_code(out, started, root) == 2
    with gzip.open(out, "rt") as handle:
        text = handle.read()
    assert text.startswith("# Inductor's generated graph modules, 2 of them")
    assert text.index("# ===== cd/first.py") < text.index("triton_poi_fused_mul_0") < text.index("# ===== ef/second.py")
    assert "old_kernel" not in text and "@triton.jit" not in text
    assert os.listdir(out.parent) == ["inductor.py.gz"]  # written under another name, then renamed
    assert save_inductor_code(out, started, tmp_path / "missing") == 0  # nothing compiled: an empty record
