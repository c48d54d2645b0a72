"""A low-precision recipe on a LoRA model: the frozen weights' GEMMs quantized, the adapters not."""

from __future__ import annotations

import torch

from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.lora import AdaptedLinear
from meshlm.precision.model_recipe import apply_recipe
from meshlm.precision.quantized_linear import QuantizedLinear, quantized_linear
from meshlm.precision.recipes import Recipe


def test_recipe_quantizes_the_frozen_weight_and_adds_the_adapter_in_high_precision():
    config = ModelConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, pattern="*-*-", lora_rank=4,
                         lora_alpha=8)
    model = LanguageModel(config, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".lora.b"):
                parameter.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    count = apply_recipe(model, Recipe("fp8_tensorwise"), config.num_blocks)
    assert count == 2 * 4 + 2 * 3  # every linear layer of the blocks, adapted or not
    layer = model.blocks[0].mixer.q_proj
    assert type(layer) is QuantizedLinear and layer.quantization is not None and layer.lora is not None
    x = torch.randn(2, 5, 32)
    expected = quantized_linear(x, layer.weight, None, Recipe("fp8_tensorwise")) + layer.lora(x)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    unquantized = x @ (layer.weight + 2.0 * layer.lora.b @ layer.lora.a).T
    assert not torch.equal(layer(x), unquantized)  # the frozen GEMM really is quantized
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    trained = {name for name, parameter in model.named_parameters() if parameter.grad is not None}
    assert trained == {name for name, _ in model.named_parameters() if ".lora." in name}
    assert not any(type(module) is AdaptedLinear
                   for block in model.blocks for module in block.modules())
