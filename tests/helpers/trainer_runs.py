"""The trainer-run helpers of tests/training/test_parallel_training.py (tiny corpus, run configs,
``train_once``, ``assert_same_run``, the model overrides), loaded by path for other test files:
test files cannot import each other."""

import importlib.util
import sys
from pathlib import Path


def load_parallel_training_helpers():
    path = Path(__file__).parents[1] / "training" / "test_parallel_training.py"
    spec = importlib.util.spec_from_file_location("parallel_training_helpers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
