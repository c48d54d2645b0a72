"""What a test reads off the graphs ``torch.compile`` traces: a backend that keeps them, the check
that no custom autograd Function traced into them returns another node's tensor, and each
parameter's compiled gradient against its eager one."""

from __future__ import annotations

import torch
import torch._dynamo


class GraphCounter:
    """A torch.compile backend that keeps each graph Dynamo hands it and runs it as traced (no Inductor)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(graph_module)
        return graph_module.forward


def returned_tensors_aliasing_intermediates(graph_module) -> list[str]:
    """Each tensor an autograd Function traced into ``graph_module`` returns that is the same tensor
    object as another node of its forward graph (an in-place op's result, a no-op ``.contiguous()``
    or ``.to()``): on torch 2.11 such an output gets no gradient under torch.compile
    (meshlm/models/function_outputs.py). Read off the traced graphs, so it holds on any torch."""
    found = []
    for name, body in list(graph_module.named_modules()):
        if not name.rpartition(".")[2].startswith("fwd_body"):
            continue
        output = next(node for node in body.graph.nodes if node.op == "output")
        returned = output.args[0][0] if isinstance(output.args[0][0], (tuple, list)) else (output.args[0][0],)
        # torch 2.11 returns every intermediate after the Function's own outputs, which its backward
        # graph takes as placeholders named unused_*: only the outputs before them are the Function's
        parent, _, own = name.rpartition(".")
        backward = graph_module.get_submodule(".".join(filter(None, (parent, own.replace("fwd_body", "bwd_body")))))
        unused = sum(node.op == "placeholder" and node.name.startswith("unused_") for node in backward.graph.nodes)
        for node in returned[:len(returned) - unused]:
            value = node.meta.get("example_value") if hasattr(node, "meta") else None
            if value is None:
                continue
            found += [f"{name}: {node.name} is {other.name} ({(node.stack_trace or '').strip().splitlines()[-2:]})"
                      for other in body.graph.nodes
                      if other is not node and other.op != "output" and other.meta.get("example_value") is value]
    return found


GRADIENT_CHECK_SHAPES = {
    "dense": dict(pattern="*-*-", num_kv_heads=2),
    "hybrid": dict(pattern="M*-M", mamba_head_dim=16, mamba_state_size=16, mamba_num_groups=2, mamba_chunk_size=16),
    "moe": dict(pattern="*E*-", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32),
    "gemma2 soft caps": dict(pattern="*-*-", num_kv_heads=2, qk_norm=True, attention_softcap=2.0,
                             final_logit_softcap=0.3, sliding_window=12, sliding_window_pattern="SF"),
    "mistral sliding window": dict(pattern="*-*-", num_kv_heads=2, sliding_window=12),
    "deepseek latent attention": dict(pattern="*E*-", attention_type="mla", mla_q_lora_rank=32, mla_kv_lora_rank=32,
                                      mla_qk_nope_head_dim=16, mla_qk_rope_head_dim=16, mla_v_head_dim=8,
                                      moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
                                      moe_score_function="sigmoid", moe_shared_expert_ffn_hidden_size=32),
    "command-r parallel residual": dict(pattern="*-*-", num_kv_heads=2, norm="layernorm", norm_bias=False,
                                        parallel_residual=True, parallel_residual_shared_norm=True,
                                        rope_fraction=0.5, output_bias=True, qk_norm=True, qk_norm_type="layernorm",
                                        qk_norm_per_head=True),
}
"""The model kinds (hidden 64, 4 heads, FFN 128, vocabulary 64) whose compiled gradients the CPU
suite and the GPU tier compare with the eager ones; the hybrid has the shapes the Triton SSD
kernels take, so on CUDA its Mamba blocks run them inside the compiled graphs; the Gemma 2-style
one runs the soft-capped attention core (an autograd function of its own) inside them; the
Mistral-style one a sliding window of 12 over the 32 tokens on the fused kernels (two causal
blocks a chunk, ``sink_attention.fused_windowed_attention``, another autograd function); the
DeepSeek-style one runs latent attention (value heads narrower than the query and key heads) and
sigmoid routing with a shared expert; the Command R-style one runs each MLP block beside its attention
block, on the attention block's input through its bias-free LayerNorm (a parallel residual), and
normalizes each head of q and k with a LayerNorm weight of its own (Command R+)."""


def gradient_check_model(kind: str, device, dtype):
    """A ``GRADIENT_CHECK_SHAPES`` model on ``device`` in ``dtype``, and a batch of 2 x 32 tokens for it."""
    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel

    config = ModelConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                         **GRADIENT_CHECK_SHAPES[kind])
    model = LanguageModel(config, seed=0).to(device, dtype)
    input_ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    return model, input_ids


def parameter_gradients(model, input_ids) -> dict[str, torch.Tensor]:
    """Each parameter's gradient (fp32 copies) after one forward and backward of the language-model loss."""
    model.zero_grad()
    model(input_ids, input_ids).loss.backward()
    return {name: parameter.grad.float().clone() for name, parameter in model.named_parameters()
            if parameter.grad is not None}


def relative_gradient_gaps(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """{name: |actual - expected| / |expected|} (norms over one parameter's gradient), over the
    parameters whose expected gradient is not zero."""
    assert actual.keys() == expected.keys()
    return {name: ((actual[name] - gradient).norm() / gradient.norm()).item()
            for name, gradient in expected.items() if gradient.norm() > 0}


def compiled_gradient_gaps(model, input_ids, device, backend: str = "inductor") -> tuple[dict[str, float], int]:
    """Compile ``model``'s blocks in place (``train.compile``'s ``compile_blocks``, with ``backend``) and compare each
    parameter's gradient with the eager one taken first: {name: |compiled - eager| / |eager|} over
    the parameters whose eager gradient is not zero, and the number of parameters with one. A
    gradient lost inside a compiled block (as the Mamba-2 scan's was on torch 2.11,
    meshlm/models/function_outputs.py) shows as a gap of 1; the losses alone barely move."""
    from meshlm.training.compile import compile_blocks

    expected = parameter_gradients(model, input_ids)
    torch._dynamo.reset()
    notices = []
    compiled = compile_blocks(model, device, notices.append, backend)
    assert notices == [] and compiled == len(model.config.pattern.replace("|", "")), (compiled, notices)
    return relative_gradient_gaps(parameter_gradients(model, input_ids), expected), len(expected)


def bf16_gradient_gaps(kind: str, device) -> tuple[dict[str, float], dict[str, float]]:
    """A ``GRADIENT_CHECK_SHAPES`` model's bf16 gradients, eager and with its blocks compiled, each
    against the fp32 eager gradients of the same values (``relative_gradient_gaps``): which of the
    two paths a gap between them comes from. Run with TF32 off, so the reference is fp32's."""
    reference_model, input_ids = gradient_check_model(kind, device, torch.float32)
    reference = parameter_gradients(reference_model, input_ids)
    model, _ = gradient_check_model(kind, device, torch.bfloat16)
    eager = parameter_gradients(model, input_ids)
    compiled_gradient_gaps(model, input_ids, device)  # compiles the blocks in place
    return (relative_gradient_gaps(eager, reference),
            relative_gradient_gaps(parameter_gradients(model, input_ids), reference))
