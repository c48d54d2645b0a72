"""The training loop: micro-batches -> forward/backward -> gradient step -> metrics -> checkpoints.

One optimizer step of a run with ``global_batch_size = G`` and ``micro_batch_size = m``:

    for each of the G/m micro-batches:             (gradient accumulation)
        loss = model(input_ids, labels).loss       LM loss + coefficient * (MoE aux, z, MTP)
        backward(scale * loss / (G/m))             so the summed gradient is that of the mean loss
    found_nonfinite = unscale + move grads to the fp32 master parameters
    grad_norm = clip the global L2 norm to grad_clip
    if finite: lr = schedule(step); AdamW step on the masters; copy masters into the model
    else:      skip the update (an fp16 overflow, or any inf/nan in the loss or gradients); the loss
               scaler backs off; too many skips in a row roll back or stop (fault_tolerance.py)

The pieces are small methods so that the parallel versions replace one piece each:
``forward_backward`` is where a pipeline schedule (1F1B, interleaved) takes over the loop over
micro-batches, and ``finish_gradients`` is where data-parallel gradient reduction goes, before
the overflow check and the clipping that must see the whole gradient.

Data is read by sample index: step ``s`` consumes samples ``[s*G, (s+1)*G)`` of the global
order, so a run resumed from a checkpoint at step ``s`` continues with exactly the batches the
uninterrupted run would have seen, at any data-parallel size (see ``meshlm/checkpoint/``).

Parallel runs (``torchrun --nproc_per_node N -m meshlm train ... parallel.tp=T``; see
``meshlm/parallel/``). The layout is checked first, before any collective. Every rank builds the
model on the ``meta`` device, cuts it to its shards (TP/EP slices, its pipeline stages) and only
then gives those shards their values -- each tensor drawn from its own (seed, name) generator,
or read by slice from ``train.init_from`` (``meshlm/training/build.py``) -- so no rank holds the
whole model and a run does not depend on its layout. Each step:

    DP rank d runs micro-batches [d*k, (d+1)*k) of the step's n (k = n / dp); every rank of a
        TP or CP group reads the same ones; each loss is divided by n, the whole step's count
    CP (``meshlm/parallel/context/context_parallel.py``): each rank keeps its two chunks of every
        sequence (global positions for RoPE), attention rings K/V over the CP group, Mamba hands
        its conv window and SSM state on; its losses are its share (summed over CP: the mean)
    non-final micro-batches: backward only accumulates (no DP communication)
    last micro-batch: the DP reduction of gradient buckets (over DP and CP) starts during its backward
    finish_gradients: wait for it (all-reduce, or reduce-scatter with the distributed
        optimizer), sum the partial gradients of TP-replicated parameters over TP, unscale,
        clip by the global norm that counts every parameter element once
    optimizer step (the distributed optimizer all-gathers the updated values over DP)

Summing the DP ranks' gradients of losses divided by n gives the single-process gradient of the
step's mean loss, so a parallel run matches the single-process one up to fp32 summation order.
With ``parallel.check_collectives`` the ranks compare every collective they issued at the end of
each step, evaluation and run (``meshlm/parallel/collective_checks.py``): a disagreement that
would hang NCCL stops the run, naming the step, two ranks and the first diverging call.
The logged loss is the mean over all n micro-batches (summed over DP). Only global rank 0
prints and writes logs. Checkpoints are distributed (``meshlm/checkpoint/distributed.py``): every
rank writes its own shards in single-process coordinates, and a run resumes at any layout.
SIGTERM, SIGINT and ``train.time_limit_minutes`` end a run early, with a checkpoint of the step
every rank agreed on (``meshlm/training/stop_requests.py``).
"""

from __future__ import annotations

import dataclasses
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import contextlib
import os

import numpy as np
import torch

from meshlm.checkpoint.distributed import Checkpointer
from meshlm.checkpoint.global_state import TrainingParts, optimizer_step_count, restore_optimizer_scalars
from meshlm.checkpoint.training_checkpoint import TrainerState
from meshlm.errors import ConfigError
from meshlm.models.attention_kernels import prefer_attention_kernel
from meshlm.models.scan_kernels import choose_scan_kernels
from meshlm.models.dropout import DropoutKey
from meshlm.models.flops import model_flops_per_token
from meshlm.models.moe.balancing import update_expert_biases
from meshlm.models.moe.layer import set_load_balancing_sum
from meshlm.optim.build import build_optimizer
from meshlm.parallel.collective_checks import compare_collectives
from meshlm.parallel.collectives import all_reduce_, barrier, summing_over
from meshlm.parallel.context.context_parallel import check_context_parallel_model, share_losses, split_batch
from meshlm.parallel.data.data_parallel import build_data_parallel, finish_gradients as finish_distributed_gradients
from meshlm.parallel.data.low_communication import LowCommunicationSync, replica_context
from meshlm.parallel.expert.expert_parallel import expert_parallel_names
from meshlm.parallel.mesh import build_parallel_context, world_from_environment
from meshlm.parallel.tensor.sharding import partial_grad_names, tensor_parallel_names
from meshlm.precision.device_defaults import configure_tf32, parse_device, resolve_precision
from meshlm.precision.mixed_precision import MixedPrecision
from meshlm.precision.model_recipe import apply_recipe
from meshlm.precision.delayed_scaling import begin_step as begin_delayed_scaling
from meshlm.precision.delayed_scaling import finish_step as finish_delayed_scaling
from meshlm.precision.quantized_linear import keeping_weight_codes
from meshlm.precision.recipes import build_recipe
from meshlm.training.build import build_model
from meshlm.training.compile import compile_blocks
from meshlm.training.cpu_allocator import keep_freed_memory
from meshlm.training.data_loading import BatchPrefetcher, build_training_data, read_batch
from meshlm.training.distillation import Distillation
from meshlm.training.distillation_pipeline import distilling_stages
from meshlm.training.early_stopping import EARLY_STOP, early_stop_message, stopped_early, write_best_pointer
from meshlm.training.fault_tolerance import NonFiniteTrainingStop, SkipStreak, explain_collective_failures, stop_message
from meshlm.training.initial_weights import model_from_init_folder
from meshlm.training.memory_estimate import available_memory, estimate_training_memory, memory_warning
from meshlm.training.memory_snapshot import MemorySnapshots
from meshlm.training.memory_usage import format_bytes, peak_memory
from meshlm.training.metrics import (MetricsLog, ProgressLine, SilentLog, Throughput, expert_load_summary, format_count,
                                     peak_flops)
