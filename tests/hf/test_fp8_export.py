"""``meshlm convert meshlm-to-hf --quantize fp8`` (``meshlm/hf/fp8_export.py``).

Each case exports one meshlm checkpoint twice, plain and with ``--quantize fp8``, and checks:

1. the files: the FP8 export holds the plain export's tensors plus one ``weight_scale_inv`` per
   quantized weight; every tensor left alone is bit-identical to the plain export's; each FP8
   weight, dequantized here (codes times their 128 x 128 block's scale, written out
   independently of meshlm's quantizer), is within E4M3's rounding error of the plain weight,
   and each scale is DeepSeek-V3's ``amax(block) / 448``;
2. config.json's ``quantization_config`` and the modules it keeps in high precision (ragged
   weights, routers, lm_head);
3. transformers on CPU: ``AutoModelForCausalLM.from_pretrained`` loads the FP8 folder through
   its fine-grained FP8 quantizer, which on a machine without a GPU dequantizes while loading (we
   ask for that explicitly with ``FineGrainedFP8Config(dequantize=True)``, so a CUDA machine runs
   the same path). Its weights must equal, bit for bit, a model loaded from our own
   dequantization of the same files -- so transformers reads the codes, the scale grid and the
   per-expert merges exactly as we meant them -- and its logits must be close to the plain
   export's (tolerance reasoning in ``test_transformers_loads_fp8_export_on_cpu``);
4. transformers' FP8 modules (the path a GPU runs; built and loaded on CPU, no forward): every
   FP8Linear and FP8Experts holds our codes and scales bit for bit, with no missing or
   unexpected key.

transformers refuses any FP8 folder unless ``accelerate`` is installed, even to dequantize; parts
3 and 4 are skipped without it.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaConfig, NemotronHConfig, Qwen3MoeConfig  # noqa: E402

from meshlm.checkpoint.model_files import load_model, save_model  # noqa: E402
from meshlm.checkpoint.safetensors_stream import PlannedTensor  # noqa: E402
from meshlm.cli import main  # noqa: E402
from meshlm.hf.fp8_export import quantize_plan  # noqa: E402

from .helpers import VOCAB, load_hf, random_ids, save_random_hf_model  # noqa: E402

BLOCK = 128
E4M3_MAX = 448.0
E4M3_RELATIVE_STEP = 2.0 ** -4
"""Half the spacing of E4M3's normal numbers relative to their size (3 mantissa bits)."""
E4M3_SUBNORMAL_STEP = 2.0 ** -10
"""Half the spacing of E4M3's subnormals (2^-9), in units of the block's scale."""
NO_SPECIAL_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

# Dimensions are multiples of 128 where a weight should be quantized, and deliberately not where
# it should stay high precision (Nemotron-H's in_proj has 2*128 + 2*2*16 + 8 = 328 rows, its
# k/v projections 2 heads x 32 = 64, its shared expert 192).
CASES = {
    "llama": (lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, initializer_range=0.1,
                                  **NO_SPECIAL_IDS),
              ["lm_head"]),
    "nemotron_h": (lambda: NemotronHConfig(
        vocab_size=VOCAB, hidden_size=128, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=4, time_step_min=1e-6, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128, moe_shared_expert_intermediate_size=192,
        initializer_range=0.1, **NO_SPECIAL_IDS),
                   ["lm_head", "backbone.layers.0.mixer.in_proj", "backbone.layers.1.mixer.gate",
                    "backbone.layers.1.mixer.experts",  # FP8, dequantized by transformers at load
                    "backbone.layers.1.mixer.shared_experts.up_proj", "backbone.layers.1.mixer.shared_experts.down_proj",
                    "backbone.layers.2.mixer.k_proj", "backbone.layers.2.mixer.v_proj"]),
    "qwen3_moe": (lambda: Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                         moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                         initializer_range=0.1, **NO_SPECIAL_IDS),
                  ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]),
}
QUANTIZED_COUNTS = {"llama": 2 * 7, "nemotron_h": 1 + 4 * 2 + 2 + 2, "qwen3_moe": 2 * (4 + 4 * 3)}
"""Weights stored in FP8 per case: llama 2 layers x q,k,v,o,gate,up,down; Nemotron-H out_proj, 4
experts x up,down, q,o, MLP up,down; Qwen3-MoE 2 layers x (q,k,v,o + 4 experts x gate,up,down)."""
PARAMS = [("llama", torch.float32), ("llama", torch.bfloat16), ("nemotron_h", torch.float32),
          ("qwen3_moe", torch.float32)]


