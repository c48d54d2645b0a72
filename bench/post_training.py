"""Post-training on a CPU in minutes: pretrain -> SFT -> GRPO, held-out accuracy after each stage.

    python -m bench.post_training [--init MODEL_DIR] [--pretrain-steps N] [--sft-steps N]
                                  [--rl-steps N] [--digits D] [--operations +-] [--out FILE]

The recipe of the seed models' post-training at toy scale, with meshlm's own commands:

1. **Data.** The arithmetic environment of ``meshlm rl`` (``meshlm/rl/environments.py``) with the
   bench's seed gives (a) a plain-text pretraining corpus: facts ("7 + 5 = 12") drawn from every
   question, as a pretraining corpus states facts, mixed with worked questions ("What is 3 + 4?
   3 + 4 = 7") from its training stream only (never a held-out question); and (b) from the
   training stream, a synthetic instruction set of conversations (user: "What is 7 + 5?",
   assistant: "7 + 5 = 12": the question restated as the facts are written, then the answer) for
   SFT. The held-out questions are never asked in SFT or RL: what
   is measured is how well each stage turns what pretraining saw into answers to new questions.
   The tokenizer is written here, offline: one token per character (digits stay separate, which
   is what arithmetic needs), plus the chat markers of meshlm's default template.
2. **Pretraining** (``meshlm preprocess`` + ``meshlm train``) of a small attention/MLP model on the
   facts; or ``--init DIR``: start from that model folder instead (its tokenizer must be this one's).
3. **SFT** (``meshlm preprocess --chat`` + ``meshlm train train.init_from=...``): the loss on the
   assistant's tokens only.
4. **RL** (``meshlm rl``): GRPO on the environment's training prompts, rewards 1 for the right
   final number, from the SFT checkpoint, with the k3 KL to it.

After each stage the same held-out prompts are answered greedily (``meshlm rl --eval-only``): the
pretrained model (asked in the chat format it has never seen), the SFT model, the RL model. The
target is that each stage improves accuracy. A short table goes to stderr, one JSON object to
stdout (and ``--out``). Everything runs in a temporary folder (``--keep DIR`` keeps it there).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch



def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", metavar="DIR", help="skip pretraining: start SFT from this model folder")
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--rl-lr", type=float, default=2e-5)
    parser.add_argument("--digits", type=int, default=1, help="operands of 1 to D digits (rl.digits)")
    parser.add_argument("--operations", default="+-", help="rl.operations")
    parser.add_argument("--held-out", type=int, default=48, help="held-out prompts (rl.eval_prompts)")
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
            f"rl.operations={args.operations}", f"rl.eval_prompts={args.held_out}", "rl.max_new_tokens=12"]


def fact(record: dict) -> str:
    """"What is 7 + 5?" -> "7 + 5 = 12": a pretraining line, and the SFT reply (the sum restated, then answered)."""
    return f"{record['prompt'].removeprefix('What is ').removesuffix('?')} = {record['answer']}"


def write_data(args, work: Path) -> tuple[Path, Path]:
    """(facts.jsonl for pretraining, chats.jsonl for SFT) from the environment's training stream."""
    from meshlm.config import load_run_config
    from meshlm.rl.environments import build_environment

    config = load_run_config(None, common_overrides(args))
    environment = build_environment(config.rl, config.train.seed)
    facts, chats = work / "facts.jsonl", work / "chats.jsonl"
    with facts.open("w") as file:
        for document in range(2000):  # 4 facts of any question, 4 worked questions of the training stream
            facts_ = [fact(environment.draw(random.Random(f"facts:{document}:{line}"))) for line in range(4)]
            worked = [f"{record['prompt']} {fact(record)}"
                      for record in (environment.train_record(10_000 + 4 * document + line) for line in range(4))]
            file.write(json.dumps({"text": "\n".join(facts_ + worked)}) + "\n")
    with chats.open("w") as file:
        for record in (environment.train_record(index) for index in range(4000)):
            file.write(json.dumps({"messages": [{"role": "user", "content": record["prompt"]},
                                                {"role": "assistant", "content": fact(record)}]}) + "\n")
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


def accuracy(args, model_dir: Path, tokenizer: Path, work: Path, name: str) -> dict:
    """`meshlm rl --eval-only` on the held-out prompts: the model at ``model_dir``, greedy."""
    output = meshlm("rl", *common_overrides(args), f"train.init_from={model_dir}", f"data.tokenizer={tokenizer}",
                    "data.blend=null", f"train.run_dir={work / ('eval-' + name)}", "rl.kl_coeff=0",
                    "train.micro_batch_size=4", "--eval-only")
    return json.loads(output.strip().splitlines()[-1])


