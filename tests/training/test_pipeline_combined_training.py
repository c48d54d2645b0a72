"""Pipeline parallelism combined with tensor, context and data parallelism on 8 processes.

The trainer at tp2 x pp2 x dp2 (sequence parallel, dense model with a tied embedding),
tp2 x cp2 x pp2 (sequence parallel, hybrid Mamba model: ring attention and the Mamba state
hand-off inside pipeline stages) and pp2 x vp2 x cp2 x dp2 (interleaved schedule, hybrid) runs
5 steps whose losses, gradient norms, validation losses and final parameters equal the
single-process run (relative error <= 1e-5) on every rank. Few and small on purpose: 8 spawned
processes share a 2-core machine. (Run helpers and the hybrid model:
tests/training/test_parallel_training.py; the dense model: tests/training/test_pipeline_training.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.distributed import import_test_file, run_distributed


HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
MODELS = {"dense tied": import_test_file(Path(__file__).parent / "test_pipeline_training.py",
                                             "pipeline_training_models").MODELS["dense tied"],
          "hybrid": HELPERS.MODELS["hybrid"]}
"""The 8-block dense model of the pipeline tests; the 4-block hybrid of the CP tests ('M*-M': with
CP, 1e-5 holds for it; an 8-block hybrid ends 6.5e-5 apart at cp2 alone, pipeline or not)."""
LAYOUTS = {  # name -> (model, layout), all on 8 ranks
    "tp2 pp2 dp2 sp": ("dense tied", ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.sp=true"]),
    "tp2 cp2 pp2 sp": ("hybrid", ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.sp=true"]),
    "pp2 vp2 cp2 dp2": ("hybrid", ["parallel.pp=2", "parallel.vp=2", "parallel.cp=2", "parallel.dp=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pipeline-combined")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    models = {model for model, _ in LAYOUTS.values()}
    single = {model: HELPERS.train_once(blend, root / f"single {model}", MODELS[model]) for model in models}
    batch = [(name, [*MODELS[model], *overrides]) for name, (model, overrides) in LAYOUTS.items()]
    results = run_distributed(HELPERS.train_runs, 8, str(blend), str(root), batch, timeout_s=400)
    return dict(single=single, results=results)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_combined_layout_equals_single_process(runs, name):
    model = LAYOUTS[name][0]
    for rank, results in enumerate(runs["results"]):
        HELPERS.assert_same_run(results[name], runs["single"][model], f"{name} rank {rank}")
