"""``train.distill_from`` under pipeline and context parallelism (``distillation_pipeline.py``).

Under PP the teacher runs its own forward-only pipeline pass beside the student's stages; the
student's last stage takes the teacher's final hidden state (logit KL), and under
``train.distill_blocks`` every stage fits its own blocks to the teacher's. Under CP the teacher
runs on the same chunks (ring attention) and each rank's loss terms are its share. On spawned
gloo ranks, in fp32: logit KL at pp2, pp2 x vp2 (interleaved), cp2 and tp2 x pp2 with SP;
reverse KL at T = 2, w = 0.5 at pp2; block-wise distillation at pp2, pp2 x vp2, cp2 and pp2 x cp2
-- every step's loss and gradient norm, the logged 'lm', 'distill' (and per-block) terms, the
validation loss and the final parameters equal the single-process run within 1e-5 (the helpers
of test_parallel_training.py, the teacher and student of test_distillation.py).
"""

from __future__ import annotations

from pathlib import Path

from meshlm.training.metrics import read_metrics
from tests.helpers.distributed import import_test_file, run_distributed
from tests.helpers.tiny_training import relative_error

HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
DISTILLATION = import_test_file(Path(__file__).parent / "test_distillation.py", "distillation_helpers")
PP2, PP2_VP2, CP2 = ["parallel.pp=2"], ["parallel.pp=2", "parallel.vp=2"], ["parallel.cp=2"]
LAYOUTS = {2: [("kl", "pp2", PP2), ("kl", "pp2 vp2", PP2_VP2), ("kl", "cp2", CP2), ("reverse T2 w.5", "pp2", PP2),
               ("blocks", "pp2", PP2), ("blocks", "pp2 vp2", PP2_VP2), ("blocks", "cp2", CP2)],
           4: [("kl", "tp2 sp pp2", ["parallel.tp=2", "parallel.sp=true", *PP2]),
               ("blocks", "pp2 cp2", [*PP2, *CP2])]}
TERMS = ["loss_lm", "loss_distill"] + [f"loss_distill_block_{index}" for index in range(4)]


def logged_terms(run_dir: Path) -> dict[str, list[float]]:
    records = [record for record in read_metrics(run_dir / "metrics.jsonl") if "loss_distill" in record]
    return {name: [record[name] for record in records] for name in TERMS if name in records[0]}


def test_distillation_under_pipeline_and_context_parallelism_equals_one_process(tmp_path):
    blend = HELPERS.write_tiny_corpus(tmp_path / "corpus")
    teacher = DISTILLATION.save_teacher(tmp_path / "teacher", 11, **DISTILLATION.TEACHER)
    configs = DISTILLATION.configurations(teacher, teacher)
    names = sorted({name for layouts in LAYOUTS.values() for name, _, _ in layouts})
    single = {name: HELPERS.train_once(blend, tmp_path / f"single {name}", configs[name]) for name in names}
    by_rank = {}
    for world, layouts in LAYOUTS.items():
        runs = [(f"{name} {layout}", [*configs[name], *overrides]) for name, layout, overrides in layouts]
        results = run_distributed(HELPERS.train_runs, world, str(blend), str(tmp_path), runs, timeout_s=300)
        by_rank.update({(name, layout): [ranks[f"{name} {layout}"] for ranks in results]
                        for name, layout, _ in layouts})
    for (name, layout), results in by_rank.items():
        for rank, result in enumerate(results):
            HELPERS.assert_same_run(result, single[name], f"{name} {layout} rank {rank}")
        expected = logged_terms(tmp_path / f"single {name}")
        actual = logged_terms(tmp_path / f"{name} {layout}")
        assert set(actual) == set(expected) and len(expected) == (6 if name == "blocks" else 2), (name, layout)
        for term, values in expected.items():
            assert len(actual[term]) == 5 and relative_error(actual[term], values) <= 1e-5, (name, layout, term)
