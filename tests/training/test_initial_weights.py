"""``train.init_from``: the folder's model is compared with the run's as the model each builds.

A size left unset (``ffn_hidden_size: null``) equals the number it stands for, as an imported
Hugging Face model spells it out; training-only fields may differ; a true difference is refused
with the ``model.key=value`` overrides that make the run match, and those overrides work. A run
directory is taken like a model folder (its newest checkpoint).
"""

from __future__ import annotations

import re

import pytest
import torch

from meshlm.checkpoint.global_state import GlobalTensor
from meshlm.checkpoint.materialize import InitialValues, SafetensorsFile, read_tensor
from meshlm.checkpoint.model_files import save_model
from meshlm.config import load_run_config
from meshlm.errors import CheckpointError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.training.initial_weights import FreshAdaptersSource, initial_weights_source

RUN = ["model.vocab_size=64", "model.hidden_size=32", "model.pattern=M*-", "model.num_attention_heads=4",
       "model.mamba_head_dim=8"]
"""A hybrid run that leaves every derived size unset."""
SPELLED_OUT = dict(vocab_size=64, hidden_size=32, pattern="M*-", num_attention_heads=4, mamba_head_dim=8,
                   ffn_hidden_size=128, num_kv_heads=4, head_dim=8, moe_ffn_hidden_size=128, mamba_num_heads=8,
                   mamba_expand=4)
"""The same model with every derived size written out (as converted from Hugging Face)."""


def folder(tmp_path, **values):
    return save_model(LanguageModel(ModelConfig(**values)), tmp_path / "imported")


def test_a_folder_that_spells_out_the_run_s_derived_sizes_is_accepted(tmp_path):
    directory = folder(tmp_path, **SPELLED_OUT, hidden_dropout=0.0)
    run = load_run_config(None, [*RUN, "model.hidden_dropout=0.1"])  # training-only fields may differ
    assert run.model.ffn_hidden_size is None and run.model.resolved_ffn_hidden_size == 128
    source = initial_weights_source(directory, run.model)
    assert isinstance(source, SafetensorsFile) and source.path == directory / "model.safetensors"


def test_a_different_model_is_refused_with_the_overrides_that_make_it_match(tmp_path):
    directory = folder(tmp_path, **dict(SPELLED_OUT, ffn_hidden_size=96, pattern="M*-*-", qk_norm=True))
    run = load_run_config(None, RUN)
    with pytest.raises(CheckpointError) as refused:
        initial_weights_source(directory, run.model)
    message = str(refused.value)
    assert "model.ffn_hidden_size: folder 96 vs run 128" in message
    assert "model.mamba_expand" not in message  # read only to derive mamba_num_heads, which agree
    overrides = re.search(r"; add (.*) to the run", message).group(1).split(" ")
    assert overrides == ["model.ffn_hidden_size=96", "model.pattern='M*-*-'", "model.qk_norm=true",
                         "model.moe_ffn_hidden_size=128"]  # the run's unset expert width would follow 96
    matched = load_run_config(None, [*RUN, *overrides])  # the overrides as a shell hands them over
    assert isinstance(initial_weights_source(directory, matched.model), SafetensorsFile)


def test_a_run_directory_starts_from_its_newest_checkpoint(tmp_path):
    run = load_run_config(None, RUN)
    for step in (2, 4):
        save_model(LanguageModel(run.model), tmp_path / "run" / "checkpoints" / f"step_{step}")
    source = initial_weights_source(tmp_path / "run", run.model)
    assert source.path == tmp_path / "run" / "checkpoints" / "step_4" / "model.safetensors"


def test_lora_on_a_plain_folder_reads_its_weights_and_starts_fresh_adapters(tmp_path):
    directory = folder(tmp_path, **SPELLED_OUT)
    run = load_run_config(None, [*RUN, "model.lora_rank=2"])
    source = initial_weights_source(directory, run.model, seed=7)
    assert isinstance(source, FreshAdaptersSource)
    with torch.device("meta"):
        shapes = {name: tuple(tensor.shape) for name, tensor in LanguageModel(run.model).state_dict().items()}

    def filled_by(values_source, names) -> dict[str, torch.Tensor]:
        targets = {name: GlobalTensor(shapes[name], torch.float32,
                                      [((0,) * len(shapes[name]), torch.empty(shapes[name]))]) for name in names}
        values_source.fill(targets)
        return {name: target.chunks[0][1] for name, target in targets.items()}

    filled = filled_by(source, shapes)
    saved = SafetensorsFile(directory / "model.safetensors")
    for name in shapes:
        if ".lora." not in name:
            assert torch.equal(filled[name], read_tensor(saved, name)), name  # the folder's weights
    adapters = [name for name in shapes if ".lora." in name]
    assert adapters and all(not filled[name].any() for name in adapters if name.endswith(".lora.b"))
    expected = filled_by(InitialValues(run.model, 7), adapters)  # a new run's values from (seed, name)
    assert all(torch.equal(filled[name], expected[name]) for name in adapters)


def test_a_lora_folder_into_a_run_without_adapters_asks_for_the_merge(tmp_path):
    directory = folder(tmp_path, **SPELLED_OUT, lora_rank=4)
    with pytest.raises(CheckpointError, match=r"holds a LoRA model \(model.lora_rank=4\).*meshlm merge-lora"):
        initial_weights_source(directory, load_run_config(None, RUN).model)
