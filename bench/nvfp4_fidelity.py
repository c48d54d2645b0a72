"""What each part of the NVFP4 recipe does to the gradients: error, bias and the weight-gradient GEMM.

    python -m bench.nvfp4_fidelity [--warmup-steps N] [--batches B] [--draws K] [--warm-state FILE]
                                   [--out FILE]

"Pretraining Large Language Models with NVFP4" (NVIDIA 2025, arXiv 2509.25149) argues for each
part of its recipe by what it does to the *gradients*, not by a loss curve a short run could
show: 16 x 16 weight blocks so that the forward and backward see the same weight, a random
Hadamard transform (RHT) on the weight-gradient GEMM's operands to spread outliers across a
block, stochastic rounding (SR) of gradients so that their rounding errors average out instead
of adding up, and a few blocks kept in bf16. ``bench/low_precision.py`` trains 60 CPU steps under
each ablation and cannot tell them apart (the validation losses differ by less than run-to-run
noise). This bench measures the quantities themselves, deterministically, in a few minutes:

1. **Gradient error.** The demo hybrid (``configs/demo.yaml``) is first trained ``--warmup-steps``
   steps in bf16 without a recipe (the ``bench.low_precision`` shape: 8 x 128 tokens a step), so
   its activations and gradients have the structure of a model that is learning; that state is
   kept in memory and every config starts from it. On ``--batches`` fixed batches of the next
   training samples each config computes the loss and the whole model's gradient (in bf16, the
   parameters' dtype), and is compared with the unquantized bf16 gradient of the same batch:
   ``||g_q - g_ref|| / ||g_ref||`` for the whole model and per parameter group (the GEMM weights
   of the blocks the full recipe quantizes, the other parameters of those blocks, the first and
   last block, and the embedding and final norm), and the loss difference, median over batches.
2. **Bias (what stochastic rounding buys).** The rounding noise is hashed from (seed, optimizer
   step, layer, GEMM operand) and the value rounded (``meshlm/precision/formats/hashed_noise.py``),
   so setting the recipe's ``step`` to ``--draws`` different values gives independent draws of
   the noise on the *same* weights and batch. The mean of K draws is compared with ``g_ref`` for
   K = 1, 2, 4, ... (each K: averaged over the ``draws / K`` disjoint groups). With SR the
   rounding is unbiased (E[round(x)] = x, and the backward pass is linear in the gradient it
   carries), so the error of the mean falls like ``sqrt(b^2 + v^2 / K)`` towards ``b``, the part
   SR cannot remove (the forward pass's round-to-nearest activations and weights); fitted, ``b``
   and ``v`` are reported. With round-to-nearest every draw is the same and the curve is flat:
   its error does not average away over steps, which is the paper's argument for SR.
3. **Hadamard.** Every linear layer's weight-gradient operands (``dY`` and ``X``, captured in the
   bf16 reference backward) are quantized as the recipe does, with and without the transform
   (with SR as in the recipe, and with round-to-nearest), and ``dY^T X`` is compared with the
   exact product (fp32 GEMM on the dequantized operands, isolating the quantization from bf16
   accumulation). Beside it, each operand's *block crest factor* (mean over the 1 x 16 blocks
   along the tokens of amax / rms: 4 for one spike in a block, about 2.1 for Gaussian values),
   which the transform brings to the Gaussian value. Whether that lowers the GEMM's error is what
   is measured: E2M1 is a floating-point grid, fine near zero (0, 0.5, 1, 1.5 times the block
   step) and coarse at the top (4, 6), so a block with one spike is already held well (the spike
   is the block's amax, exact up to the scale's rounding; its neighbours fall in the fine part),
   while the transform moves all 16 values up into the coarse part. A controlled case on one
   layer: its input with ``OUTLIER_FRACTION`` of the tokens scaled by ``OUTLIER_SCALE`` (rows of
   ``X``: what the transform spreads), the same with those tokens' output gradients divided by it
   (spikes that set the block scales without dominating the product), and channels scaled instead
   (columns of ``X``: each is a row of ``X^T`` whose blocks scale together, nothing to spread).
4. **bf16 first and last block.** ``nvfp4_all_layers`` in the gradient-error table.

``effects`` states for each ablation whether removing the part made its quantity worse (computed
from the numbers): the transform's by the real layers' median wgrad-GEMM error, SR's by the error
of the mean of all draws, the bf16 blocks' by the whole-model gradient error; ``targets`` holds
those booleans. A readable table goes to stderr; one JSON object to stdout (and ``--out``).
``fp8_tensorwise`` is measured too, for scale.

Cost on an idle 2-core CPU without bf16 instructions (every bf16 matmul emulated in software):
the warm-up about 4 s a step, then ``batches x 6 + draws x 2`` forward-backward passes of 4-5 s
each (defaults: 40 steps, 4 batches, 8 draws: about 3 + 4 minutes). ``--warm-state FILE`` keeps
the warmed-up model: the next run with the same ``--warmup-steps`` loads it and skips the warm-up.

Measured at the defaults (torch 2.13 CPU, 2-core AMD EPYC shared with other jobs: 20 minutes, the
warm-up 14 s a step): whole-model gradient error against bf16 10.9% under nvfp4 (31% on the
quantized blocks' GEMM weights), 31.7% with every block in NVFP4; the mean of K draws under SR
10.7, 9.9, 9.4, 9.2% for K = 1, 2, 4, 8 (fitted floor 9.0%), round-to-nearest a flat 10.4%; the
Hadamard transform *raised* the wgrad GEMM's error (median over the 18 quantized layers 12.8%
against 12.4% without; lower in 4 of them; +30-40% on the down-projections, whose squared-ReLU
inputs are sparse); every loss within 0.02% of bf16's.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from bench.low_precision import ABLATIONS, CONFIGS, DEFAULTS, DEMO_CONFIG, DEMO_DATA, machine, run_overrides
from meshlm.checkpoint.files import write_json_atomic
from meshlm.config import load_run_config
from meshlm.data.demo_corpus import build_demo_corpus
from meshlm.models.language_model import LanguageModel
from meshlm.models.moe.experts import GroupedExperts
from meshlm.precision.model_recipe import apply_recipe, is_quantized_block
from meshlm.precision.quantized_experts import WEIGHTS
from meshlm.precision.recipes import Recipe, build_recipe
from meshlm.training.data_loading import read_batch
from meshlm.training.trainer import Trainer

FIDELITY_CONFIGS = ("bf16", "nvfp4", "nvfp4_no_hadamard", "nvfp4_no_stochastic_rounding", "nvfp4_all_layers",
                    "fp8_tensorwise")
DEFAULT_WARMUP_STEPS, DEFAULT_BATCHES, DEFAULT_DRAWS = 40, 4, 8
DRAW_STEP = 1_000_000
"""First recipe ``step`` (noise key) of the bias draws; the gradient-error batches use steps 0 .. B-1."""
OUTLIER_SCALE, OUTLIER_FRACTION = 32.0, 1 / 64
FULL_RECIPE_HIGH_PRECISION_LAYERS = 1
"""The full recipe's ``precision.high_precision_layers`` (bench.low_precision.NVFP4): the groups use it."""


