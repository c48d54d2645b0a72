"""DPO (``train.objective=dpo``) and its length-normalized and RPO variants, through the real trainer.

- ``dpo_terms`` and the per-row log-probabilities equal hand computations on tiny tensors; a
  micro-batch's loss equals the one computed by hand from the policy's and the reference's full
  log-softmax, for every variant.
- Training widens the margin between the chosen and rejected replies' implicit rewards.
- LoRA adapters on the policy (the reference without them) widen the margin while every other
  weight stays the SFT model's.
- tp2 (+SP) and dp2 (with the distributed optimizer; with dropout, whose masks are keyed by row;
  with LoRA) equal one process, on 2 spawned gloo ranks.
- A missing or unusable reference, and a store of rated replies, are refused in one sentence.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshlm.checkpoint.model_files import save_model
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import IGNORE_INDEX
from meshlm.training.metrics import read_metrics
from meshlm.training.preference import dpo_terms, sequence_log_probs
from meshlm.training.trainer import Trainer
from tests.helpers.distributed import import_test_file, run_distributed
from tests.helpers.preference_data import rated_replies, separable_pairs, write_store
from tests.helpers.tiny_training import relative_error

HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
MODEL = dict(vocab_size=128, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64)
"""HELPERS.run_config's dense model, with the chat tokens' vocabulary."""
DPO = ["model.vocab_size=128", "model.pattern=*-*-", "model.num_kv_heads=2", "train.objective=dpo",
       "data.blend=null", "data.split=80,20,0"]


@pytest.fixture(scope="module")
def setup(corpus_blend, tmp_path_factory):
    """The pairs store, an 'SFT' model (the policy's start) and a different reference model."""
    root = tmp_path_factory.mktemp("dpo")
    folders = {}
    for name, seed in (("sft", 3), ("other", 4)):
        torch.manual_seed(seed)
        model = LanguageModel(ModelConfig(**MODEL), seed=seed)
        with torch.no_grad():  # distributions far from uniform, as a trained model's
            model.final_norm.weight.mul_(4.0)
        folders[name] = save_model(model, root / name)
    pairs = write_store(root, separable_pairs(60, seed=0), corpus_blend.parent / "tokenizer.json", "pairs")
    rated = write_store(root, rated_replies(10, seed=1), corpus_blend.parent / "tokenizer.json", "rated")
    return dict(corpus=corpus_blend, pairs=pairs, rated=rated, **folders)


def dpo_config(setup, run_dir: Path, *overrides: str):
    return HELPERS.run_config(setup["corpus"], run_dir, *DPO, f"data.prefixes=[{setup['pairs']}]",
                              f"train.init_from={setup['sft']}", *overrides)


# --- by hand -------------------------------------------------------------------------------------------

def test_dpo_terms_equal_hand_computations():
    policy = torch.tensor([-3.0, -5.0, -2.0, -1.5])  # pairs (chosen, rejected): rows (0, 1), (2, 3)
    reference = torch.tensor([-3.5, -4.0, -2.5, -2.5])
    beta = 0.2
    terms = dpo_terms(policy, reference, beta)
    chosen = [beta * (-3.0 + 3.5), beta * (-2.0 + 2.5)]
    rejected = [beta * (-5.0 + 4.0), beta * (-1.5 + 2.5)]
    hand = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(chosen, rejected)) / 2
    assert abs(terms["dpo"].item() - hand) < 1e-6
    assert abs(terms["chosen_reward"].item() - sum(chosen) / 2) < 1e-6
    assert abs(terms["rejected_reward"].item() - sum(rejected) / 2) < 1e-6
    assert abs(terms["reward_margin"].item() - (sum(chosen) - sum(rejected)) / 2) < 1e-6
    assert terms["reward_accuracy"].item() == 0.5  # pair 0 right (0.1 > -0.2), pair 1 wrong (0.1 < 0.2)
    token_losses = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]])
    labels = torch.tensor([[4, 5, IGNORE_INDEX], [6, IGNORE_INDEX, IGNORE_INDEX]])
    assert sequence_log_probs(token_losses, labels, mean=False).tolist() == [-1.5, -2.0]
    assert sequence_log_probs(token_losses, labels, mean=True).tolist() == [-0.75, -2.0]


