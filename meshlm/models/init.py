"""Weight initialization, in one place.

Linear and embedding weights are drawn from N(0, init_std); biases start at zero; norm weights
at one. The output projection of every block -- the matrix that writes into the residual
stream (attention ``o_proj``, MLP ``down_proj``, Mamba ``out_proj``, expert down weights) --
uses init_std / sqrt(2 * num_blocks), so that the residual stream's variance does not grow
with depth (GPT-2, Radford et al. 2019; Megatron-LM). Modules with parameters of their own
kind (Mamba's A_log, dt_bias, D; stacked expert weights) define
``reset_parameters_from_config(config)``, called after the generic pass.
"""

from __future__ import annotations

import torch
from torch import nn

OUTPUT_PROJECTION_NAMES = ("o_proj", "down_proj", "out_proj")


@torch.no_grad()
def initialize_weights(model: nn.Module, config) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            is_output = name.rsplit(".", 1)[-1] in OUTPUT_PROJECTION_NAMES
            nn.init.normal_(module.weight, std=config.output_init_std if is_output else config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=config.init_std)
    for module in model.modules():
        if hasattr(module, "reset_parameters_from_config"):
            module.reset_parameters_from_config(config)
