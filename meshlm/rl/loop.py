"""The GRPO loop: the trainer's machinery, with rollouts instead of a dataset.

    meshlm rl CONFIG.yaml train.init_from=runs/sft/checkpoints/step_200 [--env arithmetic]
    torchrun --nproc_per_node 2 -m meshlm rl CONFIG.yaml ...                      (data parallel)

``GRPOTrainer`` is a ``Trainer`` (``meshlm/training/trainer.py``): the model, optimizer, mixed
precision, data-parallel reducer (ZeRO-1/2 included), distributed checkpoints that resume at any
DP size, metrics.jsonl, the progress line, stop requests and the time limit are all the
trainer's. What changes is one step (GRPO, Shao et al. 2024; the math is ``grpo.py``):

    records  = prompts [s*P, (s+1)*P) of the environment; DP rank d takes its contiguous P/dp
    for each record: G completions sampled by the policy itself      (rollouts.py; eval mode)
    rewards  -> advantages, normalized within each group             (a group lives on one rank)
    old_logp = log pi(completion tokens) before any update (the first pass's, detached); ref_logp from the reference
    repeat rl.epochs times:                                          (mu)
        for each micro-batch of train.micro_batch_size completions:
            backward(-clipped surrogate + beta * k3 KL), weighted so the sum over micro-batches
            and DP ranks is the step's mean (grpo.py: 'sequence' or 'token' averaging)
        finish_gradients (DP reduction, clipping) and the optimizer step, as the trainer's

Generation and training share the weights: the policy that samples is the model being trained,
in the same memory, so no copy is synchronized. The whole RL step runs in eval mode (no
dropout): the log-probabilities of the ratio must be those of the policy that sampled.

**Layouts.** Single process, or data parallel (with ZeRO stage 1 or 2: every rank keeps the whole
model, so it can generate). Every rank samples its own groups with per-group seeds and the loss
is divided by the step's counts over all ranks, so a DP run equals one process running all the
prompts, up to fp32 summation order. Tensor, pipeline, context and expert parallelism, ZeRO-3
and the low-communication DP modes are refused at start-up: generation needs the whole model
in each process.

**Evaluation.** Every ``train.eval_every`` steps (and at the start and end), each rank answers its
share of the environment's held-out prompts greedily and the accuracy is logged
(``eval_accuracy`` in metrics.jsonl); ``meshlm rl --eval-only`` does only that, and with
``--pass-at K`` also samples K completions per held-out prompt (``held_out_pass_at_k``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from pathlib import Path

import torch

from meshlm.checkpoint.folders import latest_checkpoint
from meshlm.data.tokenizer import find_tokenizer_file, load_tokenizer
from meshlm.errors import ConfigError
from meshlm.inference.chat import chat_prompt, conversation_prompt, record_messages, reply_ids
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.parallel.collective_checks import compare_collectives
from meshlm.parallel.collectives import all_reduce_
from meshlm.rl.environments import build_environment
from meshlm.rl.grpo import TokenWeights, group_advantages, grpo_loss
from meshlm.rl.progress import RLProgressLine
from meshlm.rl.reward_functions import load_reward_fn, score
from meshlm.rl.rollouts import Rollouts, group_seed, pack, sample_groups, score_rollouts, token_log_probs
from meshlm.training.data_loading import TrainingData
from meshlm.training.distillation import build_frozen_model, frozen_model_config
from meshlm.training.fault_tolerance import explain_collective_failures
from meshlm.training.initial_weights import model_from_init_folder
from meshlm.training.preflight import finished_run
from meshlm.training.schedules import learning_rate
from meshlm.training.trainer import StepResult, Trainer, TrainResult


HELD_OUT_SAMPLING_STEP = 2 ** 62
"""The 'step' that seeds the held-out prompts' sampled completions (``held_out_pass_at_k``): one no
run reaches, so they never share a seed with a training group."""
SOLVED_REWARD = 1.0
"""A prompt-file record without an answer counts as solved (accuracy) when its reward reaches this."""
HELD_OUT_SAMPLING_BATCH = 16
"""Held-out prompts whose samples share one ``generate`` call (and one generator) in ``held_out_pass_at_k``."""


def check_rl_layout(config) -> int:
    """The DP size of an RL run, or ConfigError (one sentence) for a layout it cannot run."""
    parallel, rl, train = config.parallel, config.rl, config.train
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(parallel, name) > 1:
            raise ConfigError(f"parallel.{name}={getattr(parallel, name)}: meshlm rl generates its rollouts with the "
                              f"whole model in every process, so it runs single-process or data-parallel only; "
                              f"set parallel.{name}=1.")
    if parallel.sharding_stage == 3:
        raise ConfigError("parallel.zero_stage=3 shards the parameters, but meshlm rl generates with the whole model "
                          "on every rank; use parallel.zero_stage=1 or 2.")
    if parallel.dp_sync != "every_step":
        raise ConfigError(f"parallel.dp_sync={parallel.dp_sync!r}: meshlm rl keeps one policy for all ranks; "
                          "use parallel.dp_sync=every_step.")
    if train.distill_from is not None:
        raise ConfigError("train.distill_from does not apply to meshlm rl (its loss is GRPO's); drop it.")
    if train.keep_best or train.early_stop_evals:
        raise ConfigError("train.keep_best and train.early_stop_evals follow a validation loss, which meshlm rl does "
                          "not compute (its evaluation is the held-out accuracy); drop them.")
    if config.precision.recipe != "none":
        raise ConfigError(f"precision.recipe={config.precision.recipe!r}: meshlm rl samples from the model as "
                          "trained, in plain bf16 or fp32; set precision.recipe=none.")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = parallel.dp or world
    if rl.prompts_per_step % dp:
        raise ConfigError(f"rl.prompts_per_step={rl.prompts_per_step} must be a multiple of the data-parallel size "
                          f"{dp} (each rank samples whole groups).")
    rows = rl.prompts_per_step // dp * rl.group_size
    if rows % train.micro_batch_size:
        raise ConfigError(f"train.micro_batch_size={train.micro_batch_size} must divide the {rows} completions each "
                          f"rank trains on per step (rl.prompts_per_step / dp * rl.group_size).")
    return dp


def check_prompt_lengths(environment, encode_prompt, config) -> None:
    """A prompt file's longest prompt plus rl.max_new_tokens must fit train.seq_len: refused at start-up,
    naming its line, rather than at the step that first draws it."""
    if not hasattr(environment, "longest_prompt"):
        return  # the arithmetic questions are a few tokens
    tokens, where = environment.longest_prompt(encode_prompt)
    needed, seq_len = tokens + config.rl.max_new_tokens, config.train.seq_len
    if needed > seq_len:
        raise ConfigError(f"rl.prompts: {where}: the prompt is {tokens} tokens with the chat template, and with "
                          f"rl.max_new_tokens={config.rl.max_new_tokens} needs train.seq_len >= {needed} "
                          f"(it is {seq_len}); raise train.seq_len, or shorten or drop that prompt.")


def rl_run_config(config):
    """The run config the trainer is built from: a step is prompts_per_step * group_size sequences."""
    train = dataclasses.replace(config.train, global_batch_size=config.rl.prompts_per_step * config.rl.group_size,
                                prefetch_batches=False)
    return dataclasses.replace(config, train=train)


def rl_tokenizer_file(config) -> Path:
    """data.tokenizer, else the tokenizer beside train.init_from, else the run's newest checkpoint's."""
    train = config.train
    candidates = [config.data.tokenizer, train.init_from, latest_checkpoint(train.run_dir)]
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            return find_tokenizer_file(candidate)
        except FileNotFoundError:
            continue
    raise ConfigError("meshlm rl needs the tokenizer (with its chat template) of the model it starts from: set "
                      "train.init_from to a model folder or checkpoint that holds tokenizer.json, or data.tokenizer.")


def reference_source(config) -> tuple[str, str]:
    """(setting, path) of the KL term's frozen reference: rl.reference_from, else train.init_from."""
    rl, train = config.rl, config.train
    if rl.reference_from is not None:
        return "rl.reference_from", rl.reference_from
    if train.init_from is None:
        raise ConfigError("rl.kl_coeff > 0 needs a reference model: set train.init_from (the model RL starts "
                          "from) or rl.reference_from, or set rl.kl_coeff=0.")
    return "train.init_from", train.init_from


