"""bench/gpu_throughput.py: the real shapes are ~1B parameters (counted on meta, by hand), the
--tiny dry run on CPU writes the whole JSON with finite numbers, a split run merges into one file,
an out-of-memory variant is retried at half the micro-batch, and the targets follow the numbers."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from bench import gpu_throughput as bench


@pytest.fixture
def one_thread():
    """The dry run is a few hundred tiny ops per step: on a shared CPU one thread is fastest."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_real_shapes_are_about_one_billion_parameters():
    shapes = bench.describe_shapes(bench.SHAPES, 4096)
    h, vocab, kv = 2048, 32000, 4 * 128
    embeddings = 2 * vocab * h + h  # untied embedding and head, final norm
    attention = 2 * h * h + 2 * h * kv + h  # q, o, k, v, pre-norm
    assert shapes["dense"]["parameters"]["total"] == embeddings + 20 * (attention + 3 * h * 5632 + h)
    experts = 18 * 8 * 3 * h * 2816
    moe = embeddings + 18 * (attention + 8 * h + h) + experts  # router + pre-norm per MoE block
    assert shapes["moe"]["parameters"] == {"total": moe, "active": moe - experts * 6 // 8}
    for name, counts in shapes.items():
        assert 0.8e9 <= counts["parameters"]["active"] <= 1.3e9, name
    assert shapes["hybrid"]["blocks"] == {"*": 2, "-": 12, "M": 12}  # attention 2/26 = 7.7% of the blocks
    assert shapes["moe"]["parameters"]["total"] < 3.0e9  # fits 80 GB with fp32 masters and AdamW
    matmuls = 20 * (2 * h * h + 2 * h * kv + 3 * h * 5632) + h * vocab  # weights a token multiplies, head included
    scores = 20 * 2 * (2 * 16 * 128 * 4096)  # per layer: scores and weighted sum, the full 4096 x 4096 square
    assert shapes["dense"]["flops_per_token"] == 3 * (2 * matmuls + scores)


def test_micro_batch_is_the_largest_whose_estimate_fits():
    model = bench.SHAPES["dense"]
    size, estimates = bench.fitting_micro_batch(model, 4096, "bf16", 0.85 * 80 * 2**30)
    assert size in bench.MICRO_BATCHES and estimates[size] <= 0.85 * 80
    assert all(estimates[larger] > 0.85 * 80 for larger in bench.MICRO_BATCHES if larger > size)
    assert bench.fitting_micro_batch(model, 4096, "bf16", 1.0)[0] == 1


def test_tiny_dry_run_writes_every_variant_with_finite_numbers(tmp_path, capsys, one_thread):
    out = tmp_path / "gpu.json"
    assert bench.main(["--tiny", "--device", "cpu", "--compile", "off", "--steps", "1", "--warmup", "1",
                       "--repeats", "2", "--out", str(out)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == document
    results = {(r["impl"], r["model"], r["recompute"]): r for r in document["results"]}
    assert set(results) == {("meshlm", model, recompute) for model in ("dense", "hybrid", "moe")
                            for recompute in ("none", "selective")} | {("baseline", "dense", "none")}
    for result in results.values():
        assert "error" not in result, result
        for key in ("step_s", "tokens_per_s", "mfu", "loss"):
            assert math.isfinite(result[key]) and result[key] > 0, (key, result)
        assert result["tokens_per_s"] == pytest.approx(result["tokens_per_step"] / result["step_s"], rel=1e-3)
        flops = document["shapes"][result["model"]]["flops_per_token"]
        assert result["mfu"] == pytest.approx(flops * result["tokens_per_s"] / document["peak_flops"], abs=1e-4)
        assert len(result["step_s_repeats"]) == 2 and result["micro_batch"] == 2 and result["seq_len"] == 32
    assert results[("baseline", "dense", "none")]["parameters"] == results[("meshlm", "dense", "none")]["parameters"]
    ratio = document["summary"]["dense_over_baseline"]["compile_off"]
    fastest = max(results[("meshlm", "dense", r)]["tokens_per_s"] for r in ("none", "selective"))
    assert ratio == pytest.approx(fastest / results[("baseline", "dense", "none")]["tokens_per_s"], rel=1e-2)
    assert set(document["targets"].values()) <= {True, False}
    attention = document["attention_kernels"]  # each kernel forced on the dense attention, and auto's choice
    assert set(attention["kernels"]) == {"flash", "cudnn", "efficient", "auto"}
    assert attention["kernels"]["flash"]["ms"] > 0 and "error" in attention["kernels"]["cudnn"]  # CPU: no cuDNN
    assert "_scaled_dot_product_flash_attention_for_cpu" in attention["kernels"]["auto"]["ran"]

    # a second command measures one variant again: the file keeps the others and replaces that one
    assert bench.main(["--tiny", "--device", "cpu", "--models", "dense", "--compile", "off", "--recompute", "none",
                       "--no-baseline", "--steps", "1", "--warmup", "0", "--repeats", "1", "--profile", "5",
                       "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert len(merged["results"]) == len(results)
    again = [r for r in merged["results"] if (r["impl"], r["model"], r["recompute"]) == ("meshlm", "dense", "none")]
    assert len(again) == 1 and again[0]["step_s_repeats"] != results[("meshlm", "dense", "none")]["step_s_repeats"]
    profile = again[0]["profile"]  # --profile 5: the step's five most expensive operators
    assert profile["measured"] == "self_cpu_time_total" and len(profile["top"]) == 5
    milliseconds = [op["ms"] for op in profile["top"]]
    assert milliseconds == sorted(milliseconds, reverse=True) and 0 < sum(milliseconds) <= profile["total_ms"]
    assert any("mm" in op["name"] for op in profile["top"]), profile  # a matmul is among the dearest
    assert all(op["calls"] >= 1 for op in profile["top"])
    regions = profile["regions_ms"]  # the fused loss, the optimizer and attention, with what they called
    assert set(regions) == {"loss_head", "optimizer", "attention"} and all(ms > 0 for ms in regions.values())


class HungrySubject:
    """Runs out of memory above ``fits`` sequences per step; any variant named 'broken' raises."""

    impl = "meshlm"

    def __init__(self, micro_batch: int, fits: int):
        self.micro_batch, self.fits = micro_batch, fits

    def prepare(self, compile: bool, recompute: str) -> dict:
        if recompute == "broken":
            raise ValueError("this variant cannot run")
        return {}

    def step(self) -> float:
        if self.micro_batch > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        time.sleep(0.001)
        return 1.0

    def close(self) -> None:
        pass


def test_out_of_memory_halves_the_micro_batch_and_errors_do_not_stop_the_bench():
    args = bench.parse_args(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "1", "--repeats", "1"])
    recorded = []
    bench.measure_subject(HungrySubject, {"fits": 2}, [(False, "none"), (False, "broken"), (True, "none")], 8,
                          "dense", 1e6, 1e9, args, torch.device("cpu"), recorded.append)
    first, broken, last = recorded
    assert first["micro_batch"] == 2 and first["out_of_memory_at_micro_batch"] == [8, 4]
    assert first["tokens_per_step"] == 2 * 32 and "error" not in first
    assert broken["error"] == "ValueError: this variant cannot run"
    assert "error" not in last and last["compile"] is True
    recorded.clear()
    bench.measure_subject(HungrySubject, {"fits": 0}, [(False, "none")], 2, "dense", 1e6, 1e9, args,
                          torch.device("cpu"), recorded.append)
    assert recorded[0]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert recorded[0]["out_of_memory_at_micro_batch"] == [2]


def test_targets_are_computed_from_the_numbers():
    def result(impl, model, tokens_per_s, mfu, compile=False):
        return {"impl": impl, "model": model, "compile": compile, "recompute": "none", "micro_batch": 4,
                "tokens_per_s": tokens_per_s, "mfu": mfu}

    results = [result("meshlm", "dense", 1100.0, 0.51), result("baseline", "dense", 1000.0, 0.46),
               result("meshlm", "hybrid", 900.0, 0.39), result("meshlm", "moe", 800.0, 0.36, compile=True),
               {"impl": "meshlm", "model": "moe", "compile": False, "recompute": "none", "error": "OutOfMemoryError"}]
    report = bench.summarize(results)
    assert report["targets"] == {"dense_mfu_at_least_0.5": True, "hybrid_mfu_at_least_0.4": False,
                                 "moe_mfu_at_least_0.35": True, "dense_over_baseline_at_least_1.1": True}
    assert report["summary"]["dense_over_baseline"] == {"compile_off": 1.1, "best_vs_best": 1.1}
    report = bench.summarize(results[1:2])
    assert report["targets"]["dense_mfu_at_least_0.5"] is None
    assert report["targets"]["dense_over_baseline_at_least_1.1"] is None


@pytest.mark.parametrize("argv, message", [
    (["--tiny", "--models", "dense,llama"], "--models 'dense,llama': use a comma-separated subset"),
    (["--tiny", "--steps", "0"], "--steps must be a positive integer"),
    (["--device", "cpu"], "the ~1B shapes need a CUDA GPU; use --tiny"),
    (["--tiny", "--profile", "-5"], "--profile -5: give how many operators to list (0, the default, profiles nothing)"),
])
def test_bad_flags_are_refused_with_one_sentence(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


class CompilingSubject:
    """A subject whose first ``compiling_steps`` steps each 'compile' a graph (a fake Dynamo counter)."""

    def __init__(self, compiling_steps: int):
        self.steps, self.compiling_steps, self.graphs = 0, compiling_steps, 0

    def prepare(self, compile, recompute):
        return {}

    def step(self):
        self.steps += 1
        self.graphs += self.steps <= self.compiling_steps
        return 1.0


@pytest.mark.parametrize("compiling_steps,warmup,expected_warmup,compiled_while_timed", [
    (0, 2, 2, 0),   # nothing compiles: exactly --warmup
    (3, 1, 4, 0),   # compiles on steps 1-3: warm up until a step compiles nothing
    (20, 2, 2 + bench.MAX_EXTRA_WARMUP, 6),  # never settles: capped, and the 6 timed steps report it
    (2, 0, 0, 2),   # --warmup 0 times even the first step
])
def test_warmup_runs_on_while_steps_still_compile(monkeypatch, compiling_steps, warmup, expected_warmup,
                                                  compiled_while_timed):
    subject = CompilingSubject(compiling_steps)
    monkeypatch.setattr(bench, "graphs_compiled", lambda: subject.graphs)
    args = bench.parse_args(["--tiny", "--device", "cpu", "--steps", "2", "--warmup", str(warmup), "--repeats", "3"])
    result = bench.measure_variant(subject, True, "none", args, torch.device("cpu"))
    assert result["warmup_steps"] == expected_warmup
    assert result["graphs_compiled_while_timed"] == compiled_while_timed
    assert subject.steps == expected_warmup + 2 * 3


def test_sdp_priority_order_names_every_attention_kernel_after_a_first_call():
    order = bench.sdp_priority_order(torch.device("cpu"))
    assert order is not None and {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION"} <= set(order)
    assert len(order) == len(set(order))


def test_the_baseline_trains_on_a_fresh_random_batch_each_step(one_thread):
    """As meshlm's trainer reads its random-token store: one batch over and over is memorized (the
    baseline's loss fell to 0.0005 in the first GPU runs)."""
    from types import SimpleNamespace

    args = SimpleNamespace(device="cpu", dtype="fp32", seq_len=16)
    subject = bench.BaselineSubject(2, bench.TINY_SHAPES["dense"], args)
    seen = []
    subject.reference.train_step = lambda inputs, labels: seen.append((inputs, labels)) or 0.0
    for _ in range(3):
        subject.step()
    assert all(inputs.shape == (2, 16) and torch.equal(inputs[:, 1:], labels[:, :-1]) for inputs, labels in seen)
    assert not torch.equal(seen[0][0], seen[1][0]) and not torch.equal(seen[1][0], seen[2][0])
    assert int(max(inputs.max() for inputs, _ in seen)) < bench.TINY_SHAPES["dense"]["vocab_size"]
