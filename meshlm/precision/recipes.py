"""Low-precision training recipes: how each operand of a linear layer's three GEMMs is quantized.

A linear layer y = x W^T runs three GEMMs per step (forward, data gradient, weight gradient):

    fprop   Y  = X  W^T       contraction over the input features
    dgrad   dX = dY W         contraction over the output features
    wgrad   dW = dY^T X       contraction over the tokens

A recipe quantizes both operands of every GEMM (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"; DeepSeek-V3 §3.3; NVIDIA 2025, "Pretraining LLMs with NVFP4"). Block scales are taken
along each GEMM's *contraction* dimension -- that is what a hardware GEMM with block scales
consumes -- so an operand is quantized in the layout where the contraction dimension is last:
X for fprop, X^T (tokens last) for wgrad, W for fprop, W^T for dgrad, dY for dgrad, dY^T for
wgrad. Weights use square 2D blocks (128 x 128 blockwise FP8, 16 x 16 NVFP4), so W and W^T
quantize alike; 1D tiles of a transposed operand are re-quantized from high precision.

Roles and formats per recipe (``precision.recipe``):

- ``fp8_tensorwise``: current per-tensor scaling (scale = amax / format max, this tensor's amax);
  E4M3 for activations and weights, E5M2 for gradients (``precision.fp8_format: hybrid``) or E4M3
  for everything (``e4m3``).
- ``fp8_blockwise`` (DeepSeek-V3): E4M3 everywhere, 1 x 128 tiles for activations and gradients,
  128 x 128 blocks for weights, fp32 power-of-two scales.
- ``mxfp8`` (OCP microscaling): E4M3 in 1 x 32 blocks with E8M0 (power-of-two) scales, for every
  operand along its contraction dimension.
- ``nvfp4``: E2M1 in 1 x 16 blocks (16 x 16 for weights) with E4M3 block scales and an fp32
  tensor scale; gradients rounded stochastically, everything else to nearest-even; both wgrad
  operands pass through a 16 x 16 random Hadamard transform along the tokens first, which
  spreads outliers and leaves dY^T X unchanged (Q orthogonal: dY^T Q Q^T X = dY^T X).

Emulation: an operand is quantized to the exact format values and dequantized to the run's
dtype, and the GEMM runs in that dtype -- the recipe's numerics at bf16's speed. (Delayed
scaling from an amax history, the hardware FP8 GEMM and the scales' reduction over sharded
layouts are not part of this file yet.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from meshlm.errors import ConfigError
from meshlm.precision.formats.blockwise import quantize_fp8_blockwise
from meshlm.precision.formats.fp8 import E4M3, E5M2, quantize_fp8_tensorwise
from meshlm.precision.formats.hadamard import apply_blockwise, random_hadamard_matrix
from meshlm.precision.formats.mxfp8 import quantize_mxfp8
from meshlm.precision.formats.nvfp4 import quantize_nvfp4

RECIPES = ("none", "fp8_tensorwise", "fp8_blockwise", "mxfp8", "nvfp4")
FP8_FORMATS = ("hybrid", "e4m3")
HADAMARD_SIZE = 16


@dataclass
class Recipe:
    """Quantizes GEMM operands for one of ``RECIPES`` (module docstring).

    ``quantize(tensor, role)``: ``tensor [..., contraction]`` quantized with its blocks along the
    last dim (weights: square blocks over the last two dims) and returned dequantized, in its dtype.
    """

    name: str
    fp8_format: str = "hybrid"
    seed: int = 0
    """Seeds the stochastic rounding of NVFP4 gradients (generators of the recipe's own, one per device)."""
    generators: dict = field(init=False, repr=False, default_factory=dict)
    hadamard_matrices: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        check_names(self.name, self.fp8_format)
        if self.name == "none":
            raise ConfigError(f"precision.recipe='none' is not a low-precision recipe; use one of "
                              f"{', '.join(RECIPES[1:])}.")

    def generator(self, device: torch.device) -> torch.Generator:
        """This recipe's random-number generator on ``device`` (seeded with ``seed`` on first use)."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def hadamard_matrix(self, device: torch.device) -> torch.Tensor:
        """The fixed random Hadamard matrix [16, 16] on ``device`` (built once per device)."""
        if device not in self.hadamard_matrices:
            self.hadamard_matrices[device] = random_hadamard_matrix(HADAMARD_SIZE, device=device)
        return self.hadamard_matrices[device]

    @property
    def hadamard_for_wgrad(self) -> bool:
        return self.name == "nvfp4"

    def quantize(self, tensor: torch.Tensor, role: str) -> torch.Tensor:
        if self.name == "fp8_tensorwise":
            fmt = E5M2 if role == "gradient" and self.fp8_format == "hybrid" else E4M3
            return quantize_fp8_tensorwise(tensor, fmt).values
        if self.name == "fp8_blockwise":
            rows, cols = (128, 128) if role == "weight" else (1, 128)
            return quantize_fp8_blockwise(tensor, rows, cols, E4M3, power_of_two=True).values
        if self.name == "mxfp8":
            return quantize_mxfp8(tensor, E4M3).values
        rows = HADAMARD_SIZE if role == "weight" else 1  # nvfp4
        if role == "gradient":
            return quantize_nvfp4(tensor, rows, 16, rounding="stochastic", generator=self.generator(tensor.device)).values
        return quantize_nvfp4(tensor, rows, 16).values

    def wgrad_operands(self, grad_output: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dY^T and X^T [features, tokens], transformed by the random Hadamard transform along the
        tokens (NVFP4; the tokens zero-padded to a multiple of 16) and quantized along them."""
        grad_t, inputs_t = grad_output.t(), inputs.t()
        if self.hadamard_for_wgrad:
            pad = -grad_t.shape[1] % HADAMARD_SIZE
            grad_t, inputs_t = F.pad(grad_t, (0, pad)), F.pad(inputs_t, (0, pad))
            matrix = self.hadamard_matrix(grad_t.device)
            grad_t, inputs_t = apply_blockwise(grad_t, matrix, dim=1), apply_blockwise(inputs_t, matrix, dim=1)
        return self.quantize(grad_t, "gradient"), self.quantize(inputs_t, "activation")


def check_names(recipe: str, fp8_format: str) -> None:
    """ConfigError unless ``precision.recipe`` and ``precision.fp8_format`` name known choices."""
    if fp8_format not in FP8_FORMATS:
        raise ConfigError(f"precision.fp8_format={fp8_format!r} is not one of {', '.join(FP8_FORMATS)}.")
    if recipe not in RECIPES:
        raise ConfigError(f"precision.recipe={recipe!r} is not one of {', '.join(RECIPES)}.")


def build_recipe(precision, seed: int = 0) -> Recipe | None:
    """The recipe ``precision`` (a resolved ``PrecisionConfig``) asks for, None for 'none'; a
    ConfigError for an unknown name or format, or a recipe on a dtype other than bf16."""
    check_names(precision.recipe, precision.fp8_format)
    if precision.recipe == "none":
        return None
    if precision.dtype != "bf16":
        raise ConfigError(f"precision.recipe={precision.recipe} quantizes the GEMMs of a bf16 run, but "
                          f"precision.dtype is {precision.dtype}; set precision.dtype=bf16 (or precision.recipe=none).")
    return Recipe(precision.recipe, precision.fp8_format, seed)


def check_recipe_layout(recipe: Recipe | None, parallel) -> None:
    """Refuse the layouts a recipe does not run exactly under yet: tensor and context parallelism
    shard the tensors whose scales need an amax over the whole tensor (not reduced over the group yet)."""
    if recipe is not None and (parallel.tp > 1 or parallel.cp > 1):
        raise ConfigError(f"precision.recipe={recipe.name} does not run under tensor or context parallelism yet "
                          f"(parallel.tp={parallel.tp}, parallel.cp={parallel.cp}): its scales would be taken per "
                          "shard; use parallel.tp=1 and parallel.cp=1 (data and pipeline parallelism are fine), "
                          "or precision.recipe=none.")


__all__ = ["check_names", "check_recipe_layout", "FP8_FORMATS", "RECIPES", "Recipe", "build_recipe"]
