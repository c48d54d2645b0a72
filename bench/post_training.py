"""Post-training on a CPU in minutes: pretrain -> SFT -> GRPO, held-out accuracy after each stage.

    python -m bench.post_training [--task answer|worked] [--init MODEL_DIR] [--pretrain-steps N]
                                  [--sft-steps N] [--rl-steps N] [--digits D] [--operations +-]
                                  [--held-out N] [--pass-at K] [--out FILE]

    python -m bench.post_training --task worked --digits 2 --operations + --held-out 256 \
        --max-new-tokens 40 --pretrain-steps 0 --sft-steps 550 --sft-schedule constant \
        --rl-steps 30 --rl-lr 5e-5 --pass-at 8          RL with verifiable rewards, measurably

The recipe of the seed models' post-training at toy scale, with meshlm's own commands:

1. **Data.** The arithmetic environment of ``meshlm rl`` (``meshlm/rl/environments.py``) with the
   bench's seed gives (a) a plain-text pretraining corpus: facts ("7 + 5 = 12") drawn from every
   question, as a pretraining corpus states facts, mixed with worked questions ("What is 3 + 4?
   3 + 4 = 7") from its training stream only (never a held-out question); and (b) from the
   training stream, a synthetic instruction set of conversations (user: "What is 7 + 5?",
   assistant: "7 + 5 = 12": the question restated as the facts are written, then the answer) for
   SFT. The held-out questions are never asked in SFT or RL: what
   is measured is how well each stage turns what pretraining saw into answers to new questions.
   With ``--task worked`` every reply writes the column sums first ("47 + 38 = 7+8=15 4+3+1=8
   so 85"; ``worked``), and the pretraining facts come from the training stream too.
   The tokenizer is written here, offline: one token per character (digits stay separate, which
   is what arithmetic needs), plus the chat markers of meshlm's default template.
2. **Pretraining** (``meshlm preprocess`` + ``meshlm train``) of a small attention/MLP model on the
   facts; or ``--init DIR``: start from that model folder instead (its tokenizer must be this one's);
   or ``--pretrain-steps 0``: SFT starts from a random init.
3. **SFT** (``meshlm preprocess --chat`` + ``meshlm train train.init_from=...``): the loss on the
   assistant's tokens only.
4. **RL** (``meshlm rl``): GRPO on the environment's training prompts, rewards 1 for the right
   final number, from the SFT checkpoint, with the k3 KL to it.

After each stage the same held-out prompts are answered greedily (``meshlm rl --eval-only``): the
pretrained model (asked in the chat format it has never seen), the SFT model, the RL model, each
with its binomial standard error; ``--pass-at K`` also samples K replies per held-out prompt after
SFT and after RL (at rl.temperature): the sampled pass@1 and pass@K.

**When RL helps.** RL with verifiable rewards sharpens a skill the model already has in part: it
raises pass@1 toward pass@k (DeepSeek-R1 2025, §2.2; Llama-Nemotron 2025, §5). With one-digit
answers recalled whole (``--task answer``) there is little to sharpen and the gain is within noise;
two-digit sums written column by column, after an SFT stopped early (``--sft-schedule constant``,
550 steps; seed 1234: 43% right greedily, 73% within 8 samples), give GRPO room: 30 steps raise
held-out greedy accuracy to 77% (256 prompts, standard error 3 points). Where SFT stops matters:
the carry is learnt abruptly around 400-600 steps, and seed 7 is already at 78% after 550. A short table goes to stderr, one JSON object to stdout (and ``--out``).
Everything runs in a temporary folder (``--keep DIR`` keeps it there).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch



def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=TASKS, default="answer",
                        help="answer: the reply is 'a + b = c'; worked: the reply writes the column sums first")
    parser.add_argument("--init", metavar="DIR", help="skip pretraining: start SFT from this model folder")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="0: SFT starts from a random init")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-examples", type=int, default=4000, help="conversations in the SFT set")
    parser.add_argument("--sft-schedule", choices=("cosine", "constant"), default="cosine",
                        help="SFT's optim.schedule; constant (lr 1e-3 throughout) stops SFT early, partway there")
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--rl-lr", type=float, default=2e-5)
    parser.add_argument("--rl-prompts", type=int, default=16, help="rl.prompts_per_step")
    parser.add_argument("--group-size", type=int, default=8, help="rl.group_size")
    parser.add_argument("--kl", type=float, default=0.04, help="rl.kl_coeff")
    parser.add_argument("--epochs", type=int, default=2, help="rl.epochs")
    parser.add_argument("--temperature", type=float, default=1.0, help="rl.temperature (rollouts and pass@k)")
    parser.add_argument("--pass-at", type=int, default=0, metavar="K",
                        help="also measure sampled pass@1 and pass@K on the held-out prompts after SFT and RL")
    parser.add_argument("--digits", type=int, default=1, help="operands of 1 to D digits (rl.digits)")
    parser.add_argument("--operations", default="+-", help="rl.operations")
    parser.add_argument("--held-out", type=int, default=48, help="held-out prompts (rl.eval_prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=12, help="rl.max_new_tokens")
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--pattern", default="*-*-*-")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary folder)")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON here")
    return parser.parse_args(argv)


def common_overrides(args) -> list[str]:
    """What every stage shares: the model, the seed (which fixes the held-out questions), the environment."""
    return ["model.vocab_size=64", f"model.hidden_size={args.hidden}", f"model.pattern={args.pattern}",
            "model.num_attention_heads=4", f"model.ffn_hidden_size={4 * args.hidden}", f"train.seed={args.seed}",
            "train.device=cpu", "precision.dtype=fp32", "train.progress=false", "train.tensorboard=false",
            "train.plot=false", "train.seq_len=64", "rl.env=arithmetic", f"rl.digits={args.digits}",
            f"rl.operations={args.operations}", f"rl.eval_prompts={args.held_out}",
            f"rl.max_new_tokens={args.max_new_tokens}", f"rl.temperature={args.temperature}"]


def operands(record: dict) -> tuple[int, str, int]:
    """"What is 47 + 38?" -> (47, '+', 38)."""
    a, operation, b = record["prompt"].removeprefix("What is ").removesuffix("?").split(" ")
    return int(a), operation, int(b)


def fact(record: dict) -> str:
    """"What is 7 + 5?" -> "7 + 5 = 12": a pretraining line, and the SFT reply (the sum restated, then answered)."""
    a, operation, b = operands(record)
    return f"{a} {operation} {b} = {record['answer']}"


def worked(record: dict) -> str:
    """"What is 47 + 38?" -> "47 + 38 = 7+8=15 4+3+1=8 so 85": the sum restated, each column's sum
    from the units up with the carry it receives, then the answer (the last number, which the
    reward reads). Writing the steps out lets a small model compute what it cannot recall, as a
    chain of thought does (Wei et al. 2022; Nye et al. 2021, "scratchpads")."""
    a, operation, b = operands(record)
    if operation != "+":
        raise SystemExit("--task worked writes column sums: use --operations +")
    steps, carry, column = [], 0, 0
    while a // 10 ** column or b // 10 ** column or column == 0:
        digit_a, digit_b = a // 10 ** column % 10, b // 10 ** column % 10
        total = digit_a + digit_b + carry
        steps.append(f"{digit_a}+{digit_b}" + ("+1" if carry else "") + f"={total}")
        carry, column = total // 10, column + 1
    return f"{a} + {b} = {' '.join(steps)} so {record['answer']}"


TASKS = {"answer": fact, "worked": worked}
"""--task -> the reply (and pretraining line) written for a record."""


def write_data(args, work: Path) -> tuple[Path, Path]:
    """(facts.jsonl for pretraining, chats.jsonl for SFT) from the environment's training stream."""
    from meshlm.config import load_run_config
    from meshlm.rl.environments import build_environment

    config = load_run_config(None, common_overrides(args))
    environment = build_environment(config.rl, config.train.seed)
    reply = TASKS[args.task]
    facts, chats = work / "facts.jsonl", work / "chats.jsonl"
    with facts.open("w") as file:
        for document in range(2000):  # 4 facts of any question, 4 worked questions of the training stream
            facts_ = [reply(environment.draw(random.Random(f"facts:{document}:{line}"))) for line in range(4)] \
                if args.task == "answer" else [reply(environment.train_record(100_000 + 4 * document + line))
                                               for line in range(4)]  # worked answers of held-out sums: never
            asked = [f"{record['prompt']} {reply(record)}"
                     for record in (environment.train_record(10_000 + 4 * document + line) for line in range(4))]
            file.write(json.dumps({"text": "\n".join(facts_ + asked)}) + "\n")
    with chats.open("w") as file:  # the first records of the training stream (RL draws from it too)
        for record in (environment.train_record(index) for index in range(args.sft_examples)):
            file.write(json.dumps({"messages": [{"role": "user", "content": record["prompt"]},
                                                {"role": "assistant", "content": reply(record)}]}) + "\n")
    return facts, chats


