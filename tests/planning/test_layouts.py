"""Enumeration follows the trainer's layout rules; ``--layout`` errors are one clear sentence."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.parallel.mesh import check_layout
from meshlm.planning.layouts import Layout, apply_layout, candidate_layouts, parse_layout, refusal


def moe_config():
    return load_run_config(None, ["model.pattern=M*-E", "model.hidden_size=64", "model.num_attention_heads=4",
                                  "model.num_kv_heads=2", "model.moe_num_experts=4", "model.mamba_head_dim=16",
                                  "train.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=1"])


def test_accepted_layouts_are_exactly_those_check_layout_accepts():
    config = moe_config()
    layouts = candidate_layouts(config, 8, gpus_per_node=8, recompute=("none",))
    assert len({layout.world_size for layout in layouts}) == 1 and layouts[0].world_size == 8
    accepted = 0
    for layout in layouts:
        run = apply_layout(config, layout, 1)
        try:
            run.validate()
            check_layout(run.parallel, run.model, 8, run.train.seq_len, run.train.global_batch_size)
            trainer_says = None
        except ConfigError as error:
            trainer_says = str(error)
        assert refusal(config, layout, 1) == trainer_says, layout
        accepted += trainer_says is None
    assert 0 < accepted < len(layouts)  # tp=8 > 4 heads and ep=8 > 4 experts, among others, are refused
    assert "model.num_attention_heads = 4 is not divisible by parallel.tp=8" in refusal(
        config, Layout(tp=8, sp=True, dp=1), 1)


def test_tp_stays_inside_a_node():
    layouts = candidate_layouts(moe_config(), 8, gpus_per_node=2)
    assert max(layout.tp for layout in layouts) == 2


def test_parse_layout_reads_every_key():
    layout = parse_layout("tp=2, sp=true, pp=2, vp=2, dp=3, cp=1, ep=2, zero=1, recompute=selective")
    assert layout == Layout(tp=2, sp=True, pp=2, vp=2, dp=3, cp=1, ep=2, zero=1, recompute="selective")
    assert layout.world_size == 12 and parse_layout(layout.describe()) == layout
    assert dataclasses.replace(layout, tp=1).describe().startswith("tp=1,")


@pytest.mark.parametrize("text, names", [
    ("tp=2,bogus=3", "bogus=3"), ("tp", "'tp'"), ("tp=two", "tp='two'"), ("zero=4", "zero='4'"),
    ("sp=yes", "sp='yes'"), ("recompute=some", "recompute='some'"), ("dp=0", "dp='0'"),
])
def test_layout_errors_are_one_sentence_naming_the_item(text, names):
    with pytest.raises(ConfigError) as error:
        parse_layout(text)
    message = str(error.value)
    assert names in message and message.replace("e.g. ", "").count(". ") == 0 and message.endswith(".")
    assert "\n" not in message


def test_the_planner_never_imports_the_trainer():
    package = Path(__file__).resolve().parents[2] / "meshlm" / "planning"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.startswith("meshlm.training.trainer") for name in names), path
