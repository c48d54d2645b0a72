"""One pipelined training step equals the single-process step: losses, gradients, norm, eval.

Spawned gloo ranks build the same model, keep their stages (``PipelinedModel.build``) and run one
step's schedule; the loss terms (every rank gets them), every parameter's gradient (after the DP
reduction and the tied-embedding sum, gathered by name), the global gradient norm, the per-expert
counts and a forward-only evaluation must equal one process running the whole model. The models
put MoE blocks (auxiliary and z losses) on a non-last stage, MTP and a tied head on the last
(and one dense model has Gemma 2's soft-capped attention scores and logits, its MTP loss too, and
GPT-NeoX's parallel residual, each attention block beside its MLP on one stage; a
GPT-2-style one its learned positions on the first stage and its tied head on the last);
layouts: pp2 (1F1B), pp2 x vp2 (interleaved), pp2 x dp2 with the distributed optimizer, and
pp2 x tp2 with sequence parallelism. Every run has ``parallel.check_collectives`` on and compares
the ranks' collectives and pipeline messages at the end.

With small DP buckets, the executor's action timestamps and the reducer's launch times show the
DP reduction of each chunk's gradients starting inside that chunk's last backward -- under
interleaving, before the rank's last action -- while the tied embedding's bucket waits for the
sum over the two stages; the gradients still equal the single-process ones.
"""

from __future__ import annotations

import torch

from meshlm.config import OptimConfig, ParallelConfig, PrecisionConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.collective_checks import compare_collectives
from meshlm.parallel.collectives import all_gather_along, all_gather_objects, all_reduce_
from meshlm.parallel.data.data_parallel import build_data_parallel, finish_gradients
from meshlm.parallel.mesh import build_parallel_context
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.pipeline.pipelined_model import PipelinedModel
from meshlm.parallel.pipeline.state import merge_named
from meshlm.parallel.tensor.sharding import gather_full_tensor, partial_grad_names, tensor_parallel_names
from meshlm.precision.mixed_precision import MixedPrecision
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_training import relative_error

TOLERANCE = 1e-5
SEQ_LEN, MICRO_BATCH, NUM_MICROBATCHES = 16, 2, 4
BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
MODELS = {
    "moe mtp tied": dict(BASE, pattern="*E|-*", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
                         moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, mtp_depth=1, tie_embeddings=True),
    "hybrid tied": dict(BASE, pattern="M*-M", mamba_head_dim=8, mamba_state_size=8, mamba_num_groups=4,
                        mamba_chunk_size=8, tie_embeddings=True),
    "dense": dict(BASE, pattern="*-*-", num_kv_heads=2),
    # Gemma 2's caps, small enough to bend this model's scores (QK-normed) and logits; MTP's loss capped too;
    # attention and MLP side by side (GPT-NeoX's parallel residual) in the main blocks and the MTP depth
    "dense soft caps mtp": dict(BASE, pattern="*-*-", num_kv_heads=2, qk_norm=True, attention_softcap=2.0,
                                final_logit_softcap=0.3, mtp_depth=1, parallel_residual=True),
    # DeepSeek-V3-shaped: latent attention in the main blocks and the MTP depth, sigmoid routing
    "deepseek-style mtp": dict(BASE, pattern="*E|*-", attention_type="mla", mla_q_lora_rank=16, mla_kv_lora_rank=8,
                               mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=4, mla_v_head_dim=6, moe_num_experts=4,
                               moe_top_k=2, moe_ffn_hidden_size=32, moe_score_function="sigmoid",
                               moe_shared_expert_ffn_hidden_size=32, mtp_depth=1),
    # learned positions live with the embedding on the first stage
    "gpt2-style": dict(BASE, pattern="*-*-", position_embedding="learned", max_position_embeddings=16,
                       norm="layernorm", attention_bias=True, mlp_bias=True, mlp_activation="gelu_tanh", qk_norm=True,
                       tie_embeddings=True),
}


def make_batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [{"input_ids": torch.randint(0, 64, (MICRO_BATCH, SEQ_LEN), generator=generator),
             "labels": torch.randint(0, 64, (MICRO_BATCH, SEQ_LEN), generator=generator)}
            for _ in range(NUM_MICROBATCHES)]


