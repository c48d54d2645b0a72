"""Context parallelism (meshlm/parallel/context/context_parallel.py) in the trainer equals the single-process run.

The chunk pairing, batch slicing, loss shares and the multi-token shift across chunks are
checked first. Then spawned gloo ranks run the real ``Trainer`` for 5 steps of 4 micro-batches
of 32 tokens on the trainer tests' tiny corpus, with the dense ('*-*-', GQA) and the hybrid
Mamba ('M*-M') models of tests/training/test_parallel_training.py, at cp2 (world 2), cp4,
cp2 x tp2 with SP off and on, and cp2 x dp2 with the distributed optimizer (world 4). Also at
cp2: the dense model with selective recomputation (ring attention rerun in backward), the
hybrid with full recomputation (ring attention and Mamba hand-offs rerun) and the MoE model
with its Switch balance and z losses (the routing gathered over CP: exact, see the module
docstring), also at cp2 x tp2 with SP; the dense model with a sliding window of 6 on alternate
attention blocks (ring attention banding the blocks the window's edge crosses and skipping those
beyond it) and the Gemma 3 and OLMo 2 layer features (own RoPE base for the sliding blocks, an
attention scale, output norms and no input norms, a QK-norm over all heads, GeGLU, zero-centered
norms, scaled embeddings), also at cp2 x dp2; a dense model with soft-capped attention scores and
logits and a window (Gemma 2: every ring block on the reference path, with the cap's slope in its
backward), also at cp2 x tp2 with SP; a GPT-2-style model (learned positions looked up at each
chunk's global positions, LayerNorm, biases; attention beside the MLP through one norm, a bias on
the output head); a Falcon-H1-style parallel hybrid (attention beside Mamba on one norm, Mamba
without its output norm), also at cp2 x tp2 with SP; at cp4 the dense model with a multi-token-prediction
depth (with 2 depths one block-0 weight of this model ends ~1e-4 apart at tp2 as well -- Adam
amplifying fp32 rounding in near-zero gradient elements -- so 1 depth here; the shift by 2
across 4 ranks is checked on its own). Every step's loss and global gradient norm, the validation losses and the
final parameters must equal the single-process run (relative error <= 1e-5, the tolerance of
the other parallel trainer tests). A sequence length that 2*cp (2*cp*tp under SP) does not
divide is refused by the trainer before any collective, naming the numbers.

(The trainer-run helpers are those of tests/training/test_parallel_training.py, loaded by path with
tests/helpers/trainer_runs.py: test files cannot import each other.)
"""

from __future__ import annotations

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LMOutput
from meshlm.parallel.context.chunks import chunk_owner, contiguous_chunks, local_token_positions, paired_chunks
from meshlm.parallel.context.context_parallel import (ContextParallelShift, check_context_parallel_model, share_losses,
                                                      slice_sequence, split_batch, target_share)
from meshlm.parallel.mesh import ParallelContext
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer_runs import load_parallel_training_helpers


