"""A whole tensor-(and sequence-)parallel model against the single-process model, in gloo processes.

Dense models ('*-*-', vocabulary 61 so it must be padded, QK-norm on) with grouped-query attention
whose KV heads are split over the ranks (kv 2 at tp 2, kv 4 at tp 4) or replicated on them (kv 2 at
tp 4, kv 1 at tp 2 and 4), tied and untied embeddings, biases, LayerNorm and a non-gated MLP, one
MTP depth (with RoPE on half of each head's channels), and a Gemma-style model (GeGLU, output norms
after each mixer -- partial gradients under SP --, zero-centered norms, scaled embeddings) with a
sliding window of 5 on alternate attention blocks, their own RoPE base (shorter than the 16 tokens,
so the chunked windowed path runs and the cache reads only the window), a Gemma 2-style one whose
attention scores and logits are soft-capped (caps that bend them: each rank caps its own heads'
scores and its vocabulary slice's logits), a GPT-2-style one (learned positions -- replicated, each
rank adding its slice's rows under SP, a partial gradient --, LayerNorm, biases everywhere, GELU), a
Granite-style one (muP-style multipliers on the embeddings, attention, each block's output and the
logits), two with DeepSeek's multi-head latent attention (heads split, the latent down-projections
and norms replicated with partial gradients; one with a query latent and a block of 8 heads, one
without, with LoRA adapters on its latent projections), an OLMo-style model (no input norms, output
norms, a QK-norm over all heads: cut over the ranks with its statistics all-reduced), a GPT-NeoX-
style one (each attention block beside its MLP on one input, a parallel residual; a quarter of each
head rotated) and a Phi- and Command R-style one (the same with one LayerNorm per pair, without a
bias, which the MLP block applies too: its gradient partial under SP from both blocks; a bias on the
output head, split and padded with the vocabulary); and a hybrid ('M*-M', an MTP depth) with LoRA
adapters on every targeted layer (their b drawn, as after training), of which only the adapters have
gradients; and a Falcon-H1-style parallel hybrid (each attention block beside a Mamba block on one
norm, the Mamba mixers without their output norm). One spawned world of 4 ranks runs each model at
tp 2 (two TP groups side by side) and at tp 4, one of the two with sequence parallelism (which one
alternates from model to model). Every rank builds the full model from a seed, runs the
single-process forward/backward itself, then
parallelizes a copy and checks:

- the training loss (``return_logits=False``: vocab-parallel cross-entropy, logits never
  gathered), and the loss and full logits of ``return_logits=True``;
- every trained parameter's gradient, after ``reduce_partial_tp_grads`` and gathered back to full;
- ``gather_full_state_dict`` equals the single-process state dict exactly, and
  ``load_full_state_dict`` of it restores a zeroed parallel model exactly;
- cached generation (prefill, then one token at a time) gives the full forward's logits.

The parent asserts every relative error is <= 1e-5 (max|a - b| / max|b|).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import IGNORE_INDEX
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.tensor.sharding import (gather_full_state_dict, gather_full_tensor, load_full_state_dict,
                                             partial_grad_names, reduce_partial_tp_grads, tensor_parallel_names)
from tests.helpers.distributed import run_distributed

TOLERANCE = 1e-5
BATCH, SEQ, VOCAB = 2, 16, 61
BASE = dict(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, qk_norm=True)
MODELS = {
    "kv2 untied biases, rmsnorm weight per head": dict(num_kv_heads=2, attention_bias=True, mlp_bias=True,
                                                       qk_norm_per_head=True),
    "mqa tied": dict(num_kv_heads=1, tie_embeddings=True),
    "kv2 qwen2 biases": dict(num_kv_heads=2, attention_bias=True, attention_output_bias=False),
    # Hunyuan's QK-norm of the rotated heads, Ministral 3's query scale by position
    "kv2 hunyuan-style qk-norm after rope, query scale": dict(num_kv_heads=2, attention_bias=True,
                                                               qk_norm_after_rope=True, query_scale_beta=0.5,
                                                               query_scale_length=4),
    "kv2 gemma-style sliding window": dict(num_kv_heads=2, sliding_window=5, sliding_window_pattern="SF",
                                           rope_local_theta=500.0, mlp_activation="geglu", block_output_norm=True,
                                           norm_zero_centered=True, embedding_multiplier=5.0, attention_scale=0.3),
    "kv2 gemma2-style soft caps": dict(num_kv_heads=2, sliding_window=5, sliding_window_pattern="SF",
                                       attention_softcap=2.0, final_logit_softcap=0.3, mlp_activation="geglu",
                                       block_output_norm=True, norm_zero_centered=True, embedding_multiplier=5.0),
    # (QK-norm kept: without it the key bias's gradient is 0 up to rounding -- a shift of every key by
    # the same vector moves a row's scores alike -- and no relative error of it means anything)
    "gpt2-style learned positions": dict(position_embedding="learned", max_position_embeddings=24,
                                         norm="layernorm", attention_bias=True, mlp_bias=True,
                                         mlp_activation="gelu_tanh", tie_embeddings=True),
    "kv2 granite-style multipliers, longrope": dict(num_kv_heads=2, embedding_multiplier=6.0, residual_multiplier=0.4,
                                                    logit_divisor=2.5, attention_scale=0.2, rope_scaling="longrope",
                                                    rope_scaling_factor=4.0, rope_original_max_positions=4,
                                                    rope_short_factors=[1.0, 1.2, 1.5, 2.0],
                                                    rope_long_factors=[1.0, 4.0, 16.0, 64.0]),
    "kv4 olmo-style": dict(num_kv_heads=4, qk_norm_scope="all", block_input_norm=False, block_output_norm=True),
    "kv4 tied layernorm relu, phi-style qk layernorm": dict(num_kv_heads=4, tie_embeddings=True, norm="layernorm",
                                                            mlp_activation="squared_relu", mlp_bias=True,
                                                            qk_norm_type="layernorm", qk_norm_bias=True),
    "kv2 mtp partial rotary, nope blocks": dict(num_kv_heads=2, mtp_depth=1, mtp_pattern="*-", rope_fraction=0.5,
                                                rope_pattern="RN"),
    "gpt-neox-style parallel residual": dict(norm="layernorm", attention_bias=True, mlp_bias=True,
                                             mlp_activation="gelu", rope_fraction=0.25, parallel_residual=True,
                                             qk_norm=False),
    "kv2 shared bias-free norm, biased head, layernorm per head": dict(
        num_kv_heads=2, norm="layernorm", norm_bias=False, parallel_residual=True, parallel_residual_shared_norm=True,
        rope_fraction=0.25, attention_bias=True, mlp_bias=True, output_bias=True, qk_norm_type="layernorm",
        qk_norm_per_head=True),
    "deepseek-style latent attention": dict(attention_type="mla", qk_norm=False, mla_q_lora_rank=12,
                                            mla_kv_lora_rank=8, mla_qk_nope_head_dim=6, mla_qk_rope_head_dim=4,
                                            mla_v_head_dim=5, block_overrides={2: {"num_attention_heads": 8}}),
    "lora latent attention, direct queries": dict(attention_type="mla", qk_norm=False, mla_kv_lora_rank=8,
                                                  mla_qk_nope_head_dim=6, mla_qk_rope_head_dim=4, mla_v_head_dim=5,
                                                  lora_rank=4, lora_targets=["q_proj", "kv_a_proj", "kv_b_proj",
                                                                             "o_proj", "up_proj"]),
    # gpt-oss: sinks cut with the heads, a biased router, biased experts cut on their width (the down
    # bias added by one TP rank), the clamped SwiGLU bending some of the experts' values
    "kv2 gpt-oss-style sinks and biased experts": dict(
        pattern="*E*E", num_kv_heads=2, attention_bias=True, attention_sinks=True, sliding_window=5,
        sliding_window_pattern="SF", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
        moe_softmax_before_topk=False, moe_router_bias=True, moe_expert_linear_bias=True,
        mlp_activation="clamped_swiglu", swiglu_limit=1.0),
    # Falcon-H1: attention beside Mamba on one norm (the shared norm's gradient partial under SP from
    # both blocks), Mamba without its output norm, muP-style embedding and logit multipliers
    "falcon-h1-style parallel hybrid": dict(pattern="*M-*M-", num_kv_heads=2, mamba_head_dim=8, mamba_state_size=8,
                                            mamba_num_groups=4, mamba_chunk_size=8, parallel_residual=True,
                                            parallel_residual_shared_norm=True, mamba_gated_norm=False,
                                            embedding_multiplier=2.0, logit_divisor=2.5),
    "lora hybrid mtp": dict(pattern="M*-M", num_kv_heads=2, mamba_head_dim=8, mamba_state_size=8,
                            mamba_num_groups=4, mamba_chunk_size=8, mtp_depth=1, mtp_pattern="*-", lora_rank=4,
                            lora_alpha=8),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach() - expected.detach()).abs().max() / expected.detach().abs().max())


def build_model(overrides: dict) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**{**BASE, **overrides}))
    with torch.no_grad():  # LoRA: trained adapters (a fresh b is zero, and so would be a's gradient)
        for name, param in model.named_parameters():
            if name.endswith(".lora.b"):
                param.normal_(0.0, 0.1)
            elif ".q_norm." in name or ".k_norm." in name:  # trained QK-norms: a head given another's row shows
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif name.endswith(".sinks") or ".experts." in name and "bias" in name:  # trained sinks and biases
                param.normal_(0.0, 0.5)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    tokens[0, :2] = torch.tensor([0, VOCAB - 1])
    labels = tokens[:, 1:].clone()
    labels[1, :3] = IGNORE_INDEX
    return tokens[:, :-1], labels


def check_layout(full: LanguageModel, reference: dict, context) -> dict:
    input_ids, labels = batch()
    model = parallelize_model(copy.deepcopy(full), context)
    output = model(input_ids, labels, return_logits=False)  # the training path: vocab-parallel loss
    assert output.logits is None
    output.loss.backward()
    reduce_partial_tp_grads(model, context)
    with torch.no_grad():
        evaluated = model(input_ids, labels, return_logits=True)  # evaluation: logits gathered in full
    errors = {"loss": relative_error(output.loss, reference["loss"]),
              "loss with logits": relative_error(evaluated.loss, reference["loss"]),
              "logits": relative_error(evaluated.logits, reference["logits"])}
    assert evaluated.logits.shape == (BATCH, SEQ, VOCAB)
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    assert [name for name, _ in trained] == list(reference["grads"])
    for name, param in trained:
        errors[f"grad {name}"] = relative_error(gather_full_tensor(param, param.grad, context),
                                                reference["grads"][name])
    assert tensor_parallel_names(model) and not tensor_parallel_names(model) & partial_grad_names(model)

    state = gather_full_state_dict(model, context)
    assert state.keys() == reference["state"].keys()
    errors["state dict (exact)"] = float(not all(torch.equal(state[k], reference["state"][k]) for k in state))
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    load_full_state_dict(model, reference["state"], context)
    reloaded = gather_full_state_dict(model, context)
    errors["load + gather (exact)"] = float(not all(torch.equal(reloaded[k], state[k]) for k in state))
    errors.update(check_cached_generation(model, input_ids, reference["logits"]))
    return errors


@torch.no_grad()
def check_cached_generation(model, input_ids, full_logits) -> dict:
    cache = InferenceCache()
    pieces = [model(input_ids[:, :8], cache=cache).logits]
    pieces += [model(input_ids[:, t:t + 1], cache=cache).logits for t in range(8, 12)]
    return {"cached generation logits": relative_error(torch.cat(pieces, dim=1), full_logits[:, :12])}


LAYOUTS = ((2, False), (4, True), (2, True), (4, False))
"""(tp, sp): each model runs two of them, the first two or the last two in turn (``layouts_of``)."""


def layouts_of(position: int) -> tuple:
    """The layouts of the model at ``position`` in MODELS: tp 2 and tp 4, one of them with sequence
    parallelism, alternating which, so every model is split both ways and with and without SP, and
    every layout runs half the models (all four for each model took twice the time)."""
    return LAYOUTS[:2] if position % 2 == 0 else LAYOUTS[2:]


def run_all_cases() -> dict:
    input_ids, labels = batch()
    errors = {}
    for position, (model_name, overrides) in enumerate(MODELS.items()):
        full = build_model(overrides)
        output = full(input_ids, labels, return_logits=True)
        output.loss.backward()
        reference = {"loss": output.loss.detach(), "logits": output.logits.detach(),
                     "grads": {name: param.grad.clone() for name, param in full.named_parameters()
                               if param.requires_grad},  # (LoRA: the adapters only)
                     "state": {name: value.clone() for name, value in full.state_dict().items()}}
        full.zero_grad(set_to_none=True)
        for tp, sp in layouts_of(position):
            context = build_parallel_context(ParallelConfig(tp=tp, sp=sp), full.config, torch.device("cpu"),
                                             seq_len=SEQ)
            for quantity, error in check_layout(full, reference, context).items():
                errors[f"{model_name} tp={tp} sp={sp}: {quantity}"] = error
    dist.barrier()
    return errors


def test_parallel_model_matches_single_process():
    every_rank = run_distributed(run_all_cases, 4, timeout_s=420)
    for rank, errors in enumerate(every_rank):
        assert len(errors) > len(MODELS) * 2 * 20
        bad = {case: error for case, error in errors.items() if not error <= TOLERANCE}
        assert not bad, f"rank {rank}: {bad}"


def test_world_of_one_is_unchanged():
    model = build_model({})
    assert parallelize_model(model, ParallelContext()) is model
    assert type(model) is LanguageModel and not tensor_parallel_names(model)


def test_indivisible_heads_are_refused_before_any_collective():
    model = build_model({"num_kv_heads": 2})
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by parallel.tp=3"):
        parallelize_model(model, ParallelContext(tp_size=3, tp_rank=0))


def test_qk_norm_over_all_heads_with_replicated_key_heads_is_refused():
    model = build_model({"num_kv_heads": 2, "qk_norm_scope": "all"})
    with pytest.raises(ConfigError, match="model.num_kv_heads=2 < parallel.tp=4 the key heads are replicated"):
        parallelize_model(model, ParallelContext(tp_size=4, tp_rank=0))


def test_sequence_not_divisible_under_sequence_parallelism_is_refused():
    model = parallelize_model(build_model({"num_kv_heads": 2}), ParallelContext(tp_size=2, sequence_parallel=True))
    with pytest.raises(ConfigError, match="this batch has 15 positions; use a multiple of tp"):
        model(torch.zeros(1, 15, dtype=torch.long))