from meshlm.training.out_of_memory import OutOfMemoryStop, is_out_of_memory, out_of_memory_message
from meshlm.training.phase_timeline import power_recording
from meshlm.training.plan_check import PlanCheck, describe as describe_plan_check
from meshlm.training.plots import plot_losses
from meshlm.training.preference import LOGGED_AS_IS, PreferenceObjective
from meshlm.training.preflight import finished_run, startup_warnings
from meshlm.training.profiling import StepProfiler
from meshlm.training.schedules import learning_rate
from meshlm.training.stop_requests import StopRequests
from meshlm.training.tracking import WandbTracker, check_wandb_installed


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    """The step the run stands at when train() returns."""
    losses: dict[int, float] = field(default_factory=dict)
    """Training loss of every step this call ran."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss of every evaluation this call ran."""
    skipped_steps: int = 0
    """Steps of the whole run whose update was skipped (non-finite loss or gradients)."""
    rollbacks: int = 0
    """Rollbacks to the last checkpoint this call made (train.on_nonfinite='rollback')."""
    stopped_by: str | None = None
    """Why the run stopped early and saved: 'SIGTERM', 'SIGINT' or 'time limit' (stop_requests.py); None if not."""
    already_complete: str | None = None
    """When RUN_DIR's checkpoint was already at or past train.steps: the sentence saying so (nothing was
    trained; see meshlm/training/preflight.py). None otherwise."""


@dataclass
class StepResult:
    loss: float
    """Mean over micro-batches of the total loss (what backward saw)."""
    losses: dict[str, float]
    """Each loss term ('lm', 'moe_aux', 'moe_z', 'mtp', ...), mean over micro-batches."""
    grad_norm: float
    lr: float
    skipped: bool
    tokens_per_expert: list[torch.Tensor]
    pseudo_sync: bool = False
    """PALSGD: logging rank's replica pulled toward the global copy instead of training (no data;
    ``loss`` repeats the previous step's)."""


