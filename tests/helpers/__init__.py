"""Helpers shared by the tests (and by the ``bench/`` scripts that run distributed code).

- ``distributed.py`` -- ``run_distributed``: a function in N real gloo processes, results by rank.
- ``tiny_training.py`` -- a small training step loop at any data/tensor-parallel layout, for the
  data-parallel tests and ``bench/memory.py``.
- ``parallel_checks.py`` -- seeded inputs, a rank's sequence slice, errors-within-tolerance over ranks.
- ``triton_interpreter.py`` -- two fixes to Triton's CPU interpreter (NumPy 2.4 loop bounds, bf16
  ``tl.dot``), applied by tests/conftest.py.

Nothing here is part of the ``meshlm`` package.
"""
