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

- ``fp8_delayed``: as ``fp8_tensorwise``, but a tensor's scale comes from the largest amax of
  the previous ``precision.amax_history`` steps (Transformer Engine's delayed scaling; the first
  step, with an empty history, scales from the current amax); the histories are per layer and
  operand, reduced over every rank that holds the layer and checkpointed
  (``delayed_scaling.py``).

Emulation: an operand is quantized to the exact format values and dequantized to the run's
dtype, and the GEMM runs in that dtype -- the recipe's numerics at bf16's speed. On hardware
with FP8 GEMMs the per-tensor FP8 recipes multiply the FP8 codes instead (``fp8_gemm.py``).

Layout independence: a per-tensor scale needs the amax of the whole tensor, so where a layout
shards the tensor (TP, CP) the caller passes the amax reduced over the shards' group
(``tensor_amax``; ``quantized_linear.py`` knows which operand is sharded where); block scales
need blocks that never straddle two shards (checked when the recipe is put on the model).
Stochastic rounding is keyed by the values themselves (``formats/hashed_noise.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshlm.errors import ConfigError
from meshlm.precision.formats.blockwise import quantize_fp8_blockwise
from meshlm.precision.formats.fp8 import (E4M3, E5M2, FP8Format, FP8Quantized, abs_max, fp8_codes, quantize_fp8,
                                         scale_from_amax)
from meshlm.precision.formats.hadamard import apply_blockwise, random_hadamard_matrix
from meshlm.precision.formats.mxfp8 import quantize_mxfp8
from meshlm.precision.formats.nvfp4 import quantize_nvfp4

RECIPES = ("none", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4")
PER_TENSOR_RECIPES = ("fp8_tensorwise", "fp8_delayed")
FP8_CODE_RECIPES = ("fp8_tensorwise", "fp8_delayed", "fp8_blockwise")
"""The recipes whose operands are FP8 codes with fp32 scales (the hardware FP8 GEMM's input)."""
FP8_FORMATS = ("hybrid", "e4m3")
HADAMARD_SIZE = 16
BLOCK_SIZES = {"fp8_tensorwise": 1, "fp8_delayed": 1, "fp8_blockwise": 128, "mxfp8": 32, "nvfp4": 16}
"""Elements per scaling block along a GEMM's contraction dimension (and the side of a weight's
square block); 1 for per-tensor scaling. A dimension a layout shards must be cut at multiples of it."""


@dataclass
class Recipe:
    """Quantizes GEMM operands for one of ``RECIPES`` (module docstring).

    ``quantize(tensor, role, ...)``: ``tensor [..., contraction]`` quantized with its blocks along
    the last dim (weights: square blocks over the last two dims) and returned dequantized, in its dtype.
    """

    name: str
    fp8_format: str = "hybrid"
    seed: int = 0
    """Keys the stochastic rounding of NVFP4 gradients (with the step, the layer and the operand)."""
    amax_history: int = 16
    """fp8_delayed: steps of amax history behind a scale."""
    hadamard: bool = True
    """nvfp4: random Hadamard transform of the weight-gradient operands."""
    stochastic_rounding: bool = True
    """nvfp4: stochastic rounding of gradients (else nearest-even)."""
    fp8_gemm: str = "auto"
    """'auto', 'emulated' or 'hardware' (``PrecisionConfig.fp8_gemm``)."""
    fast_accumulation: str = "fprop"
    """Which hardware FP8 GEMMs accumulate fast: 'fprop', 'none' or 'all' (``PrecisionConfig.fp8_fast_accumulation``)."""
    step: int = 0
    """The optimizer step being run (set by the trainer): part of the stochastic-rounding key."""

    def __post_init__(self) -> None:
        check_names(self.name, self.fp8_format)
        if self.name == "none":
            raise ConfigError(f"precision.recipe='none' is not a low-precision recipe; use one of "
                              f"{', '.join(RECIPES[1:])}.")
        # Built here, outside any compiled region: drawing its signs takes a torch.Generator, which
        # torch.compile cannot create inside a graph (a block's backward would break there).
        self.hadamard_on_cpu = random_hadamard_matrix(HADAMARD_SIZE)
        self.hadamard_matrices: dict[torch.device, torch.Tensor] = {}

    @property
    def block_size(self) -> int:
        return BLOCK_SIZES[self.name]

    @property
    def per_tensor(self) -> bool:
        """Whether one scale covers a whole tensor (so sharded tensors need their amax reduced)."""
        return self.name in PER_TENSOR_RECIPES or self.name == "nvfp4"  # nvfp4: the fp32 tensor scale

    @property
    def rounds_stochastically(self) -> bool:
        """Whether gradients are rounded with hashed noise (NVFP4 with stochastic rounding): only
        then is a noise key made. (Under torch.compile the key's layer and step would be constants
        of the graph, recompiled every step: the trainer runs such a recipe eagerly.)"""
        return self.name == "nvfp4" and self.stochastic_rounding

    @property
    def hadamard_for_wgrad(self) -> bool:
        return self.name == "nvfp4" and self.hadamard

    def fp8_format_of(self, role: str) -> FP8Format:
        """The FP8 format of a per-tensor FP8 recipe's ``role`` operand (E5M2 gradients under 'hybrid')."""
        return E5M2 if role == "gradient" and self.fp8_format == "hybrid" else E4M3

    def hadamard_matrix(self, device: torch.device) -> torch.Tensor:
        """The fixed random Hadamard matrix [16, 16] on ``device`` (copied once per device; under
        torch.compile, where a graph may not change state outside it, copied in the graph if the
        trainer has not put it on the device yet)."""
        matrix = self.hadamard_matrices.get(device)
        if matrix is None:
            matrix = self.hadamard_on_cpu.to(device)
            if not torch.compiler.is_compiling():
                self.hadamard_matrices[device] = matrix
        return matrix

    def quantize(self, tensor: torch.Tensor, role: str, tensor_amax: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, noise_key: int | None = None) -> torch.Tensor:
        """``tensor`` quantized as ``role`` ('activation', 'weight' or 'gradient') and dequantized.

        ``tensor_amax``: the whole tensor's amax where ``tensor`` is a shard (per-tensor scales);
        ``scale``: a given per-tensor FP8 scale (fp8_delayed); ``noise_key``: keys NVFP4's
        stochastic rounding of gradients."""
        if self.name in FP8_CODE_RECIPES:
            return self._fp8(tensor, role, tensor_amax, scale).values
        if self.name == "mxfp8":
            return quantize_mxfp8(tensor, E4M3).values
        rows = HADAMARD_SIZE if role == "weight" else 1  # nvfp4
        if role == "gradient" and self.stochastic_rounding:
            return quantize_nvfp4(tensor, rows, 16, rounding="stochastic", tensor_amax=tensor_amax,
                                  noise_key=noise_key if noise_key is not None else self.seed).values
        return quantize_nvfp4(tensor, rows, 16, tensor_amax=tensor_amax).values

    def fp8_codes(self, tensor: torch.Tensor, role: str, tensor_amax: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 codes, fp32 scales) of ``tensor [rows, contraction]`` for the hardware GEMM
        (``fp8_gemm.py``): what ``quantize`` dequantizes, before dequantization. Per-tensor recipes
        give a 0-dim scale, fp8_blockwise 1 x 128 tile or 128 x 128 block scales."""
        if self.name not in FP8_CODE_RECIPES:
            raise ValueError(f"precision.recipe={self.name} has no hardware FP8 GEMM (only the fp8_* recipes).")
        if self.per_tensor:  # fp8_tensorwise, fp8_delayed: the codes alone (``fp8_codes``), no dequantized copy
            scale = self._per_tensor_scale(tensor, role, tensor_amax, scale)
            return fp8_codes(tensor, scale, self.fp8_format_of(role)), scale
        quantized = self._fp8(tensor, role, tensor_amax, scale)
        return quantized.codes, quantized.scales

    def _fp8(self, tensor: torch.Tensor, role: str, tensor_amax: torch.Tensor | None,
             scale: torch.Tensor | None) -> FP8Quantized:
        """An FP8 recipe's quantization of ``tensor`` (per-tensor: from ``scale``, else from
        ``tensor_amax`` or the tensor's own amax; fp8_blockwise: tiles or 128 x 128 blocks)."""
        if self.name == "fp8_blockwise":
            rows, cols = (128, 128) if role == "weight" else (1, 128)
            return quantize_fp8_blockwise(tensor, rows, cols, E4M3, power_of_two=True)
        return quantize_fp8(tensor, self._per_tensor_scale(tensor, role, tensor_amax, scale), self.fp8_format_of(role))

    def _per_tensor_scale(self, tensor: torch.Tensor, role: str, tensor_amax: torch.Tensor | None,
                          scale: torch.Tensor | None) -> torch.Tensor:
        """``scale`` if given (fp8_delayed), else from ``tensor_amax`` or the tensor's own amax."""
        if scale is not None:
            return torch.as_tensor(scale, dtype=torch.float32, device=tensor.device)
        amax = abs_max(tensor) if tensor_amax is None else tensor_amax
        return torch.as_tensor(scale_from_amax(amax, self.fp8_format_of(role)), dtype=torch.float32,
                               device=tensor.device)

    def accumulates_fast(self, gemm: str) -> bool:
        """Whether hardware GEMM ``gemm`` ('fprop', 'dgrad' or 'wgrad') may use fast accumulation."""
        if gemm not in ("fprop", "dgrad", "wgrad"):
            raise ValueError(f"gemm={gemm!r}: expected 'fprop', 'dgrad' or 'wgrad'")
        return self.fast_accumulation == "all" or (self.fast_accumulation == "fprop" and gemm == "fprop")

    def hardware_scalings(self) -> tuple[str, str]:
        """The ``fp8_gemm.py`` scale layouts of (fprop and dgrad, wgrad) under this recipe."""
        return ("blockwise", "tilewise") if self.name == "fp8_blockwise" else ("tensorwise", "tensorwise")

    def wgrad_layout(self, grad_output: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dY^T and X^T [features, tokens], the weight-gradient GEMM's operands with its contraction
        (the tokens) last; NVFP4 with the Hadamard transform: transformed along the tokens (zero-padded
        to a multiple of 16) by the random Hadamard matrix, which leaves dY^T X unchanged."""
        grad_t, inputs_t = grad_output.t(), inputs.t()
        if self.hadamard_for_wgrad:
            pad = -grad_t.shape[1] % HADAMARD_SIZE
            grad_t, inputs_t = F.pad(grad_t, (0, pad)), F.pad(inputs_t, (0, pad))
            matrix = self.hadamard_matrix(grad_t.device)
            grad_t, inputs_t = apply_blockwise(grad_t, matrix, dim=1), apply_blockwise(inputs_t, matrix, dim=1)
        return grad_t, inputs_t




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
    return Recipe(precision.recipe, precision.fp8_format, seed, amax_history=precision.amax_history,
                  hadamard=precision.nvfp4_hadamard, stochastic_rounding=precision.nvfp4_stochastic_rounding,
                  fp8_gemm=precision.fp8_gemm, fast_accumulation=precision.fp8_fast_accumulation)


__all__ = ["check_names", "BLOCK_SIZES", "FP8_FORMATS", "RECIPES", "Recipe", "build_recipe"]
