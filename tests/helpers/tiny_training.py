"""A small training loop with data parallelism, shared by the DP tests and ``bench/memory.py``.

It runs the trainer's step (micro-batches with gradient accumulation, MixedPrecision, global-norm
clipping, AdamW by parameter name, an LR that changes every step) on synthetic token batches,
either the plain single-process way -- ``torch.optim.AdamW`` on ``.grad``, as
``meshlm.training.trainer`` does it today -- or with this rank's share of the micro-batches and
the data-parallel pieces (``GradientReducer`` + AdamW, or the ``DistributedOptimizer``). The
tests compare the two: losses and final parameters must agree to fp32 rounding.

Micro-batch ``j`` of step ``s`` is the same tokens in every run; with dp ranks, rank r runs
micro-batches ``[r*n/dp, (r+1)*n/dp)`` of the n per step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshlm.config import OptimConfig, ParallelConfig, PrecisionConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.optim.build import build_optimizer
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.data.data_parallel import build_data_parallel, finish_gradients
from meshlm.parallel.groups import group_of
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.tensor.sharding import gather_full_state_dict, partial_grad_names, tensor_parallel_names
from meshlm.precision.mixed_precision import MixedPrecision


@dataclass
class TrainSpec:
    model: dict
    """ModelConfig fields."""
    steps: int = 5
    micro_batches: int = 4
    """Per step, over all DP ranks together."""
    micro_batch_size: int = 2
    seq_len: int = 16
    dtype: str = "fp32"
    lr: float = 1e-3
    weight_decay: float = 0.1
    eps: float = 1e-6
    """AdamW's eps, as in the trainer tests: at 1e-8 an element whose gradient is nearly zero
    moves by m / sqrt(v) ~ +-lr whatever its size, so fp32 rounding of another summation order
    (DP) can flip a whole update there -- an element-level difference, not an error."""
    grad_clip: float = 0.5
    tp: int = 1
    """Tensor-parallel size of the DP run (the world is dp * tp)."""
    sp: bool = False
    distributed_optimizer: bool = False
    zero_stage: int = 0
    """ZeRO stage of the DP run (distributed_optimizer=True is stage 1)."""
    reduce_grads_in_fp32: bool = True
    """ZeRO-2/3 in bf16/fp16: False reduces and keeps the gradient shard in the model's dtype."""
    bucket_size_mb: float = 25.0
    overlap: bool = True
    seed: int = 0
    data_seed: int = 1
    optimizer: str = "adamw"
    """optim.optimizer: adamw or muon (meshlm/optim/muon.py)."""

    def optim_config(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, weight_decay=self.weight_decay, eps=self.eps, optimizer=self.optimizer)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, sp=self.sp, distributed_optimizer=self.distributed_optimizer,
                              zero_stage=self.zero_stage, reduce_grads_in_fp32=self.reduce_grads_in_fp32,
                              bucket_size_mb=self.bucket_size_mb,
                              overlap_grad_reduce=self.overlap)