def meshlm(*argv: str) -> str:
    """Run a `meshlm` command in this process; its stdout (stderr passes through)."""
    from meshlm.cli import main

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        status = main(list(argv))
    if status != 0:
        raise SystemExit(f"meshlm {' '.join(argv)} exited with status {status}")
    return captured.getvalue()


def accuracy(args, model_dir: Path, tokenizer: Path, work: Path, name: str, pass_at: int = 0) -> dict:
    """`meshlm rl --eval-only` on the held-out prompts: the model at ``model_dir``, greedy (and with
    ``pass_at`` > 0, the sampled pass@1 and pass@k), plus the binomial standard error of the accuracy."""
    output = meshlm("rl", *common_overrides(args), f"train.init_from={model_dir}", f"data.tokenizer={tokenizer}",
                    "data.blend=null", f"train.run_dir={work / ('eval-' + name)}", "rl.kl_coeff=0",
                    "train.micro_batch_size=4", "--eval-only", *(["--pass-at", str(pass_at)] if pass_at else []))
    report = json.loads(output.strip().splitlines()[-1])
    return report | {"standard_error": standard_error(report["accuracy"], report["prompts"])}


def standard_error(accuracy: float, prompts: int) -> float:
    """sqrt(p (1 - p) / n): the binomial standard error of an accuracy measured on n prompts."""
    return math.sqrt(accuracy * (1 - accuracy) / prompts)