def hand_log_probs(model, batch, mean: bool) -> torch.Tensor:
    """Per row, the sum (or mean) of log-softmax of the full logits at the labelled tokens, in float64."""
    log_probs = F.log_softmax(model(batch["input_ids"]).logits.double(), dim=-1)
    labels = batch["labels"]
    picked = log_probs.gather(-1, labels.clamp_min(0)[..., None])[..., 0].masked_fill(labels == IGNORE_INDEX, 0)
    counts = (labels != IGNORE_INDEX).sum(-1)
    return picked.sum(-1) / counts if mean else picked.sum(-1)


@pytest.mark.parametrize("variant", ["dpo", "length_normalized", "rpo"])
def test_a_micro_batch_s_loss_equals_the_hand_computation(setup, tmp_path, variant):
    config = dpo_config(setup, tmp_path / "run", f"train.dpo_variant={variant}", "train.dpo_beta=0.5",
                        "train.rpo_alpha=0.3", f"train.reference_from={setup['other']}", "train.eval_every=0")
    trainer = Trainer(config)
    batch = trainer.next_micro_batches()[0]
    output = trainer.forward_micro_batch(batch)
    with torch.no_grad():
        mean = variant == "length_normalized"
        rewards = 0.5 * (hand_log_probs(trainer.model, batch, mean) - hand_log_probs(trainer.preference.reference,
                                                                                     batch, mean))
        hand = -F.logsigmoid(rewards[0::2] - rewards[1::2]).mean()
        if variant == "rpo":
            hand = hand - 0.3 * hand_log_probs(trainer.model, {k: v[0::2] for k, v in batch.items()
                                                               if k in ("input_ids", "labels")}, mean=True).mean()
    assert relative_error(output.loss, hand) <= 1e-5, (output.loss, hand)
    assert relative_error(output.losses["chosen_reward"], rewards[0::2].mean()) <= 1e-5
    assert relative_error(output.losses["reward_margin"], (rewards[0::2] - rewards[1::2]).mean()) <= 1e-5


# --- training ------------------------------------------------------------------------------------------

def test_dpo_widens_the_implicit_reward_margin(setup, tmp_path):
    run_dir = tmp_path / "dpo"
    Trainer(dpo_config(setup, run_dir, "train.steps=15", "optim.lr=3e-3", "train.eval_every=5",
                       "train.eval_batches=2")).run()
    validations = [record for record in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in record]
    assert [record["step"] for record in validations] == [0, 5, 10, 15]
    first, last = validations[0], validations[-1]
    assert first["val_reward_margin"] == 0.0 and abs(first["val_loss"] - math.log(2)) < 1e-6  # policy = reference
    assert last["val_reward_margin"] > 0.5 and last["val_loss"] < 0.5 * first["val_loss"], validations
    assert last["val_reward_accuracy"] == 1.0
    steps = [record for record in read_metrics(run_dir / "metrics.jsonl") if "reward_margin" in record]
    assert len(steps) == 15 and steps[-1]["chosen_reward"] - steps[-1]["rejected_reward"] > 0


def test_dpo_with_lora_adapters_widens_the_margin_and_trains_only_the_adapters(setup, tmp_path):
    """LoRA on the SFT model (fresh adapters: step 0 is the reference exactly), the reference
    without adapters: the margin widens while every other weight stays the SFT model's."""
    run_dir = tmp_path / "dpo lora"
    trainer = Trainer(dpo_config(setup, run_dir, "train.steps=15", "optim.lr=2e-2", "train.eval_every=15",
                                 "train.eval_batches=2", "model.lora_rank=8", "model.lora_alpha=16"))
    trainer.run()
    validations = [record for record in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in record]
    first, last = validations[0], validations[-1]
    assert first["val_reward_margin"] == 0.0 and abs(first["val_loss"] - math.log(2)) < 1e-6
    assert last["val_reward_margin"] > 0.2 and last["val_loss"] < 0.8 * first["val_loss"], validations
    sft = LanguageModel(ModelConfig(**MODEL), seed=3).state_dict()
    with torch.no_grad():
        sft["final_norm.weight"].mul_(4.0)
    for name, value in trainer.model.state_dict().items():
        if ".lora." not in name:
            assert torch.equal(value, sft[name]), name


# --- layouts -------------------------------------------------------------------------------------------

LAYOUTS = [("dpo", "tp2", ["parallel.tp=2"]),
           ("dpo", "dp2 dist-opt", ["parallel.dp=2", "parallel.distributed_optimizer=true"]),
           ("rpo", "tp2 sp", ["parallel.tp=2", "parallel.sp=true"]),
           ("dropout", "dp2", ["parallel.dp=2"]),
           ("lora", "tp2 sp", ["parallel.tp=2", "parallel.sp=true"])]


