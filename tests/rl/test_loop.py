"""meshlm/rl/loop.py end to end on a tiny model: the reward rises, logs, resume, DP = one process, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.model_files import load_model
from meshlm.cli import main
from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.rl.loop import GRPOTrainer
from meshlm.training.metrics import read_metrics
from tests.helpers.distributed import run_distributed
from tests.rl.conftest import rl_overrides

SEVENS = "train.reward_fn=tests.rl.rewards:sevens"
STEP_KEYS = {"loss", "lr", "grad_norm", "reward_mean", "reward_std", "accuracy", "completion_length",
             "clip_fraction", "kl"}


def run_once(policy: str, run_dir: str, extra: list[str]) -> dict:
    """Train (or resume) an RL run; its step records, held-out accuracies and parameters."""
    torch.set_num_threads(1)
    trainer = GRPOTrainer(load_run_config(None, rl_overrides(Path(policy), Path(run_dir), *extra)))
    result = trainer.run()
    records = []
    if trainer.context.is_logging_rank:
        records = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "reward_mean" in r]
    return {"losses": result.losses, "records": records, "accuracies": trainer.eval_accuracies,
            "params": {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}}


def test_grpo_raises_the_reward_and_logs_every_term(policy_folder, tmp_path):
    run = run_once(str(policy_folder), str(tmp_path / "run"),
                   [SEVENS, "train.steps=16", "rl.group_size=8", "rl.epochs=2", "rl.kl_coeff=0.02",
                    "train.micro_batch_size=8", "optim.lr=3e-2", "train.eval_every=16", "train.save_every=0"])
    records = run["records"]
    assert [r["step"] for r in records] == list(range(1, 17))
    assert all(STEP_KEYS <= set(r) for r in records)
    rewards = [r["reward_mean"] for r in records]
    assert sum(rewards[-4:]) / 4 > 2 * sum(rewards[:4]) / 4 + 0.05, rewards
    assert any(r["clip_fraction"] > 0 for r in records)  # the second epoch moves ratios past the clip
    assert all(r["kl"] >= 0 for r in records) and records[-1]["kl"] > 0
    assert all(0 < r["completion_length"] <= 6 for r in records)
    assert set(run["accuracies"]) == {0, 16}  # held-out accuracy at the start and the end


def assert_same_run(one: dict, other: dict, tolerance: float) -> None:
    assert one["losses"].keys() == other["losses"].keys()
    for step in one["losses"]:
        assert one["losses"][step] == pytest.approx(other["losses"][step], rel=tolerance, abs=tolerance)
    for mine, theirs in zip(one["records"], other["records"]):
        for key in ("reward_mean", "reward_std", "completion_length", "clip_fraction", "kl"):
            assert mine[key] == pytest.approx(theirs[key], rel=tolerance, abs=tolerance), (mine["step"], key)
    for name, value in one["params"].items():
        assert torch.allclose(value, other["params"][name], rtol=tolerance, atol=tolerance), name


RUN = [SEVENS, "train.steps=4", "rl.prompts_per_step=4", "rl.epochs=2", "rl.kl_coeff=0.05", "train.micro_batch_size=2",
       "train.save_every=2"]


def test_a_resumed_run_equals_the_uninterrupted_one(policy_folder, tmp_path):
    straight = run_once(str(policy_folder), str(tmp_path / "straight"), RUN)
    first = run_once(str(policy_folder), str(tmp_path / "resumed"), [*RUN, "train.steps=2"])
    resumed = run_once(str(policy_folder), str(tmp_path / "resumed"), RUN)
    assert set(first["losses"]) == {1, 2} and set(resumed["losses"]) == {3, 4}
    resumed["losses"] = {**first["losses"], **resumed["losses"]}
    resumed["records"] = [r for r in resumed["records"]]  # metrics.jsonl holds both parts
    assert [r["step"] for r in resumed["records"]] == [1, 2, 3, 4]
    assert_same_run(straight, resumed, 1e-6)


def dp_runs(policy: str, root: str, runs: list[tuple[str, list[str]]]) -> dict:
    return {name: run_once(policy, str(Path(root) / name), extra) for name, extra in runs}


def test_data_parallel_equals_one_process(policy_folder, tmp_path):
    """dp=2 (plain, ZeRO-1, with token averaging, and on a prompt file) on gloo: each rank samples 2
    of the 4 prompts' groups; fp32, the same losses, rewards, KL, clip fractions and weights as one
    process sampling all 4."""
    token = [*RUN, "rl.loss_averaging=token"]  # DAPO's mean: the token count is the step's, over both ranks
    prompts = [*RUN, "rl.env=prompts", f"rl.prompts={write_questions(tmp_path / 'questions.jsonl', 30)}"]
    single = {"dp2": run_once(str(policy_folder), str(tmp_path / "single"), RUN),
              "token": run_once(str(policy_folder), str(tmp_path / "single_token"), token),
              "prompts": run_once(str(policy_folder), str(tmp_path / "single_prompts"), prompts)}
    single["zero1"] = single["dp2"]
    runs = [("dp2", RUN), ("zero1", [*RUN, "parallel.zero_stage=1"]), ("token", token), ("prompts", prompts)]
    results = run_distributed(dp_runs, 2, str(policy_folder), str(tmp_path), runs, timeout_s=300)
    assert single["token"]["losses"] != single["dp2"]["losses"]
    assert single["prompts"]["losses"] != single["dp2"]["losses"]  # other prompts, other rollouts
    for name, _ in runs:
        assert_same_run(single[name], results[0][name], 1e-5)
        for rank in (0, 1):  # every rank ends with the same weights
            for key, value in results[rank][name]["params"].items():
                assert torch.equal(value, results[0][name]["params"][key]), (name, rank, key)


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=2", "parallel.tp=2: meshlm rl generates its rollouts with the whole model"),
    ("parallel.pp=2", "parallel.pp=2: meshlm rl"),
    ("parallel.cp=2", "parallel.cp=2: meshlm rl"),
    ("parallel.zero_stage=3", "parallel.zero_stage=3 shards the parameters"),
    ("rl.group_size=3", r"train.micro_batch_size=4 must divide the 6 completions"),
    ("rl.env=chess", "rl.env='chess' is not a built-in environment"),
    ("train.reward_fn=tests.rl.rewards:missing", "has no function 'missing'"),
])
def test_layouts_and_settings_rl_cannot_run_are_refused_at_start_up(make_rl_config, override, message):
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(make_rl_config(override))


def test_a_kl_penalty_without_a_reference_is_refused(policy_folder, make_rl_config):
    config = make_rl_config("train.init_from=null", f"data.tokenizer={policy_folder / 'tokenizer.json'}")
    with pytest.raises(ConfigError, match="rl.kl_coeff > 0 needs a reference model"):
        GRPOTrainer(config)


def test_cli_eval_only_and_training(policy_folder, tmp_path, capsys):
    overrides = rl_overrides(policy_folder, tmp_path / "run", "train.global_batch_size=3")
    assert main(["rl", *overrides, "--env", "arithmetic", "--eval-only"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["prompts"] == 8 and report["step"] == 0 and 0 <= report["accuracy"] <= 1
    assert main(["rl", *overrides, "train.steps=1", "train.save_every=1"]) == 0
    assert "meshlm rl: done: step 1/1" in capsys.readouterr().out
    assert main(["rl", *overrides, "rl.group_size=1"]) == 2
    assert "rl.group_size=1 must be >= 2" in capsys.readouterr().err


def test_a_finished_run_trains_nothing_and_says_so(policy_folder, tmp_path, capsys):
    from meshlm.config import save_run_config
    from meshlm.rl.cli import load_rl_config

    config_file = tmp_path / "rl.yaml"
    save_run_config(load_rl_config(None, rl_overrides(policy_folder, tmp_path / "run", "train.steps=1",
                                                      "train.save_every=1")), config_file)
    assert main(["rl", str(config_file)]) == 0
    capsys.readouterr()
    assert main(["rl", str(config_file)]) == 0
    assert "meshlm rl: the run in" in capsys.readouterr().out


def test_the_progress_line_shows_reward_accuracy_and_length():
    from meshlm.rl.progress import rl_progress_text

    record = {"step": 3, "loss": -0.01, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.01, "reward_mean": 0.625,
              "accuracy": 0.5, "completion_length": 4.25}
    text = rl_progress_text(record, 10, 12.0)
    assert text.startswith("step 3/10 | loss -0.010 | reward 0.625 | acc 50.0% | len 4.2 | lr 1.0e-03")


def test_the_memory_estimate_counts_the_kl_reference(make_rl_config):
    with_reference, without = GRPOTrainer(make_rl_config()), GRPOTrainer(make_rl_config("rl.kl_coeff=0"))
    reference_bytes = sum(param.numel() * param.element_size() for param in with_reference.reference.parameters())
    assert with_reference.memory.frozen == reference_bytes and without.memory.frozen == 0


def write_questions(path: Path, count: int, answers: bool = True) -> Path:
    lines = [{"prompt": f"What is {index} + 1?", **({"answer": index + 1} if answers else {"n": index})}
             for index in range(count)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_rl_on_a_prompt_file_trains_on_its_records_and_holds_some_out(policy_folder, tmp_path, capsys):
    prompts = write_questions(tmp_path / "questions.jsonl", 30)
    overrides = rl_overrides(policy_folder, tmp_path / "run", "train.eval_every=2")
    assert main(["rl", *overrides, "--prompts", str(prompts)]) == 0
    assert "meshlm rl: done: step 2/2, held-out accuracy" in capsys.readouterr().out
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evaluations = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 2] and all(r["eval_prompts"] == 8 for r in evaluations)
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2]
    trainer = GRPOTrainer(load_run_config(None, [*overrides, "rl.env=prompts", f"rl.prompts={prompts}",
                                                 "train.run_dir=" + str(tmp_path / "other")]))
    file_prompts = {json.loads(line)["prompt"] for line in prompts.read_text().splitlines()}
    rollouts = trainer.collect_rollouts()
    assert [record["prompt"] for record in rollouts.records] == [trainer.environment.train_record(i)["prompt"]
                                                                 for i in range(2)]
    assert {record["prompt"] for record in rollouts.records} <= file_prompts
    held_out = {record["prompt"] for record in trainer.environment.held_out}
    assert len(held_out) == 8 and held_out <= file_prompts and not held_out & {r["prompt"] for r in rollouts.records}
    assert rollouts.rewards.shape == (2, 4) and set(rollouts.rewards.flatten().tolist()) <= {0.0, 1.0}


def test_without_answers_a_reward_of_one_counts_as_solved(policy_folder, tmp_path, make_rl_config):
    prompts = write_questions(tmp_path / "open.jsonl", 20, answers=False)
    with pytest.raises(ConfigError, match=r"open\.jsonl, line 1: no 'answer'; without train.reward_fn"):
        GRPOTrainer(make_rl_config("rl.env=prompts", f"rl.prompts={prompts}"))
    trainer = GRPOTrainer(make_rl_config("rl.env=prompts", f"rl.prompts={prompts}", SEVENS))
    record = trainer.environment.held_out[0]
    assert trainer.is_correct(record, "7777") and not trainer.is_correct(record, "7717")
    assert trainer.is_correct(record, "1", reward=1.0)  # a reward already computed is not recomputed


def test_a_prompt_too_long_for_the_window_is_refused_at_start_up_by_its_line(policy_folder, tmp_path, make_rl_config):
    prompts = write_questions(tmp_path / "q.jsonl", 20)
    with prompts.open("a") as handle:
        handle.write(json.dumps({"prompt": "What is " + "1 + " * 20 + "1?", "answer": 21}) + "\n")
    with pytest.raises(ConfigError, match=r"q\.jsonl, line 21: the prompt is \d+ tokens with the chat template, and "
                                          r"with rl.max_new_tokens=6 needs train.seq_len >= \d+ \(it is 64\)"):
        GRPOTrainer(make_rl_config("rl.env=prompts", f"rl.prompts={prompts}"))


def test_prompts_and_another_env_on_the_command_line_are_refused(policy_folder, tmp_path, capsys):
    overrides = rl_overrides(policy_folder, tmp_path / "run")
    assert main(["rl", *overrides, "--env", "arithmetic", "--prompts", "q.jsonl"]) == 2
    assert "--prompts q.jsonl trains on a prompt file, which is rl.env=prompts, not --env arithmetic" in \
        capsys.readouterr().err


def test_prompts_render_with_their_system_turn_or_context(policy_folder, tmp_path, make_rl_config):
    from meshlm.inference.chat import chat_messages, conversation_prompt

    trainer = GRPOTrainer(make_rl_config("rl.system=Be brief."))
    tokenizer = trainer.tokenizer
    record = {"prompt": "What is 1 + 2?", "answer": 3}
    assert trainer.encode_prompt(record) == conversation_prompt(tokenizer, chat_messages("What is 1 + 2?", "Be brief."))
    own = {**record, "system": "Think."}  # a record's own system turn wins
    assert trainer.encode_prompt(own) == conversation_prompt(tokenizer, chat_messages("What is 1 + 2?", "Think."))
    context = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"},
               {"role": "user", "content": "What is 1 + 2?"}]
    assert trainer.encode_prompt({**record, "messages": context}) == conversation_prompt(tokenizer, context)
    plain = GRPOTrainer(make_rl_config("train.run_dir=" + str(tmp_path / "plain")))
    assert plain.encode_prompt(record) == conversation_prompt(tokenizer, chat_messages("What is 1 + 2?"))


def test_grpo_with_lora_adapters_trains_only_them(policy_folder, tmp_path):
    """LoRA on the policy's folder (the KL reference: the folder's model, its adapters fresh): the
    adapters train, every other weight stays the folder's. (On this random tiny policy the reward
    rises with full fine-tuning, which moves the embedding and the head, not with adapters on the blocks.)"""
    run = run_once(str(policy_folder), str(tmp_path / "run"),
                   [SEVENS, "train.steps=3", "rl.group_size=8", "rl.kl_coeff=0.02", "train.micro_batch_size=8",
                    "train.save_every=0", "model.lora_rank=8", "model.lora_alpha=16"])
    assert [r["step"] for r in run["records"]] == [1, 2, 3] and all(r["kl"] >= 0 for r in run["records"])
    folder = load_model(policy_folder).state_dict()
    adapters = {name for name in run["params"] if ".lora." in name}
    assert adapters and set(run["params"]) - adapters == set(folder)
    assert all(run["params"][name].abs().max() > 0 for name in adapters if name.endswith(".lora.b"))
    for name, value in folder.items():
        assert torch.equal(run["params"][name], value), name