class GRPOTrainer(Trainer):
    """A ``Trainer`` whose step is GRPO on the environment ``config.rl.env`` (module docstring)."""

    command = "meshlm rl"

    def __init__(self, config, predicted: dict | None = None):
        config = model_from_init_folder(config)
        config.validate()
        self.dp = check_rl_layout(config)
        config = rl_run_config(config)
        self.tokenizer_file = rl_tokenizer_file(config)
        self.tokenizer = load_tokenizer(self.tokenizer_file)
        self.system = config.rl.system
        reward_fn = config.train.reward_fn
        self.environment = build_environment(config.rl, config.train.seed, needs_answers=reward_fn is None)
        self.reward_name = f"train.reward_fn={reward_fn}" if reward_fn else f"the {config.rl.env} environment's reward"
        self.reward_function = load_reward_fn(reward_fn) if reward_fn else self.environment.reward
        self.stop_ids = chat_prompt(self.tokenizer, "?")[1]
        check_prompt_lengths(self.environment, self.encode_prompt, config)
        self.reference_source = reference_source(config) if config.rl.kl_coeff > 0 else None
        if self.tokenizer.vocab_size > config.model.vocab_size:
            raise ConfigError(f"the tokenizer {self.tokenizer_file} has {self.tokenizer.vocab_size} ids but "
                              f"model.vocab_size={config.model.vocab_size}; use the model's own tokenizer.")
        super().__init__(config, predicted)
        self.valid_vocab_size = min(self.tokenizer.vocab_size, self.model.config.vocab_size)
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.reference = self.build_reference() if self.reference_source is not None else None
        self.eval_accuracies: dict[int, float] = {}
        self.step_stats: dict[str, float] = {}

    def frozen_reference(self) -> str | None:
        return self.reference_source[1] if self.reference_source is not None else None

    def build_data(self) -> TrainingData:
        """No dataset: the environment is the data. The tokenizer is copied into every checkpoint."""
        return TrainingData(train=[], valid=None, tokenizer_file=self.tokenizer_file)

    def build_reference(self):
        """The frozen reference policy of the KL term, this rank's copy in the run's dtype."""
        setting, path = self.reference_source
        directory, model_config = frozen_model_config(setting, path, self.config.model)
        model, _ = build_frozen_model(f"{setting}={path}", directory, model_config, self.config, self.context,
                                      self.device, self.precision.dtype)
        return model

    def encode_prompt(self, record: dict) -> list[int]:
        """A record's prompt as the chat template renders it, ending with the assistant header: its
        ``messages`` (a prompt file's multi-turn context), else its ``prompt`` as the user turn after
        its ``system`` turn, or rl.system's."""
        return conversation_prompt(self.tokenizer, record_messages(record, self.system))

    def reward(self, record: dict, completion: str) -> float:
        return score(self.reward_function, self.reward_name, record, completion)

    def is_correct(self, record: dict, completion: str, reward: float | None = None) -> bool:
        """The environment's verdict; for a prompt-file record without an answer, a reward of at least
        SOLVED_REWARD (``reward``, when already computed, is not recomputed)."""
        verdict = self.environment.is_correct(record, completion)
        if verdict is not None:
            return bool(verdict)
        return (self.reward(record, completion) if reward is None else reward) >= SOLVED_REWARD

    # --- one step -----------------------------------------------------------------------------------
    def collect_rollouts(self) -> Rollouts:
        """This DP rank's groups of the step, sampled and scored."""
        rl, step = self.config.rl, self.state.step
        per_rank = rl.prompts_per_step // self.dp
        first = self.context.dp_rank * per_rank
        records = [self.environment.train_record(step * rl.prompts_per_step + first + offset)
                   for offset in range(per_rank)]
        rollouts = sample_groups(self.model, records, first, step, self.config.train.seed, self.encode_prompt, rl,
                                 self.stop_ids, self.valid_vocab_size, self.pad_token_id)
        score_rollouts(rollouts, self.tokenizer, self.stop_ids, self.reward, self.is_correct, rl.group_size)
        return rollouts

    def micro_batches(self, rollouts: Rollouts, advantages: torch.Tensor) -> list[dict]:
        """The rollouts as micro-batches of train.micro_batch_size rows, with the reference's log-probs
        (the old policy's are those of the first pass, ``policy_gradient_pass``)."""
        size, seq_len = self.config.train.micro_batch_size, self.config.train.seq_len
        longest = max(len(p) + len(c) for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids))
        if longest > seq_len:
            raise ConfigError(f"a prompt plus its completion is {longest} tokens, more than train.seq_len={seq_len}; "
                              "raise train.seq_len or lower rl.max_new_tokens.")
        batches = []
        for start in range(0, len(rollouts.prompt_ids), size):
            rows = slice(start, start + size)
            input_ids, labels = pack(rollouts.prompt_ids[rows], rollouts.completion_ids[rows], self.pad_token_id,
                                     self.device)
            batch = {"input_ids": input_ids, "labels": labels, "advantages": advantages[rows].to(self.device)}
            with torch.no_grad(), self.precision.autocast():
                batch["reference_log_probs"] = (None if self.reference is None
                                                else self.log_probs(self.reference, batch))
            batches.append(batch)
        return batches

    def log_probs(self, model, batch: dict) -> torch.Tensor:
        return token_log_probs(model, batch["input_ids"], batch["labels"], self.config.rl.temperature,
                               self.valid_vocab_size)

    def sum_over_dp(self, values: list[float]) -> list[float]:
        """``values`` summed over the data-parallel ranks (float64, one all-reduce)."""
        summed = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.context.dp_size > 1:
            all_reduce_(summed, self.context.dp_cp_group)
        return summed.tolist()

    def train_step(self) -> StepResult:
        rl = self.config.rl
        self.model.eval()  # no dropout: the ratio compares the very policy that sampled
        rollouts = self.collect_rollouts()
        advantages = group_advantages(rollouts.rewards).reshape(-1)
        batches = self.micro_batches(rollouts, advantages)
        lengths = [len(ids) for ids in rollouts.completion_ids]
        rows, tokens = self.sum_over_dp([len(lengths), sum(lengths)])
        weights = [TokenWeights.build(batch["labels"] != -100, rl.loss_averaging, int(rows), int(tokens))
                   for batch in batches]
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, surrogate, kl, clip fraction
        grad_norm, skipped, lr = 0.0, False, 0.0
        for _ in range(rl.epochs):
            totals += self.policy_gradient_pass(batches, weights)
            grad_norm, skipped = self.finish_gradients()
            lr = learning_rate(self.state.step, self.config.optim, self.config.train.steps)
            if not skipped:
                self.optimizer_step(lr)
            self.precision.update_scale(skipped)
            self.optimizer.zero_grad(set_to_none=True)
        rewards = rollouts.rewards.reshape(-1).double()
        sums = self.sum_over_dp([*(totals / rl.epochs).tolist(), float(rewards.sum()), float((rewards ** 2).sum()),
                                 float(rollouts.correct.sum())])
        loss, surrogate, kl, clip_fraction, reward_sum, reward_squares, correct = sums
        mean = reward_sum / rows
        self.step_stats = {"reward_mean": mean, "reward_std": math.sqrt(max(reward_squares / rows - mean ** 2, 0.0)),
                           "accuracy": correct / rows, "completion_length": tokens / rows,
                           "clip_fraction": clip_fraction, "kl": kl, "surrogate": surrogate}
        self.state.step += 1
        self.state.consumed_samples += int(rows)
        self.state.skipped_steps += int(skipped)
        self.state.lr, self.state.last_loss = lr, loss
        compare_collectives(self.context, f"after step {self.state.step}")
        return StepResult(loss=loss, losses={"surrogate": surrogate, "kl": kl}, grad_norm=grad_norm, lr=lr,
                          skipped=skipped, tokens_per_expert=[])

    def policy_gradient_pass(self, batches: list[dict], weights: list[TokenWeights]) -> torch.Tensor:
        """One pass of the GRPO loss over the micro-batches, accumulating gradients (the DP reduction
        starts in the last backward); returns this rank's (loss, surrogate, kl, clip fraction) sums.
        The first pass runs the policy that sampled, so its log-probabilities, detached, are the old
        policy's of every pass (no separate forward)."""
        rl = self.config.rl
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)
        if self.reducer is not None:
            self.reducer.zero_grad()
        for index, (batch, weight) in enumerate(zip(batches, weights)):
            last = index == len(batches) - 1
            quiet = self.reducer.no_sync() if self.reducer is not None and not last else contextlib.nullcontext()
            with quiet, self.precision.autocast():
                current = self.log_probs(self.model, batch)
                old = batch.setdefault("old_log_probs", current.detach())
                terms = grpo_loss(current, old, batch["reference_log_probs"], batch["advantages"], weight,
                                  rl.clip_epsilon, rl.kl_coeff)
                self.precision.scale_loss(terms.loss).backward()
            totals += torch.stack([terms.loss.detach(), terms.surrogate, terms.kl, terms.clip_fraction]).double()
        return totals

    def step_record(self, result: StepResult) -> dict:
        return {**super().step_record(result), **self.step_stats}

    # --- logs and evaluation ------------------------------------------------------------------------
    def open_logs(self) -> None:
        super().open_logs()
        if self.context.is_logging_rank:
            self.progress = RLProgressLine(self.config.train.steps, self.config.train.progress)

    @torch.no_grad()
    def held_out_share(self) -> tuple[int, int]:
        """[first, end) of the held-out prompts this DP rank answers: a contiguous share."""
        count = len(self.environment.held_out)
        share = math.ceil(count / self.dp)
        return min(self.context.dp_rank * share, count), min((self.context.dp_rank + 1) * share, count)

    def held_out_accuracy(self) -> tuple[int, int]:
        """(correct, prompts): the held-out prompts answered greedily, each rank a contiguous share."""
        records = self.environment.held_out
        first, end = self.held_out_share()
        mine = records[first:end]
        correct = 0
        for start in range(0, len(mine), 64):
            chunk = mine[start:start + 64]
            replies = generate(self.model, [self.encode_prompt(record) for record in chunk],
                               self.config.rl.max_new_tokens, SamplingConfig(greedy=True), eos_token_id=self.stop_ids,
                               pad_token_id=self.pad_token_id, valid_vocab_size=self.valid_vocab_size)
            for record, ids in zip(chunk, replies):
                text = self.tokenizer.decode([token for token in ids if token not in self.stop_ids])
                correct += self.is_correct(record, text)
        total_correct, = self.sum_over_dp([correct])
        compare_collectives(self.context, f"in the evaluation after step {self.state.step}")
        return int(total_correct), len(records)

    @torch.no_grad()
    def held_out_pass_at_k(self, samples: int) -> tuple[int, int, int]:
        """(correct samples, prompts with at least one correct sample, prompts): ``samples``
        completions of each held-out prompt drawn at rl.temperature -- the mean is the sampled
        pass@1 and the second count pass@k with k = ``samples`` (Chen et al. 2021, §2.1, with n = k).
        pass@k well above greedy accuracy is the headroom GRPO can turn into pass@1 (DeepSeek-R1
        2025, §2.2: RL sharpens what the model already sometimes gets right). Each rank samples its
        share in batches of HELD_OUT_SAMPLING_BATCH prompts, each batch one generator seeded by
        (train.seed, HELD_OUT_SAMPLING_STEP, its first prompt's index): the figures are reproducible
        for a given DP size, and differ between sizes only by sampling noise."""
        records = self.environment.held_out
        first, end = self.held_out_share()
        rl = self.config.rl
        correct = solved = 0
        for start in range(first, end, HELD_OUT_SAMPLING_BATCH):
            chunk = records[start:min(start + HELD_OUT_SAMPLING_BATCH, end)]
            prompts = [self.encode_prompt(record) for record in chunk for _ in range(samples)]
            sampling = SamplingConfig(temperature=rl.temperature,
                                      seed=group_seed(self.config.train.seed, HELD_OUT_SAMPLING_STEP, start))
            replies = generate(self.model, prompts, rl.max_new_tokens, sampling, eos_token_id=self.stop_ids,
                               pad_token_id=self.pad_token_id, valid_vocab_size=self.valid_vocab_size)
            texts = [self.tokenizer.decode(reply_ids(ids, self.stop_ids)) for ids in replies]
            hits = torch.tensor([self.is_correct(chunk[row // samples], text)
                                 for row, text in enumerate(texts)]).view(len(chunk), samples)
            correct, solved = correct + int(hits.sum()), solved + int(hits.any(dim=-1).sum())
        total_correct, total_solved = self.sum_over_dp([correct, solved])
        compare_collectives(self.context, f"in the sampled evaluation after step {self.state.step}")
        return int(total_correct), int(total_solved), len(records)

    def maybe_evaluate(self, final: bool) -> None:
        """Held-out accuracy every train.eval_every steps (and at the start and the end)."""
        every, step = self.config.train.eval_every, self.state.step
        if every <= 0 or self.last_eval_step == step or not (step % every == 0 or final):
            return None
        correct, total = self.held_out_accuracy()
        self.last_eval_step = step
        self.eval_accuracies[step] = correct / total
        self.metrics.write({"step": step, "eval_accuracy": correct / total, "eval_prompts": total})
        self.progress.message(f"step {step}: held-out accuracy {correct / total:.1%} ({correct}/{total}, greedy)")
        return None


def run_rl(config, command_line_keys=()) -> tuple[TrainResult, dict[int, float]]:
    """Train (or resume) the RL run ``config``; (the trainer's result, held-out accuracy by step)."""
    config = rl_run_config(model_from_init_folder(config))  # as the checkpoints saved it
    finished = finished_run(config, command_line_keys)
    if finished is not None:
        return TrainResult(run_dir=Path(config.train.run_dir), step=finished.step,
                           already_complete=finished.message()), {}
    with explain_collective_failures(config.parallel.timeout_s):
        trainer = GRPOTrainer(config)
        return trainer.run(), trainer.eval_accuracies


def evaluate_only(config, samples: int = 0) -> dict:
    """Held-out accuracy of the run's newest checkpoint, else of train.init_from (nothing trained);
    with ``samples`` > 0 also the sampled pass@1 and pass@k, k = ``samples`` (``held_out_pass_at_k``)."""
    with explain_collective_failures(config.parallel.timeout_s):
        trainer = GRPOTrainer(config)
        try:
            correct, total = trainer.held_out_accuracy()
            report = {"step": trainer.state.step, "accuracy": correct / total, "correct": correct, "prompts": total,
                      "source": str(trainer.resumed_from or config.train.init_from)}
            if samples > 0:
                sampled, solved, _ = trainer.held_out_pass_at_k(samples)
                report.update({"samples": samples, "temperature": config.rl.temperature,
                               "sampled_pass_at_1": sampled / (samples * total), f"pass_at_{samples}": solved / total})
        finally:
            trainer.batches.close()
    return report


__all__ = ["HELD_OUT_SAMPLING_BATCH", "HELD_OUT_SAMPLING_STEP", "SOLVED_REWARD", "GRPOTrainer", "check_prompt_lengths",
           "check_rl_layout", "evaluate_only", "rl_run_config", "run_rl"]