def export_both(name: str, dtype: torch.dtype, root) -> tuple:
    """A meshlm checkpoint (from a random HF model, in ``dtype``) exported plain and as FP8 under ``root``."""
    save_random_hf_model(CASES[name][0](), root / "hf")
    source = root / "meshlm"
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert main(["convert", "hf-to-meshlm", str(root / "hf"), str(source)]) == 0
        if dtype != torch.float32:
            extra = json.loads((source / "config.json").read_text())["hf"]
            source = save_model(load_model(source).to(dtype), root / "meshlm_cast", extra_config={"hf": extra})
        assert main(["convert", "meshlm-to-hf", str(source), str(root / "plain")]) == 0
        assert main(["convert", "meshlm-to-hf", str(source), str(root / "fp8"), "--quantize", "fp8"]) == 0
    assert "block linears in FP8 E4M3 with 128x128 block scales; modules_to_not_convert: lm_head" in output.getvalue()
    return root / "plain", root / "fp8"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(name, dtype)`` -> (plain folder, FP8 folder), each case exported once for the module."""
    folders = {}

    def export(name: str, dtype: torch.dtype) -> tuple:
        if (name, dtype) not in folders:
            root = tmp_path_factory.mktemp(f"{name}_{str(dtype).removeprefix('torch.')}")
            folders[name, dtype] = export_both(name, dtype, root)
        return folders[name, dtype]

    return export


def dequantize(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """codes[r, c] * scale_inv[r // 128, c // 128] in fp32: the format's definition, written out."""
    rows, cols = codes.shape
    per_weight = scale_inv.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :cols]
    return codes.float() * per_weight


def block_amax(weight: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    blocks = weight.float().abs().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    return blocks.amax(dim=(1, 3))


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_fp8_export_files_and_config(name, dtype, exported):
    plain_dir, fp8_dir = exported(name, dtype)
    plain, fp8 = load_file(plain_dir / "model.safetensors"), load_file(fp8_dir / "model.safetensors")
    quantized = sorted(key for key, tensor in fp8.items() if tensor.dtype == torch.float8_e4m3fn)
    assert len(quantized) == QUANTIZED_COUNTS[name]
    assert sorted(fp8) == sorted([*plain, *(key + "_scale_inv" for key in quantized)])
    for key, tensor in plain.items():
        if key in quantized:
            continue
        assert tensor.dtype == fp8[key].dtype and torch.equal(tensor, fp8[key]), key
    for key in quantized:
        weight, codes, scale_inv = plain[key].float(), fp8[key], fp8[key + "_scale_inv"]
        assert key.endswith(".weight") and codes.shape == weight.shape
        assert scale_inv.dtype == torch.float32
        assert tuple(scale_inv.shape) == (weight.shape[0] // BLOCK, weight.shape[1] // BLOCK)
        # DeepSeek-V3's scale: the block's amax lands exactly on E4M3's largest value.
        assert torch.equal(scale_inv, block_amax(weight) / E4M3_MAX), key
        # Round to nearest: relative error <= 2^-4 for normal codes, <= 2^-10 scales for subnormal ones
        # (the 1e-6 covers fp32's own rounding of x / scale and code * scale).
        per_weight_scale = dequantize(torch.ones_like(weight), scale_inv)
        bound = (E4M3_RELATIVE_STEP * weight.abs() + E4M3_SUBNORMAL_STEP * per_weight_scale) * (1 + 1e-6)
        error = (dequantize(codes, scale_inv) - weight).abs()
        assert (error <= bound).all(), f"{key}: worst error / bound {(error / bound).max().item():.3f}"
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128],
                                             "modules_to_not_convert": CASES[name][1]}
    assert {key: value for key, value in config.items() if key != "quantization_config"} == \
        json.loads((plain_dir / "config.json").read_text())


