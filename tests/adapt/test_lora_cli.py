"""``meshlm merge-lora`` and the merge on export (meshlm/adapt/lora_cli.py, meshlm/hf/convert.py)."""

from __future__ import annotations

import json

import pytest
import torch

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.cli import main
from meshlm.hf.convert import meshlm_to_hf
from meshlm.hf.files import open_hf_tensors
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

CONFIG = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_kv_heads=2, pattern="*-*-", lora_rank=4,
              lora_alpha=16)


def lora_folder(path, dtype=torch.float32):
    """A LoRA model folder whose adapters are not zero (as after training), with an 'hf' section."""
    model = LanguageModel(ModelConfig(**CONFIG), seed=0)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".lora.b"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    save_model(model.to(dtype), path, extra_config={"hf": {"eos_token_id": 3}})
    return model


def test_merge_writes_a_plain_model_with_the_same_outputs(tmp_path, capsys):
    model = lora_folder(tmp_path / "lora").eval()
    assert main(["merge-lora", str(tmp_path / "lora"), str(tmp_path / "merged")]) == 0
    assert "14 LoRA adapters of rank 4 folded" in capsys.readouterr().out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lora", "merged"]  # no temporary folder left
    merged = load_model(tmp_path / "merged").eval()
    assert merged.config.lora_rank == 0 and not any(".lora." in name for name in merged.state_dict())
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["hf"] == {"eos_token_id": 3}
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(merged(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    weight = model.blocks[0].mixer.q_proj
    expected = weight.weight + 4.0 * weight.lora.b @ weight.lora.a  # lora_alpha / lora_rank = 4
    torch.testing.assert_close(merged.blocks[0].mixer.q_proj.weight, expected, rtol=1e-6, atol=1e-7)


def test_hf_export_of_a_lora_model_is_the_export_of_its_merge(tmp_path):
    lora_folder(tmp_path / "lora", dtype=torch.bfloat16)
    assert main(["merge-lora", str(tmp_path / "lora"), str(tmp_path / "merged")]) == 0
    meshlm_to_hf(tmp_path / "lora", tmp_path / "hf from lora")
    meshlm_to_hf(tmp_path / "merged", tmp_path / "hf from merged")
    first, second = (hf_tensors(tmp_path / name) for name in ("hf from lora", "hf from merged"))
    assert sorted(first) == sorted(second) and not any("lora" in name for name in first)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert first["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # the sum is stored in W's dtype


def hf_tensors(directory) -> dict[str, torch.Tensor]:
    with open_hf_tensors(directory) as files:
        return {name: handle.load() for name, handle in files.tensors.items()}


@pytest.mark.parametrize("case, words", [("no adapters", "has no LoRA adapters"), ("out exists", "already exists")])
def test_refusals_are_one_sentence(tmp_path, capsys, case, words):
    if case == "no adapters":
        save_model(LanguageModel(ModelConfig(**{**CONFIG, "lora_rank": 0}), seed=0), tmp_path / "lora")
    else:
        lora_folder(tmp_path / "lora")
        (tmp_path / "merged").mkdir()
    assert main(["merge-lora", str(tmp_path / "lora"), str(tmp_path / "merged")]) == 2
    error = capsys.readouterr().err.strip()
    assert words in error and len(error.splitlines()) == 1, error


@pytest.mark.parametrize("command", [["upcycle", "{model}", "{out}", "--experts", "4", "--top-k", "2"],
                                     ["prune", "{model}", "{out}", "--calibration", "{model}", "--hidden", "16"],
                                     ["adapt-vocab", "{model}", "--tokenizer", "{model}", "{out}"]],
                         ids=["upcycle", "prune", "adapt-vocab"])
def test_commands_that_rewrite_weights_ask_for_the_merge_first(tmp_path, capsys, command):
    lora_folder(tmp_path / "lora")
    argv = [word.format(model=tmp_path / "lora", out=tmp_path / "out") for word in command]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert "holds a LoRA model" in error and "meshlm merge-lora" in error and len(error.splitlines()) == 1, error
    assert not (tmp_path / "out").exists()


def test_generation_folds_the_adapters_in_at_load(tmp_path, capsys):
    """``meshlm generate`` loads a LoRA model merged (no extra GEMMs per token): its tensors are
    those of the ``merge-lora`` folder, bit for bit, and so are its greedy tokens."""
    model = lora_folder(tmp_path / "lora").eval()
    assert main(["merge-lora", str(tmp_path / "lora"), str(tmp_path / "merged")]) == 0
    loaded = load_model(tmp_path / "lora", merge_lora=True)
    merged = load_model(tmp_path / "merged")
    assert loaded.config == merged.config and loaded.config.lora_rank == 0
    assert all(torch.equal(value, merged.state_dict()[name]) for name, value in loaded.state_dict().items())
    assert load_model(tmp_path / "lora").config.lora_rank == 4  # as trained unless asked
    capsys.readouterr()
    outputs = []
    for folder in ("lora", "merged"):
        assert main(["generate", str(tmp_path / folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                     "--greedy", "--json", "--device", "cpu"]) == 0
        outputs.append(json.loads(capsys.readouterr().out.strip())["ids"])
    assert outputs[0] == outputs[1] and outputs[0]  # (ends at the folder's eos id 3)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
