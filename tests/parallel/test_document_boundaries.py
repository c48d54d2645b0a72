"""Packed documents kept apart (``data.document_boundaries=true``) under TP+SP, PP and CP.

Spawned gloo ranks run the real ``Trainer`` for 5 steps of 4 micro-batches of 32 tokens on the
trainer tests' counting corpus, cut into documents of 21-24 tokens (so every sample packs two or
three documents, their boundaries anywhere relative to Mamba chunks, CP chunks and SP slices), with
two models: a hybrid (Mamba-2, attention, MLP) and an attention + MoE model with a
multi-token-prediction depth and a sliding window of 6 tokens in every attention block (MTP's
included), so windows and document boundaries cut the same rows (under CP: ring attention's
per-document sub-blocks banded and skipped by the window). At tp2 with SP, pp2 and cp2 every step's
loss and global gradient norm, the validation losses and the final parameters equal the
single-process run with boundaries (relative error <= 1e-5), which itself differs from the run
without them (the boundaries are used). The single-process run is itself checked against documents
run one by one in tests/models/test_document_boundaries.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer_runs import load_parallel_training_helpers

helpers = load_parallel_training_helpers()
BASE = ["train.seq_len=32", "data.document_boundaries=true"]
MODELS = {"hybrid": helpers.MODELS["hybrid"],
          "moe mtp window": [*helpers.MODELS["moe"], "model.mtp_depth=1", "model.sliding_window=6"]}
LAYOUTS = {"tp2 sp": ["parallel.tp=2", "parallel.sp=true"], "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("document-boundaries")
    blend = write_corpus(root / "corpus", num_documents=80, max_length=24)
    single = {model: helpers.train_once(blend, root / f"single {model}", [*overrides, *BASE])
              for model, overrides in MODELS.items()}
    plain = helpers.train_once(blend, root / "plain hybrid", [*MODELS["hybrid"], "train.seq_len=32"])
    todo = [(f"{model} {layout}", [*MODELS[model], *BASE, *overrides])
            for model in MODELS for layout, overrides in LAYOUTS.items()]
    parallel = run_distributed(helpers.train_runs, 2, str(blend), str(root), todo, timeout_s=300)
    return dict(single=single, plain=plain, parallel=parallel)


def test_boundaries_change_the_run(runs):
    with_boundaries, without = runs["single"]["hybrid"], runs["plain"]
    last = max(without["losses"])  # at the start both predict about uniformly: they part as the model learns
    assert abs(with_boundaries["losses"][last] - without["losses"][last]) > 1e-3
    assert helpers.relative_error(with_boundaries["params"]["blocks.0.mixer.in_proj.weight"],
                                  without["params"]["blocks.0.mixer.in_proj.weight"]) > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_parallel_layouts_equal_the_single_process_run(runs, model, layout):
    for rank, results in enumerate(runs["parallel"]):
        helpers.assert_same_run(results[f"{model} {layout}"], runs["single"][model], f"{model} {layout} rank {rank}")