def main(argv=None) -> dict:
    from tests.helpers.chat_tokenizers import write_char_tokenizer

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="meshlm_post_training_"))
    work.mkdir(parents=True, exist_ok=True)
    started, seconds = time.perf_counter(), {}
    try:
        tokenizer = write_char_tokenizer(work / "tokenizer")
        facts, chats = write_data(args, work)
        common = common_overrides(args)
        clock = time.perf_counter()
        if args.init is None:
            meshlm("preprocess", "--input", str(facts), "--tokenizer", str(tokenizer), "--out", str(work / "facts"),
                   "--append-eos", "--no-progress")
            meshlm("train", *common, f"data.prefixes=[{work / 'facts'}]", "data.blend=null", "data.split=99,1,0",
                   f"train.run_dir={work / 'pretrain'}", f"train.steps={args.pretrain_steps}",
                   "train.micro_batch_size=16", "train.global_batch_size=16", "train.eval_every=0",
                   "train.log_every=100", f"train.save_every={args.pretrain_steps}", "optim.lr=3e-3",
                   "optim.min_lr=3e-4", "optim.warmup_steps=30", "optim.weight_decay=0.0")
            pretrained = work / "pretrain" / "checkpoints" / f"step_{args.pretrain_steps}"
        else:
            pretrained = Path(args.init)
        seconds["pretrain"] = time.perf_counter() - clock
        before = accuracy(args, pretrained, tokenizer, work, "pretrained")

        clock = time.perf_counter()
        meshlm("preprocess", "--chat", "--input", str(chats), "--tokenizer", str(tokenizer), "--out",
               str(work / "sft"), "--max-vocab-size", "64", "--no-progress")
        meshlm("train", *common, f"data.prefixes=[{work / 'sft'}]", "data.blend=null", "data.split=99,1,0",
               f"train.init_from={pretrained}", f"train.run_dir={work / 'sft-run'}", f"train.steps={args.sft_steps}",
               "train.micro_batch_size=16", "train.global_batch_size=16", "train.eval_every=0", "train.log_every=50",
               f"train.save_every={args.sft_steps}", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=10",
               "optim.weight_decay=0.0")
        sft = work / "sft-run" / "checkpoints" / f"step_{args.sft_steps}"
        seconds["sft"] = time.perf_counter() - clock
        after_sft = accuracy(args, sft, tokenizer, work, "sft")

        clock = time.perf_counter()
        meshlm("rl", *common, f"train.init_from={sft}", "data.blend=null", f"train.run_dir={work / 'rl-run'}",
               f"train.steps={args.rl_steps}", "train.micro_batch_size=32", "train.log_every=1",
               f"train.eval_every={args.rl_steps}", f"train.save_every={args.rl_steps}", f"optim.lr={args.rl_lr}",
               f"optim.min_lr={args.rl_lr}", "optim.schedule=constant", "optim.warmup_steps=5", "optim.weight_decay=0.0",
               "rl.group_size=8", "rl.prompts_per_step=16", "rl.temperature=1.0", "rl.kl_coeff=0.04", "rl.epochs=2")
        rl_model = work / "rl-run" / "checkpoints" / f"step_{args.rl_steps}"
        seconds["rl"] = time.perf_counter() - clock
        after_rl = accuracy(args, rl_model, tokenizer, work, "rl")
        metrics = [json.loads(line) for line in (work / "rl-run" / "metrics.jsonl").read_text().splitlines()]
        steps = [record for record in metrics if "reward_mean" in record]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    stages = {"pretrained": before["accuracy"], "sft": after_sft["accuracy"], "rl": after_rl["accuracy"]}
    report = {
        "task": f"held-out '{args.operations}' questions, operands of 1-{args.digits} digits",
        "held_out_prompts": before["prompts"], "accuracy": stages,
        "correct": {"pretrained": before["correct"], "sft": after_sft["correct"], "rl": after_rl["correct"]},
        "each_stage_improves": stages["pretrained"] < stages["sft"] < stages["rl"],
        "rl_reward_first_10_steps": sum(r["reward_mean"] for r in steps[:10]) / max(len(steps[:10]), 1),
        "rl_reward_last_10_steps": sum(r["reward_mean"] for r in steps[-10:]) / max(len(steps[-10:]), 1),
        "steps": {"pretrain": 0 if args.init else args.pretrain_steps, "sft": args.sft_steps, "rl": args.rl_steps},
        "seconds": {name: round(value, 1) for name, value in seconds.items()},
        "total_seconds": round(time.perf_counter() - started, 1),
        "threads": args.threads,
    }
    print(f"held-out accuracy ({report['held_out_prompts']} prompts): pretrained {stages['pretrained']:.1%}, "
          f"SFT {stages['sft']:.1%}, RL {stages['rl']:.1%}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
