"""Tensor- and sequence-parallel Mamba-2 against the single-process mixer, in real gloo processes.

One spawned world of 4 ranks runs every case: tp 2 (two TP groups side by side) and tp 4,
sequence parallelism off and on, 2 and 4 B/C groups (tp 4 needs 4), a chunk size that does not
divide the sequence, biases everywhere. Every rank builds the full mixer (or model) from a seed,
computes the single-process reference itself, then splits a copy with ``parallelize_mamba`` (or
``parallelize_model``) and compares the output, the input gradient and every parameter gradient
(shards gathered back to full, partial gradients summed over the group). The parent asserts the
relative errors are <= 1e-5.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.models.mamba2 import Mamba2Mixer
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.tensor.mamba import parallelize_mamba
from meshlm.parallel.tensor.sharding import gather_full_tensor, reduce_partial_tp_grads
from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_checks import assert_all_within_tolerance, seeded, sequence_slice

TOLERANCE = 1e-5
BATCH, SEQ, HIDDEN = 2, 16, 32


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach() - expected).abs().max() / expected.abs().max())


def make_config(groups: int, **overrides) -> ModelConfig:
    values = dict(hidden_size=HIDDEN, pattern="M", vocab_size=64, mamba_head_dim=8, mamba_state_size=8,
                  mamba_num_groups=groups, mamba_chunk_size=5, mamba_proj_bias=True, init_std=0.2)
    values.update(overrides)
    return ModelConfig(**values)


@torch.no_grad()
def perturb(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values in every parameter (norm weights, D and biases start at constants)."""
    for index, param in enumerate(module.parameters()):
        param.add_(0.1 * seeded(*param.shape, seed=seed + index))


def gradient_errors(parallel: torch.nn.Module, reference: torch.nn.Module, context) -> dict:
    """Relative error of every parameter gradient, shards gathered back to full."""
    reduce_partial_tp_grads(parallel, context)
    expected = dict(reference.named_parameters())
    errors = {}
    for name, param in parallel.named_parameters():
        full_grad = gather_full_tensor(param, param.grad, context)
        errors[f"grad {name}"] = relative_error(full_grad, expected[name].grad)
    assert set(errors) == {f"grad {name}" for name in expected}
    return errors


def check_mixer(context, groups: int, seed: int) -> dict:
    torch.manual_seed(seed)
    reference = Mamba2Mixer(make_config(groups), layer_index=0)
    perturb(reference, seed)
    parallel = copy.deepcopy(reference)
    parallelize_mamba(parallel, context)
    x, upstream = seeded(BATCH, SEQ, HIDDEN, seed=seed), seeded(BATCH, SEQ, HIDDEN, seed=seed + 1)
    sequence = SequenceContext.for_tokens(torch.zeros(BATCH, SEQ, dtype=torch.long))

    full_x = x.clone().requires_grad_()
    expected = reference(full_x, sequence)
    (expected * upstream).sum().backward()

    local_x = sequence_slice(x, context).clone().requires_grad_()
    out = parallel(local_x, sequence)
    (out * sequence_slice(upstream, context)).sum().backward()
    assert parallel.num_heads * context.tp_size == reference.num_heads
    assert all(getattr(p, "tensor_parallel", False) for name, p in parallel.named_parameters()
               if name != "out_proj.bias")
    return {"output": relative_error(out, sequence_slice(expected.detach(), context)),
            "input grad": relative_error(local_x.grad, sequence_slice(full_x.grad, context)),
            **gradient_errors(parallel, reference, context)}


@torch.no_grad()
def check_cached_generation(context, groups: int, seed: int) -> dict:
    """Prefill then two one-token steps: the cache holds local heads, the outputs stay exact."""
    torch.manual_seed(seed)
    reference = Mamba2Mixer(make_config(groups), layer_index=0)
    perturb(reference, seed)
    parallel = copy.deepcopy(reference)
    parallelize_mamba(parallel, context)
    x = seeded(1, 10, HIDDEN, seed=seed)
    outputs, caches = {}, {}
    for label, mixer in (("reference", reference), ("parallel", parallel)):
        cache, pieces = InferenceCache(), []
        for piece in (x[:, :8], x[:, 8:9], x[:, 9:10]):
            ids = torch.zeros(piece.shape[:2], dtype=torch.long)
            pieces.append(mixer(piece, SequenceContext.for_tokens(ids, cache=cache)))
        outputs[label], caches[label] = torch.cat(pieces, dim=1), cache.layers[0]
    assert caches["parallel"].ssm_state.shape[1] * context.tp_size == caches["reference"].ssm_state.shape[1]
    return {"cached generation": relative_error(outputs["parallel"], outputs["reference"])}


def check_model(context, seed: int) -> dict:
    """A hybrid 'M*M-' language model split by parallelize_model: loss and every gradient."""
    torch.manual_seed(seed)
    config = make_config(4, pattern="M*M-", num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64)
    reference = LanguageModel(config)
    perturb(reference, seed)
    parallel = parallelize_model(copy.deepcopy(reference), context)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=generator)
    reference_loss = reference(ids[:, :-1], ids[:, 1:], return_logits=False).loss
    reference_loss.backward()
    loss = parallel(ids[:, :-1], ids[:, 1:], return_logits=False).loss
    loss.backward()
    return {"loss": relative_error(loss, reference_loss.detach()), **gradient_errors(parallel, reference, context)}


def every_layout():
    """(label, context) for tp 2 and 4, SP off and on, in the world of 4 (tp 2: two TP groups)."""
    for tp in (2, 4):
        for sp in (False, True):
            yield f"tp={tp} sp={sp}", build_parallel_context(ParallelConfig(tp=tp, sp=sp), ModelConfig(),
                                                             torch.device("cpu"))


def run_mixer_cases() -> dict:
    errors = {}
    for layout, context in every_layout():
        for groups in (2, 4) if context.tp_size == 2 else (4,):
            for quantity, error in check_mixer(context, groups, seed=len(errors)).items():
                errors[f"mixer {layout} groups={groups}: {quantity}"] = error
        if not context.sequence_parallel:
            for quantity, error in check_cached_generation(context, 4, seed=len(errors)).items():
                errors[f"{layout}: {quantity}"] = error
    dist.barrier()
    return errors


def run_model_cases() -> dict:
    errors = {}
    for layout, context in every_layout():
        for quantity, error in check_model(context, seed=len(errors)).items():
            errors[f"model M*M- {layout}: {quantity}"] = error
    dist.barrier()
    return errors


def test_parallel_mixer_matches_single_process():
    every_rank = run_distributed(run_mixer_cases, 4)
    assert all(sum(case.endswith("grad A_log") for case in errors) == 6 for errors in every_rank)
    assert all(sum("cached generation" in case for case in errors) == 2 for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)


def test_parallel_hybrid_model_matches_single_process():
    every_rank = run_distributed(run_model_cases, 4)
    assert all(sum(case.endswith(": loss") for case in errors) == 4 for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)


def test_groups_not_divisible_by_tp_are_refused():
    mixer = Mamba2Mixer(make_config(2), layer_index=0)
    with pytest.raises(ConfigError, match="mamba_num_groups=2"):
        parallelize_mamba(mixer, ParallelContext(world_size=4, tp_size=4))
