"""bench/lora.py: a tiny run writes its record, with the numbers adding up; bad flags are refused."""

from __future__ import annotations

import json

import pytest

from bench.lora import main


def test_a_tiny_run_records_both_trainers(capsys):
    assert main(["--device", "cpu", "--layers", "1", "--hidden", "64", "--rank", "2", "--repeats", "1",
                 "--steps", "1"]) == 0
    record = json.loads(capsys.readouterr().out)
    full, lora = record["state_bytes"]["full"], record["state_bytes"]["lora"]
    adapters, base = record["trainable"], record["parameters"] - record["trainable"]  # fp32: two 4-byte moments each
    assert (lora["optimizer"], full["optimizer"], lora["masters"]) == (8 * adapters, 8 * base, 0)
    assert (full["weights"], lora["weights"]) == (4 * base, 4 * (base + adapters))
    assert record["state_ratio"] == pytest.approx(sum(full.values()) / sum(lora.values()))
    assert record["speedup"] == pytest.approx(record["seconds_per_step"]["full"] / record["seconds_per_step"]["lora"])
    assert record["flops_per_token"]["lora"] < record["flops_per_token"]["full"]
    assert 0 < record["trainable_fraction"] < 0.2
    seconds = record["seconds_per_step"]  # the third run, with the adapters' inputs dropped
    assert record["dropout"] == 0.1
    assert record["dropout_cost"] == pytest.approx(seconds["lora_dropout"] / seconds["lora"])


@pytest.mark.parametrize("argv, message", [(["--hidden", "100"], "--hidden 100 must be a positive multiple of 64"),
                                           (["--rank", "0"], "--rank 0 must be at least 1"),
                                           (["--dropout", "1"], "--dropout 1.0 must be a probability in [0, 1)")])
def test_bad_flags_are_refused_with_one_sentence(argv, message, capsys):
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1