def pretrain(args, work: Path, tokenizer: Path, facts: Path) -> Path | None:
    """The pretrained model folder: ``--init``, else ``meshlm train`` on the facts (None: --pretrain-steps 0)."""
    if args.init is not None:
        return Path(args.init)
    if args.pretrain_steps == 0:
        return None
    meshlm("preprocess", "--input", str(facts), "--tokenizer", str(tokenizer), "--out", str(work / "facts"),
           "--append-eos", "--no-progress")
    meshlm("train", *common_overrides(args), f"data.prefixes=[{work / 'facts'}]", "data.blend=null",
           "data.split=99,1,0", f"train.run_dir={work / 'pretrain'}", f"train.steps={args.pretrain_steps}",
           "train.micro_batch_size=16", "train.global_batch_size=16", "train.eval_every=0", "train.log_every=100",
           f"train.save_every={args.pretrain_steps}", "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=30",
           "optim.weight_decay=0.0")
    return work / "pretrain" / "checkpoints" / f"step_{args.pretrain_steps}"


def supervised_fine_tuning(args, work: Path, tokenizer: Path, chats: Path, pretrained: Path | None) -> Path:
    """``meshlm train`` on the chat store (loss on the replies), from ``pretrained`` or a random init."""
    meshlm("preprocess", "--chat", "--input", str(chats), "--tokenizer", str(tokenizer), "--out", str(work / "sft"),
           "--max-vocab-size", "64", "--no-progress")
    start = [f"train.init_from={pretrained}"] if pretrained is not None else []
    meshlm("train", *common_overrides(args), f"data.prefixes=[{work / 'sft'}]", "data.blend=null",
           "data.split=99,1,0", *start, f"train.run_dir={work / 'sft-run'}", f"train.steps={args.sft_steps}",
           "train.micro_batch_size=16", "train.global_batch_size=16", "train.eval_every=0", "train.log_every=50",
           f"train.save_every={args.sft_steps}", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=10",
           "optim.weight_decay=0.0", f"optim.schedule={args.sft_schedule}")
    return work / "sft-run" / "checkpoints" / f"step_{args.sft_steps}"


def reinforcement_learning(args, work: Path, sft: Path) -> tuple[Path, list[dict]]:
    """``meshlm rl`` (GRPO) from the SFT model; (the RL model, its metrics.jsonl step records)."""
    meshlm("rl", *common_overrides(args), f"train.init_from={sft}", "data.blend=null",
           f"train.run_dir={work / 'rl-run'}", f"train.steps={args.rl_steps}", "train.micro_batch_size=32",
           "train.log_every=1", "train.eval_every=0", f"train.save_every={args.rl_steps}", f"optim.lr={args.rl_lr}",
           f"optim.min_lr={args.rl_lr}", "optim.schedule=constant", "optim.warmup_steps=5", "optim.weight_decay=0.0",
           f"rl.group_size={args.group_size}", f"rl.prompts_per_step={args.rl_prompts}", f"rl.kl_coeff={args.kl}",
           f"rl.epochs={args.epochs}")
    from meshlm.training.metrics import read_metrics

    metrics = read_metrics(work / "rl-run" / "metrics.jsonl")
    return work / "rl-run" / "checkpoints" / f"step_{args.rl_steps}", [r for r in metrics if "reward_mean" in r]