def test_dpo_at_tp2_sp_and_dp2_equals_one_process(setup, tmp_path):
    base = [*DPO, f"data.prefixes=[{setup['pairs']}]", f"train.init_from={setup['sft']}",
            f"train.reference_from={setup['other']}"]
    runs = {"dpo": base, "rpo": [*base, "train.dpo_variant=rpo", "train.dpo_beta=0.3"],
            "dropout": [*base, "train.dpo_variant=length_normalized", "model.hidden_dropout=0.2"],
            "lora": [*base, "model.lora_rank=4", "model.lora_alpha=8"]}
    single = {name: HELPERS.train_once(setup["corpus"], tmp_path / f"single {name}", overrides)
              for name, overrides in runs.items()}
    parallel = [(f"{name} {layout}", [*runs[name], *overrides]) for name, layout, overrides in LAYOUTS]
    by_rank = run_distributed(HELPERS.train_runs, 2, str(setup["corpus"]), str(tmp_path), parallel, timeout_s=300)
    for name, layout, _ in LAYOUTS:
        for rank, results in enumerate(by_rank):
            HELPERS.assert_same_run(results[f"{name} {layout}"], single[name], f"{name} {layout} rank {rank}")
        logged = [r for r in read_metrics(tmp_path / f"{name} {layout}" / "metrics.jsonl") if "reward_margin" in r]
        expected = [r for r in read_metrics(tmp_path / f"single {name}" / "metrics.jsonl") if "reward_margin" in r]
        for key in ("reward_margin", "chosen_reward", "rejected_reward"):
            assert len(logged) == 5 and relative_error([r[key] for r in logged], [r[key] for r in expected]) <= 1e-5


# --- refusals ------------------------------------------------------------------------------------------

def test_a_missing_or_unusable_reference_is_refused(setup, tmp_path):
    with pytest.raises(ConfigError, match="train.objective=dpo needs a frozen reference model; set train.init_from"):
        HELPERS.run_config(setup["corpus"], tmp_path / "a", *DPO, f"data.prefixes=[{setup['pairs']}]")
    with pytest.raises(ConfigError, match="train.reference_from=.*nowhere does not exist"):
        Trainer(dpo_config(setup, tmp_path / "b", f"train.reference_from={tmp_path / 'nowhere'}"))
    reward = LanguageModel(ModelConfig(**MODEL, head="reward"), seed=1)
    folder = save_model(reward, tmp_path / "rm")
    with pytest.raises(ConfigError, match="is a reward model \\(model.head=reward\\); DPO's reference must be a "
                                          "language model"):
        Trainer(dpo_config(setup, tmp_path / "c", f"train.reference_from={folder}"))
    with pytest.raises(ConfigError, match="train.objective=dpo needs a store of pairs, but .*rated holds scores"):
        Trainer(HELPERS.run_config(setup["corpus"], tmp_path / "d", *DPO, f"data.prefixes=[{setup['rated']}]",
                                   f"train.init_from={setup['sft']}"))
    with pytest.raises(ConfigError, match="train.objective=dpo does not support parallel.ep=2 yet"):
        dpo_config(setup, tmp_path / "e", "parallel.ep=2")
    with pytest.raises(ConfigError, match="train.dpo_beta=0.0 must be > 0"):
        dpo_config(setup, tmp_path / "f", "train.dpo_beta=0")


def test_the_memory_estimate_counts_the_reference_and_two_rows_per_pair(setup, tmp_path):
    from meshlm.parallel.mesh import ParallelContext
    from meshlm.precision.device_defaults import resolve_precision
    from meshlm.training.memory_estimate import activation_items, frozen_items

    config = dpo_config(setup, tmp_path / "run", f"train.reference_from={setup['other']}", "train.eval_every=0")
    trainer = Trainer(config)
    resolved = dataclasses.replace(config, precision=resolve_precision(config.precision, torch.device("cpu")))
    reference_bytes = sum(param.numel() * param.element_size() for param in trainer.preference.reference.parameters())
    assert frozen_items(resolved, ParallelContext()) == {"reference weights": reference_bytes}
    as_lm = dataclasses.replace(resolved, train=dataclasses.replace(resolved.train, objective="lm"))
    pairs, rows = activation_items(resolved, ParallelContext()), activation_items(as_lm, ParallelContext())
    assert pairs["blocks *"] == 2 * rows["blocks *"]  # a micro-batch of B pairs is 2B rows
    assert trainer.memory.frozen == reference_bytes
