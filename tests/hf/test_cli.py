"""``meshlm convert`` end to end, and the done-when check: a converted model generates exactly the
tokens transformers generates from the same weights."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import (CohereConfig, FalconConfig, GPTNeoXConfig, LlamaConfig, Mamba2Config,  # noqa: E402
                          NemotronHConfig, PhiConfig)

from meshlm.cli import main  # noqa: E402

from .helpers import VOCAB, load_hf, save_random_hf_model  # noqa: E402

PROMPT = [5, 17, 3, 42, 8, 1, 60]
NEW_TOKENS = 12
NO_SPECIAL_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # so neither side stops early

HF_CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, **NO_SPECIAL_IDS),
    # a parallel residual and a quarter of each head rotated: the cached path and the decode step
    "gpt_neox": lambda: GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, initializer_range=0.1, **NO_SPECIAL_IDS),
    # one key/value head, one norm for attention and MLP side by side (Falcon-7B's layer)
    "falcon": lambda: FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   ffn_hidden_size=64, initializer_range=0.1, **NO_SPECIAL_IDS),
    # one norm for attention and MLP, a bias on the output head, 0.4 of each head rotated (Phi-2's layer)
    "phi": lambda: PhiConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, initializer_range=0.1, **NO_SPECIAL_IDS,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.4}),
    # interleaved rotary pairs (reordered on import), scaled logits, one bias-free LayerNorm (Command R)
    "cohere": lambda: CohereConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, logit_scale=2.0,
                                   initializer_range=0.2, **NO_SPECIAL_IDS),
    "mamba2": lambda: Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=16,
                                   n_groups=2, num_hidden_layers=2, chunk_size=4, **NO_SPECIAL_IDS),
    # time_step_min is also Nemotron-H's dt clamp, which transformers skips in single-token decoding;
    # keep it below every dt so both decoding paths agree (meshlm clamps in both).
    "nemotron_h": lambda: NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8,
        mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=4, time_step_min=1e-6, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        initializer_range=0.1, **NO_SPECIAL_IDS),
}


def generate_ids(capsys, model_dir) -> list[int]:
    argv = ["generate", str(model_dir), "--greedy", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-new-tokens", str(NEW_TOKENS), "--json", "--device", "cpu"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ids"]


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_converted_model_generates_what_transformers_generates(name, tmp_path, capsys):
    hf_model = save_random_hf_model(HF_CONFIGS[name](), tmp_path / "hf", noise=0.0)
    assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "meshlm")]) == 0
    assert "wrote meshlm model" in capsys.readouterr().out
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS)[0, len(PROMPT):].tolist()
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 2
    assert generate_ids(capsys, tmp_path / "meshlm") == expected


def test_meshlm_to_hf_command_and_architecture_override(tmp_path, capsys):
    save_random_hf_model(HF_CONFIGS["mamba2"](), tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")
    assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "meshlm")]) == 0
    assert (tmp_path / "meshlm" / "tokenizer_config.json").is_file()
    assert main(["convert", "meshlm-to-hf", str(tmp_path / "meshlm"), str(tmp_path / "as_nemotron"),
                 "--architecture", "NemotronHForCausalLM"]) == 0
    assert "NemotronHForCausalLM" in capsys.readouterr().out
    assert load_hf(tmp_path / "as_nemotron").config.layers_block_type == ["linear_attention"] * 2
    assert (tmp_path / "as_nemotron" / "tokenizer_config.json").is_file()
    assert main(["convert", "meshlm-to-hf", str(tmp_path / "meshlm"), str(tmp_path / "as_llama"),
                 "--architecture", "LlamaForCausalLM"]) == 2
    error = capsys.readouterr().err
    assert "cannot be written as LlamaForCausalLM" in error and "model.pattern='MM'" in error


def test_unsupported_architecture_is_named(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["BloomForCausalLM"]}))
    assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "BloomForCausalLM is not supported" in error and "LlamaForCausalLM" in error


def test_missing_and_misshaped_tensors_are_named(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    save_random_hf_model(HF_CONFIGS["llama"](), tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, weights, metadata={"format": "pt"})
    assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "missing tensors model.layers.1.mlp.up_proj.weight" in error
    assert "model.layers.0.self_attn.k_proj.weight has shape (8, 32), but config.json implies (16, 32)" in error
    assert not (tmp_path / "out").exists()  # nothing written on failure


def test_non_empty_output_needs_overwrite(tmp_path, capsys):
    save_random_hf_model(HF_CONFIGS["llama"](), tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "output folder exists and is not empty" in error and "--overwrite" in error
    assert (tmp_path / "out" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "out"), "--overwrite"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "notes.txt").is_file()