def main(argv=None) -> dict:
    from tests.helpers.chat_tokenizers import write_char_tokenizer

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="meshlm_post_training_"))
    work.mkdir(parents=True, exist_ok=True)
    started, seconds, evaluations = time.perf_counter(), {}, {}
    try:
        tokenizer = write_char_tokenizer(work / "tokenizer")
        facts, chats = write_data(args, work)
        clock = time.perf_counter()
        pretrained = pretrain(args, work, tokenizer, facts)
        seconds["pretrain"] = time.perf_counter() - clock
        if pretrained is not None:
            evaluations["pretrained"] = accuracy(args, pretrained, tokenizer, work, "pretrained")
        clock = time.perf_counter()
        sft = supervised_fine_tuning(args, work, tokenizer, chats, pretrained)
        seconds["sft"] = time.perf_counter() - clock
        evaluations["sft"] = accuracy(args, sft, tokenizer, work, "sft", args.pass_at)
        clock = time.perf_counter()
        rl_model, steps = reinforcement_learning(args, work, sft)
        seconds["rl"] = time.perf_counter() - clock
        evaluations["rl"] = accuracy(args, rl_model, tokenizer, work, "rl", args.pass_at)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report = summary(args, evaluations, steps, seconds, time.perf_counter() - started)
    stages = report["accuracy"]
    print(f"held-out accuracy ({report['held_out_prompts']} prompts, greedy): "
          + ", ".join(f"{name} {value:.1%}" for name, value in stages.items())
          + f"; RL - SFT {report['rl_gain']:+.1%} +- {report['rl_gain_standard_error']:.1%}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


def summary(args, evaluations: dict, steps: list[dict], seconds: dict, total_seconds: float) -> dict:
    """The bench's JSON: accuracy after each stage with its standard error, RL's gain, the reward per step."""
    stages = {name: report["accuracy"] for name, report in evaluations.items()}
    sft, rl = evaluations["sft"], evaluations["rl"]
    gain_error = math.hypot(sft["standard_error"], rl["standard_error"])  # two measurements, unpaired: conservative
    sampled = {name: {key: value for key, value in report.items() if key.startswith(("sampled_", "pass_at_"))}
               for name, report in evaluations.items() if "samples" in report}
    return {
        "task": f"{args.task}: held-out '{args.operations}' questions, operands of 1-{args.digits} digits",
        "seed": args.seed, "held_out_prompts": sft["prompts"], "accuracy": stages,
        "correct": {name: report["correct"] for name, report in evaluations.items()},
        "standard_error": {name: round(report["standard_error"], 4) for name, report in evaluations.items()},
        "rl_gain": rl["accuracy"] - sft["accuracy"], "rl_gain_standard_error": gain_error,
        "rl_gain_beyond_2_standard_errors": rl["accuracy"] - sft["accuracy"] > 2 * gain_error,
        "each_stage_improves": all(a < b for a, b in zip(list(stages.values()), list(stages.values())[1:])),
        "sampled": sampled,
        "rl_reward_per_step": [round(record["reward_mean"], 4) for record in steps],
        "rl_kl_per_step": [round(record["kl"], 5) for record in steps],
        "rl_reward_first_10_steps": sum(r["reward_mean"] for r in steps[:10]) / max(len(steps[:10]), 1),
        "rl_reward_last_10_steps": sum(r["reward_mean"] for r in steps[-10:]) / max(len(steps[-10:]), 1),
        "steps": {"pretrain": 0 if args.init else args.pretrain_steps, "sft": args.sft_steps, "rl": args.rl_steps},
        "sft_schedule": args.sft_schedule,
        "rl": {"lr": args.rl_lr, "prompts_per_step": args.rl_prompts, "group_size": args.group_size,
               "kl_coeff": args.kl, "epochs": args.epochs, "temperature": args.temperature},
        "seconds": {name: round(value, 1) for name, value in seconds.items()},
        "total_seconds": round(total_seconds, 1), "threads": args.threads,
    }


if __name__ == "__main__":
    main()
