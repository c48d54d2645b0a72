"""Training on preferences: reward models (Bradley-Terry, attribute MSE) and DPO.

    meshlm preprocess --preference --input pairs.jsonl --tokenizer T --out data/prefs
    meshlm train configs/tiny.yaml data.blend=null data.prefixes=[data/prefs] \\
        train.objective=reward model.head=reward train.init_from=runs/sft          # a reward model
    meshlm train configs/tiny.yaml data.blend=null data.prefixes=[data/prefs] \\
        train.objective=dpo train.init_from=runs/sft train.dpo_beta=0.1            # DPO

A micro-batch of B examples is 2B rows for pairs (chosen at row 2b, rejected at 2b + 1) or B rows
of rated replies (``meshlm/data/preference.py``). The trainer hands every micro-batch to
``PreferenceObjective.forward`` (its ``forward_micro_batch`` hook), which returns the loss -- the
mean over the micro-batch's examples, so the trainer's division by the step's micro-batch count
gives the step's mean -- and the terms it logs.

**Reward model** (``model.head=reward``, ``train.objective=reward``; Nemotron-4 340B-Reward,
InstructGPT). The score of a row is the reward head at its last token (``meshlm/models/reward_head.py``).

    bradley_terry   loss = mean over pairs of  -log sigmoid(r_chosen - r_rejected)
                    (Bradley & Terry 1952: P(chosen > rejected) = sigmoid(r_c - r_r))
    mse             loss = mean over rated (row, attribute) of  (r_a - y_a)^2   (HelpSteer's ratings)

logged as ``loss_bradley_terry`` / ``loss_mse``, with ``reward_accuracy`` (the fraction of pairs
whose chosen reply scores higher) and ``score_margin`` (mean r_c - r_r) for pairs.

**DPO** (Rafailov et al. 2023, "Direct Preference Optimization"). With the policy's and the frozen
reference's log-probabilities of each reply, logp = sum over the reply's tokens of log p(token):

    chosen_reward   = beta * (logp(chosen) - ref_logp(chosen))        (the implicit rewards)
    rejected_reward = beta * (logp(rejected) - ref_logp(rejected))
    loss            = mean over pairs of  -log sigmoid(chosen_reward - rejected_reward)

``length_normalized`` uses the mean token log-probability instead of the sum (so long replies do
not dominate: the normalization of SimPO and ORPO, here with the reference kept); ``rpo`` adds
``rpo_alpha`` times the chosen reply's mean token NLL (Pang et al. 2024, "Iterative Reasoning
Preference Optimization"; the RPO of Nemotron-4 340B's alignment uses the same SFT-on-chosen
term), which keeps the chosen reply's likelihood from falling. Logged: ``loss_dpo`` (and
``loss_rpo_nll``), ``reward_accuracy``, ``chosen_reward``, ``rejected_reward`` and
``reward_margin`` (their mean difference). The reference (``train.reference_from``, default
``train.init_from``) is built as a distillation teacher is -- this rank's shards in the run's
layout and dtype, eval mode, no gradient (``distillation.build_frozen_model``) -- and runs on the
same rows.

**Layouts.** Under TP the log-probabilities come from the vocab-parallel cross-entropy
(reduction 'none') of each rank's logit shard, never gathered; per-row sums are then the same on
every TP rank, so the loss is replicated as the LM loss is, and the backward through the shards is
exact. The reward head is replicated (its hidden state gathered over the sequence under SP; see
reward_head.py for how its gradients are reduced). DP splits the step's examples as it splits
sequences, and ZeRO changes nothing here; the per-example losses make every layout equal one
process. PP, CP, EP, MTP and the low-precision recipes are refused at start-up (config.py's
``validate_objective``). MoE blocks' aux and z losses are added at their coefficients, as in LM
training. Dropout masks are keyed by row (sample index * rows + row), layout-independent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshlm.errors import ConfigError
from meshlm.models.context import SequenceContext
from meshlm.models.dropout import DropoutKey
from meshlm.models.language_model import LMOutput
from meshlm.models.losses import IGNORE_INDEX
from meshlm.models.reward_head import last_token_rewards
from meshlm.parallel.collectives import gather_along
from meshlm.parallel.tensor.vocab_parallel import vocab_parallel_cross_entropy
from meshlm.training.distillation import build_frozen_model, frozen_model_config, local_logits

LOGGED_AS_IS = ("reward_accuracy", "score_margin", "chosen_reward", "rejected_reward", "reward_margin")
"""Terms of ``output.losses`` that are measurements, not losses: logged under their own names
(metrics.jsonl), not as ``loss_{name}``."""


# --- the losses, on per-row tensors ----------------------------------------------------------------

def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Mean over pairs of -log sigmoid(r_chosen - r_rejected); ``chosen``, ``rejected``: [pairs]."""
    return -F.logsigmoid(chosen - rejected).mean()


