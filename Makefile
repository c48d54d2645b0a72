# The two commands of the README. Each sets up its own virtual environment on a fresh machine:
# torch first, pinned (a CPU build is served from the machine's local index; an unpinned torch
# would pull several GB of CUDA wheels), then the project with its extras.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin

.PHONY: setup test demo clean

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

demo: setup
	$(BIN)/python -m meshlm demo

clean:
	rm -rf $(VENV) build *.egg-info
