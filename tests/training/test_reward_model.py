"""Reward models (``model.head=reward``, ``train.objective=reward``) through the real trainer.

- The Bradley-Terry and attribute-MSE losses equal hand computations on tiny tensors, and a
  micro-batch's loss equals the one computed by hand from each unpadded conversation alone.
- A reward model trained on a separable preference set ranks > 95% of held-out pairs right,
  measured by ``meshlm score --json``; an attribute model's MSE falls and ``meshlm score`` reports it.
- Started from a language model's folder, the backbone is the folder's and the head fresh.
- tp2 (+SP) and dp2 with the distributed optimizer equal one process (losses, gradient norms,
  validation loss, parameters), on 2 spawned gloo ranks.
- Mismatched objective, head, store and layout are refused in one sentence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.model_files import save_model
from meshlm.cli import main
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.models.reward_head import last_token_rewards
from meshlm.training.metrics import read_metrics
from meshlm.training.preference import attribute_mse, bradley_terry_loss
from meshlm.training.trainer import Trainer
from tests.helpers.distributed import import_test_file, run_distributed
from tests.helpers.preference_data import rated_replies, separable_pairs, write_jsonl, write_store
from tests.helpers.tiny_training import relative_error

HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
REWARD = ["model.vocab_size=128", "model.head=reward", "train.objective=reward", "data.blend=null",
          "data.split=80,20,0", "model.pattern=*-*-", "model.num_kv_heads=2"]


@pytest.fixture(scope="module")
def stores(corpus_blend, tmp_path_factory):
    root, tokenizer = tmp_path_factory.mktemp("preferences"), corpus_blend.parent / "tokenizer.json"
    return {"pairs": write_store(root, separable_pairs(60, seed=0), tokenizer, "pairs"),
            "rated": write_store(root, rated_replies(60, seed=1), tokenizer, "rated"),
            "held_out": write_jsonl(root / "held_out.jsonl", separable_pairs(40, seed=99)),
            "held_out_rated": write_jsonl(root / "held_out_rated.jsonl", rated_replies(20, seed=98)),
            "corpus": corpus_blend}


def reward_config(stores, run_dir: Path, *overrides: str, store: str = "pairs"):
    return HELPERS.run_config(stores["corpus"], run_dir, *REWARD, f"data.prefixes=[{stores[store]}]", *overrides)


# --- the losses by hand ------------------------------------------------------------------------------

def test_bradley_terry_and_mse_equal_hand_computations():
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    hand = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 3
    assert abs(bradley_terry_loss(chosen, rejected).item() - hand) < 1e-6
    scores = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    ratings = torch.tensor([[2.0, float("nan")], [0.0, 1.0]])
    assert abs(attribute_mse(scores, ratings).item() - (1.0 + 0.25 + 4.0) / 3) < 1e-6


def test_a_micro_batch_s_loss_equals_the_hand_computation_on_each_conversation(stores, tmp_path):
    trainer = Trainer(reward_config(stores, tmp_path / "run", "train.eval_every=0"))
    batch = trainer.next_micro_batches()[0]
    output = trainer.forward_micro_batch(batch)
    model, scores = trainer.model, []
    with torch.no_grad():
        for row in range(batch["input_ids"].shape[0]):  # each conversation alone, unpadded
            length = int(batch["last_index"][row]) + 1
            tokens = batch["input_ids"][row:row + 1, :length]
            context = SequenceContext.for_tokens(tokens)
            hidden = model.run_blocks(model.embed(tokens, context), context)
            scores.append(last_token_rewards(model.reward_head, model.final_norm(hidden), torch.tensor([length - 1]))[0, 0])
    scores = torch.stack(scores)
    hand = torch.stack([-torch.nn.functional.logsigmoid(c - r) for c, r in zip(scores[0::2], scores[1::2])]).mean()
    assert relative_error(output.loss, hand) <= 1e-5
    assert output.losses["reward_accuracy"] == (scores[0::2] > scores[1::2]).float().mean()


def test_an_moe_reward_model_adds_the_router_losses_at_their_coefficients(stores, tmp_path):
    config = reward_config(stores, tmp_path / "moe", *HELPERS.MODELS["moe"], "train.eval_every=0")
    trainer = Trainer(config)
    output = trainer.forward_micro_batch(trainer.next_micro_batches()[0])
    expected = output.losses["bradley_terry"] + 0.01 * output.losses["moe_aux"] + 0.001 * output.losses["moe_z"]
    assert output.losses["moe_aux"] > 0 and relative_error(output.loss, expected) <= 1e-6
    assert len(output.tokens_per_expert) == 1 and int(output.tokens_per_expert[0].sum()) == 2 * 4 * 16  # top-2, 4 rows


# --- training ------------------------------------------------------------------------------------------

def test_a_reward_model_ranks_held_out_separable_pairs(stores, tmp_path, capsys):
    run_dir = tmp_path / "rm"
    Trainer(reward_config(stores, run_dir, "train.steps=20", "optim.lr=3e-3", "train.eval_every=10")).run()
    validations = [record for record in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in record]
    assert [record["step"] for record in validations] == [0, 10, 20]
    assert validations[-1]["val_loss"] < validations[0]["val_loss"] and validations[-1]["val_reward_accuracy"] > 0.95
    capsys.readouterr()
    assert main(["score", str(run_dir), "--input", str(stores["held_out"]), "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["examples"]) == 40 and result["pairwise_accuracy"] > 0.95, result["pairwise_accuracy"]
    assert main(["score", str(run_dir), "--input", str(stores["held_out"]), "--device", "cpu"]) == 0
    assert f"pairwise accuracy: {100 * result['pairwise_accuracy']:.1f}% (" in capsys.readouterr().out


def test_an_attribute_model_learns_its_ratings_and_score_reports_the_error(stores, tmp_path, capsys):
    run_dir = tmp_path / "attributes"
    config = reward_config(stores, run_dir, "train.reward_loss=mse", "model.reward_attributes=[marker,length]",
                           "train.steps=40", "optim.lr=1e-2", "train.eval_every=0", store="rated")
    result = Trainer(config).run()
    losses = list(result.losses.values())
    assert sum(losses[-5:]) / 5 < 0.3 * sum(losses[:5]) / 5, losses
    capsys.readouterr()
    assert main(["score", str(run_dir), "--input", str(stores["held_out_rated"]), "--json", "--device", "cpu"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["kind"] == "scores" and set(scored["mse"]) == {"marker", "length"}
    hand = {name: [] for name in ("marker", "length")}
    for record in scored["examples"]:
        for name, target in record["targets"].items():
            hand[name].append((record["scores"][name] - target) ** 2)
    for name, errors in hand.items():
        assert abs(scored["mse"][name] - sum(errors) / len(errors)) < 1e-9


def test_a_reward_model_starts_from_a_language_model_s_folder(stores, tmp_path):
    lm_config = ModelConfig(vocab_size=128, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                            ffn_hidden_size=64)
    language_model = LanguageModel(lm_config, seed=5)
    folder = save_model(language_model, tmp_path / "sft")
    config = reward_config(stores, tmp_path / "rm", f"train.init_from={folder}", "train.eval_every=0")
    state = Trainer(config).model.state_dict()
    for name, value in language_model.state_dict().items():  # the backbone: the folder's
        if name != "output.weight":
            assert torch.equal(state[name], value), name
    fresh = LanguageModel(config.model, seed=config.train.seed)  # the head: a new run's initial value
    assert set(state) == set(fresh.state_dict()) and torch.equal(state["reward_head.weight"], fresh.reward_head.weight)
    shaped = reward_config(stores, tmp_path / "rm3", f"train.init_from={folder}", "train.init_model_config=true",
                           "model.hidden_size=64", "train.eval_every=0")  # the shape from the folder, the head kept
    assert torch.equal(Trainer(shaped).model.state_dict()["blocks.0.mixer.q_proj.weight"],
                       language_model.state_dict()["blocks.0.mixer.q_proj.weight"])
    with pytest.raises(Exception, match="holds a different model.*model.hidden_size"):
        Trainer(reward_config(stores, tmp_path / "rm2", f"train.init_from={folder}", "model.hidden_size=64",
                              "model.num_attention_heads=4"))


def test_a_lora_reward_model_trains_its_adapters_and_new_head_only(stores, tmp_path):
    """LoRA on a language model's folder, with the init_model_config shape: the backbone's weights
    stay the folder's, the adapters start fresh and the reward head trains with them."""
    lm_config = ModelConfig(vocab_size=128, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                            ffn_hidden_size=64)
    language_model = LanguageModel(lm_config, seed=5)
    folder = save_model(language_model, tmp_path / "sft")
    config = reward_config(stores, tmp_path / "rm", f"train.init_from={folder}", "train.init_model_config=true",
                           "model.lora_rank=4", "train.eval_every=0", "train.steps=3", "optim.lr=1e-2")
    trainer = Trainer(config)
    start = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    assert trainer.config.model.lora_rank == 4 and trainer.num_trainable < trainer.num_parameters / 4
    trainer.run()
    changed = {name for name, value in trainer.model.state_dict().items() if not torch.equal(value, start[name])}
    assert "reward_head.weight" in changed and changed - {"reward_head.weight"}
    assert all(".lora." in name for name in changed - {"reward_head.weight"})
    for name, value in language_model.state_dict().items():
        if name != "output.weight":
            assert torch.equal(trainer.model.state_dict()[name], value), name


