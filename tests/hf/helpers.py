"""Shared pieces of the Hugging Face interop tests: tiny random HF models and comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.hf import export_hf, hf_to_meshlm
from meshlm.models.language_model import LanguageModel

VOCAB = 96
TOLERANCE = 1e-4


def save_random_hf_model(hf_config, directory: Path, seed: int = 0, noise: float = 0.05):
    """Build ``hf_config`` with transformers, perturb *every* tensor (norm weights, biases, D, dt
    bias, router bias...) so that no default value can hide a mapping mistake, and save it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(noise * torch.randn_like(tensor))
    model.save_pretrained(directory)
    return model


def with_trained_norms_and_biases(model: LanguageModel) -> LanguageModel:
    """``model`` with its norm weights and biases drawn from N(0, 0.1), as after training: a mapping
    mistake cannot hide behind the ones and zeros they start at."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


def load_hf(directory: Path):
    """transformers' model from ``directory``, after checking nothing was missing or unexpected."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    problems = {key: value for key, value in info.items() if value}
    assert not problems, f"transformers reported {problems} loading {directory}"
    return model.eval()


def random_ids(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=generator)


def assert_same_logits(hf_model, model: LanguageModel, input_ids: torch.Tensor) -> None:
    with torch.no_grad():
        expected = hf_model(input_ids).logits.float()
        actual = model.eval()(input_ids).logits
    assert expected.shape == actual.shape
    difference = (expected - actual).abs().max().item()
    assert difference <= TOLERANCE, f"max |logits difference| = {difference}"
    assert expected.std() > 0.05  # the comparison would be weak on near-constant logits


def convert_and_compare(hf_config, tmp_path: Path, seq: int = 24) -> LanguageModel:
    """Save a random HF model, convert it with ``hf_to_meshlm``, compare the logits; return ours."""
    hf_model = save_random_hf_model(hf_config, tmp_path / "hf")
    out, _, _ = hf_to_meshlm(tmp_path / "hf", tmp_path / "meshlm")
    model = load_model(out)
    assert_same_logits(hf_model, model, random_ids(seq=seq))
    return model


def assert_hf_round_trip(tmp_path: Path, fields: tuple[str, ...]) -> None:
    """HF -> meshlm (already in tmp_path/meshlm) -> HF reproduces every tensor and ``fields``."""
    from meshlm.hf import meshlm_to_hf

    meshlm_to_hf(tmp_path / "meshlm", tmp_path / "hf_again")
    original, again = load_hf(tmp_path / "hf"), load_hf(tmp_path / "hf_again")
    original_state, state_again = original.state_dict(), again.state_dict()
    assert sorted(original_state) == sorted(state_again)
    for name, tensor in original_state.items():
        assert torch.equal(tensor, state_again[name]), name
    config, config_again = (json.loads((tmp_path / folder / "config.json").read_text())
                            for folder in ("hf", "hf_again"))
    for field in fields + ("architectures", "model_type", "vocab_size", "hidden_size", "tie_word_embeddings"):
        assert config_again.get(field) == config.get(field), field


def assert_meshlm_round_trip(model: LanguageModel, tmp_path: Path, architecture: str,
                             imported_from: str | None = None) -> None:
    """meshlm -> HF -> meshlm reproduces every tensor and the config, via files on disk; the
    export picks ``architecture`` (for a model recorded as ``imported_from`` that class, if given)."""
    from meshlm.hf import meshlm_to_hf

    save_model(model, tmp_path / "ours", extra_config={"hf": {"architecture": imported_from}} if imported_from else None)
    _, chosen = meshlm_to_hf(tmp_path / "ours", tmp_path / "hf_export")
    assert chosen.name == architecture
    load_hf(tmp_path / "hf_export")  # transformers loads it with no missing / unexpected keys
    out, _, _ = hf_to_meshlm(tmp_path / "hf_export", tmp_path / "ours_again")
    back = load_model(out)
    ours, again = model.config.to_dict(), back.config.to_dict()
    assert ours == again, {key: (ours[key], again[key]) for key in ours if ours[key] != again[key]}
    state, state_again = model.state_dict(), back.state_dict()
    assert sorted(state) == sorted(state_again)
    for name, tensor in state.items():
        assert torch.equal(tensor, state_again[name]), name


def exported_logits_match(model: LanguageModel, tmp_path: Path) -> None:
    """The HF model written by ``export_hf`` computes our logits."""
    from meshlm.hf.files import write_hf_folder

    hf_config, tensors, _ = export_hf(model)
    write_hf_folder(tmp_path / "exported", hf_config, tensors)
    assert_same_logits(load_hf(tmp_path / "exported"), model, random_ids())
