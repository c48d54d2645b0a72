"""A LoRA model to Hugging Face (meshlm/hf/peft_export.py, meshlm/hf/convert.py): the merged model,
the base model alone, and the adapters alone as a PEFT folder that ``peft`` loads onto that base
and that computes our logits (Llama: attention and MLP adapters; Nemotron-H: Mamba-2 in/out
projections and the shared expert too)."""

from __future__ import annotations

import json

import pytest
import torch

from meshlm.checkpoint.model_files import save_model
from meshlm.cli import main
from meshlm.errors import CheckpointError
from meshlm.hf import meshlm_to_hf
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from tests.hf.helpers import VOCAB, assert_same_logits, load_hf, random_ids

MODELS = {
    "llama": dict(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                  init_std=0.1),
    "nemotron_h": dict(vocab_size=VOCAB, hidden_size=32, pattern="M*-E", mamba_head_dim=8, mamba_state_size=8,
                       mamba_chunk_size=8, position_embedding="none", mlp_activation="squared_relu",
                       ffn_hidden_size=40, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                       moe_score_function="sigmoid", moe_shared_expert_ffn_hidden_size=16, num_kv_heads=2,
                       init_std=0.1),
}


def lora_model(kind: str, folder, **lora) -> LanguageModel:
    """A LoRA model whose adapters are not zero (as after training), saved in ``folder``."""
    model = LanguageModel(ModelConfig(**MODELS[kind], lora_rank=4, **lora), seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".lora.b"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    save_model(model, folder)
    return model.eval()


@pytest.mark.parametrize("kind", list(MODELS))
def test_peft_loads_the_adapter_folder_onto_the_base_and_computes_our_logits(kind, tmp_path, capsys):
    from peft import PeftModel

    targets = {"lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj"]} \
        if kind == "nemotron_h" else {}  # PEFT refuses Mamba's out_proj (see the refusal test)
    model = lora_model(kind, tmp_path / "lora", lora_alpha=12, lora_dropout=0.05, **targets)
    assert main(["convert", "meshlm-to-hf", str(tmp_path / "lora"), str(tmp_path / "base"), "--base-only"]) == 0
    assert main(["convert", "meshlm-to-hf", str(tmp_path / "lora"), str(tmp_path / "adapter"), "--adapter-only",
                 "--base-model", "org/base"]) == 0
    assert "wrote PEFT LoRA adapter folder" in capsys.readouterr().out
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["peft_type"]) == (4, 12, "LORA")
    assert adapter_config["lora_dropout"] == 0.05  # (training only: the logits below are eval mode's)
    assert adapter_config["base_model_name_or_path"] == "org/base"
    base = load_hf(tmp_path / "base")
    ids = random_ids()
    with torch.no_grad():
        without = base(ids).logits
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    loaded = {name for name, _ in adapted.named_parameters() if "lora_" in name}
    assert len(loaded) == sum(".lora." in name for name in model.state_dict())  # every adapter has its place
    assert_same_logits(adapted, model, ids)
    assert (adapted(ids).logits - without).abs().max() > 0.05  # the adapters change the function
    merged = tmp_path / "merged"
    meshlm_to_hf(tmp_path / "lora", merged)
    assert_same_logits(load_hf(merged), model, ids)


def test_default_alpha_and_refusals(tmp_path):
    lora_model("llama", tmp_path / "lora")  # lora_alpha None: the rank (a scale of 1)
    meshlm_to_hf(tmp_path / "lora", tmp_path / "adapter", part="adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["lora_alpha"] == 4 and adapter_config["target_modules"] == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    save_model(LanguageModel(ModelConfig(**MODELS["llama"]), seed=0), tmp_path / "plain")
    with pytest.raises(CheckpointError, match="has no LoRA adapters"):
        meshlm_to_hf(tmp_path / "plain", tmp_path / "nothing", part="adapter")
    lora_model("nemotron_h", tmp_path / "hybrid")  # the default targets: Mamba's out_proj too
    with pytest.raises(CheckpointError, match="PEFT cannot load LoRA adapters on the Mamba out_proj"):
        meshlm_to_hf(tmp_path / "hybrid", tmp_path / "hybrid adapter", part="adapter")
    meshlm_to_hf(tmp_path / "hybrid", tmp_path / "hybrid merged")  # merged: fine
