"""Importing block-wise FP8 folders (``meshlm/hf/fp8_import.py``): DeepSeek-V3's released format.

Each case writes an FP8 folder with ``meshlm convert meshlm-to-hf --quantize fp8`` (the format
transformers' fine-grained FP8 loader reads; ``tests/hf/test_fp8_export.py``) and imports it:

1. every imported weight is the codes times their 128 x 128 block's scale, written out here, in the
   dtype config.json names; every tensor left in high precision is the plain export's; Phi-3's fused
   projections stored in FP8 too, so import cuts rows of a dequantized weight;
2. transformers, loading the same FP8 folder and dequantizing it (``FineGrainedFP8Config``), computes
   our imported model's logits (skipped without ``accelerate``, which transformers needs for FP8);
3. DeepSeek-V3, whose FP8 folders were refused before, imports one (multi-head latent attention,
   routed and shared experts) with the same dequantized weights;
4. the refusals: other quantization methods, static activation scales, a misshapen scale grid.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, Phi3Config, Qwen3MoeConfig  # noqa: E402

from meshlm.checkpoint.model_files import load_model, save_model  # noqa: E402
from meshlm.cli import main  # noqa: E402
from meshlm.errors import CheckpointError, ConfigError  # noqa: E402
from meshlm.hf import hf_to_meshlm  # noqa: E402
from meshlm.hf.files import write_hf_folder  # noqa: E402
from meshlm.hf.fp8_import import dequantize_blocks, fp8_blocks  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402
from meshlm.precision.formats.blockwise import quantize_fp8_weight_blocks  # noqa: E402
from meshlm.precision.formats.fp8 import E4M3  # noqa: E402

from .helpers import VOCAB, assert_same_logits, random_ids, save_random_hf_model  # noqa: E402

BLOCK = 128
NO_SPECIAL_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
CASES = {
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, initializer_range=0.1,
                                 **NO_SPECIAL_IDS),
    "qwen3_moe": lambda: Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                        moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                        initializer_range=0.1, **NO_SPECIAL_IDS),
    # fused qkv_proj and gate_up_proj: import cuts the dequantized tensor's rows (DerivedTensor.split)
    "phi3": lambda: Phi3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, initializer_range=0.1,
                               **NO_SPECIAL_IDS),
}


def quiet(*argv: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(list(argv)) == 0


def export_plain_and_fp8(source, root) -> tuple:
    quiet("convert", "meshlm-to-hf", str(source), str(root / "plain"))
    quiet("convert", "meshlm-to-hf", str(source), str(root / "fp8"), "--quantize", "fp8")
    return root / "plain", root / "fp8"


def written_out(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """codes[r, c] * scale_inv[r // 128, c // 128] in fp32: the format's definition."""
    rows, columns = codes.shape
    grid = scale_inv.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :columns]
    return codes.float() * grid


def assert_imported_weights_are_the_dequantized_codes(fp8_dir, plain_dir, imported_dir, dtype) -> int:
    """Export the imported model folder plainly (as the class it came from) and compare it, tensor by
    tensor, with the FP8 folder written out: dequantized where FP8, as the plain export elsewhere.
    Returns how many were FP8."""
    fp8, plain = load_file(fp8_dir / "model.safetensors"), load_file(plain_dir / "model.safetensors")
    again_dir = fp8_dir.parent / "again"
    quiet("convert", "meshlm-to-hf", str(imported_dir), str(again_dir))
    again = load_file(again_dir / "model.safetensors")
    assert sorted(again) == sorted(plain)
    quantized = 0
    for name, tensor in again.items():
        if fp8.get(name) is not None and fp8[name].dtype == torch.float8_e4m3fn:
            quantized += 1
            assert tensor.dtype == dtype and torch.equal(tensor, written_out(fp8[name], fp8[name + "_scale_inv"])
                                                         .to(dtype)), name
        else:
            assert torch.equal(tensor, plain[name]), name
    return quantized


FUSED = ("qkv_proj", "gate_up_proj")
"""Phi-3's fused projections, which meshlm's FP8 export leaves in high precision."""


def quantize_fused_projections(fp8_dir) -> None:
    """Store Phi-3's fused projections in FP8 too (as a release may), so that import must cut the
    rows of a dequantized weight; transformers is told to convert them as well."""
    tensors = load_file(fp8_dir / "model.safetensors")
    for name in [name for name in tensors if name.endswith(tuple(f"{fused}.weight" for fused in FUSED))]:
        quantized = quantize_fp8_weight_blocks(tensors[name], E4M3, power_of_two=False, block_size=BLOCK)
        tensors[name], tensors[name + "_scale_inv"] = quantized.codes, quantized.scales
    config = json.loads((fp8_dir / "config.json").read_text())
    kept = config["quantization_config"]["modules_to_not_convert"]
    config["quantization_config"]["modules_to_not_convert"] = [module for module in kept
                                                               if not module.endswith(FUSED)]
    write_hf_folder(fp8_dir, config, tensors, overwrite=True)


