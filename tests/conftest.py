"""Suite-wide settings: one intra-op thread; Triton's interpreter where there is no GPU.

The tests run tiny models whose ops take microseconds; with several PyTorch threads on a 2-core
machine they spend their time synchronizing threads (measured: test_generate.py 29 s with the
default thread count under load, 3 s with one thread). Spawned multi-process tests set this in
each child too.

Without CUDA, Triton kernels (meshlm/kernels/, tests/kernels/) run in Triton's interpreter. The
variable must be set before Triton is first imported (``triton.jit`` reads it when a kernel is
defined), hence here, before any test module is collected. Two interpreter defects (NumPy 2.4
loop bounds, bf16 ``tl.dot``) are fixed for the suite by tests/helpers/triton_interpreter.py.

A trainer on CUDA sets the process's TF32 switches (``precision.tf32``, in fp32 and bf16 runs
alike); every test gets them back as they were, so that one test's trainer does not change the
precision of a later test's fp32 matmuls (the CUDA tier checks fp32 Triton kernels at 1e-4).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.triton_interpreter import fix_triton_interpreter  # noqa: E402

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
fix_triton_interpreter()


@pytest.fixture(autouse=True)
def restore_tf32_switches():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
