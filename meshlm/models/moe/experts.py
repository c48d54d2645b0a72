"""The routed experts, stored as stacked weights and run as one grouped computation.

Each of the E experts is an MLP of inner width F over tokens of width d (d is the hidden size,
or the latent size in LatentMoE):

    gated (SwiGLU):  y = W_down[e] (silu(W_gate[e] x) * W_up[e] x)
    otherwise:       y = W_down[e] act(W_up[e] x)

The weights of all experts live in three [E, out, in] tensors (the nn.Linear layout, one slice
per expert), which is what expert parallelism shards along E and what a grouped GEMM consumes.
The input is the permuted token tensor from ``dispatch.permute``: rows grouped by expert, with
``tokens_per_expert`` giving the group sizes, so each matmul is a *grouped* matmul: segment e of
the rows times W[e]^T. Two implementations compute it:

- ``torch.nn.functional.grouped_mm`` with int32 end offsets (a single kernel; in torch 2.13 it
  runs on CPU for fp32/bf16/fp16 -- bf16 only under torch.compile -- and on CUDA for bf16, and
  needs 16-byte aligned row strides);
- a loop over *experts* (never over tokens): split the rows into the E contiguous segments and
  do one ordinary matmul per segment.

Both give the same numbers; an expert with zero rows simply contributes an empty segment.

**Biases** (``model.moe_expert_linear_bias``, gpt-oss's experts). The Mixtral, Qwen3-MoE and
Nemotron-H experts carry none; gpt-oss's carry one per projection and expert, [E, F] for gate and
up and [E, d] for down. Each row of segment e gets expert e's bias, gathered by the rows' expert
index (``expert_of_each_row``). Where the experts are split on their width F (expert tensor
parallelism), gate and up biases split with their rows; but each rank's down projection yields a
*partial* sum of the whole d-vector, and the ranks' partials are summed afterwards, so the down bias
must enter that sum once. It is split on d instead: rank r holds, and adds, the bias's r-th share of
the d columns (``down_bias_columns``), zero elsewhere; the sum of the partials then holds the whole
bias, and each share gets exactly its columns' gradient, with no communication of its own.

Under a low-precision
recipe each stacked weight carries a quantization (``meshlm/precision/quantized_experts.py``)
that runs the three grouped GEMMs on quantized operands, each expert scaled on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.init import constant, initialize_own_tensors, normal
from meshlm.models.mlp import activate, is_gated


def grouped_mm_supported(tokens: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` can run this grouped matmul (device, dtype, 16-byte strides)."""
    if not hasattr(F, "grouped_mm") or tokens.dtype != weight.dtype or tokens.dim() != 2:
        return False
    if tokens.device.type == "cpu" and torch.compiler.is_compiling():
        # The compiler runs the op's shape function (its meta kernel), which takes bf16 only
        # (torch 2.11 to 2.13) although the CPU kernel itself also takes fp32 and fp16.
        dtype_ok = tokens.dtype == torch.bfloat16
    elif tokens.device.type == "cpu":
        dtype_ok = tokens.dtype in (torch.float32, torch.bfloat16, torch.float16)
    elif tokens.device.type == "cuda":
        dtype_ok = tokens.dtype == torch.bfloat16 and torch.cuda.get_device_capability(tokens.device)[0] >= 8
    else:
        dtype_ok = False
    out_features, in_features = weight.shape[1:]
    aligned = all((size * tokens.element_size()) % 16 == 0 for size in (in_features, out_features))
    return dtype_ok and aligned and tokens.is_contiguous() and weight.is_contiguous()


def grouped_linear(tokens: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                   use_grouped_mm: bool | None = None) -> torch.Tensor:
    """Rows of segment e of ``tokens`` [m, in] times ``weight[e]``^T ([E, out, in]): [m, out].

    ``use_grouped_mm`` None picks the grouped kernel when it supports the inputs, else the loop.
    """
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(tokens, weight)
    if use_grouped_mm:
        end_offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        return F.grouped_mm(tokens, weight.transpose(-2, -1), offs=end_offsets)
    segments = tokens.split(tokens_per_expert.tolist())
    return torch.cat([segment @ weight[expert].T for expert, segment in enumerate(segments)])