@dataclass
class TrainRun:
    model: LanguageModel
    precision: MixedPrecision
    optimizer: object
    reducer: object | None
    """None in the plain single-process run."""
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def micro_batch(spec: TrainSpec, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of micro-batch ``index`` of ``step``, the same in every run."""
    generator = torch.Generator().manual_seed(spec.data_seed * 1_000_003 + step * 1009 + index)
    tokens = torch.randint(0, spec.model["vocab_size"], (spec.micro_batch_size, spec.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def learning_rate(spec: TrainSpec, step: int) -> float:
    return spec.lr * (1.0 - 0.1 * step)


def build_run(spec: TrainSpec, context: ParallelContext | None) -> TrainRun:
    """Model, precision and optimizer; ``context`` None means the plain single-process run."""
    torch.manual_seed(spec.seed)
    model = LanguageModel(ModelConfig(**spec.model)).train()
    if context is not None:
        model = parallelize_model(model, context)
    stage = spec.parallel_config().sharding_stage
    sharded_masters = context is not None and stage >= 1  # ZeRO owns the masters
    precision = MixedPrecision(model, PrecisionConfig(dtype=spec.dtype), sharded_masters=sharded_masters)
    if context is None:
        return TrainRun(model, precision, build_optimizer(precision.master_parameters(), spec.optim_config()), None)
    reducer, optimizer = build_data_parallel(precision, spec.optim_config(), spec.parallel_config(), context,
                                             model=model if stage >= 2 else None)  # ZeRO-2/3 hook the blocks
    return TrainRun(model, precision, optimizer, reducer)


def train_steps(run: TrainRun, spec: TrainSpec, context: ParallelContext | None, first_step: int = 0,
                steps: int | None = None, observe=None) -> TrainRun:
    """Run steps ``first_step .. first_step + steps``. ``observe(event, step, micro_index)``, if
    given, is called with event "start" before a step's first forward, "backward" after each
    micro-batch's backward, "reduced" after the reduction and clipping, "stepped" after the update."""
    observe = observe or (lambda event, step, micro: None)
    dp_size, dp_rank = (context.dp_size, context.dp_rank) if context is not None else (1, 0)
    per_rank = spec.micro_batches // dp_size
    for step in range(first_step, first_step + (spec.steps if steps is None else steps)):
        if run.reducer is not None:
            run.reducer.zero_grad()
        observe("start", step, 0)
        loss_sum = torch.zeros(())
        for local in range(per_rank):
            input_ids, labels = micro_batch(spec, step, dp_rank * per_rank + local)
            last = local == per_rank - 1
            quiet = run.reducer.no_sync() if run.reducer is not None and not last else contextlib.nullcontext()
            with quiet:
                output = run.model(input_ids, labels, return_logits=False)
                run.precision.scale_loss(output.loss / spec.micro_batches).backward()
            loss_sum += output.loss.detach()
            observe("backward", step, local)
        norm = finish_and_clip(run, spec, context)
        observe("reduced", step, per_rank - 1)
        for group in run.optimizer.param_groups:
            group["lr"] = learning_rate(spec, step)
        run.optimizer.step()
        run.precision.master_to_model()
        run.optimizer.zero_grad(set_to_none=True)
        observe("stepped", step, per_rank - 1)
        if context is not None and context.dp_size > 1:
            all_reduce_(loss_sum, context.dp_group)
        run.losses.append(loss_sum.item() / spec.micro_batches)
        run.grad_norms.append(float(norm))
    return run


def finish_and_clip(run: TrainRun, spec: TrainSpec, context: ParallelContext | None) -> torch.Tensor:
    if run.reducer is None:
        run.precision.gradients_to_master(check_nonfinite=False)  # the norm below tells, as in the trainer
        masters = [param for _, param in run.precision.master_parameters()]
        if spec.grad_clip > 0:  # as the trainer does it
            return torch.nn.utils.clip_grad_norm_(masters, spec.grad_clip)
        return torch.nn.utils.get_total_norm([param.grad for param in masters])
    norm, _ = finish_gradients(run.reducer, run.optimizer, run.precision, context, spec.grad_clip,
                               tensor_parallel_names(run.model), partial_grad_names(run.model))
    return norm


def single_process_result(spec: TrainSpec) -> dict:
    """Losses, grad norms and final parameters of the plain single-process run."""
    run = train_steps(build_run(spec, None), spec, None)
    return result_of(run)


def result_of(run: TrainRun, context: ParallelContext | None = None) -> dict:
    """Losses, grad norms and the single-process form of the parameters (gathered over TP)."""
    if getattr(run.optimizer, "zero_stage", 0) == 3:  # the parameters hold values only while gathered
        run.optimizer.gather_all()
    # ZeRO-1/2: the step's parameter all-gathers overlap the next forward; with no next forward they
    # may still be running (a loaded machine read a stale embedding bucket) -- wait, as a checkpoint does
    getattr(run.optimizer, "wait_for_parameters", lambda: None)()
    params = dict(run.model.named_parameters())
    if context is not None and context.tp_size > 1:
        params = {name: value for name, value in gather_full_state_dict(run.model, context).items() if name in params}
    return {"losses": run.losses, "grad_norms": run.grad_norms,
            "params": {name: param.detach().float().clone() for name, param in params.items()}}


def context_from_world(spec: TrainSpec | None = None) -> ParallelContext:
    """The (dp, tp) context of the spawned world: pure DP over the default group when tp = 1."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if spec is not None and spec.tp > 1:
        return build_parallel_context(spec.parallel_config(), ModelConfig(**spec.model), torch.device("cpu"),
                                      spec.seq_len, spec.micro_batches)
    group = group_of(dist.group.WORLD, "dp", torch.device("cpu")) if world > 1 else None
    return ParallelContext(rank=rank, world_size=world, dp_size=world, dp_rank=rank, dp_group=group,
                           dp_cp_size=world, dp_cp_rank=rank, dp_cp_group=group,
                           world_group=group_of(dist.group.WORLD, "world", torch.device("cpu")) if world > 1 else None)


COLLECTIVES = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
               "all_gather_into_tensor", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single")


@contextlib.contextmanager
def counting_collectives(counts: dict):
    """Count calls of the torch.distributed collectives into ``counts`` (name -> calls) while
    inside; a call nested in another (a renamed function calling the old one) is not counted."""
    originals, depth = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}, [0]

    def counted(name, function):
        def call(*args, **kwargs):
            if depth[0] == 0:
                counts[name] = counts.get(name, 0) + 1
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    try:
        for name, function in originals.items():
            setattr(dist, name, counted(name, function))
        yield counts
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def train_and_count(spec: TrainSpec, context: ParallelContext) -> tuple[TrainRun, list[tuple]]:
    """Train with DP, recording (event, step, micro, {collective: calls}) for every phase of every
    step: the calls made since the previous event (see ``train_steps``' observe)."""
    run = build_run(spec, context)
    counts, phases = {}, []

    def observe(event, step, micro):
        if event != "start":
            phases.append((event, step, micro, dict(counts)))
        counts.clear()

    with counting_collectives(counts):
        train_steps(run, spec, context, observe=observe)
    return run, phases


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|a - b| / max|b| (the measure of the parallel tests)."""
    actual = torch.as_tensor(actual).detach().to(torch.float64)
    expected = torch.as_tensor(expected).detach().to(torch.float64)
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


__all__ = ["TrainRun", "TrainSpec", "build_run", "context_from_world", "counting_collectives", "finish_and_clip",
           "micro_batch", "relative_error", "result_of", "single_process_result", "train_and_count", "train_steps"]