def single_process_step(model_kwargs: dict) -> dict:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**model_kwargs))
    loss_sum, terms = 0.0, {}
    counts = []
    for batch in make_batches():
        output = model(batch["input_ids"], batch["labels"], return_logits=False)
        (output.loss / NUM_MICROBATCHES).backward()
        loss_sum += output.loss.item()
        for name, value in output.losses.items():
            terms[name] = terms.get(name, 0.0) + value.item()
        counts = [a + b for a, b in zip(counts, output.tokens_per_expert)] if counts else output.tokens_per_expert
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    norm = torch.nn.utils.get_total_norm(list(grads.values())).item()
    with torch.no_grad():
        evaluation = sum(model(b["input_ids"], b["labels"], return_logits=False).losses["lm"].item()
                         for b in make_batches()[:2])
    return dict(loss=loss_sum, terms=terms, counts=[c.tolist() for c in counts], grads=grads, norm=norm,
                evaluation=evaluation)


def pipelined_step(model_kwargs: dict, parallel_kwargs: dict) -> dict:
    """In each spawned rank: one step of this rank's stages; full gradients gathered by name."""
    torch.set_num_threads(1)
    config, parallel = ModelConfig(**model_kwargs), ParallelConfig(check_collectives=True, **parallel_kwargs)
    context = build_parallel_context(parallel, config, torch.device("cpu"), SEQ_LEN, NUM_MICROBATCHES)
    torch.manual_seed(0)
    model = parallelize_model(LanguageModel(config), context)
    pipelined = PipelinedModel.build(model, context, SEQ_LEN)
    precision = MixedPrecision(model, PrecisionConfig())
    reducer, optimizer = build_data_parallel(precision, OptimConfig(), parallel, context)
    share = NUM_MICROBATCHES // context.dp_size
    batches = make_batches()[context.dp_rank * share:(context.dp_rank + 1) * share]
    loss, terms, counts = pipelined.forward_backward(batches, NUM_MICROBATCHES, precision, reducer)
    launches = list(reducer.launches)  # those that went out during the schedule (finish() adds the rest)
    records = [(action.kind, action.chunk, action.microbatch, start, end)
               for action, start, end in ((r.action, r.start, r.end) for r in pipelined.last_records)]
    embedding = reducer.index_of.get("embedding.weight")
    embedding_bucket = reducer.layout.bucket_of[embedding] if embedding is not None else None
    if context.dp_size > 1:  # the trainer sums the DP ranks' loss terms for logging the same way
        flat = torch.stack([loss, *terms.values()])
        all_reduce_(flat, context.dp_group)
        loss, terms = flat[0], dict(zip(terms, flat[1:]))
        counts = [count.clone() for count in counts]
        for count in counts:
            all_reduce_(count, context.dp_group)
    norm, _ = finish_gradients(reducer, optimizer, precision, context, 0.0, tensor_parallel_names(model),
                               partial_grad_names(model))
    named = dict(model.named_parameters())
    grads = dict(reducer.named_grads())
    if parallel.distributed_optimizer:  # each DP rank holds the reduced gradient of its own segments
        owned = torch.zeros_like(reducer.buffer)
        for segment in optimizer.segments:
            owned[segment.start:segment.end] = reducer.buffer[segment.start:segment.end]
        all_reduce_(owned, context.dp_cp_group)
        grads = {name: reducer.layout.view(owned, index) for index, name in enumerate(reducer.names)}
    full = {name: gather_full_tensor(named[name], grad, context).clone() for name, grad in grads.items()}
    everyone = all_gather_objects(full, context.pp_group)
    evaluation = pipelined.evaluate(make_batches()[:2], precision)
    copies = _embedding_copies_equal(model, context, pipelined)
    compare_collectives(context, "after the pipelined step")
    return dict(loss=float(loss), terms={name: float(value) for name, value in terms.items()},
                counts=[count.tolist() for count in counts], grads=merge_named(everyone), norm=float(norm),
                evaluation=evaluation, embedding_copies=copies,
                launches=launches, records=records, embedding_bucket=embedding_bucket,
                embedding_group=pipelined.embedding_group is not None)


def _embedding_copies_equal(model, context, pipelined) -> bool | None:
    """The first and last stages' embedding gradients are the same after the step (None: no copy)."""
    if pipelined.embedding_group is None:
        return None
    copies = all_gather_along(model.embedding.weight.grad.detach(), 0, pipelined.embedding_group).chunk(2)
    return bool(torch.equal(copies[0], copies[1]))


def pipelined_steps(runs: list[tuple[str, dict, dict]]) -> dict:
    return {name: pipelined_step(model_kwargs, parallel_kwargs) for name, model_kwargs, parallel_kwargs in runs}