@dataclass
class Variant:
    """One config of the measurement: its recipe (None: bf16) and how many first/last blocks stay bf16."""

    name: str
    recipe: Recipe | None
    high_precision_layers: int


def variant(name: str, seed: int = 0) -> Variant:
    """The ``bench.low_precision.CONFIGS`` entry ``name`` as a recipe, read through the run config."""
    precision = load_run_config(None, ["precision.dtype=bf16", *CONFIGS[name]]).precision
    return Variant(name, build_recipe(precision, seed), precision.high_precision_layers)


# --- models, gradients, errors ---------------------------------------------------------------------
def bf16_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with bf16 parameters (as ``MixedPrecision`` casts them), in training mode."""
    model = copy.deepcopy(model).train()
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model


def with_recipe(base: nn.Module, config: Variant, num_blocks: int) -> nn.Module:
    """A copy of the bf16 ``base`` with ``config``'s recipe on its linear layers and experts."""
    model = copy.deepcopy(base)
    if config.recipe is not None:
        apply_recipe(model, config.recipe, num_blocks, config.high_precision_layers)
    return model


def loss_and_gradient(model: nn.Module, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The training loss (language model plus auxiliary terms) on ``batch`` and every parameter's gradient, fp32."""
    model.zero_grad(set_to_none=True)
    output = model(batch["input_ids"], batch["labels"], return_logits=False, document_ids=batch.get("document_ids"))
    output.loss.backward()
    grads = {name: (param.grad.float() if param.grad is not None else torch.zeros_like(param, dtype=torch.float32))
             for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return output.loss.item(), grads


def flat(grads: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([grads[name].reshape(-1) for name in names])


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``||value - reference|| / ||reference||`` in float64 (0 for two zero tensors)."""
    value, reference = value.double(), reference.double()
    norm = reference.norm().item()
    return (value - reference).norm().item() / norm if norm > 0 else float((value - reference).norm().item() > 0)


def gemm_weight_names(model: nn.Module) -> dict[int, list[str]]:
    """Block index -> the parameter names of the GEMM weights a recipe quantizes in it (linears, experts)."""
    names: dict[int, list[str]] = {}
    for prefix, module in model.named_modules():
        if type(module) is nn.Linear or type(module).__name__ == "QuantizedLinear":
            weights = [f"{prefix}.weight"]
        elif isinstance(module, GroupedExperts):
            weights = [f"{prefix}.{name}" for name in WEIGHTS if getattr(module, name, None) is not None]
        else:
            continue
        parts = prefix.split(".")
        if parts[0] == "blocks":
            names.setdefault(int(parts[1]), []).extend(weights)
    return names


def parameter_groups(model: nn.Module, num_blocks: int,
                     high_precision_layers: int = FULL_RECIPE_HIGH_PRECISION_LAYERS) -> dict[str, list[str]]:
    """Parameter names by group: the GEMM weights of the blocks the full recipe quantizes, the
    other parameters of those blocks, the first and last blocks (bf16 under the full recipe), the
    rest (embedding, final norm); and 'all'."""
    gemm = {name for names in gemm_weight_names(model).values() for name in names}
    groups = {"quantized_blocks_gemm_weights": [], "quantized_blocks_other": [], "first_last_blocks": [],
              "embedding_and_rest": []}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if parts[0] != "blocks" or int(parts[1]) >= num_blocks:
            groups["embedding_and_rest"].append(name)
        elif not is_quantized_block(int(parts[1]), num_blocks, high_precision_layers):
            groups["first_last_blocks"].append(name)
        else:
            groups["quantized_blocks_gemm_weights" if name in gemm else "quantized_blocks_other"].append(name)
    groups = {group: names for group, names in groups.items() if names}
    return {"all": [name for name, _ in model.named_parameters()], **groups}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- 1 and 4: gradient error per config ---------------------------------------------------------------
def gradient_fidelity(base: nn.Module, configs: list[Variant], batches: list[dict], num_blocks: int,
                      groups: dict[str, list[str]], references: list | None = None) -> tuple[dict, list]:
    """Per config, median over ``batches`` of the loss difference and each group's relative gradient
    error against the bf16 gradient of the same batch (batch i keys the rounding noise with step i).
    ``references``: the bf16 (loss, gradients) per batch, when already computed. Returns (results by
    name, the references)."""
    if references is None:
        references = [loss_and_gradient(base, batch) for batch in batches]
    results = {}
    for config in configs:
        model = with_recipe(base, config, num_blocks)
        losses, errors = [], {group: [] for group in groups}
        for index, (batch, (ref_loss, ref_grads)) in enumerate(zip(batches, references)):
            if config.recipe is not None:
                config.recipe.step = index
            loss, grads = loss_and_gradient(model, batch)
            losses.append((loss, ref_loss))
            for group, names in groups.items():
                errors[group].append(relative_error(flat(grads, names), flat(ref_grads, names)))
        results[config.name] = {
            "loss_diff_percent": round(median([100 * (loss / ref - 1) for loss, ref in losses]), 4),
            "abs_loss_diff": round(median([abs(loss - ref) for loss, ref in losses]), 5),
            "gradient_error": {group: round(median(values), 5) for group, values in errors.items()},
            "gradient_error_per_batch": [round(value, 5) for value in errors["all"]],
        }
    return results, references


# --- 2: bias, the mean of K draws of the rounding noise ----------------------------------------------
def draw_sizes(draws: int) -> list[int]:
    """K = 1, 2, 4, ... up to ``draws``."""
    return [2**power for power in range(int(math.log2(draws)) + 1)] if draws >= 1 else []


def fit_bias_and_noise(curve: dict[int, float]) -> tuple[float, float]:
    """Least-squares ``error(K)^2 = b^2 + v^2 / K`` over the curve; returns (b, v), each clamped at 0."""
    xs, ys = [1 / k for k in curve], [error**2 for error in curve.values()]
    if len(xs) < 2:
        return float("nan"), float("nan")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    return math.sqrt(max(intercept, 0.0)), math.sqrt(max(slope, 0.0))


def mean_of_draws(model: nn.Module, recipe: Recipe, batch: dict, reference: torch.Tensor, names: list[str],
                  draws: int) -> dict:
    """The relative error of the mean of K gradient draws (recipe steps ``DRAW_STEP + d``: independent
    rounding noise, same weights and batch) against ``reference``, for K in ``draw_sizes(draws)``,
    each averaged over the disjoint groups of K draws; the fitted deterministic part b and single-draw
    noise v; the cosine between the error of the mean of all draws and the reference."""
    sizes = draw_sizes(draws)
    sums = {k: torch.zeros_like(reference, dtype=torch.float64) for k in sizes}
    errors: dict[int, list[float]] = {k: [] for k in sizes}
    mean_error = None
    for index in range(draws):
        recipe.step = DRAW_STEP + index
        gradient = flat(loss_and_gradient(model, batch)[1], names).double()
        for k in sizes:
            sums[k] += gradient
            if (index + 1) % k == 0:
                errors[k].append(relative_error(sums[k] / k, reference))
                if k == sizes[-1]:
                    mean_error = sums[k] / k - reference.double()
                sums[k].zero_()
    curve = {k: statistics.fmean(values) for k, values in errors.items()}
    bias, noise = fit_bias_and_noise(curve)
    cosine = torch.nn.functional.cosine_similarity(mean_error, reference.double(), dim=0).item()
    return {"error_of_mean": {str(k): round(value, 5) for k, value in curve.items()},
            "fitted_deterministic_error": round(bias, 5), "fitted_single_draw_noise": round(noise, 5),
            "mean_error_cosine_with_gradient": round(cosine, 4)}


# --- 3: the weight-gradient GEMM with and without the Hadamard transform -----------------------------
def capture_wgrad_operands(model: nn.Module, batch: dict) -> tuple[dict, tuple[float, dict]]:
    """Each linear layer's weight-gradient operands ``{name: (dY [tokens, out], X [tokens, in])}`` in
    one forward and backward of ``model`` (no recipe) on ``batch``, in the model's dtype; and that
    pass's ``loss_and_gradient``."""
    captured: dict[str, list] = {}
    handles = []

    def hook(name):
        def forward_hook(module, inputs, output):
            captured[name] = [None, inputs[0].detach().reshape(-1, inputs[0].shape[-1])]
            output.register_hook(lambda grad: captured[name].__setitem__(0, grad.detach().reshape(-1, grad.shape[-1])))
        return forward_hook

    for name, module in model.named_modules():
        if type(module) is nn.Linear and name.startswith("blocks."):
            handles.append(module.register_forward_hook(hook(name)))
    try:
        result = loss_and_gradient(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return {name: (grad, inputs) for name, (grad, inputs) in captured.items() if grad is not None}, result


def wgrad_error(grad: torch.Tensor, inputs: torch.Tensor, recipe: Recipe, noise_key: int) -> float:
    """Relative error of the recipe's quantized ``dY^T X`` (fp32 GEMM on the dequantized operands)
    against the exact fp32 product of the same (bf16) operands."""
    exact = grad.float().t() @ inputs.float()
    grad_t, inputs_t = recipe.wgrad_layout(grad, inputs)
    quantized = (recipe.quantize(grad_t, "gradient", noise_key=noise_key).float()
                 @ recipe.quantize(inputs_t, "activation").float().t())
    return relative_error(quantized, exact)


def block_crest(tensor_t: torch.Tensor) -> float:
    """Mean over the 1 x 16 blocks (along the last dim, zero blocks left out) of amax / rms."""
    rows, cols = tensor_t.shape
    blocks = torch.nn.functional.pad(tensor_t.float(), (0, -cols % 16)).reshape(rows, -1, 16)
    rms = blocks.pow(2).mean(-1).sqrt()
    crest = blocks.abs().amax(-1)[rms > 0] / rms[rms > 0]
    return crest.mean().item() if crest.numel() else float("nan")


def hadamard_recipes(stochastic_rounding: bool) -> tuple[Recipe, Recipe]:
    return (Recipe("nvfp4", hadamard=True, stochastic_rounding=stochastic_rounding),
            Recipe("nvfp4", hadamard=False, stochastic_rounding=stochastic_rounding))


def layer_wgrad_errors(grad: torch.Tensor, inputs: torch.Tensor, key: int) -> dict:
    """One layer's wgrad-GEMM errors with and without the transform (SR as in the recipe, and
    round-to-nearest), and its operands' block crest factors before and after the transform."""
    row = {}
    for rounding, sr in (("sr", True), ("nearest", False)):
        with_rht, without_rht = hadamard_recipes(sr)
        row[f"{rounding}_with_hadamard"] = wgrad_error(grad, inputs, with_rht, key)
        row[f"{rounding}_without_hadamard"] = wgrad_error(grad, inputs, without_rht, key)
    with_rht = hadamard_recipes(True)[0]
    mixed_grad, mixed_inputs = with_rht.wgrad_layout(grad, inputs)
    row.update(crest_grad=block_crest(grad.t()), crest_input=block_crest(inputs.t()),
               crest_grad_hadamard=block_crest(mixed_grad), crest_input_hadamard=block_crest(mixed_inputs))
    return row


def hadamard_per_layer(captures: list[dict], quantized_layers: set[str]) -> dict:
    """Per linear layer, the median over batches of ``layer_wgrad_errors``; ``in_full_recipe``: whether the
    full recipe quantizes it (the other layers are quantized only by nvfp4_all_layers)."""
    layers = {}
    for name in captures[0]:
        rows = [layer_wgrad_errors(*capture[name], key=index) for index, capture in enumerate(captures)]
        layers[name] = {key: round(median([row[key] for row in rows]), 5) for key in rows[0]}
        layers[name]["in_full_recipe"] = name in quantized_layers
    return layers


def outlier_case(grad: torch.Tensor, inputs: torch.Tensor, seed: int = 0) -> dict:
    """One layer's wgrad-GEMM error with and without the transform (SR): as captured; with
    ``OUTLIER_FRACTION`` of its input's tokens (rows of X) scaled by ``OUTLIER_SCALE``; the same with
    those tokens' output gradients divided by it (outliers that set a block's scale without
    dominating the product, like a "massive activation" token with an ordinary gradient share);
    and with that fraction of its input's channels (columns) scaled instead."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(inputs.shape[0], generator=generator)[:max(1, round(inputs.shape[0] * OUTLIER_FRACTION))]
    channels = torch.randperm(inputs.shape[1], generator=generator)[:max(1, round(inputs.shape[1] * OUTLIER_FRACTION))]
    outlier_tokens, outlier_channels, small_grad = inputs.clone(), inputs.clone(), grad.clone()
    outlier_tokens[tokens] *= OUTLIER_SCALE
    outlier_channels[:, channels] *= OUTLIER_SCALE
    small_grad[tokens] /= OUTLIER_SCALE
    with_rht, without_rht = hadamard_recipes(True)
    case = {}
    for label, dy, x in (("as_captured", grad, inputs), ("outlier_tokens", grad, outlier_tokens),
                         ("outlier_tokens_small_gradient", small_grad, outlier_tokens),
                         ("outlier_channels", grad, outlier_channels)):
        case[label] = {"with_hadamard": round(wgrad_error(dy, x, with_rht, 0), 5),
                       "without_hadamard": round(wgrad_error(dy, x, without_rht, 0), 5),
                       "input_crest": round(block_crest(x.t()), 3)}
    return case


# --- the verdicts --------------------------------------------------------------------------------
def hadamard_summary(layers: dict) -> dict:
    """Median over the full recipe's layers of the wgrad error with and without the transform, and the
    median of their per-layer ratios (above 1: the transform helped)."""
    chosen = [row for row in layers.values() if row["in_full_recipe"]] or list(layers.values())
    summary = {}
    for rounding in ("sr", "nearest"):
        summary[rounding] = {
            "with_hadamard": round(median([row[f"{rounding}_with_hadamard"] for row in chosen]), 5),
            "without_hadamard": round(median([row[f"{rounding}_without_hadamard"] for row in chosen]), 5),
            "median_ratio_without_over_with": round(median([row[f"{rounding}_without_hadamard"]
                                                            / row[f"{rounding}_with_hadamard"] for row in chosen]), 4),
            "layers_helped": sum(row[f"{rounding}_without_hadamard"] > row[f"{rounding}_with_hadamard"]
                                 for row in chosen), "layers": len(chosen)}
    return summary


def effects(report: dict) -> tuple[dict, dict]:
    """Per ablation: the quantity its part is meant to improve, under nvfp4 and under the ablation,
    and whether removing the part made it worse; and those booleans as ``targets``."""
    grads, found = report["gradient_error"], {}
    if "nvfp4" not in grads:
        return {}, {}

    def pair(name, nvfp4, ablation, measure):
        return {"removed": ABLATIONS[name], "measure": measure, "nvfp4": nvfp4, "ablation": ablation,
                "worse_without": ablation > nvfp4}

    whole = {name: grads[name]["gradient_error"]["all"] for name in grads}
    losses = {name: grads[name]["abs_loss_diff"] for name in grads}
    if "hadamard" in report and "nvfp4_no_hadamard" in grads:
        summary = report["hadamard"]["summary"]["sr"]
        entry = pair("nvfp4_no_hadamard", summary["with_hadamard"], summary["without_hadamard"],
                     "wgrad GEMM relative error, median over the full recipe's linear layers (SR)")
        entry["whole_model_gradient_error_worse"] = whole["nvfp4_no_hadamard"] > whole["nvfp4"]
        outliers = report["hadamard"]["outlier_case"]["outlier_tokens"]
        entry["outlier_tokens_worse"] = outliers["without_hadamard"] > outliers["with_hadamard"]
        found["nvfp4_no_hadamard"] = entry
    if "bias" in report:
        sr, nearest = report["bias"]["nvfp4"]["error_of_mean"], report["bias"]["nvfp4_no_stochastic_rounding"]["error_of_mean"]
        k = max(sr, key=int)
        entry = pair("nvfp4_no_stochastic_rounding", sr[k], nearest[k],
                     f"relative error of the mean of {k} gradient draws against bf16")
        entry["sr_mean_error_falls_with_k"] = sr[k] < sr["1"]
        entry["nearest_mean_error_flat"] = abs(nearest[k] - nearest["1"]) <= 1e-3 * nearest["1"]
        entry["single_draw_error_worse"] = nearest["1"] > sr["1"]
        found["nvfp4_no_stochastic_rounding"] = entry
    if "nvfp4_all_layers" in grads:
        entry = pair("nvfp4_all_layers", whole["nvfp4"], whole["nvfp4_all_layers"],
                     "whole-model relative gradient error against bf16, median over batches")
        entry["abs_loss_error_worse"] = losses["nvfp4_all_layers"] > losses["nvfp4"]
        found["nvfp4_all_layers"] = entry
    return found, {f"{name}_worse_than_nvfp4": entry["worse_without"] for name, entry in found.items()}


# --- the run -------------------------------------------------------------------------------------
def warm_up(args, workdir: Path) -> tuple:
    """Train the demo hybrid ``args.warmup_steps`` bf16 steps (no recipe, the low-precision bench's
    shape), or load that state from ``args.warm_state`` when the file exists (written there otherwise);
    returns (the run config, the trained model as an fp32 ``LanguageModel``, the next ``args.batches``
    micro-batches of the training order: the measurement batches)."""
    _, seq_len, micro_batch, eval_batches = DEFAULTS["hybrid", "cpu"]
    steps = args.warmup_steps + args.batches  # the data holds the measurement batches after the warm-up's
    shape = SimpleNamespace(shape=(steps, seq_len, micro_batch, eval_batches), model="hybrid", device="cpu")
    overrides = [*run_overrides(shape, workdir / "warmup"), *CONFIGS["bf16"], "train.eval_every=0"]
    trainer = Trainer(load_run_config(str(DEMO_CONFIG), overrides))
    config, cache = trainer.config, Path(args.warm_state) if args.warm_state else None
    model = LanguageModel(config.model, seed=config.train.seed)
    if cache is not None and cache.is_file():
        saved = torch.load(cache, map_location="cpu")
        if saved.get("warmup_steps") != args.warmup_steps:
            raise SystemExit(f"--warm-state {cache} holds {saved.get('warmup_steps')} warm-up steps, not "
                             f"--warmup-steps {args.warmup_steps}; pass the same number or another file.")
        model.load_state_dict(saved["model"])
    else:
        for _ in range(args.warmup_steps):
            trainer.train_step()
        model.load_state_dict({name: value.float() for name, value in trainer.model.state_dict().items()})
        if cache is not None:
            temporary = cache.with_name(cache.name + ".tmp")
            torch.save({"warmup_steps": args.warmup_steps, "model": model.state_dict()}, temporary)
            temporary.replace(cache)
    trainer.batches.close()
    first = args.warmup_steps * micro_batch
    batches = [read_batch(trainer.data.train, first + index * micro_batch, micro_batch, torch.device("cpu"))
               for index in range(args.batches)]
    return config, model, batches


def measure(base: nn.Module, batches: list[dict], num_blocks: int, draws: int, names: tuple[str, ...],
            log=lambda line: None) -> dict:
    """Every measurement on the bf16 model ``base`` (fp32 or bf16 weights) and ``batches``."""
    base = bf16_copy(base)
    configs = [variant(name) for name in names if name != "bf16"]
    groups = parameter_groups(base, num_blocks)
    report: dict = {"parameter_groups": {group: sum(dict(base.named_parameters())[n].numel() for n in members)
                                         for group, members in groups.items()}}
    started = time.perf_counter()
    captures, references = zip(*[capture_wgrad_operands(base, batch) for batch in batches])  # the bf16 passes
    report["gradient_error"], _ = gradient_fidelity(base, configs, batches, num_blocks, groups, list(references))
    log(f"gradient error: {time.perf_counter() - started:.0f} s")
    by_name = {config.name: config for config in configs}
    if draws >= 2 and {"nvfp4", "nvfp4_no_stochastic_rounding"} <= set(by_name):
        started, reference = time.perf_counter(), flat(references[0][1], groups["all"])
        report["bias"] = {name: mean_of_draws(with_recipe(base, by_name[name], num_blocks), by_name[name].recipe,
                                              batches[0], reference, groups["all"], draws)
                          for name in ("nvfp4", "nvfp4_no_stochastic_rounding")}
        log(f"bias draws: {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    quantized = {name for name in captures[0]
                 if is_quantized_block(int(name.split(".")[1]), num_blocks, FULL_RECIPE_HIGH_PRECISION_LAYERS)}
    layers = hadamard_per_layer(captures, quantized)
    middle = sorted(quantized or captures[0], key=lambda name: (abs(int(name.split(".")[1]) - num_blocks // 2), name))[0]
    report["hadamard"] = {"summary": hadamard_summary(layers), "outlier_case": {"layer": middle,
                          **outlier_case(*captures[0][middle])}, "layers": layers}
    log(f"hadamard: {time.perf_counter() - started:.0f} s")
    report["effects"], report["targets"] = effects(report)
    return report


def table(report: dict) -> str:
    """The measurements as readable lines."""
    lines = ["config                          loss diff %   grad err (all)   quantized-block GEMM W   first/last"]
    for name, entry in report["gradient_error"].items():
        errors = entry["gradient_error"]
        lines.append(f"{name:<30} {entry['loss_diff_percent']:>+11.3f}   {errors['all']:>14.4f}   "
                     f"{errors.get('quantized_blocks_gemm_weights', float('nan')):>22.4f}   "
                     f"{errors.get('first_last_blocks', float('nan')):>10.4f}")
    for name, entry in report.get("bias", {}).items():
        curve = "  ".join(f"K={k}: {value:.4f}" for k, value in entry["error_of_mean"].items())
        lines.append(f"mean of K draws, {name}: {curve}  (fit: b={entry['fitted_deterministic_error']:.4f}, "
                     f"v={entry['fitted_single_draw_noise']:.4f})")
    for rounding, entry in report["hadamard"]["summary"].items():
        lines.append(f"wgrad GEMM error ({rounding}), median over {entry['layers']} layers: with RHT "
                     f"{entry['with_hadamard']:.4f}, without {entry['without_hadamard']:.4f}, median ratio "
                     f"{entry['median_ratio_without_over_with']:.3f}, helped {entry['layers_helped']}/{entry['layers']}")
    case = report["hadamard"]["outlier_case"]
    for label in ("as_captured", "outlier_tokens", "outlier_tokens_small_gradient", "outlier_channels"):
        lines.append(f"  {case['layer']} {label}: with RHT {case[label]['with_hadamard']:.4f}, without "
                     f"{case[label]['without_hadamard']:.4f} (input crest {case[label]['input_crest']:.2f})")
    for name, entry in report["effects"].items():
        lines.append(f"removing the {entry['removed']}: {entry['measure']} {entry['nvfp4']:.4f} -> "
                     f"{entry['ablation']:.4f}, worse: {entry['worse_without']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS,
                        help="bf16 training steps before measuring (8 x 128 tokens each)")
    parser.add_argument("--batches", type=int, default=DEFAULT_BATCHES, help="fixed batches of the gradient error")
    parser.add_argument("--draws", type=int, default=DEFAULT_DRAWS,
                        help="independent rounding-noise draws of the bias curve (K = 1, 2, 4, ... up to it)")
    parser.add_argument("--warm-state", help="file of the warmed-up model: loaded when it exists (no warm-up), "
                                             "else written after the warm-up")
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.draws < 1 or args.warmup_steps < 0:
        parser.error("--batches and --draws must be at least 1 and --warmup-steps at least 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    build_demo_corpus(DEMO_DATA, workers=2)  # skipped when it is already there
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshlm-nvfp4-fidelity-") as workdir:
        config, model, batches = warm_up(args, Path(workdir))
    log(f"warm-up: {args.warmup_steps} bf16 steps, {time.perf_counter() - started:.0f} s")
    report = {"machine": machine("cpu"), "warmup_steps": args.warmup_steps, "batches": args.batches,
              "draws": args.draws, "batch_tokens": [config.train.micro_batch_size, config.train.seq_len],
              **measure(model, batches, config.model.num_blocks, args.draws, FIDELITY_CONFIGS, log)}
    report["run_s"] = round(time.perf_counter() - started, 1)
    log(table(report))
    text = json.dumps(report, indent=1)
    if args.out:
        write_json_atomic(Path(args.out), report)
    print(text)
    return report


if __name__ == "__main__":
    main()
