"""The training loop: micro-batches -> forward/backward -> gradient step -> metrics -> checkpoints.

One optimizer step of a run with ``global_batch_size = G`` and ``micro_batch_size = m``:

    for each of the G/m micro-batches:             (gradient accumulation)
        loss = model(input_ids, labels).loss       LM loss + coefficient * (MoE aux, z, MTP)
        backward(scale * loss / (G/m))             so the summed gradient is that of the mean loss
    found_nonfinite = unscale + move grads to the fp32 master parameters
    grad_norm = clip the global L2 norm to grad_clip
    if finite: lr = schedule(step); AdamW step on the masters; copy masters into the model
    else:      skip the update (an fp16 overflow); the loss scaler backs off

The pieces are small methods so that the parallel versions replace one piece each:
``forward_backward`` is where a pipeline schedule (1F1B, interleaved) takes over the loop over
micro-batches, and ``finish_gradients`` is where data-parallel gradient reduction goes, before
the overflow check and the clipping that must see the whole gradient.

Data is read by sample index: step ``s`` consumes samples ``[s*G, (s+1)*G)`` of the global
order, so a run resumed from a checkpoint at step ``s`` continues with exactly the batches the
uninterrupted run would have seen (see ``meshlm/checkpoint/training_checkpoint.py``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from meshlm.checkpoint.training_checkpoint import (TrainerState, latest_checkpoint, load_model_state,
                                                   load_training_state, read_checkpoint, save_checkpoint)
from meshlm.models.config import ConfigError
from meshlm.models.flops import model_flops_per_token
from meshlm.models.language_model import LanguageModel
from meshlm.precision.mixed_precision import MixedPrecision
from meshlm.training.data_loading import build_training_data, read_batch
from meshlm.training.metrics import (MetricsLog, ProgressLine, Throughput, expert_load_summary, format_count,
                                     peak_flops)
from meshlm.training.optimizer import build_optimizer
from meshlm.training.plots import plot_losses
from meshlm.training.recompute import apply_recompute
from meshlm.training.schedules import learning_rate


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
    """Steps of the whole run whose update was skipped (non-finite gradients)."""


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


def seed_everything(seed: int) -> None:
    """Seed every RNG a run draws from (model init, dropout, anything using numpy or random)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ConfigError(f"train.device={name!r} is not a torch device; use auto, cpu, cuda or cuda:N.") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here; use train.device=cpu.")
    return device