def expert_of_each_row(tokens_per_expert: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[m] int64: the expert of each row of the permuted tokens (segment e is expert e's rows)."""
    experts = torch.arange(tokens_per_expert.shape[0], device=tokens_per_expert.device)
    return experts.repeat_interleave(tokens_per_expert, output_size=num_rows)


class GroupedExperts(nn.Module):
    """E expert MLPs over permuted tokens: [m, d] with ``tokens_per_expert`` [E] -> [m, d]."""

    def __init__(self, config, model_size: int):
        super().__init__()
        num_experts, ffn_size = config.moe_num_experts, config.resolved_moe_ffn_hidden_size
        self.activation = config.mlp_activation
        self.use_grouped_mm: bool | None = None
        """None: grouped kernel when supported; True/False force one implementation (tests)."""
        self.quantizations: dict | None = None
        """{weight name: its low-precision quantization}, set by ``meshlm/precision/model_recipe.py``
        (``quantized_experts.py``); None: plain grouped GEMMs."""
        self.gate_weight = (nn.Parameter(torch.empty(num_experts, ffn_size, model_size))
                            if is_gated(config.mlp_activation) else None)
        self.up_weight = nn.Parameter(torch.empty(num_experts, ffn_size, model_size))
        self.down_weight = nn.Parameter(torch.empty(num_experts, model_size, ffn_size))
        self.swiglu_limit, self.swiglu_alpha = config.swiglu_limit, config.swiglu_alpha
        """``clamped_swiglu``'s clamp and gain (``model.swiglu_limit``, ``model.swiglu_alpha``)."""
        with_bias = config.moe_expert_linear_bias
        self.gate_bias = (nn.Parameter(torch.empty(num_experts, ffn_size))
                          if with_bias and self.gate_weight is not None else None)
        self.up_bias = nn.Parameter(torch.empty(num_experts, ffn_size)) if with_bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, model_size)) if with_bias else None
        self.down_bias_columns: tuple[int, int] | None = None
        """(start, stop): the output columns this rank's share of the down bias covers, where expert
        tensor parallelism splits it on d (module docstring); None: the whole bias."""
        initialize_own_tensors(self, config)

    def init_rules(self, config) -> dict:
        """N(0, init_std) for gate/up; the scaled output std for down (it feeds the residual); biases 0."""
        return {"gate_weight": normal(config.init_std), "up_weight": normal(config.init_std),
                "down_weight": normal(config.output_init_std), "gate_bias": constant(0.0),
                "up_bias": constant(0.0), "down_bias": constant(0.0)}

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor,
                rows_per_source: torch.Tensor | None = None) -> torch.Tensor:
        """``rows_per_source`` [E, sources] (expert parallelism): how many of each expert's rows came
        from each source rank, in that order; a low-precision recipe quantizes them apart."""
        def linear(inputs: torch.Tensor, name: str) -> torch.Tensor:
            weight = getattr(self, name)
            if self.quantizations is not None:
                return self.quantizations[name].linear(inputs, weight, tokens_per_expert, rows_per_source)
            return grouped_linear(inputs, weight, tokens_per_expert, self.use_grouped_mm)

        experts_of_rows = None if self.up_bias is None else expert_of_each_row(tokens_per_expert, tokens.shape[0])
        up = linear(tokens, "up_weight")
        gate = linear(tokens, "gate_weight") if self.gate_weight is not None else None
        if experts_of_rows is not None:
            up = up + self.up_bias[experts_of_rows]
            gate = gate if gate is None else gate + self.gate_bias[experts_of_rows]
        out = linear(activate(self.activation, up, gate, self.swiglu_limit, self.swiglu_alpha), "down_weight")
        if experts_of_rows is None:
            return out
        bias_rows = self.down_bias[experts_of_rows]
        if self.down_bias_columns is not None:  # this rank's share of the columns, zero elsewhere
            start, stop = self.down_bias_columns
            bias_rows = F.pad(bias_rows, (start, out.shape[-1] - stop))
        return out + bias_rows

    def extra_repr(self) -> str:
        num_experts, ffn_size, model_size = self.up_weight.shape
        return f"experts={num_experts}, model_size={model_size}, ffn_size={ffn_size}, activation={self.activation}"
