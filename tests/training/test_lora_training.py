"""LoRA fine-tuning under every kind of parallelism equals the single-process run.

The trainer fine-tunes the tiny dense, hybrid and MoE models of the parallel tests with
``model.lora_rank=4`` (every targeted layer: attention q/k/v/o, MLP and shared-expert
gate/up/down, Mamba in/out) from a model without adapters (``train.init_from``: its weights, fresh
adapters) for 5 steps, in one process and at layouts that cut the adapters every way: tp2 x dp2
with SP and the distributed optimizer (column-parallel b, row-parallel a, replicated halves with
partial gradients), tp4 with SP (the dense model's 2 KV heads replicated: both halves partial),
pp2 x dp2 with ZeRO-3, cp2 and ep2, and the hybrid with an MTP depth at tp2 x pp2 x vp2 + SP
(adapters in the MTP depth's blocks, interleaved stages) and a heterogeneous stack (per-block KV
heads and MLP width) at tp2 x dp2 + ZeRO-1. The adapters drop 10% of their inputs
(``model.lora_dropout``): every layout must draw the same masks -- sequence slices, CP chunks,
row-parallel shards of the inputs, MoE tokens and the shared expert's. Every step's loss and gradient norm, the validation
losses and the final parameters must equal the single-process run's (relative error <= 1e-5),
and the frozen weights must be exactly the folder's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.whole_tensors import read_global_tensors
from tests.helpers.distributed import import_test_file, run_distributed

HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
MODELS = {
    "dense": HELPERS.MODELS["dense"],
    "hybrid": HELPERS.MODELS["hybrid"],
    "moe": [*HELPERS.MODELS["moe"], "model.moe_shared_expert_ffn_hidden_size=32"],
    "hybrid mtp": [*HELPERS.MODELS["hybrid"], "model.mtp_depth=1"],
    "heterogeneous": ["model.pattern=*-*-", "model.num_kv_heads=2",
                      "model.block_overrides={2: {num_kv_heads: 1}, 1: {ffn_hidden_size: 32}}"],
}
LORA = ["model.lora_rank=4", "model.lora_alpha=8", "model.lora_dropout=0.1", "optim.lr=5e-3", "optim.eps=1e-3"]
"""``optim.eps=1e-3``: AdamW turns a gradient element near eps into an update of about lr * g / eps,
so eps bounds how much the last-bit differences that the layouts' fp32 summation orders leave in
a gradient are amplified (``run_config``'s note). The adapters' gradients are small (b starts at
zero): at the parallel runs' 1e-5 a row-parallel b of the dense model ended 1.24e-5 apart at
tp2 x dp2, and at 1e-4 the Mamba out_proj's b of the hybrid with MTP 2.6e-5 apart at tp2 + SP
(1.6e-6 at 1e-3), while every adapter's gradient agrees to 2.8e-6 at tp2 and tp4, with and
without SP (tests/parallel/test_parallelize.py, its 'lora hybrid mtp' model)."""
LAYOUTS = {  # world -> {name: (model, layout)}
    4: {"dense tp2xdp2 sp dist-opt": ("dense", ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true",
                                                "parallel.distributed_optimizer=true"]),
        "dense tp4 sp": ("dense", ["parallel.tp=4", "parallel.sp=true"]),
        "hybrid tp2 cp2 sp": ("hybrid", ["parallel.tp=2", "parallel.cp=2", "parallel.sp=true"]),
        "dense pp2 dp2 zero3": ("dense", ["parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=3"]),
        "hybrid mtp tp2 pp2 vp2 sp": ("hybrid mtp", ["parallel.tp=2", "parallel.pp=2", "parallel.vp=2",
                                                     "parallel.sp=true"]),
        "heterogeneous tp2 dp2 zero1": ("heterogeneous", ["parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=1"])},
    2: {"moe ep2": ("moe", ["parallel.ep=2"]),
        "moe tp2 sp": ("moe", ["parallel.tp=2", "parallel.sp=true"])},
}


def base_models(blend: str, root: str, models: list[str]) -> None:
    """In this process: a 2-step run of each model without adapters, the folder LoRA starts from."""
    for model in models:
        HELPERS.train_once(Path(blend), Path(root) / f"base {model}", [*MODELS[model], "train.steps=2",
                                                                       "train.save_every=2", "optim.warmup_steps=1"])


def lora_overrides(root: Path, model: str) -> list[str]:
    return [*MODELS[model], *LORA, f"train.init_from={root / f'base {model}'}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-training")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    base_models(str(blend), str(root), list(MODELS))
    single = {model: HELPERS.train_once(blend, root / f"single {model}", lora_overrides(root, model))
              for model in MODELS}
    by_world = {}
    for world, layouts in LAYOUTS.items():
        batch = [(name, [*lora_overrides(root, model), *layout]) for name, (model, layout) in layouts.items()]
        by_world[world] = run_distributed(HELPERS.train_runs, world, str(blend), str(root), batch, timeout_s=400)
    return dict(root=root, blend=blend, single=single, by_world=by_world)


@pytest.mark.parametrize("world,name", [(world, name) for world, layouts in LAYOUTS.items() for name in layouts])
def test_lora_layout_equals_single_process(runs, world, name):
    model = LAYOUTS[world][name][0]
    for rank, results in enumerate(runs["by_world"][world]):
        HELPERS.assert_same_run(results[name], runs["single"][model], f"{name} rank {rank}")


@pytest.mark.parametrize("model", list(MODELS))
def test_only_the_adapters_train(runs, model):
    stored = read_global_tensors(runs["root"] / f"base {model}" / "checkpoints" / "step_2")
    base = {key.removeprefix("model/"): value for key, value in stored.items() if key.startswith("model/")}
    final = runs["single"][model]["params"]
    adapters = {name for name in final if ".lora." in name}
    assert adapters and set(final) - adapters == set(base)
    for name, value in base.items():
        assert final[name].equal(value), f"{name} is frozen but changed"
    moved = [name for name in adapters if name.endswith(".lora.b") and final[name].abs().max() > 0]
    assert len(moved) == len(adapters) // 2, "every adapter's b (zero at the start) must have trained"


def test_lora_dropout_changes_the_training(runs, tmp_path):
    """The runs above drop 10% of the adapters' inputs, and it shows: step 1's loss is the base
    model's either way (b starts at zero, so the detour adds nothing yet), but b's first update reads
    the dropped inputs, and every later loss differs from the run without dropout."""
    overrides = [override for override in lora_overrides(runs["root"], "dense") if "lora_dropout" not in override]
    plain = HELPERS.train_once(runs["blend"], tmp_path / "plain", overrides)
    dropping = runs["single"]["dense"]
    assert plain["losses"][1] == dropping["losses"][1]
    assert all(plain["losses"][step] != dropping["losses"][step] for step in (2, 3, 4, 5))


BF16_LAYOUTS = {"dp2 zero1": ["parallel.dp=2", "parallel.distributed_optimizer=true"],
                "tp2 sp": ["parallel.tp=2", "parallel.sp=true"],
                "dp2 zero3": ["parallel.dp=2", "parallel.zero_stage=3"]}


def test_bf16_lora_keeps_masters_of_the_adapters_only_and_resumes_exactly(runs, tmp_path):
    """In bf16 a frozen weight needs no fp32 master (it never changes): the checkpoint holds masters
    of the adapters only, the frozen weights are the folder's cast to bf16, and resuming at the same
    layout repeats the uninterrupted run's losses exactly (ZeRO-1, TP + SP, ZeRO-3)."""
    root, blend = runs["root"], runs["blend"]
    bf16 = [*lora_overrides(root, "dense"), "precision.dtype=bf16", "train.eval_every=0", "train.save_every=3"]
    batch = [(name, [*bf16, *layout]) for name, layout in BF16_LAYOUTS.items()]
    uninterrupted = run_distributed(HELPERS.train_runs, 2, str(blend), str(tmp_path), batch, timeout_s=400)[0]
    stored = read_global_tensors(root / "base dense" / "checkpoints" / "step_2")
    for name, _ in batch:
        saved = tmp_path / name / "checkpoints" / "step_3"
        tensors = read_global_tensors(saved)
        masters = sorted(key.removeprefix("master/") for key in tensors if key.startswith("master/"))
        assert masters and all(".lora." in key for key in masters), (name, masters[:3])
        assert all(tensors[f"master/{key}"].dtype == torch.float32 for key in masters)
        for key, value in stored.items():
            if key.startswith("model/"):
                assert tensors[key].equal(value.to(torch.bfloat16)), (name, key)
        shutil.copytree(saved, tmp_path / f"resumed {name}" / "checkpoints" / "step_3")
    resumed = [(f"resumed {name}", overrides) for name, overrides in batch]
    again = run_distributed(HELPERS.train_runs, 2, str(blend), str(tmp_path), resumed, timeout_s=400)[0]
    for name, _ in batch:
        expected = {step: uninterrupted[name]["losses"][step] for step in (4, 5)}
        assert again[f"resumed {name}"]["losses"] == expected, name