helpers = load_parallel_training_helpers()
SEQ_LEN = ["train.seq_len=32"]  # chunks of 4 tokens at cp 4: at least the Mamba conv window of 3
MODELS = {"dense": helpers.MODELS["dense"], "hybrid": helpers.MODELS["hybrid"],
          "dense with mtp": [*helpers.MODELS["dense"], "model.mtp_depth=1"],
          "moe": helpers.MODELS["moe"],
          # and Ministral 3's query scale by position, which each chunk takes at its global positions
          "dense yarn partial rotary": [*helpers.MODELS["dense"], "model.rope_scaling=yarn",
                                        "model.rope_scaling_factor=4", "model.rope_original_max_positions=8",
                                        "model.rope_fraction=0.5", "model.query_scale_beta=0.5",
                                        "model.query_scale_length=4"],
          # chunks of 8 tokens at cp2: a window of 6 bands the diagonal and the next blocks, skips the rest
          "dense sliding window": [*helpers.MODELS["dense"], "model.sliding_window=6",
                                   "model.sliding_window_pattern=SF", "model.rope_local_theta=500",
                                   "model.block_output_norm=true", "model.mlp_activation=geglu",
                                   "model.norm_zero_centered=true", "model.embedding_multiplier=4",
                                   "model.attention_scale=0.3", "model.qk_norm=true", "model.qk_norm_scope=all",
                                   "model.block_input_norm=false"],
          # caps that bend this model's scores (~3 under QK-norm) and logits (~0.4): every ring block on the
          # reference path, the capped logits in the vocab-parallel loss under tp; the first attention
          # block without RoPE (its ring blocks see raw queries and keys)
          "dense soft caps": [*helpers.MODELS["dense"], "model.qk_norm=true", "model.attention_softcap=2",
                              "model.final_logit_softcap=0.3", "model.sliding_window=6", "model.rope_pattern=NR"],
          # each rank looks its chunks' global positions up in the learned table; attention beside the MLP
          # through one norm (a parallel residual) and a bias on the output head, as Phi's
          "gpt2-style": [*helpers.MODELS["dense"], "model.position_embedding=learned", "model.max_position_embeddings=32",
                         "model.norm=layernorm", "model.attention_bias=true", "model.mlp_bias=true",
                         "model.mlp_activation=gelu_tanh", "model.qk_norm=true", "model.parallel_residual=true",
                         "model.parallel_residual_shared_norm=true", "model.output_bias=true"],
          # Falcon-H1-shaped: attention beside Mamba on one norm (the ring and the Mamba state exchange on
          # one input), the Mamba mixers without their output norm
          "falcon-h1-style": [*helpers.MODELS["hybrid"], "model.pattern=*M-*M-", "model.parallel_residual=true",
                              "model.parallel_residual_shared_norm=true", "model.mamba_gated_norm=false"],
          # gpt-oss-shaped: sinks merged after the ring (and cut with the heads under tp), biased router and
          # experts, the clamped SwiGLU, alternating windows. Adam eps 1e-4: the expert biases start at zero and
          # some get gradients near 1e-5 (few tokens each), where eps 1e-5 turned the last-bit differences of
          # the summation order into 1.2e-5 of the largest bias at cp2 x tp2 + SP on an AMD EPYC host (the
          # update's sensitivity to its gradient, lr * eps / (|g| + eps)^2, peaks at |g| ~ eps); 1.6e-6 at 1e-4
          "gpt-oss-style": [*helpers.MODELS["moe"], "optim.eps=1e-4", "model.pattern=*E*E", "model.attention_bias=true",
                            "model.attention_sinks=true", "model.sliding_window=6", "model.sliding_window_pattern=SF",
                            "model.moe_softmax_before_topk=false", "model.moe_router_bias=true",
                            "model.moe_expert_linear_bias=true", "model.mlp_activation=clamped_swiglu",
                            "model.swiglu_limit=1"],
          # DeepSeek-V3-shaped: latent attention (value heads narrower than the query/key heads, padded on
          # the ring), sigmoid routing with a routed scale and a shared expert
          "deepseek-style": [*helpers.MODELS["moe"], "model.attention_type=mla", "model.mla_q_lora_rank=16",
                             "model.mla_kv_lora_rank=8", "model.mla_qk_nope_head_dim=8",
                             "model.mla_qk_rope_head_dim=4", "model.mla_v_head_dim=6",
                             "model.moe_score_function=sigmoid", "model.moe_routed_scaling_factor=2.5",
                             "model.moe_shared_expert_ffn_hidden_size=32"]}