# --- layouts -------------------------------------------------------------------------------------------

LAYOUTS = [("bt", "tp2", ["parallel.tp=2"]),
           ("bt", "dp2 dist-opt", ["parallel.dp=2", "parallel.distributed_optimizer=true"]),
           ("mse", "tp2 sp", ["parallel.tp=2", "parallel.sp=true"])]


def test_reward_training_at_tp2_sp_and_dp2_equals_one_process(stores, tmp_path):
    runs = {"bt": [*REWARD, f"data.prefixes=[{stores['pairs']}]"],
            "mse": [*REWARD, f"data.prefixes=[{stores['rated']}]", "train.reward_loss=mse",
                    "model.reward_attributes=[length,marker]"]}
    single = {name: HELPERS.train_once(stores["corpus"], tmp_path / f"single {name}", overrides)
              for name, overrides in runs.items()}
    parallel = [(f"{name} {layout}", [*runs[name], *overrides]) for name, layout, overrides in LAYOUTS]
    by_rank = run_distributed(HELPERS.train_runs, 2, str(stores["corpus"]), str(tmp_path), parallel, timeout_s=300)
    for name, layout, _ in LAYOUTS:
        for rank, results in enumerate(by_rank):
            HELPERS.assert_same_run(results[f"{name} {layout}"], single[name], f"{name} {layout} rank {rank}")
    records = [r for r in read_metrics(tmp_path / "bt tp2" / "metrics.jsonl") if "reward_accuracy" in r]
    expected = [r for r in read_metrics(tmp_path / "single bt" / "metrics.jsonl") if "reward_accuracy" in r]
    assert len(records) == 5 and relative_error([r["score_margin"] for r in records],
                                                [r["score_margin"] for r in expected]) <= 1e-5