def attribute_mse(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean of (score - rating)^2 over the (row, attribute) entries that have a rating (not NaN)."""
    rated = ~torch.isnan(targets)
    return (scores - torch.nan_to_num(targets)).square().masked_fill(~rated, 0.0).sum() / rated.sum().clamp_min(1)


def sequence_log_probs(token_losses: torch.Tensor, labels: torch.Tensor, mean: bool) -> torch.Tensor:
    """Per row, the sum (or with ``mean`` the average) of log p over the labelled tokens, from the
    per-token cross-entropies [rows, seq] (0 where ignored)."""
    log_probs = -token_losses.sum(dim=-1)
    return log_probs / (labels != IGNORE_INDEX).sum(dim=-1).clamp_min(1) if mean else log_probs


def dpo_terms(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
    """DPO's loss and implicit rewards from per-row log-probabilities [2 * pairs] (chosen at even
    rows, rejected at odd): {'dpo', 'chosen_reward', 'rejected_reward', 'reward_margin',
    'reward_accuracy'}, each a mean over pairs."""
    rewards = beta * (policy - reference.detach())
    chosen, rejected = rewards[0::2], rewards[1::2]
    return {"dpo": -F.logsigmoid(chosen - rejected).mean(), **pair_measurements(chosen, rejected, "reward")}


def pair_measurements(chosen: torch.Tensor, rejected: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """The logged measurements of pairs' scores (detached means): accuracy, and for DPO ('reward')
    each implicit reward and their margin, for a reward model ('score') the score margin."""
    chosen, rejected = chosen.detach().float(), rejected.detach().float()
    terms = {"reward_accuracy": (chosen > rejected).float().mean(), f"{kind}_margin": (chosen - rejected).mean()}
    if kind == "reward":
        terms.update(chosen_reward=chosen.mean(), rejected_reward=rejected.mean())
    return terms


# --- the objective -----------------------------------------------------------------------------------

class PreferenceObjective:
    """The loss of one micro-batch of preference rows (module docstring) for ``train.objective``
    'reward' or 'dpo'; ``reference``: DPO's frozen model (this rank's shards)."""

    def __init__(self, train, context, vocab_size: int, reference=None):
        self.objective, self.context, self.vocab_size, self.reference = train.objective, context, vocab_size, reference
        self.reward_loss, self.beta = train.reward_loss, train.dpo_beta
        self.variant, self.rpo_alpha = train.dpo_variant, train.rpo_alpha
        self.term = self.reward_loss if self.objective == "reward" else "dpo"
        """The name of the objective's own loss term (what validation reports)."""
        self.validation: dict[str, float] = {}

    @classmethod
    def build(cls, config, context, device: torch.device, dtype: torch.dtype) -> PreferenceObjective | None:
        """None for train.objective=lm; for DPO, with the reference model built in the run's layout."""
        train = config.train
        if train.objective == "lm":
            return None
        reference = None
        if train.objective == "dpo":
            path = train.reference_from or train.init_from
            setting = f"train.reference_from={path}" if train.reference_from else f"train.init_from={path} (the reference)"
            directory, model_config = frozen_model_config(setting, path, config.model)
            if model_config.head != "lm":
                raise ConfigError(f"{setting} is a reward model (model.head={model_config.head}); DPO's reference "
                                  "must be a language model, e.g. the SFT model the run starts from.")
            reference, _ = build_frozen_model(setting, directory, model_config, config, context, device, dtype)
        return cls(train, context, config.model.vocab_size, reference)

    def forward(self, model, batch: dict[str, torch.Tensor]) -> LMOutput:
        """The micro-batch's loss (mean over its examples) and logged terms, as ``model(...)`` returns them."""
        context = sequence_context(batch, training=model.training)
        hidden = model.run_blocks(model.embed(batch["input_ids"], context), context)
        if self.objective == "reward":
            losses = self.reward_terms(model, hidden, batch)
        else:
            losses = self.dpo_terms(model, hidden, batch)
        total = losses[self.term] + (self.rpo_alpha * losses["rpo_nll"] if "rpo_nll" in losses else 0.0)
        output = LMOutput(logits=None, losses=losses)
        if context.moe_losses:  # the MoE blocks' own terms, at their coefficients (as LM training)
            output.tokens_per_expert = [moe.tokens_per_expert for moe in context.moe_losses]
            output.losses.update(model.moe_loss_terms(context))
            total = model.add_moe_losses(total, output.losses)
        output.loss = total
        return output

    def reward_terms(self, model, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        normed = model.final_norm(hidden)
        if self.context.sequence_parallel:  # every rank needs each row's last token: gather the sequence
            normed = gather_along(normed, 1, self.context.tp_group)
        scores = last_token_rewards(model.reward_head, normed, batch["last_index"])  # [rows, attributes]
        if self.reward_loss == "mse":
            return {"mse": attribute_mse(scores, batch["scores"].float())}
        chosen, rejected = scores[0::2, 0], scores[1::2, 0]
        return {"bradley_terry": bradley_terry_loss(chosen, rejected), **pair_measurements(chosen, rejected, "score")}

    def dpo_terms(self, model, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels, mean = batch["labels"], self.variant == "length_normalized"
        token_losses = self.token_losses(model, hidden, labels)
        with torch.no_grad():
            reference_context = sequence_context(batch, training=False)
            reference_hidden = self.reference.run_blocks(self.reference.embed(batch["input_ids"], reference_context),
                                                         reference_context)
            reference = sequence_log_probs(self.token_losses(self.reference, reference_hidden, labels), labels, mean)
        terms = dpo_terms(sequence_log_probs(token_losses, labels, mean), reference, self.beta)
        if self.variant == "rpo":
            terms["rpo_nll"] = -sequence_log_probs(token_losses[0::2], labels[0::2], mean=True).mean()
        return terms

    def token_losses(self, model, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy [rows, seq] of ``model``'s logits (vocab-parallel under TP), 0 where ignored."""
        return vocab_parallel_cross_entropy(local_logits(model, hidden), labels, self.context, self.vocab_size,
                                            reduction="none")

    @torch.no_grad()
    def evaluate(self, model, batches: list[dict[str, torch.Tensor]], precision) -> float:
        """The summed objective loss of ``batches`` (the model in eval mode); the mean of each
        other logged term is kept in ``validation`` (e.g. ``val_reward_accuracy``)."""
        total, sums = 0.0, {}
        for batch in batches:
            with precision.autocast():
                output = self.forward(model, batch)
            total += output.losses[self.term].item()
            for name in LOGGED_AS_IS:
                if name in output.losses:
                    sums[name] = sums.get(name, 0.0) + output.losses[name].item()
        self.validation = {f"val_{name}": value / len(batches) for name, value in sums.items()}
        return total


def sequence_context(batch: dict[str, torch.Tensor], training: bool) -> SequenceContext:
    """The rows' context; in training, a dropout key per row (sample index * rows + row), so the
    masks do not depend on the layout."""
    key = batch.get("dropout_key") if training else None
    if key is not None:
        rows = batch["input_ids"].shape[0] // key.sample_ids.numel()
        row_ids = key.sample_ids.repeat_interleave(rows) * rows + torch.arange(rows, device=key.sample_ids.device
                                                                               ).repeat(key.sample_ids.numel())
        key = DropoutKey(key.seed, key.step, row_ids)
    return SequenceContext.for_tokens(batch["input_ids"], dropout_key=key)


__all__ = ["LOGGED_AS_IS", "PreferenceObjective", "attribute_mse", "bradley_terry_loss", "dpo_terms",
           "pair_measurements", "sequence_log_probs"]