LAYOUTS = {
    2: {"cp2": ["parallel.cp=2"]},
    4: {"cp4": ["parallel.cp=4"], "cp2xtp2": ["parallel.cp=2", "parallel.tp=2"],
        "cp2xtp2 sp": ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"],
        "cp2xdp2 dist-opt": ["parallel.cp=2", "parallel.dp=2", "parallel.distributed_optimizer=true"]},
}
EXTRA_RUNS = {2: [("dense", "cp2 selective recompute", ["parallel.cp=2", "train.recompute=selective"]),
                  ("hybrid", "cp2 full recompute", ["parallel.cp=2", "train.recompute=full"]),
                  # scaled RoPE on half of each head, at each chunk's global positions
                  ("dense yarn partial rotary", "cp2", ["parallel.cp=2"]),
                  ("gpt2-style", "cp2", ["parallel.cp=2"])],
              # the other model kinds at cp2 with tp2 + SP (or dp2) beside it: the ring and the chunks as
              # at cp2 alone, with the heads or the optimizer state cut as well
              4: [("dense with mtp", "cp4", ["parallel.cp=4"]),
                  ("moe", "cp2xtp2 sp", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
                  ("dense soft caps", "cp2xtp2 sp", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
                  ("deepseek-style", "cp2xtp2 sp", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
                  ("gpt-oss-style", "cp2xtp2 sp", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
                  ("falcon-h1-style", "cp2xtp2 sp", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
                  ("dense sliding window", "cp2xdp2 dist-opt", ["parallel.cp=2", "parallel.dp=2",
                                                                "parallel.distributed_optimizer=true"])]}


# --- one process -------------------------------------------------------------------------------------

def test_paired_chunks_balance_the_causal_work():
    assert [paired_chunks(rank, 4) for rank in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [contiguous_chunks(rank, 2) for rank in range(2)] == [(0, 1), (2, 3)]
    assert local_token_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_token_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    every = torch.cat([local_token_positions(24, rank, 3) for rank in range(3)]).sort().values
    assert every.tolist() == list(range(24))  # each token on exactly one rank
    assert chunk_owner(5, 4) == (2, 1) and chunk_owner(2, 4) == (2, 0)


def test_split_batch_keeps_this_ranks_chunks_with_global_positions():
    context = ParallelContext(cp_size=2, cp_rank=1)
    tokens = torch.arange(16).view(2, 8)
    labels = tokens.clone()
    labels[0, 2] = -100  # one ignored label, on rank 1's chunks
    batch = split_batch({"input_ids": tokens, "labels": labels}, context)
    assert batch["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert batch["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert torch.equal(batch["sequence_labels"], labels)
    assert target_share(labels, 0, context) == 7 / 15  # its labelled tokens over the whole sequences'
    assert target_share(labels, 2, context) == 8 / 11  # depth 2: the last 2 of each sequence have no target
    assert torch.equal(slice_sequence(tokens, context), batch["input_ids"])
    assert split_batch({"input_ids": tokens, "labels": labels}, ParallelContext())["input_ids"] is tokens


def test_loss_shares_sum_to_the_micro_batch_losses():
    context = ParallelContext(cp_size=2, cp_rank=0)  # positions 0, 1, 6, 7 of 8
    batch = {"sequence_labels": torch.arange(8).view(1, 8)}
    terms = {"lm": 2.0, "moe_z": 1.0, "mtp_1": 4.0, "mtp": 4.0}
    output = LMOutput(logits=None, loss=torch.tensor(2.0 + 1.0 + 0.5 * 4.0),
                      losses={name: torch.tensor(value) for name, value in terms.items()})
    shared = share_losses(output, batch, context, mtp_loss_coeff=0.5)
    assert shared.losses["lm"].item() == 1.0  # 4 of the 8 labels
    assert shared.losses["moe_z"].item() == 0.5  # 1/cp
    assert shared.losses["mtp_1"].item() == pytest.approx(4.0 * 3 / 7)  # position 7 has no target 1 ahead
    assert shared.losses["mtp"].item() == pytest.approx(4.0 * 3 / 7)
    assert shared.loss.item() == pytest.approx(1.0 + 0.5 + 0.5 * 4.0 * 3 / 7)
    with pytest.raises(ValueError, match="mtp_loss_coeff"):
        share_losses(LMOutput(logits=None, loss=torch.tensor(1.0), losses={"lm": torch.tensor(1.0),
                                                                           "mtp_1": torch.tensor(1.0)}), batch, context)


def test_chunks_shorter_than_what_is_fetched_from_a_neighbour_are_refused():
    with pytest.raises(ConfigError, match="chunks of 2 tokens .* shorter than the Mamba conv window of 3"):
        check_context_parallel_model(ModelConfig(pattern="M*"), 4, seq_len=16)
    with pytest.raises(ConfigError, match="shorter than the multi-token prediction look-ahead of model.mtp_depth=3"):
        check_context_parallel_model(ModelConfig(pattern="*-", mtp_depth=3), 4, seq_len=16)
    check_context_parallel_model(ModelConfig(pattern="M*", mtp_depth=3), 4, seq_len=32)


def shifted_across_ranks(cp: int) -> list:
    from meshlm.config import ParallelConfig
    from meshlm.parallel.mesh import build_parallel_context

    context = build_parallel_context(ParallelConfig(cp=cp), ModelConfig(), torch.device("cpu"))
    tokens = slice_sequence(torch.arange(16).view(1, 16), context)
    return ContextParallelShift(context)(tokens, 2, fill=-1).tolist()


def test_multi_token_shift_crosses_chunk_boundaries():
    from meshlm.models.mtp import shift_left

    expected = shift_left(torch.arange(16).view(1, 16), 2, fill=-1)
    for rank, shifted in enumerate(run_distributed(shifted_across_ranks, 4, 4)):
        assert shifted == slice_sequence(expected, ParallelContext(cp_size=4, cp_rank=rank)).tolist(), rank


# --- the trainer ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("context-parallel-training")
    blend = helpers.write_tiny_corpus(root / "corpus")
    single = {model: helpers.train_once(blend, root / f"single {model}", [*overrides, *SEQ_LEN])
              for model, overrides in MODELS.items()}
    by_world = {}
    for world, layouts in LAYOUTS.items():
        todo = [(f"{model} {layout}", [*MODELS[model], *SEQ_LEN, *overrides])
                for model in ("dense", "hybrid") for layout, overrides in layouts.items()]
        todo += [(f"{model} {name}", [*MODELS[model], *SEQ_LEN, *overrides])
                 for model, name, overrides in EXTRA_RUNS.get(world, [])]
        by_world[world] = run_distributed(helpers.train_runs, world, str(blend), str(root), todo, timeout_s=300)
    return dict(root=root, blend=blend, single=single, by_world=by_world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_context_parallel_training_equals_single_process(runs, model, world):
    for layout in LAYOUTS[world]:
        for rank, results in enumerate(runs["by_world"][world]):
            helpers.assert_same_run(results[f"{model} {layout}"], runs["single"][model],
                                    f"{model} {layout} rank {rank}")


@pytest.mark.parametrize("world", [2, 4])
def test_recomputation_mtp_moe_and_scaled_rope_under_context_parallelism(runs, world):
    for model, name, _ in EXTRA_RUNS[world]:
        for rank, results in enumerate(runs["by_world"][world]):
            helpers.assert_same_run(results[f"{model} {name}"], runs["single"][model], f"{model} {name} rank {rank}")


def test_sequence_not_divisible_by_twice_cp_is_refused(runs):
    layouts = [["parallel.cp=2", "train.seq_len=18"],
               ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "train.seq_len=20"]]
    refusals = run_distributed(helpers.refused_layouts, 4, str(runs["blend"]), str(runs["root"]), layouts)
    for (cp_message, cp_calls), (sp_message, sp_calls) in refusals:
        assert "train.seq_len=18 is not divisible by 4 (2*cp)" in cp_message and cp_calls == {}
        assert "train.seq_len=20 is not divisible by 8 (2*cp*tp)" in sp_message and sp_calls == {}