def seed_everything(seed: int) -> None:
    """Seed every RNG a run draws from (model init, anything using numpy or random). Dropout draws
    nothing: its masks hash train.seed with global coordinates (meshlm/models/dropout.py)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(name: str) -> torch.device:
    """The run's device, with an index on CUDA: ``cuda`` means the GPU of LOCAL_RANK under torchrun,
    else the current one (``torch.cuda`` calls such as ``set_device`` and ``mem_get_info`` refuse a
    bare ``cuda``)."""
    device = parse_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here; use train.device=cpu.")
    if device.type == "cuda" and device.index is None:
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if distributed
                              else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class Trainer:
    """Builds everything a run needs from a ``RunConfig`` (resuming when RUN_DIR has a checkpoint).
    ``predicted``: a plan's ``memory_bytes_per_gpu`` and ``step_time_s`` for this layout, which rank 0
    reports its measurements beside (``meshlm train --plan``; plan_check.py)."""

    command = "meshlm train"
    """How the run's own lines name it (a subclass's command, e.g. ``meshlm rl``)."""

    def __init__(self, config, predicted: dict | None = None):
        config = model_from_init_folder(config)  # train.init_model_config (train() has applied it: no second note)
        config.validate()
        check_wandb_installed(config.train.wandb)  # train.wandb=true without wandb: refused before any work
        self.stop_requests = StopRequests(config.train.time_limit_minutes)  # the time limit counts from here
        self.device = resolve_device(config.train.device)
        self.requested_dtype = config.precision.dtype  # 'auto' -> bf16 on CUDA, fp32 on CPU, from here on
        config = dataclasses.replace(config, precision=resolve_precision(config.precision, self.device))
        self.config, train = config, config.train
        self.tf32 = configure_tf32(self.device, config.precision.dtype, config.precision.tf32)  # CUDA only
        self.attention_kernels = prefer_attention_kernel(config.model.attention_kernel, self.device)  # CUDA only
        self.run_dir = Path(train.run_dir)
        # before the model is built, so that its weights' allocations are recorded with their stacks
        self.memory_snapshots = MemorySnapshots(train.memory_snapshot, self.device, self.run_dir,
                                                rank=world_from_environment()[0])
        self.memory_snapshots.start()
        if self.device.type == "cpu" and train.keep_freed_cpu_memory:
            keep_freed_memory()
        self.micro_batches_per_step = train.global_batch_size // train.micro_batch_size
        # The layout is refused (ConfigError) here, before the process group is joined.
        check_context_parallel_model(config.model, config.parallel.cp, train.seq_len)
        self.recipe = build_recipe(config.precision, train.seed)  # low-precision GEMMs (None: plain dtype)
        self.context = build_parallel_context(config.parallel, config.model, self.device, train.seq_len,
                                              self.micro_batches_per_step)
        # waits on collectives watched: RUN_DIR/power_timeline.jsonl, train.power_floor (phase_timeline.py)
        self.context, self.phases = power_recording(train, self.context, self.device)
        # parallel.dp_sync: each DP replica trains alone between syncs (low_communication.py)
        local_replicas = config.parallel.dp_sync != "every_step" and self.context.dp_size > 1
        self.replica = replica_context(self.context) if local_replicas else self.context
        self.plan_check = (PlanCheck(predicted, self.device) if predicted and self.context.is_logging_rank
                           else None)  # before the model: its memory is part of what is measured
        self.memory = estimate_training_memory(config, self.context, self.frozen_reference())  # before allocating
        self.memory_available = available_memory(self.device)
        if self.context.is_logging_rank:
            too_big = memory_warning(self.memory, self.memory_available, self.device, config)
            for message in startup_warnings(config) + ([too_big] if too_big else []):
                warnings.warn(message, stacklevel=2)
        seed_everything(train.seed)
        self.data = self.build_data()
        self.rows_per_sample = getattr(self.data.train, "rows_per_example", 1)  # a preference pair is 2 rows
        self.batches = BatchPrefetcher(self.data.train, train.micro_batch_size, pin_memory=self.device.type == "cuda",
                                       background=train.prefetch_batches)
        self.checkpoints = Checkpointer(self.run_dir, config, self.context, tokenizer_file=self.data.tokenizer_file)
        checkpoint_dir = self.checkpoints.latest()

        # Built on meta and materialized shard by shard: no rank ever holds the whole model.
        built = build_model(config, self.context, self.device,
                            init_from=train.init_from if checkpoint_dir is None else None)
        self.model, self.pipeline, self.num_parameters = built.model, built.pipeline, built.num_parameters
        self.num_trainable, self.num_muon = built.num_trainable, built.num_muon
        self.sum_over_dp_cp = built.sum_over_dp_cp  # the MoE balancing's token counts
        if self.recipe is not None:
            apply_recipe(self.model, self.recipe, config.model.num_blocks, config.precision.high_precision_layers,
                         self.context, train.seq_len, reduce_max=reduce_max)
            if self.recipe.hadamard_for_wgrad:
                self.recipe.hadamard_matrix(self.device)  # on the device before any compiled graph reads it
        self.zero_stage = config.parallel.sharding_stage if self.context.distributed else 0
        self.precision = MixedPrecision(self.model, config.precision,
                                        sharded_masters=self.zero_stage >= 1)  # ZeRO: no full fp32 copy
        self.master_parameters = [param for _, param in self.precision.master_parameters()]
        # the Triton SSD scan, checked on this device before it computes anything (scan_kernels.py)
        self.scan_kernels_note = self.check_scan_kernels()
        # train.distill_from: the teacher's shards beside the student's, forward-only (distillation.py)
        self.distillation = Distillation.build(config, self.context, self.device, self.precision.dtype)
        # train.objective=reward|dpo: the preference losses (and DPO's frozen reference; preference.py)
        self.preference = PreferenceObjective.build(config, self.context, self.device, self.precision.dtype)
        self.reducer = None
        if self.context.distributed:
            self.reducer, self.optimizer = build_data_parallel(self.precision, config.optim, config.parallel,
                                                               self.replica, model=self.model)
        else:
            self.optimizer = build_optimizer(self.precision.master_parameters(), config.optim)
        self.dp_sync = None
        if local_replicas:
            self.dp_sync = LowCommunicationSync(config.parallel, self.precision.master_parameters(), self.context,
                                                train.seed)
            self.sum_over_dp_cp = summing_over(self.replica.dp_cp_group)  # MoE balancing counts: this replica's
            set_load_balancing_sum(self.model, self.sum_over_dp_cp)
        self.sharded_names = tensor_parallel_names(self.model)
        self.partial_names = partial_grad_names(self.model)
        self.expert_names = expert_parallel_names(self.model)
        self.state = TrainerState()
        if checkpoint_dir is not None:  # saved at any layout; loaded in place, the RNG states last
            self.state = self.checkpoints.load(checkpoint_dir, self.training_parts())
        if checkpoint_dir is not None and self.dp_sync is not None:  # PALSGD: replicas stepped AdamW unequally
            shift = (self.dp_sync.pseudo_syncs(0, self.state.step)
                     - self.dp_sync.pseudo_syncs(self.context.dp_rank, self.state.step))
            if shift:  # the saved count is replica 0's
                restore_optimizer_scalars(self.optimizer, [{"step": optimizer_step_count(self.optimizer) + shift,
                                                            "groups": []}])
        self.resumed_from = checkpoint_dir
        self.last_saved_step = self.state.step if checkpoint_dir is not None else None
        self.last_eval_step: int | None = None
        self.skips = SkipStreak.from_config(train)
        self.compile_pending = train.compile  # in run(), once the progress line can print a fallback notice

    def check_scan_kernels(self) -> str | None:
        """Where the Mamba-2 layers would run the Triton SSD kernels (``model.mamba_scan``: auto on
        CUDA, or triton), check them against the PyTorch scan first (``scan_kernels.py``): layers
        whose check fails run PyTorch (auto), or the run stops (triton). Returns the run's note, if any."""
        model = self.config.model
        kernels_wanted = model.mamba_scan == "triton" or (model.mamba_scan == "auto" and self.device.type == "cuda")
        if not kernels_wanted or "M" not in model.pattern + model.mtp_pattern:
            return None
        note = choose_scan_kernels(self.model, self.device, self.context.world_group, reduce_max)
        if note is not None and self.context.is_logging_rank:
            warnings.warn(f"{self.command}: {note}", stacklevel=3)
        return note

    def frozen_reference(self) -> str | None:
        """The folder of a frozen reference model a subclass keeps beside the trained one (RL's KL
        reference), for the memory estimate; DPO's is found from the config."""
        return None

    def training_parts(self) -> TrainingParts:
        """What a checkpoint saves and restores (see ``meshlm/checkpoint/global_state.py``)."""
        return TrainingParts(self.model, self.optimizer, self.precision, self.context, self.dp_sync)

    def build_data(self):
        """The datasets; rank 0 builds (and caches) the sample indices first, the others then read them."""
        if not self.context.distributed:
            return build_training_data(self.config)
        data = build_training_data(self.config) if self.context.rank == 0 else None
        barrier(self.context.world_group)
        if data is not None:
            return data
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rank 0 has given the data's warnings (prefixes over blend, vocabulary)
            return build_training_data(self.config)

    # --- one optimizer step ---------------------------------------------------------------------------
    def micro_batch_starts(self, consumed_samples: int) -> list[int]:
        """First sample index of each of this DP rank's micro-batches of the step at ``consumed_samples``."""
        size, per_rank = self.config.train.micro_batch_size, self.micro_batches_per_step // self.context.dp_size
        start = consumed_samples + self.context.dp_rank * per_rank * size
        return list(range(start, start + per_rank * size, size))

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """This DP rank's contiguous share of the step's micro-batches (all of them without DP);
        under CP, of each sequence only this rank's chunks (with their global positions). Each
        carries its ``dropout_key`` (seed, step, global sample indices: layout-independent masks).
        The next step's share is read ahead in the background meanwhile (data_loading.py)."""
        train, firsts = self.config.train, self.micro_batch_starts(self.state.consumed_samples)
        host_batches = self.batches.take(firsts)
        if self.state.step + 1 < train.steps:
            self.batches.prefetch(self.micro_batch_starts(self.state.consumed_samples + train.global_batch_size))
        batches = []
        for first, host_batch in zip(firsts, host_batches):
            batch = {key: value.to(self.device, non_blocking=True) for key, value in host_batch.items()}
            batch = split_batch(batch, self.context)
            samples = torch.arange(first, first + train.micro_batch_size, device=self.device)
            batches.append({**batch, "dropout_key": DropoutKey(train.seed, self.state.step, samples)})
        return batches

    def forward_micro_batch(self, batch: dict[str, torch.Tensor]):
        """The model's output on one micro-batch (loss only, no logits); under CP its losses are
        this rank's share, which summed over the CP group give the micro-batch's losses. With
        train.distill_from, training micro-batches also run the teacher (``distillation.py``); with
        train.objective=reward|dpo the rows are preference pairs or rated replies (``preference.py``)."""
        if self.preference is not None:  # reward model or DPO on preference rows
            return self.preference.forward(self.model, batch)
        if self.distillation is not None and self.model.training:
            return self.distillation.forward(self.model, batch)  # already this rank's share under CP
        output = self.model(batch["input_ids"], batch["labels"], position_ids=batch.get("position_ids"),
                            return_logits=False, dropout_key=batch.get("dropout_key"),
                            document_ids=batch.get("document_ids"), document_positions=batch.get("document_positions"))
        return share_losses(output, batch, self.context, self.config.model.mtp_loss_coeff)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict, list]:
        """Forward and backward of every micro-batch, accumulating gradients.

        Returns this rank's summed total loss, summed loss terms and summed per-expert token
        counts (detached). Each loss is divided by the step's micro-batch count over all DP
        ranks; only the last backward starts the DP reduction. A pipeline schedule replaces
        exactly this loop.
        """
        if self.pipeline is not None:  # the 1F1B / interleaved schedule (meshlm/parallel/pipeline/)
            stages = {} if self.distillation is None else {  # the teacher's pipeline pass runs first
                "make_stages": distilling_stages(self.distillation, micro_batches)}
            return self.pipeline.forward_backward(micro_batches, self.micro_batches_per_step, self.precision,
                                                  self.reducer, **stages)
        loss_sum, term_sums, expert_counts = torch.zeros((), device=self.device), {}, []
        if self.reducer is not None:
            self.reducer.zero_grad()
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            quiet = self.reducer.no_sync() if self.reducer is not None and not last else contextlib.nullcontext()
            with quiet, self.precision.autocast():
                output = self.forward_micro_batch(batch)
                self.precision.scale_loss(output.loss / self.micro_batches_per_step).backward()
            loss_sum += output.loss.detach()
            for name, value in output.losses.items():
                term_sums[name] = term_sums.get(name, 0.0) + value.detach()
            counts = [count.detach() for count in output.tokens_per_expert]
            expert_counts = [a + b for a, b in zip(expert_counts, counts)] if expert_counts else counts
        return loss_sum, term_sums, expert_counts

    def finish_gradients(self) -> tuple[float, bool]:
        """Gradients -> fp32 masters (reduced, unscaled), global-norm clipping; returns (norm, found_nonfinite).

        Distributed (``meshlm.parallel.data.data_parallel.finish_gradients``): finish the DP reduction,
        sum the partial gradients of TP-replicated parameters over TP (sums commute, so after the
        DP sum is as good as before it), unscale, clip by the global norm that counts every
        element once. The skip decision comes from that norm alone, the same on every rank.
        """
        clip = self.config.train.grad_clip
        if self.dp_sync is not None:  # the replica's own mean gradient (or, in PALSGD's warm-up, DDP's)
            self.reducer.finish()
            self.dp_sync.finish_replica_gradients(self.reducer.buffer, self.state.step)
        if self.reducer is not None:
            norm, skip = finish_distributed_gradients(self.reducer, self.optimizer, self.precision, self.replica, clip,
                                                      self.sharded_names, self.partial_names, self.expert_names)
            return float(norm), skip
        self.precision.gradients_to_master(check_nonfinite=False)  # the norm below tells
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.master_parameters, clip)
        else:
            grads = [param.grad for param in self.master_parameters if param.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        grad_norm = float(norm)
        return grad_norm, not np.isfinite(grad_norm)

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.precision.master_to_model()

    def train_step(self) -> StepResult:
        if self.dp_sync is not None:
            if self.dp_sync.starts_local_phase(self.state.step):
                self.dp_sync.take_global_copy()
            if self.dp_sync.is_pseudo_sync(self.state.step):
                return self.pseudo_sync_step()
        micro_batches = self.next_micro_batches()
        if self.recipe is not None:  # keys stochastic rounding; delayed scaling's histories
            self.recipe.step = self.state.step
            begin_delayed_scaling(self.model)
        with keeping_weight_codes(self.model) if self.recipe is not None else contextlib.nullcontext():
            loss_sum, term_sums, expert_counts = self.forward_backward(micro_batches)  # FP8 weights cast once
        if self.recipe is not None:
            context = self.context
            finish_delayed_scaling(self.model, (context.tp_group, context.cp_group, self.replica.dp_group),
                                   reduce_max)
        grad_norm, skipped = self.finish_gradients()
        lr = learning_rate(self.state.step, self.config.optim, self.config.train.steps)
        if self.dp_sync is not None:
            lr = self.dp_sync.inner_lr(lr, self.state.step)  # PALSGD: 1 / (1 - p)
        if not skipped:
            with self.phases.phase("optimizer"):
                self.optimizer_step(lr)
        update_expert_biases(self.model, self.sum_over_dp_cp)  # aux-loss-free balancing (MoE), if on
        self.precision.update_scale(skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.maybe_outer_step()

        loss_sum, term_sums, expert_counts = self.sum_over_data_parallel(loss_sum, term_sums, expert_counts)
        count = self.micro_batches_per_step
        self.state.step += 1
        self.state.consumed_samples += self.config.train.global_batch_size
        self.state.skipped_steps += int(skipped)
        self.state.lr = lr
        self.state.last_loss = loss_sum.item() / count
        compare_collectives(self.context, f"after step {self.state.step}")  # parallel.check_collectives
        return StepResult(loss=self.state.last_loss, losses={name: value.item() / count for name, value in
                                                             term_sums.items()},
                          grad_norm=grad_norm, lr=lr, skipped=skipped, tokens_per_expert=expert_counts)

    def pseudo_sync_step(self) -> StepResult:
        """PALSGD: this replica's step is a pull toward its last global copy -- no data, forward,
        backward or communication (the step's samples are passed over) -- then, if due, the outer step."""
        train = self.config.train
        lr = learning_rate(self.state.step, self.config.optim, train.steps)
        self.dp_sync.pull_toward_global(lr)
        self.precision.master_to_model()
        if self.state.step + 1 < train.steps:
            self.batches.prefetch(self.micro_batch_starts(self.state.consumed_samples + train.global_batch_size))
        self.maybe_outer_step()
        self.state.step += 1
        self.state.consumed_samples += train.global_batch_size
        self.state.lr = lr
        compare_collectives(self.context, f"after step {self.state.step}")
        return StepResult(loss=self.state.last_loss, losses={}, grad_norm=0.0, lr=lr, skipped=False,
                          tokens_per_expert=[], pseudo_sync=True)

    def maybe_outer_step(self) -> None:
        """parallel.dp_sync: reconcile the replicas every sync_every-th step, and at the last step
        (so a run ends with one model); a collective over DP."""
        step, sync = self.state.step, self.dp_sync
        if sync is None:
            return
        changed = sync.finish_overlapped_outer_step()  # parallel.outer_overlap: the sync of the step before
        last = step + 1 == self.config.train.steps
        if sync.replicas_independent(step) and (sync.is_outer_step(step) or last):
            if sync.overlap and not last:
                sync.start_overlapped_outer_step()  # applied after the next step
            else:
                sync.outer_step()
                changed = True
        if changed:
            self.precision.master_to_model()

    def sum_over_data_parallel(self, loss_sum: torch.Tensor, term_sums: dict, expert_counts: list):
        """The step's sums over every DP rank's micro-batches (and CP rank's loss shares), in one
        all-reduce (for logging). Replicas training alone (parallel.dp_sync) log their own: the
        logging rank's replica's sums over its CP group, the losses scaled by dp to a whole step's count."""
        group, scale = self.context.dp_cp_group, 1
        if self.dp_sync is not None and self.dp_sync.replicas_independent(self.state.step):
            group, scale = self.replica.dp_cp_group, self.context.dp_size
        if group is None and scale == 1:
            return loss_sum, term_sums, expert_counts
        names = sorted(term_sums)
        pieces = [loss_sum.reshape(1).float()]
        pieces += [torch.as_tensor(term_sums[name], device=self.device).reshape(1).float() for name in names]
        pieces += [count.reshape(-1).float() for count in expert_counts]
        flat = torch.cat(pieces)
        all_reduce_(flat, group)
        values = flat.split([piece.numel() for piece in pieces])
        terms = {name: value[0] * scale for name, value in zip(names, values[1:1 + len(names)])}
        counts = [value.view_as(count).to(count.dtype) for value, count in zip(values[1 + len(names):], expert_counts)]
        return values[0][0] * scale, terms, counts

    # --- evaluation and checkpoints -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, dataset=None) -> float:
        """Mean LM loss over the fixed validation micro-batches (every DP rank evaluates all of them) of
        the run's validation split, or of ``dataset`` (one corpus's: train.eval_per_dataset)."""
        size, batches = self.config.train.micro_batch_size, self.config.train.eval_batches
        self.model.eval()
        total = 0.0
        dataset = self.data.valid if dataset is None else dataset
        batches_read = [split_batch(read_batch(dataset, index * size, size, self.device), self.context)
                        for index in range(batches)]
        if self.preference is not None:  # the objective's loss; its accuracy etc. in preference.validation
            total = self.preference.evaluate(self.model, batches_read, self.precision)
        elif self.pipeline is not None:  # a forward-only schedule; every rank gets the sum
            total = self.pipeline.evaluate(batches_read, self.precision)
        else:
            for batch in batches_read:
                with self.precision.autocast():
                    output = self.forward_micro_batch(batch)
                total += output.losses["lm"].item()
        self.model.train()
        total = self.sum_over_context_parallel(total)
        compare_collectives(self.context, f"in the evaluation after step {self.state.step}")
        return total / batches

    def sum_over_context_parallel(self, value: float) -> float:
        """A loss summed over the CP group: under CP every rank holds its share of it."""
        if self.context.cp_size == 1:
            return value
        summed = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        all_reduce_(summed, self.context.cp_group)
        return summed.item()

    def maybe_evaluate(self, final: bool) -> float | None:
        every, step = self.config.train.eval_every, self.state.step
        if every <= 0 or self.last_eval_step == step or not (step % every == 0 or final):
            return None
        with self.phases.pause("evaluation", step):
            val_loss = self.evaluate()
            per_dataset = {f"val_loss_{name}": self.evaluate(dataset)
                           for name, dataset in self.data.valid_per_dataset.items()}
        self.last_eval_step = step
        self.state.last_val_loss = val_loss
        if self.state.best_val_loss is None or val_loss < self.state.best_val_loss:
            self.state.best_val_loss, self.state.best_val_step = val_loss, step
            self.state.evaluations_since_best = 0
        else:
            self.state.evaluations_since_best += 1
        self.metrics.write({"step": step, "val_loss": val_loss, **per_dataset,
                            **(self.preference.validation if self.preference is not None else {})})
        each = ", ".join(f"{key.removeprefix('val_loss_')} {value:.4f}" for key, value in per_dataset.items())
        self.progress.message(f"step {step}: validation loss {val_loss:.4f}" + (f" ({each})" if each else ""))
        return val_loss

    def save_checkpoint(self, async_save: bool = False) -> Path:
        """Save this step (collective), with the power floor held during it; returns the folder."""
        with self.phases.pause("checkpoint", self.state.step):  # held at train.power_floor, if any
            path = self.checkpoints.save(self.state, self.training_parts(), async_save=async_save)
        self.last_saved_step = self.state.step
        return path

    def maybe_save(self, final: bool) -> None:
        every, step = self.config.train.save_every, self.state.step
        if self.last_saved_step == step or not ((every and step % every == 0) or final):
            return
        background = self.config.train.async_save
        path = self.save_checkpoint(async_save=background)
        self.progress.message(f"step {step}: {'saving' if background else 'saved'} {path}")

    def save_and_stop(self, reason: str, message: str | None = None) -> None:
        """Every rank agreed to stop after this step (a signal or the time limit, stop_requests.py; or
        train.early_stop_evals, early_stopping.py): save it synchronously (after any asynchronous
        save in flight) and say why and where to resume."""
        path = self.save_checkpoint()
        self.metrics.write({"event": "stopped", "step": self.state.step, "reason": reason, "checkpoint": str(path),
                            "time": time.time()})
        self.progress.message(message if message is not None else
                              self.stop_requests.message(reason, self.state.step, self.config.train.steps, path))

    def save_best(self) -> None:
        """train.keep_best: the evaluation of this step lowered the best validation loss: save this
        step (synchronously, so the pointer names a complete folder) and point best_checkpoint.json at it."""
        step = self.state.step
        if self.last_saved_step != step:
            path = self.save_checkpoint()
            self.progress.message(f"step {step}: saved {path} (the best validation loss so far)")
        else:
            path = self.checkpoints.wait() or self.checkpoints.latest()
        if self.context.is_logging_rank:
            write_best_pointer(self.run_dir, step, self.state.best_val_loss, path)

    # --- non-finite steps (meshlm/training/fault_tolerance.py) ---------------------------------------------
    def after_nonfinite_streak(self, action: str) -> None:
        """train.max_consecutive_skips skips in a row: roll back to the newest complete checkpoint, or stop."""
        checkpoint = self.checkpoints.latest()  # after an asynchronous save in flight has committed
        if action == "stop" or checkpoint is None:
            raise NonFiniteTrainingStop(stop_message(self.state.step, self.skips, checkpoint))
        kept = {name: getattr(self.state, name) for name in ("step", "consumed_samples", "skipped_steps")}
        self.state = self.checkpoints.load(checkpoint, self.training_parts())  # in place, the RNGs last
        for name, value in kept.items():  # neither the schedule nor the data position is rewound
            setattr(self.state, name, value)
        streak = self.skips.length
        self.skips.rolled_back()
        self.metrics.write({"event": "rollback", "step": self.state.step, "checkpoint": str(checkpoint),
                            "rollbacks": self.skips.rollbacks})
        self.progress.message(f"step {self.state.step}: {streak} non-finite steps in a row; rolled back to "
                              f"{checkpoint} (weights, optimizer, loss scale) and going on with the next batch")

    # --- the loop -----------------------------------------------------------------------------------------
    def step_record(self, result: StepResult) -> dict:
        tokens_per_s = self.throughput.tokens_per_second()
        record = {"step": self.state.step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                  "tokens_per_s": tokens_per_s, "mfu": self.throughput.mfu(tokens_per_s),
                  "loss_scale": self.precision.loss_scale, "skipped_steps": self.state.skipped_steps,
                  "samples": self.state.consumed_samples}
        record.update({name if name in LOGGED_AS_IS else f"loss_{name}": value  # accuracies, margins: as named
                       for name, value in result.losses.items()})
        record.update(expert_load_summary(result.tokens_per_expert))
        record.update(peak_memory(self.device))  # this rank's: the most it has held so far
        return record

    def open_logs(self) -> None:
        train = self.config.train
        if self.context.is_logging_rank:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tracker = (WandbTracker(self.run_dir, self.config.to_dict(), train.wandb_project, train.wandb_run_name,
                                    resume=self.resumed_from is not None) if train.wandb else None)
            self.metrics = MetricsLog(self.run_dir, self.state.step, train.tensorboard, tracker=tracker)
            self.progress = ProgressLine(train.steps, train.progress)
            if tracker is not None:
                self.progress.message(tracker.description())
        else:
            self.metrics = self.progress = SilentLog()
        self.profiler = StepProfiler(train.profile_steps, self.run_dir, self.context.rank, self.device,
                                     self.progress.message)
        device_peak, source = (peak_flops(self.device, self.config.precision.dtype) if self.context.is_logging_rank
                               else (0.0, "not measured on this rank"))
        peak = device_peak * self.context.world_size  # MFU of the whole run: every device's peak
        flops_per_token = model_flops_per_token(self.config.model, train.seq_len)
        self.throughput = Throughput(flops_per_token, peak)
        num_parameters = self.num_parameters
        layout = self.context
        experts = (f"; experts: ep {layout.ep_size}, etp {layout.etp_size}, edp {layout.edp_size}"
                   if self.expert_names else "")
        placement = f"{self.device}" if not layout.distributed else (
            f"{layout.world_size} x {self.device.type} (tp {layout.tp_size}, cp {layout.cp_size}, "
            f"dp {layout.dp_size}"
            f"{f', pp {layout.pp_size}, vp {layout.vp_size}' if layout.pp_size > 1 else ''}"
            f"{', sp' if layout.sequence_parallel else ''}"
            f"{experts}"
            f"{f', ZeRO-{self.zero_stage}' if self.zero_stage else ''})")
        self.metrics.write({"event": "resume" if self.resumed_from else "start", "step": self.state.step,
                            "steps": train.steps, "time": time.time(), "device": str(self.device),
                            "dtype": self.config.precision.dtype, "tf32": self.tf32,
                            "attention_kernels": self.attention_kernels, "scan_kernels_note": self.scan_kernels_note,
                            "world_size": layout.world_size, "tp": layout.tp_size, "cp": layout.cp_size,
                            "dp": layout.dp_size,
                            "sp": layout.sequence_parallel, "pp": layout.pp_size, "vp": layout.vp_size,
                            "ep": layout.ep_size, "etp": layout.etp_size, "edp": layout.edp_size,
                            "num_parameters": num_parameters, "num_trainable": self.num_trainable,
                            "optimizer": self.config.optim.optimizer,
                            "flops_per_token": flops_per_token,
                            "peak_flops": peak, "peak_flops_source": source,
                            "tokens_per_step": train.global_batch_size * self.rows_per_sample * train.seq_len,
                            "memory_estimate": self.memory.total, "memory_available": self.memory_available,
                            "tensorboard": self.metrics.tensorboard_enabled})
        where = f"resuming from {self.resumed_from}" if self.resumed_from else "starting"
        dtype = self.config.precision.dtype + (" from precision.dtype=auto" if self.requested_dtype == "auto" else "")
        available = "" if self.memory_available is None else f" of {format_bytes(self.memory_available)} available"
        self.progress.message(f"{self.command}: {where} at step {self.state.step}/{train.steps}; "
                              f"{format_count(num_parameters)} parameters{self.trainable_note()} on {placement} "
                              f"({dtype}); peak {format_count(peak)}FLOP/s ({source}); "
                              f"memory estimate {format_bytes(self.memory.total)} per process{available}")

    def trainable_note(self) -> str:
        """' (N trainable: LoRA rank r)' when only a part of the model trains; ' (Muon: N, AdamW: the
        rest)' under optim.optimizer=muon (single-process counts); else ''."""
        if self.config.optim.optimizer == "muon":
            return f" (Muon: {format_count(self.num_muon)}, AdamW: the rest)"
        if self.num_trainable == self.num_parameters:
            return ""
        lora = self.config.model.lora_rank
        why = f": LoRA rank {lora}" if lora else ""
        return f" ({format_count(self.num_trainable)} trainable{why})"

    def run(self) -> TrainResult:
        train = self.config.train
        result = TrainResult(run_dir=self.run_dir, step=self.state.step)
        plot = None
        self.open_logs()
        if self.compile_pending:  # the parallelized, hooked blocks (meshlm/training/compile.py)
            if self.recipe is not None and self.recipe.rounds_stochastically:
                self.progress.message(
                    "meshlm train: train.compile=true but precision.recipe=nvfp4 rounds gradients with noise keyed "
                    "by layer and step, which torch.compile would recompile every step; running eagerly (set "
                    "precision.nvfp4_stochastic_rounding=false to compile).")
            else:
                compile_blocks(self.model, self.device, self.progress.message)
            self.compile_pending = False
        self.stop_requests.listen()  # SIGTERM and SIGINT now stop the run after the current step
        doing = "in the validation before the first step"  # for an out-of-memory stop: what ran out
        try:
            self.phases.start({"step": self.state.step, "device": str(self.device), "world_size":
                               self.context.world_size, "power_floor": train.power_floor,
                               "power_ramp_seconds": train.power_ramp_seconds})  # the floor ramps up here
            if self.state.step == 0:  # the starting point of the validation curve
                val_loss = self.maybe_evaluate(final=False)
                if val_loss is not None:
                    result.val_losses[0] = val_loss
            if stopped_early(self.state, train):  # a rerun of a run that stopped early trains nothing
                result.already_complete = early_stop_message(self.state, train, self.run_dir, again=True)
            while (self.state.step < train.steps and result.stopped_by is None
                   and result.already_complete is None):
                started = time.perf_counter()
                doing = f"in step {self.state.step + 1}"
                with self.phases.interval(step=self.state.step + 1), self.profiler.step(self.state.step + 1):
                    step_result = self.train_step()
                doing = f"after step {self.state.step}, in its validation, checkpoint or logging"
                seconds = time.perf_counter() - started
                self.throughput.add(train.global_batch_size * self.rows_per_sample * train.seq_len, seconds)
                if self.plan_check is not None:
                    self.plan_check.add(seconds)
                result.losses[self.state.step] = step_result.loss
                if (snapshot := self.memory_snapshots.after_step(self.state.step)) is not None:
                    self.progress.message(f"step {self.state.step}: the allocator's history is in {snapshot} "
                                          "(open it at https://pytorch.org/memory_viz)")
                self.after_step(step_result, result)
            self.checkpoints.wait()  # an asynchronous save still in flight
            self.phases.finish()  # train.power_floor ramps down
            if self.zero_stage == 3:  # leave the model whole (its units gathered) for whoever reads it next
                self.optimizer.gather_all()
            compare_collectives(self.context, f"at the end of the run (step {self.state.step})")
            if train.plot and result.losses and self.context.is_logging_rank:
                plot = plot_losses(self.run_dir)
                if plot is None:
                    self.progress.message(f"{self.command}: matplotlib is not installed, so no loss.png was drawn "
                                          "(pip install matplotlib).")
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            snapshot = self.memory_snapshots.on_out_of_memory()
            raise OutOfMemoryStop(out_of_memory_message(error, doing, self.device, self.memory, self.config,
                                                        self.run_dir, snapshot)) from error
        finally:
            self.memory_snapshots.stop()
            self.batches.close()
            self.phases.close()
            self.stop_requests.close()
            self.profiler.stop()  # a run that stopped inside train.profile_steps still writes its trace
            self.metrics.close(plot)  # loss.png goes to W&B last
        result.step, result.skipped_steps, result.rollbacks = self.state.step, self.state.skipped_steps, \
            self.skips.rollbacks
        return result

    def after_step(self, step_result: StepResult, result: TrainResult) -> None:
        step, train = self.state.step, self.config.train
        final = step == train.steps
        action = self.skips.record(step_result.skipped)
        if step_result.skipped:
            self.progress.message(f"step {step}: non-finite loss or gradients, update skipped ({self.skips.length} "
                                  f"in a row; loss scale now {self.precision.loss_scale:g})")
        record = self.step_record(step_result)
        logged = step % train.log_every == 0 or final
        self.progress.update(record, logged)
        if logged:
            self.metrics.write(record)
            self.throughput.reset()
            check = self.plan_check.record(step, final) if self.plan_check is not None else None
            if check is not None:  # measured memory and step time beside the plan's, once
                self.metrics.write(check)
                self.progress.message(describe_plan_check(check))
        if action is not None:
            self.after_nonfinite_streak(action)
        result.stopped_by = self.stop_requests.agreed_reason(self.context.world_group)
        if result.stopped_by is not None:  # nothing slow (no evaluation) after a stop request: only the save
            return self.save_and_stop(result.stopped_by)
        val_loss = self.maybe_evaluate(final)
        if val_loss is not None:
            result.val_losses[step] = val_loss
            if train.keep_best and self.state.best_val_step == step and step > 0:
                self.save_best()
            if not final and stopped_early(self.state, train):
                result.stopped_by = EARLY_STOP
                return self.save_and_stop(EARLY_STOP, early_stop_message(self.state, train, self.run_dir))
        if self.skips.length == 0 or final:  # while steps keep failing, the last good checkpoint stays the newest
            self.maybe_save(final)


def reduce_max(tensor: torch.Tensor, group) -> None:
    """All-reduce (max) in place: how the low-precision recipes complete a sharded tensor's amax."""
    all_reduce_(tensor, group, op="max")


def train(config, command_line_keys=(), predicted: dict | None = None) -> TrainResult:
    """Train (or resume) the run described by ``config``; see the module docstring. A collective that
    fails because a peer died or hung raises ``CollectiveFailure`` naming it (fault_tolerance.py).
    A run already at train.steps trains nothing and says so (``TrainResult.already_complete``), or
    raises ConfigError when ``command_line_keys`` or a changed config would be ignored (preflight.py).
    ``predicted``: plain data from a plan (``memory_bytes_per_gpu``, ``step_time_s``) that rank 0 logs
    its measurements beside (meshlm/training/plan_check.py)."""
    config = model_from_init_folder(config)  # train.init_model_config: the model is init_from's
    finished = finished_run(config, command_line_keys)
    if finished is not None:
        return TrainResult(run_dir=Path(config.train.run_dir), step=finished.step, already_complete=finished.message())
    with explain_collective_failures(config.parallel.timeout_s):
        return Trainer(config, predicted).run()


__all__ = ["StepResult", "TrainResult", "Trainer", "seed_everything", "train"]