class Trainer:
    """Builds everything a run needs from a ``RunConfig`` (resuming when RUN_DIR has a checkpoint)."""

    def __init__(self, config):
        config.validate()
        self.config, train = config, config.train
        self.run_dir = Path(train.run_dir)
        self.device = resolve_device(train.device)
        self.micro_batches_per_step = train.global_batch_size // train.micro_batch_size
        seed_everything(train.seed)
        self.data = build_training_data(config)
        checkpoint_dir = latest_checkpoint(self.run_dir)
        checkpoint = read_checkpoint(checkpoint_dir, config.model) if checkpoint_dir is not None else None

        self.model = LanguageModel(config.model)
        if checkpoint is not None:
            load_model_state(checkpoint, self.model)
        apply_recompute(self.model, train.recompute, train.recompute_every)
        self.model.to(self.device).train()
        self.precision = MixedPrecision(self.model, config.precision)
        self.master_parameters = [param for _, param in self.precision.master_parameters()]
        self.optimizer = build_optimizer(self.precision.master_parameters(), config.optim)
        self.state = TrainerState()
        if checkpoint is not None:
            self.state = load_training_state(checkpoint, self.optimizer, self.precision)  # restores the RNGs last
        self.resumed_from = checkpoint_dir if checkpoint is not None else None
        self.last_saved_step = self.state.step if checkpoint is not None else None
        self.last_eval_step: int | None = None

    # --- one optimizer step ---------------------------------------------------------------------------
    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        size = self.config.train.micro_batch_size
        start = self.state.consumed_samples
        return [read_batch(self.data.train, start + index * size, size, self.device)
                for index in range(self.micro_batches_per_step)]

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict, list]:
        """Forward and backward of every micro-batch, accumulating gradients.

        Returns the summed total loss, the summed loss terms and the summed per-expert token
        counts (detached). A pipeline schedule replaces exactly this loop.
        """
        loss_sum, term_sums, expert_counts = torch.zeros((), device=self.device), {}, []
        for batch in micro_batches:
            with self.precision.autocast():
                output = self.model(batch["input_ids"], batch["labels"], return_logits=False)
            self.precision.scale_loss(output.loss / len(micro_batches)).backward()
            loss_sum += output.loss.detach()
            for name, value in output.losses.items():
                term_sums[name] = term_sums.get(name, 0.0) + value.detach()
            counts = [count.detach() for count in output.tokens_per_expert]
            expert_counts = [a + b for a, b in zip(expert_counts, counts)] if expert_counts else counts
        return loss_sum, term_sums, expert_counts

    def finish_gradients(self) -> tuple[float, bool]:
        """Gradients -> fp32 masters (unscaled), global-norm clipping; returns (norm, found_nonfinite).

        With data parallelism the gradient all-reduce goes first, so that every rank sees the
        same overflow flag and the same norm.
        """
        found_nonfinite = self.precision.gradients_to_master()
        grads = [param.grad for param in self.master_parameters if param.grad is not None]
        clip = self.config.train.grad_clip
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.master_parameters, clip)
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        grad_norm = float(norm)
        return grad_norm, found_nonfinite or not np.isfinite(grad_norm)

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.precision.master_to_model()

    def train_step(self) -> StepResult:
        micro_batches = self.next_micro_batches()
        loss_sum, term_sums, expert_counts = self.forward_backward(micro_batches)
        grad_norm, skipped = self.finish_gradients()
        lr = learning_rate(self.state.step, self.config.optim, self.config.train.steps)
        if not skipped:
            self.optimizer_step(lr)
        self.precision.update_scale(skipped)
        self.optimizer.zero_grad(set_to_none=True)

        count = len(micro_batches)
        self.state.step += 1
        self.state.consumed_samples += self.config.train.global_batch_size
        self.state.skipped_steps += int(skipped)
        self.state.lr = lr
        self.state.last_loss = loss_sum.item() / count
        return StepResult(loss=self.state.last_loss, losses={name: value.item() / count for name, value in
                                                             term_sums.items()},
                          grad_norm=grad_norm, lr=lr, skipped=skipped, tokens_per_expert=expert_counts)

    # --- evaluation and checkpoints -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean LM loss over the fixed validation micro-batches."""
        size, batches = self.config.train.micro_batch_size, self.config.train.eval_batches
        self.model.eval()
        total = 0.0
        for index in range(batches):
            batch = read_batch(self.data.valid, index * size, size, self.device)
            with self.precision.autocast():
                total += self.model(batch["input_ids"], batch["labels"], return_logits=False).losses["lm"].item()
        self.model.train()
        return total / batches

    def maybe_evaluate(self, final: bool) -> float | None:
        every, step = self.config.train.eval_every, self.state.step
        if every <= 0 or self.last_eval_step == step or not (step % every == 0 or final):
            return None
        val_loss = self.evaluate()
        self.last_eval_step = step
        self.state.last_val_loss = val_loss
        if self.state.best_val_loss is None or val_loss < self.state.best_val_loss:
            self.state.best_val_loss = val_loss
        self.metrics.write({"step": step, "val_loss": val_loss})
        self.progress.message(f"step {step}: validation loss {val_loss:.4f}")
        return val_loss

    def maybe_save(self, final: bool) -> None:
        every, step = self.config.train.save_every, self.state.step
        if self.last_saved_step == step or not ((every and step % every == 0) or final):
            return
        path = save_checkpoint(self.run_dir, self.state, self.model, self.optimizer, self.precision, self.config,
                               self.config.train.keep_checkpoints, tokenizer_file=self.data.tokenizer_file)
        self.last_saved_step = step
        self.progress.message(f"step {step}: saved {path}")

    # --- the loop -----------------------------------------------------------------------------------------
    def step_record(self, result: StepResult) -> dict:
        tokens_per_s = self.throughput.tokens_per_second()
        record = {"step": self.state.step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                  "tokens_per_s": tokens_per_s, "mfu": self.throughput.mfu(tokens_per_s),
                  "loss_scale": self.precision.loss_scale, "skipped_steps": self.state.skipped_steps,
                  "samples": self.state.consumed_samples}
        record.update({f"loss_{name}": value for name, value in result.losses.items()})
        record.update(expert_load_summary(result.tokens_per_expert))
        return record

    def open_logs(self) -> None:
        train = self.config.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.run_dir, self.state.step, train.tensorboard)
        self.progress = ProgressLine(train.steps, train.progress)
        peak, source = peak_flops(self.device, self.config.precision.dtype)
        flops_per_token = model_flops_per_token(self.config.model, train.seq_len)
        self.throughput = Throughput(flops_per_token, peak)
        num_parameters = self.model.num_parameters()
        self.metrics.write({"event": "resume" if self.resumed_from else "start", "step": self.state.step,
                            "device": str(self.device), "dtype": self.config.precision.dtype,
                            "num_parameters": num_parameters, "flops_per_token": flops_per_token,
                            "peak_flops": peak, "peak_flops_source": source,
                            "tokens_per_step": train.global_batch_size * train.seq_len,
                            "tensorboard": self.metrics.tensorboard_enabled})
        where = f"resuming from {self.resumed_from}" if self.resumed_from else "starting"
        self.progress.message(f"meshlm train: {where} at step {self.state.step}/{train.steps}; "
                              f"{format_count(num_parameters)} parameters on {self.device} "
                              f"({self.config.precision.dtype}); peak {format_count(peak)}FLOP/s ({source})")

    def run(self) -> TrainResult:
        train = self.config.train
        result = TrainResult(run_dir=self.run_dir, step=self.state.step)
        self.open_logs()
        try:
            if self.state.step == 0:  # the starting point of the validation curve
                val_loss = self.maybe_evaluate(final=False)
                if val_loss is not None:
                    result.val_losses[0] = val_loss
            while self.state.step < train.steps:
                started = time.perf_counter()
                step_result = self.train_step()
                self.throughput.add(train.global_batch_size * train.seq_len, time.perf_counter() - started)
                result.losses[self.state.step] = step_result.loss
                self.after_step(step_result, result)
        finally:
            self.metrics.close()
        if train.plot and result.losses and plot_losses(self.run_dir) is None:
            self.progress.message("meshlm train: matplotlib is not installed, so no loss.png was drawn "
                                  "(pip install matplotlib).")
        result.step, result.skipped_steps = self.state.step, self.state.skipped_steps
        return result

    def after_step(self, step_result: StepResult, result: TrainResult) -> None:
        step, train = self.state.step, self.config.train
        final = step == train.steps
        if step_result.skipped:
            self.progress.message(f"step {step}: non-finite gradients, update skipped "
                                  f"(loss scale now {self.precision.loss_scale:g})")
        record = self.step_record(step_result)
        logged = step % train.log_every == 0 or final
        self.progress.update(record, logged)
        if logged:
            self.metrics.write(record)
            self.throughput.reset()
        val_loss = self.maybe_evaluate(final)
        if val_loss is not None:
            result.val_losses[step] = val_loss
        self.maybe_save(final)


def train(config) -> TrainResult:
    """Train (or resume) the run described by ``config``; see the module docstring."""
    return Trainer(config).run()


__all__ = ["StepResult", "TrainResult", "Trainer", "seed_everything", "train"]