@pytest.mark.parametrize("name", list(CASES))
def test_an_fp8_folder_imports_as_its_dequantized_weights_and_transformers_logits(name, tmp_path):
    save_random_hf_model(CASES[name](), tmp_path / "hf")
    quiet("convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "meshlm"))
    plain_dir, fp8_dir = export_plain_and_fp8(tmp_path / "meshlm", tmp_path)
    if name == "phi3":
        quantize_fused_projections(fp8_dir)
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    out, _, _ = hf_to_meshlm(fp8_dir, tmp_path / "imported")
    model = load_model(out)
    quantized = assert_imported_weights_are_the_dequantized_codes(fp8_dir, plain_dir, out, torch.float32)
    # per layer: llama q, k, v, o, gate, up, down; qwen3_moe q, k, v, o and 4 x 3 experts; phi3 qkv, o, gate_up, down
    assert quantized == {"llama": 2 * 7, "qwen3_moe": 2 * (4 + 4 * 3), "phi3": 2 * 4}[name]
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    kept = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    reference = AutoModelForCausalLM.from_pretrained(
        fp8_dir, quantization_config=FineGrainedFP8Config(dequantize=True, modules_to_not_convert=kept))
    assert_same_logits(reference.eval(), model, random_ids())


def test_fp8_weights_become_the_dtype_config_json_names(tmp_path):
    save_random_hf_model(CASES["llama"](), tmp_path / "hf")
    quiet("convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "meshlm"))
    extra = json.loads((tmp_path / "meshlm" / "config.json").read_text())["hf"]
    source = save_model(load_model(tmp_path / "meshlm").to(torch.bfloat16), tmp_path / "bf16",
                        extra_config={"hf": extra})
    plain_dir, fp8_dir = export_plain_and_fp8(source, tmp_path)
    out, _, _ = hf_to_meshlm(fp8_dir, tmp_path / "imported")
    model = load_model(out)
    assert model.blocks[0].mixer.q_proj.weight.dtype == torch.bfloat16
    assert assert_imported_weights_are_the_dequantized_codes(fp8_dir, plain_dir, out, torch.bfloat16) == 14


def test_a_deepseek_v3_fp8_folder_imports(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=128, pattern="*-*E", num_attention_heads=4,
                         attention_type="mla", mla_q_lora_rank=128, mla_kv_lora_rank=128, mla_qk_nope_head_dim=32,
                         mla_qk_rope_head_dim=32, mla_v_head_dim=32, ffn_hidden_size=256, moe_num_experts=4,
                         moe_top_k=2, moe_ffn_hidden_size=128, moe_shared_expert_ffn_hidden_size=128,
                         moe_score_function="sigmoid", moe_normalize_topk=True, norm_eps=1e-6, init_std=0.1)
    source = save_model(LanguageModel(config), tmp_path / "ours")
    plain_dir, fp8_dir = export_plain_and_fp8(source, tmp_path)
    assert json.loads((fp8_dir / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    out, imported_config, _ = hf_to_meshlm(fp8_dir, tmp_path / "imported")
    assert imported_config.to_dict() == config.to_dict()
    quantized = assert_imported_weights_are_the_dequantized_codes(fp8_dir, plain_dir, out, torch.float32)
    # per layer q_a, q_b, kv_b and o (kv_a's 160 rows are off the grid), the MLP, 4 experts, the shared expert
    assert quantized == 2 * 4 + 3 + 4 * 3 + 3


def test_dequantization_takes_ragged_blocks_and_stacked_experts():
    generator = torch.Generator().manual_seed(0)
    codes = (torch.randn(2, 200, 130, generator=generator) * 50).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 2, 2, generator=generator) + 0.5
    ours = dequantize_blocks(codes, scales, (BLOCK, BLOCK), torch.float32)
    for expert in range(2):
        assert torch.equal(ours[expert], written_out(codes[expert], scales[expert]))
    with pytest.raises(ValueError, match="does not fit weights of shape"):
        dequantize_blocks(codes, scales[:, :1], (BLOCK, BLOCK), torch.float32)


def test_unread_quantizations_and_broken_grids_are_refused(tmp_path):
    where = "folder/config.json"
    assert fp8_blocks({}, (), where) is None
    assert fp8_blocks({"quantization_config": {"quant_method": "mxfp4"}}, ("mxfp4",), where) is None
    assert fp8_blocks({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}}, (), where) \
        == (64, 32)
    with pytest.raises(ConfigError, match="quant_method='gptq' is not read; meshlm reads 'fp8' folders"):
        fp8_blocks({"quantization_config": {"quant_method": "gptq"}}, (), where)
    with pytest.raises(ConfigError, match="activation_scheme='static'"):
        fp8_blocks({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, (), where)
    save_random_hf_model(CASES["llama"](), tmp_path / "hf")
    quiet("convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "meshlm"))
    _, fp8_dir = export_plain_and_fp8(tmp_path / "meshlm", tmp_path)
    tensors = load_file(fp8_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(2, 2)
    broken = tmp_path / "broken"
    write_hf_folder(broken, json.loads((fp8_dir / "config.json").read_text()), tensors)
    with pytest.raises(CheckpointError, match=r"q_proj.weight_scale_inv has shape \(2, 2\), but .* needs \(1, 1\)"):
        hf_to_meshlm(broken, tmp_path / "never")
    assert not (tmp_path / "never").exists()
