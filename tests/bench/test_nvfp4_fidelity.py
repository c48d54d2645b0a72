"""bench/nvfp4_fidelity.py's measurements on a tiny hybrid (the bench itself runs for minutes; these do not).

- The bf16 config's gradient error against the bf16 reference is exactly zero; NVFP4's is not.
- The mean of K draws of the rounding noise: with stochastic rounding its error falls as K grows,
  with round-to-nearest every draw is the same gradient and the curve is flat.
- Keeping the first and last block in bf16 does not add error (all blocks in NVFP4 adds some).
- The captured weight-gradient operands multiply to the layer's own weight gradient, and the
  Hadamard transform changes nothing without quantization.
- Hand computations: the relative error, the fit of error(K)^2 = b^2 + v^2 / K, the parameter
  groups (a partition), the block crest factor; the verdicts follow the numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench import nvfp4_fidelity as fidelity
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.precision.recipes import Recipe

CONFIG = ModelConfig(vocab_size=64, hidden_size=64, pattern="M-*E", num_attention_heads=4, num_kv_heads=2,
                     ffn_hidden_size=128, mamba_head_dim=16, mamba_state_size=16, moe_num_experts=4, moe_top_k=2,
                     moe_ffn_hidden_size=64)


@pytest.fixture(scope="module")
def base():
    return fidelity.bf16_copy(LanguageModel(CONFIG, seed=0))


def batches(count: int, rows: int = 2, seq_len: int = 32) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, CONFIG.vocab_size, (rows, seq_len + 1), generator=generator) for _ in range(count)]
    return [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]} for ids in tokens]


def nvfp4(name: str, stochastic_rounding: bool = True, high_precision_layers: int = 1) -> fidelity.Variant:
    return fidelity.Variant(name, Recipe("nvfp4", stochastic_rounding=stochastic_rounding), high_precision_layers)


def test_variants_come_from_the_low_precision_bench_configs():
    assert fidelity.variant("bf16").recipe is None
    full, no_rht = fidelity.variant("nvfp4"), fidelity.variant("nvfp4_no_hadamard")
    assert (full.recipe.name, full.recipe.hadamard, full.recipe.stochastic_rounding, full.high_precision_layers) == \
        ("nvfp4", True, True, 1)
    assert not no_rht.recipe.hadamard and no_rht.recipe.stochastic_rounding
    assert not fidelity.variant("nvfp4_no_stochastic_rounding").recipe.stochastic_rounding
    assert fidelity.variant("nvfp4_all_layers").high_precision_layers == 0


def test_bf16_has_zero_gradient_error_and_nvfp4_has_some(base):
    groups = fidelity.parameter_groups(base, CONFIG.num_blocks)
    results, references = fidelity.gradient_fidelity(base, [fidelity.Variant("bf16", None, 0), nvfp4("nvfp4")],
                                                     batches(2), CONFIG.num_blocks, groups)
    assert len(references) == 2
    assert all(value == 0 for value in results["bf16"]["gradient_error"].values())
    assert results["bf16"]["abs_loss_diff"] == 0
    errors = results["nvfp4"]["gradient_error"]
    assert 0.01 < errors["all"] < 0.5 and errors["quantized_blocks_gemm_weights"] > errors["all"]
    assert results["nvfp4"]["abs_loss_diff"] > 0


def test_mean_of_draws_falls_with_stochastic_rounding_and_is_flat_with_nearest(base):
    names = fidelity.parameter_groups(base, CONFIG.num_blocks)["all"]
    batch = batches(1)[0]
    reference = fidelity.flat(fidelity.loss_and_gradient(base, batch)[1], names)
    curves = {}
    for label, stochastic in (("sr", True), ("nearest", False)):
        config = nvfp4(label, stochastic)
        model = fidelity.with_recipe(base, config, CONFIG.num_blocks)
        curves[label] = fidelity.mean_of_draws(model, config.recipe, batch, reference, names, draws=8)
    sr, nearest = curves["sr"]["error_of_mean"], curves["nearest"]["error_of_mean"]
    assert list(sr) == ["1", "2", "4", "8"]
    assert sr["1"] > sr["2"] > sr["4"] > sr["8"] and sr["8"] < 0.85 * sr["1"]
    assert len(set(nearest.values())) == 1  # every draw the same gradient
    assert curves["nearest"]["fitted_single_draw_noise"] == 0
    assert curves["sr"]["fitted_single_draw_noise"] > 0
    assert curves["sr"]["fitted_deterministic_error"] < sr["8"]


def test_bf16_first_and_last_blocks_do_not_add_error(base):
    groups = fidelity.parameter_groups(base, CONFIG.num_blocks)
    configs = [nvfp4("kept", False, 1), nvfp4("all", False, 0)]
    results, _ = fidelity.gradient_fidelity(base, configs, batches(2), CONFIG.num_blocks, groups)
    kept, every = results["kept"]["gradient_error"], results["all"]["gradient_error"]
    assert every["all"] > 2 * kept["all"]
    assert every["first_last_blocks"] > 2 * kept["first_last_blocks"]


def test_captured_operands_give_the_weight_gradient_and_the_transform_alone_changes_nothing(base):
    batch = batches(1)[0]
    captured, (loss, grads) = fidelity.capture_wgrad_operands(base, batch)
    # the same pass without capturing: a hooked layer runs its own forward, not fused with its
    # neighbours (meshlm/models/fused_linear.py), so the reference hooks the same layers, doing nothing
    handles = [module.register_forward_hook(lambda *args: None) for name, module in base.named_modules()
               if type(module) is torch.nn.Linear and name.startswith("blocks.")]
    reference_loss, reference = fidelity.loss_and_gradient(base, batch)
    for handle in handles:
        handle.remove()
    assert loss == reference_loss and all(torch.equal(grads[name], reference[name]) for name in grads)
    assert {"blocks.0.mixer.in_proj", "blocks.2.mixer.q_proj"} <= set(captured)
    for name, (grad, inputs) in captured.items():
        exact = grad.float().t() @ inputs.float()
        assert fidelity.relative_error(grads[f"{name}.weight"], exact) < 2e-2, name  # bf16 GEMM vs fp32
        grad_t, inputs_t = Recipe("nvfp4").wgrad_layout(grad.float(), inputs.float())
        assert fidelity.relative_error(grad_t @ inputs_t.t(), exact) < 1e-5, name


def test_outlier_case_and_per_layer_errors_are_real_quantization_errors(base):
    captured, _ = fidelity.capture_wgrad_operands(base, batches(1, rows=4)[0])
    grad, inputs = captured["blocks.1.mixer.up_proj"]
    case = fidelity.outlier_case(grad, inputs)
    for entry in case.values():
        assert 0.02 < entry["with_hadamard"] < 2 and 0.02 < entry["without_hadamard"] < 2
    assert case["outlier_tokens"]["input_crest"] > case["as_captured"]["input_crest"]
    assert case["outlier_channels"]["input_crest"] == case["as_captured"]["input_crest"]  # a channel scales whole rows
    layers = fidelity.hadamard_per_layer([captured], {"blocks.1.mixer.up_proj"})
    summary = fidelity.hadamard_summary(layers)
    assert summary["sr"]["layers"] == 1 and layers["blocks.1.mixer.up_proj"]["in_full_recipe"]
    # nearest-even is deterministic: the same operands give the same error twice
    again = fidelity.layer_wgrad_errors(grad, inputs, key=0)
    assert round(again["nearest_with_hadamard"], 5) == layers["blocks.1.mixer.up_proj"]["nearest_with_hadamard"]


def test_hand_computations():
    assert fidelity.relative_error(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])) == pytest.approx(
        math.sqrt(9 + 1) / 5)
    bias, noise = 0.03, 0.05
    curve = {k: math.sqrt(bias**2 + noise**2 / k) for k in (1, 2, 4, 8)}
    assert fidelity.fit_bias_and_noise(curve) == pytest.approx((bias, noise))
    assert fidelity.draw_sizes(16) == [1, 2, 4, 8, 16] and fidelity.draw_sizes(6) == [1, 2, 4]
    spike = torch.zeros(1, 16)
    spike[0, 3] = 5.0
    assert fidelity.block_crest(spike) == pytest.approx(4.0)  # amax / rms of one spike in 16
    assert fidelity.block_crest(torch.ones(2, 32)) == pytest.approx(1.0)


def test_parameter_groups_partition_the_model(base):
    groups = fidelity.parameter_groups(base, CONFIG.num_blocks)
    parts = [names for group, names in groups.items() if group != "all"]
    flat = [name for names in parts for name in names]
    assert sorted(flat) == sorted(groups["all"]) and len(set(flat)) == len(flat)
    assert "blocks.1.mixer.up_proj.weight" in groups["quantized_blocks_gemm_weights"]
    assert "blocks.0.mixer.in_proj.weight" in groups["first_last_blocks"]
    assert any(name.startswith("blocks.3.") for name in groups["first_last_blocks"])
    assert "embedding.weight" in groups["embedding_and_rest"]


def report(sr_last: float, nearest_last: float, with_rht: float, all_layers: float) -> dict:
    gradient = {name: {"gradient_error": {"all": error}, "abs_loss_diff": error}
                for name, error in (("nvfp4", 0.1), ("nvfp4_no_hadamard", 0.1), ("nvfp4_all_layers", all_layers))}
    return {"gradient_error": gradient,
            "bias": {"nvfp4": {"error_of_mean": {"1": 0.2, "4": sr_last}},
                     "nvfp4_no_stochastic_rounding": {"error_of_mean": {"1": nearest_last, "4": nearest_last}}},
            "hadamard": {"summary": {"sr": {"with_hadamard": with_rht, "without_hadamard": 0.15}},
                         "outlier_case": {"outlier_tokens": {"with_hadamard": 0.2, "without_hadamard": 0.3}}}}


def test_effects_follow_the_numbers():
    effects, targets = fidelity.effects(report(sr_last=0.1, nearest_last=0.15, with_rht=0.1, all_layers=0.3))
    assert targets == {"nvfp4_no_hadamard_worse_than_nvfp4": True, "nvfp4_no_stochastic_rounding_worse_than_nvfp4": True,
                       "nvfp4_all_layers_worse_than_nvfp4": True}
    assert effects["nvfp4_no_stochastic_rounding"]["nearest_mean_error_flat"]
    assert effects["nvfp4_no_hadamard"]["outlier_tokens_worse"]
    _, targets = fidelity.effects(report(sr_last=0.2, nearest_last=0.15, with_rht=0.2, all_layers=0.05))
    assert not any(targets.values())


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--draws", "0"], ["--warmup-steps", "-1"]])
def test_bad_counts_are_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        fidelity.parse_args(argv)
    assert stopped.value.code == 2
    assert "--batches and --draws must be at least 1 and --warmup-steps at least 0" in capsys.readouterr().err
