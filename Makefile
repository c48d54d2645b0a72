# The two commands of the README. Each sets up its own virtual environment on a fresh machine:
# torch first, pinned (a CPU build is served from the machine's local index; an unpinned torch
# would pull several GB of CUDA wheels), then the project with its extras.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin

.PHONY: setup test test-gpu test-gpu-image-torch demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(BIN)/python -m pytest tests

# The CUDA tier (tests/gpu) with the machine's own python and torch: no virtual environment, no
# installs (a GPU machine keeps the CUDA torch it has); meshlm imports from the checkout. Without
# CUDA it stops, rather than pass with every test skipped (MESHLM_GPU_TESTS_ON_CPU=1: a CPU dry run).
GPU_PYTHON ?= python3
GPU_PYTEST_FLAGS ?= -x -q -rs
# Files of the ordinary suite that run on CUDA where torch sees it (the CI never does): the Triton
# SSD kernels compiled, the FP8 GEMM's CUDA cases (blockwise scales exist only there), and the FP8
# layers' shared input casts and kept weight codes, bit for bit, on the GPU's FP8 GEMM.
GPU_CUDA_FILES ?= tests/kernels tests/precision/test_fp8_gemm.py tests/precision/test_quantized_projections.py

test-gpu:
	@$(GPU_PYTHON) -c "import os, sys, torch; cuda = torch.cuda.is_available(); \
	print('test-gpu:', torch.cuda.get_device_name() if cuda else 'no CUDA device', '| torch', torch.__version__, \
	      '| CUDA', torch.version.cuda); \
	sys.exit(0 if cuda or os.environ.get('MESHLM_GPU_TESTS_ON_CPU') == '1' else \
	         'test-gpu: torch sees no CUDA device here; run it on a GPU machine (or set MESHLM_GPU_TESTS_ON_CPU=1 for a CPU dry run).')"
	$(GPU_PYTHON) -m pytest -m gpu tests/gpu $(GPU_PYTEST_FLAGS)
	$(GPU_PYTHON) -m pytest $(GPU_CUDA_FILES) $(GPU_PYTEST_FLAGS)

# The CPU suite under the GPU image's torch (2.11; this machine's is 2.13), in a venv of its own:
# what differs between the two releases shows here without a GPU (the first run found compiled
# Mamba blocks training without the scan's gradient, meshlm/models/function_outputs.py). PyPI's
# torch 2.11 is a CUDA build that runs on the CPU: about 4 GB of wheels, once.
GPU_IMAGE_TORCH ?= 2.11.0
GPU_IMAGE_VENV ?= .venv-torch-$(GPU_IMAGE_TORCH)

$(GPU_IMAGE_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_VENV)/bin/python -m pip install -q torch==$(GPU_IMAGE_TORCH)
	$(GPU_IMAGE_VENV)/bin/python -m pip install -q -e ".[test]" torch==$(GPU_IMAGE_TORCH)
	touch $@

test-gpu-image-torch: $(GPU_IMAGE_VENV)/.installed
	$(GPU_IMAGE_VENV)/bin/python -m pytest tests

demo: setup
	$(BIN)/python -m meshlm demo

clean:
	rm -rf $(VENV) $(GPU_IMAGE_VENV) build *.egg-info
