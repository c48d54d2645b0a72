"""``meshlm plan``: the ranking, one layout, and the --json fields."""

from __future__ import annotations

import json

from meshlm.cli import main

REQUIRED = {"layout", "micro_batch", "fits", "memory_bytes_per_gpu", "memory_items", "step_time_s", "tokens_per_s",
            "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu"}
ITEMS = {"weights", "gradients", "optimizer", "communication buffers", "fragmentation margin", "activations head"}


def test_json_has_every_field_for_every_layout(capsys):
    assert main(["plan", "configs/moe-hybrid-tiny.yaml", "train.global_batch_size=16", "--gpus", "4", "--gpu", "h100",
                 "--json", "--top", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    fitting = [line for line in lines if line["fits"]]
    assert len(fitting) == 3 and any(line.get("refused") for line in lines)
    assert fitting[0]["tokens_per_s"] >= fitting[1]["tokens_per_s"] >= fitting[2]["tokens_per_s"]
    for line in fitting:
        assert REQUIRED <= set(line) and ITEMS <= set(line["memory_items"])
        assert sum(line["memory_items"].values()) == line["memory_bytes_per_gpu"]
        assert line["hardware_tflops_per_gpu"] >= line["model_tflops_per_gpu"] > 0


def test_one_layout_in_words_and_a_mismatch_refused(capsys):
    assert main(["plan", "configs/tiny.yaml", "--gpus", "4", "--layout", "tp=2,sp=true,dp=2,zero=1,recompute=full",
                 "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp=2,sp=true,pp=1,vp=1,dp=2,cp=1,ep=1,zero=1,recompute=full" in out and "memory: weights" in out
    assert main(["plan", "configs/tiny.yaml", "--gpus", "8", "--layout", "tp=2,dp=2"]) == 2
    assert "uses tp*pp*cp*dp = 4 GPUs but --gpus is 8" in capsys.readouterr().err