def write_own_dequantization(plain_dir, fp8_dir, out_dir) -> None:
    """An unquantized HF folder holding our dequantization of the FP8 folder's weights."""
    plain, fp8 = load_file(plain_dir / "model.safetensors"), load_file(fp8_dir / "model.safetensors")
    tensors = {key: (dequantize(tensor, fp8[key + "_scale_inv"]).to(plain[key].dtype)
                     if tensor.dtype == torch.float8_e4m3fn else tensor)
               for key, tensor in fp8.items() if not key.endswith("_scale_inv")}
    out_dir.mkdir()
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text((plain_dir / "config.json").read_text())


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_transformers_loads_fp8_export_on_cpu(name, dtype, exported, tmp_path):
    """Tolerance of the logits against the plain export. Each quantized matrix carries E4M3's
    rounding error: at most 2^-4 of each weight (3 mantissa bits), about 2.6% RMS, independent
    from weight to weight. A token passes through up to 8 quantized matrices in a row in these
    2-layer models (v and o, gate/up and down, per layer), and random weights of std 0.1 amplify
    a perturbation rather than damp it: the logits move by 5-12% of their RMS (measured over the
    four cases). The bound, 25%, leaves twice that; the floor of 0.1% checks that the
    quantization is felt at all. The exact check is the weight comparison before it: a misread
    layout (block size, scale orientation, gate/up merge order) shows up there as a mismatch."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    plain_dir, fp8_dir = exported(name, dtype)
    write_own_dequantization(plain_dir, fp8_dir, tmp_path / "ours_dequantized")
    kept = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    fp8_model, info = AutoModelForCausalLM.from_pretrained(
        fp8_dir, output_loading_info=True,
        quantization_config=FineGrainedFP8Config(dequantize=True, modules_to_not_convert=kept))
    assert not any(info.values()), f"transformers reported {info} loading {fp8_dir}"
    reference = load_hf(tmp_path / "ours_dequantized")
    fp8_state, reference_state = fp8_model.state_dict(), reference.state_dict()
    assert sorted(fp8_state) == sorted(reference_state)
    for key, tensor in reference_state.items():
        assert tensor.dtype == dtype and torch.equal(fp8_state[key], tensor), key

    plain_model = load_hf(plain_dir)
    with torch.no_grad():
        expected = plain_model(random_ids()).logits.float()
        actual = fp8_model.eval()(random_ids()).logits.float()
    relative = ((actual - expected).norm() / expected.norm()).item()
    assert 1e-3 < relative < 0.25, f"relative RMS logits difference {relative:.4f}"


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.dtype == expected.dtype and torch.equal(actual.contiguous().view(torch.uint8),
                                                          expected.contiguous().view(torch.uint8))


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_fp8_modules_hold_our_codes_and_scales(name, exported, monkeypatch):
    """transformers' FP8 path, the one a GPU of compute capability >= 8.9 runs: nn.Linear swapped
    for FP8Linear and MoE experts for FP8Experts, loaded with our codes and scales unchanged (a
    fused ``gate_up_proj`` is gate then up, codes and scale rows alike). Its matmuls need a GPU,
    building and loading the model does not: we skip only the quantizer's environment check,
    which on a machine without one switches to dequantizing, and run no forward. Nemotron-H's
    routed experts come out dequantized (see ``meshlm/hf/fp8_export.py``)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None)
    _, fp8_dir = exported(name, torch.float32)
    model, info = AutoModelForCausalLM.from_pretrained(fp8_dir, output_loading_info=True)
    assert not any(info.values()), f"transformers reported {info} loading {fp8_dir}"
    files = load_file(fp8_dir / "model.safetensors")
    stored = {key.replace("backbone.", "model.", 1): tensor for key, tensor in files.items()}  # Nemotron-H's prefix
    loaded_fp8 = 0
    for module_name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            for param in ("weight", "weight_scale_inv"):
                assert same_bits(getattr(module, param), stored[f"{module_name}.{param}"]), f"{module_name}.{param}"
            loaded_fp8 += 1
        elif isinstance(module, FP8Experts):
            for expert in range(module.num_experts):
                prefix = f"{module_name}.{expert}"
                for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
                    for suffix in ("", "_scale_inv"):
                        expected = torch.cat([stored[f"{prefix}.{part}.weight{suffix}"] for part in parts])
                        assert same_bits(getattr(module, fused + suffix)[expert], expected), f"{prefix} {fused}{suffix}"
                loaded_fp8 += 3
        elif module_name.endswith("mixer.experts"):  # Nemotron-H: dequantized while loading
            for expert in range(module.num_experts):
                for part in ("up_proj", "down_proj"):
                    key = f"{module_name}.{expert}.{part}.weight"
                    expected = dequantize(stored[key], stored[key + "_scale_inv"])
                    assert torch.equal(getattr(module, part)[expert], expected), key
                    loaded_fp8 += 1
    assert loaded_fp8 == QUANTIZED_COUNTS[name]


def test_quantize_plan_keeps_ragged_weights_and_routers():
    """Which tensors become FP8, and that the scale may be asked for before the codes."""
    torch.manual_seed(0)
    weights = {"model.layers.0.mlp.up_proj.weight": torch.randn(256, 128),   # 2 x 1 blocks: FP8
               "model.layers.0.mlp.down_proj.weight": torch.randn(128, 200),  # ragged: kept
               "model.layers.0.mlp.gate.weight": torch.randn(8, 128),         # router: kept
               "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(128, 130),
               "model.layers.0.input_layernorm.weight": torch.randn(128),
               "model.embed_tokens.weight": torch.randn(VOCAB, 128),
               "lm_head.weight": torch.randn(VOCAB, 128)}
    plan = {key: PlannedTensor(tuple(value.shape), value.dtype, lambda value=value: value)
            for key, value in weights.items()}
    quantized, kept = quantize_plan(plan)
    assert kept == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts"]
    scale = quantized["model.layers.0.mlp.up_proj.weight_scale_inv"]
    assert scale.shape == (2, 1) and scale.dtype == torch.float32
    scale_first = scale.produce()
    codes = quantized["model.layers.0.mlp.up_proj.weight"].produce()
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(scale_first, scale.produce())
    assert sorted(quantized) == sorted([*weights, "model.layers.0.mlp.up_proj.weight_scale_inv"])


def test_fp8_export_refuses_a_model_with_nothing_to_quantize(tmp_path, capsys):
    hf_config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, **NO_SPECIAL_IDS)
    save_random_hf_model(hf_config, tmp_path / "hf")
    assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "meshlm")]) == 0
    assert main(["convert", "meshlm-to-hf", str(tmp_path / "meshlm"), str(tmp_path / "fp8"), "--quantize", "fp8"]) == 2
    error = capsys.readouterr().err
    assert "--quantize fp8" in error and "multiple of 128" in error and "without --quantize" in error
    assert not (tmp_path / "fp8").exists()
