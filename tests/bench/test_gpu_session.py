"""bench/gpu_session.py's planning: the budget, the time limits, ``--done`` and the records.

The real stages need a GPU (and their dry run minutes); here the plan is replaced by stages of a
few lines of Python -- one that passes, one that fails, one that outlives its limit -- and the
script's own loop runs them in real subprocesses.
"""

import json
import sys

import pytest

import bench.gpu_session as gpu_session
from bench.gpu_session import Stage, time_limit


def stage(name: str, code: str, estimate_s: float = 5, always: bool = False) -> Stage:
    command = [sys.executable, "-c", code]
    return Stage(name, 14, estimate_s, command, command, always=always)


@pytest.fixture
def small_plan(monkeypatch):
    stages = [stage("env", "print('machine facts')", always=True),
              stage("good", "print('all fine')"),
              stage("bad", "import sys; print('it broke'); sys.exit(3)"),
              stage("slow", "import time; print('started', flush=True); time.sleep(60)", estimate_s=1),
              stage("huge", "print('never')", estimate_s=10_000)]
    monkeypatch.setattr(gpu_session, "plan", lambda out: stages)
    return stages


def test_time_limit_is_the_estimate_and_half_again_within_the_budget():
    assert time_limit(stage("a", "", estimate_s=100), remaining_s=500) == 150
    assert time_limit(stage("a", "", estimate_s=100), remaining_s=120) == 120
    assert time_limit(stage("a", "", estimate_s=100), remaining_s=99) is None


def test_a_session_records_every_stage_and_skips_what_does_not_fit(small_plan, tmp_path, capsys):
    code = gpu_session.main(["--out", str(tmp_path), "--budget-s", "60"])
    records = json.loads((tmp_path / "session.json").read_text())["stages"]
    assert code == 1  # a stage failed, one timed out, one did not fit
    assert {name: record["status"] for name, record in records.items()} == {
        "env": "passed", "good": "passed", "bad": "failed", "slow": "timed out"}
    assert records["bad"]["exit_code"] == 3 and records["bad"]["tail"] == ["it broke"]
    assert records["slow"]["limit_s"] == 2 and records["slow"]["seconds"] < 30  # killed at 1.5 x 1 s
    printed = capsys.readouterr().out
    assert "huge: skipped, its estimate of 10000 s does not fit" in printed
    assert printed.rstrip().endswith("started")  # the failed stages' output comes last
    log = (tmp_path / "session.log").read_text()
    assert "all fine" in log and "===== bad (issue 14" in log and "never" not in log


def test_a_later_session_goes_on_where_the_earlier_one_stopped(small_plan, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    gpu_session.main(["--out", str(first), "--budget-s", "60", "--stages", "env,good,bad"])
    earlier = json.loads((first / "session.json").read_text())["stages"]
    small_plan[2].dry_command = small_plan[2].command = [sys.executable, "-c", "print('mended')"]
    code = gpu_session.main(["--out", str(second), "--budget-s", "60", "--stages", "env,good,bad",
                             "--done", str(first / "session.json")])
    records = json.loads((second / "session.json").read_text())["stages"]
    assert code == 0
    assert records["good"] == earlier["good"]  # passed before: not run again, its record carried forward
    assert records["bad"]["status"] == "passed" and records["env"]["when"] >= earlier["env"]["when"]
    assert "all fine" not in (second / "session.log").read_text()


def test_bad_arguments_name_the_fix(small_plan, tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_session.main(["--out", str(tmp_path), "--stages", "good,tier9"])
    assert "--stages 'good,tier9': use a comma-separated subset of env, good, bad, slow, huge." in \
        capsys.readouterr().err
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="is not a session.json this script wrote"):
        gpu_session.main(["--out", str(tmp_path), "--done", str(tmp_path / "other.json")])


def test_the_real_plan_runs_each_stage_in_priority_order():
    stages = gpu_session.plan(gpu_session.REPO / "runs")
    assert [stage.name for stage in stages] == ["env", "tier_compile_layouts", "fp8_dense_wide", "throughput_hybrid",
                                                "throughput_dense", "tier", "fp8_dense", "fp8_gemms",
                                                "fp8_dense_recipes", "sliding_window", "serving", "local_sgd"]
    assert [stage.issue for stage in stages] == [14, 14, 15, 14, 14, 14, 15, 15, 15, 14, 14, 20]
    for name, top in (("throughput_dense", "25"), ("throughput_hybrid", "60"), ("fp8_dense", "25"),
                      ("fp8_dense_wide", "25")):
        profiled = next(stage for stage in stages if stage.name == name).command  # each step seen, not only timed
        assert profiled[profiled.index("--profile") + 1] == top, name
    outs = [each.command[each.command.index("--out") + 1] for each in stages if "--out" in each.command]
    assert len(outs) == len(set(outs))  # no stage overwrites another's file
    for each in stages:  # every bench writes inside the session's folder
        outs = [each.command[i + 1] for i, word in enumerate(each.command)
                if word in ("--out", "--plot", "--inductor-code")]
        assert all(path.startswith(str(gpu_session.REPO / "runs")) for path in outs), each.name
    hybrid = stages[3]  # its generated code comes back, generated afresh in a cache of its own
    code = hybrid.command[hybrid.command.index("--inductor-code") + 1]
    assert code.endswith(".gz") and code in hybrid.dry_command
    cache = hybrid.environment["TORCHINDUCTOR_CACHE_DIR"]
    assert not cache.startswith(str(gpu_session.REPO / "runs"))  # not among the files that come back


@pytest.mark.parametrize("dry_run", [False, True], ids=["gpu", "dry-run"])
def test_a_stage_gets_its_environment_and_its_dry_environment_only_in_a_dry_run(tmp_path, dry_run):
    code = "import os; print('vars', os.environ.get('EVERYWHERE'), os.environ.get('DRY_ONLY'))"
    each = Stage("vars", 14, 5, [sys.executable, "-c", code], [sys.executable, "-c", code],
                 dry_environment={"DRY_ONLY": "dry"}, environment={"EVERYWHERE": "both"})
    record = gpu_session.run_stage(each, each.command, 30, tmp_path / "session.log", dry_run)
    assert record["status"] == "passed"
    assert record["tail"][-1] == ("vars both dry" if dry_run else "vars both None")