def assert_same_step(actual: dict, expected: dict, where: str) -> None:
    assert abs(actual["loss"] - expected["loss"]) <= TOLERANCE * abs(expected["loss"]), where
    assert set(actual["terms"]) == set(expected["terms"]), where
    for name, value in expected["terms"].items():
        assert abs(actual["terms"][name] - value) <= TOLERANCE * max(abs(value), 1e-3), (where, name)
    assert actual["counts"] == expected["counts"], where
    assert set(actual["grads"]) == set(expected["grads"]), where
    for name, grad in expected["grads"].items():
        assert relative_error(actual["grads"][name], grad) <= TOLERANCE, (where, name)
    assert abs(actual["norm"] - expected["norm"]) <= TOLERANCE * expected["norm"], where
    assert abs(actual["evaluation"] - expected["evaluation"]) <= TOLERANCE * expected["evaluation"], where


def test_pipelined_step_equals_single_process_on_two_ranks():
    runs = [("moe mtp tied pp2", MODELS["moe mtp tied"], dict(pp=2)),
            ("hybrid tied pp2 vp2", MODELS["hybrid tied"], dict(pp=2, vp=2)),
            ("dense soft caps mtp pp2", MODELS["dense soft caps mtp"], dict(pp=2)),
            ("gpt2-style pp2", MODELS["gpt2-style"], dict(pp=2)),
            ("deepseek-style mtp pp2", MODELS["deepseek-style mtp"], dict(pp=2))]
    results = run_distributed(pipelined_steps, 2, runs, timeout_s=120)
    for name, model_kwargs, _ in runs:
        expected = single_process_step(model_kwargs)
        assert expected["terms"].keys() >= {"lm"}, name
        for rank, by_run in enumerate(results):
            assert_same_step(by_run[name], expected, f"{name} rank {rank}")
            assert by_run[name]["embedding_copies"] is True, name
    moe = single_process_step(MODELS["moe mtp tied"])
    assert {"moe_aux", "moe_z", "mtp", "mtp_1"} <= set(moe["terms"])  # computed on stage 0 and 1 respectively


def test_pipelined_step_with_tp_sp_and_with_dp_distributed_optimizer():
    runs = [("dense pp2 tp2 sp", MODELS["dense"], dict(pp=2, tp=2, sp=True)),
            ("hybrid pp2 vp2 dp2 dist-opt", MODELS["hybrid tied"], dict(pp=2, vp=2, dp=2, distributed_optimizer=True))]
    results = run_distributed(pipelined_steps, 4, runs, timeout_s=120)
    for name, model_kwargs, _ in runs:
        expected = single_process_step(model_kwargs)
        for rank, by_run in enumerate(results):
            assert_same_step(by_run[name], expected, f"{name} rank {rank}")


def assert_reduction_overlaps_the_schedule(result: dict, interleaved: bool, where: str) -> None:
    """Buckets launched inside the chunks' last backwards (timestamps), the tied embedding's held back."""
    records, launches = result["records"], result["launches"]
    assert launches, f"{where}: no DP bucket was launched during the schedule"
    last_backward = {}
    for kind, chunk, _, start, end in records:
        if kind == "B":
            last_backward[chunk] = (start, end)
    first_final = min(start for start, _ in last_backward.values())
    schedule_end = records[-1][4]
    assert all(first_final <= time <= schedule_end for _, time in launches), where
    if interleaved:  # a later chunk's buckets go out while the rank still computes an earlier chunk
        assert min(time for _, time in launches) < records[-1][3], where
    else:  # 1F1B: the last action is the chunk's last backward; the launches happen inside it
        start, end = last_backward[0]
        assert records[-1][3] == start and all(start <= time <= end for _, time in launches), where
    if result["embedding_group"]:  # summed over the embedding group first, reduced over DP in finish()
        assert result["embedding_bucket"] not in {bucket for bucket, _ in launches}, where


def test_dp_reduction_starts_in_each_chunks_last_backward():
    small = dict(dp=2, bucket_size_mb=0.0005)  # ~130 fp32 elements: many buckets per stage
    runs = [("hybrid tied pp2 vp2 dp2", MODELS["hybrid tied"], dict(pp=2, vp=2, **small)),
            ("moe mtp tied pp2 dp2 dist-opt", MODELS["moe mtp tied"], dict(pp=2, distributed_optimizer=True, **small))]
    results = run_distributed(pipelined_steps, 4, runs, timeout_s=180)
    for name, model_kwargs, parallel_kwargs in runs:
        expected = single_process_step(model_kwargs)
        for rank, by_run in enumerate(results):
            assert_same_step(by_run[name], expected, f"{name} rank {rank}")
            assert by_run[name]["embedding_copies"] is True, name
            interleaved = parallel_kwargs.get("vp", 1) > 1
            assert_reduction_overlaps_the_schedule(by_run[name], interleaved, f"{name} rank {rank}")