# --- refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["model.head=lm"], "train.objective=reward trains a reward head; set model.head=reward"),
    (["train.objective=lm"], "model.head=reward has no next-token logits to train with train.objective=lm"),
    (["parallel.pp=2"], "train.objective=reward does not support parallel.pp=2 yet; use tp"),
    (["parallel.cp=2"], "does not support parallel.cp=2"),
    (["model.reward_attributes=[a,b]"], "train.reward_loss=bradley_terry compares one score per reply"),
    (["train.reward_loss=mse"], "train.reward_loss=mse needs a store of scores, but .*pairs holds pairs"),
    (["train.reward_loss=mse", "model.reward_attributes=[marker]", "STORE=rated"],
     r"model.reward_attributes=\['marker'\] but .*rated rates"),
    (["STORE=corpus"], "train.objective=reward reads preference stores, but .* is a plain token store"),
    (["train.objective=lm", "model.head=lm"], "is a preference store \\(pairs\\), which language-model training"),
    (["data.weights=[1.0]"], "data.weights does not apply to preference stores"),
])
def test_mismatched_settings_are_refused_in_one_sentence(stores, tmp_path, overrides, message):
    store = next((item.split("=")[1] for item in overrides if item.startswith("STORE=")), "pairs")
    overrides = [item for item in overrides if not item.startswith("STORE=")]
    prefix = stores[store] if store != "corpus" else stores["corpus"].parent / "corpus"
    with pytest.raises(ConfigError, match=message):
        Trainer(HELPERS.run_config(stores["corpus"], tmp_path / "run", *REWARD, f"data.prefixes=[{prefix}]",
                                   *overrides))
