"""The reasoning toggle (Llama-Nemotron): does ``/think`` / ``/no_think`` in the system turn decide
whether a fine-tuned model writes a think block?

    python -m bench.reasoning_toggle [--steps 600] [--train-size 4000] [--eval-size 200]
                                     [--init-from CKPT] [--out-dir DIR] [--device cpu]

1. **Data.** A synthetic SFT set of two-digit sums and differences ("What is 47+38?"). Each
   conversation has a system turn drawn from a few prompts (or none) and a switch
   (``meshlm/data/reasoning.py``): with ``/think`` the reply is ``<think>worked steps</think>answer``
   (the column sums with their carries or borrows), with ``/no_think`` the answer alone; 10% carry
   no switch and think (the model's default); 30% hold two or three questions, each reply following
   the switch. The held-out questions are operand pairs that no training conversation has.
2. **Tokenizer.** A 320-token byte-level BPE trained on the set (nothing is downloaded), to which
   ``meshlm preprocess --chat`` adds the template's markers and ``<think>`` / ``</think>``.
3. **SFT.** ``meshlm train`` on the chat store: a small transformer (hidden 128, 4 attention + 4 MLP
   blocks) from scratch, or ``--init-from`` a meshlm checkpoint whose tokenizer (saved beside it)
   is used, and whose ``vocab_size`` must hold the added tokens (``meshlm adapt-vocab`` otherwise).
4. **Toggle.** Every held-out question, with a system prompt drawn as in training, is answered
   greedily with ``--reasoning on`` and ``off`` (``meshlm/inference/chat.py``): the fraction of
   replies that open with a think block, and of answers that are right, under each.
5. **Transcripts.** ``meshlm generate --chat --reasoning on`` / ``off`` on one question, and a
   ``meshlm chat`` session fed through a pipe that switches the toggle mid-conversation.

The default run takes ~2-4 minutes of one CPU core. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.model_files import load_model, read_model_config
from meshlm.cli import main as meshlm
from meshlm.data.reasoning import THINK_END, THINK_START, system_with_switch
from meshlm.data.tokenizer import find_tokenizer_file, load_tokenizer
from meshlm.data.tokenizer_training import train_tokenizer
from meshlm.inference.chat import chat_prompt, reply_ids, split_reply
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.training.metrics import METRICS_FILE

SYSTEM_PROMPTS = (None, "You are a helpful assistant.", "You are a careful calculator.", "Answer the question.")
NO_SWITCH_FRACTION = 0.1
"""Conversations with no switch; their replies think (the default the model learns)."""
MULTI_TURN_FRACTION = 0.3
"""Conversations of two or three questions, every reply following the conversation's switch."""
QUESTION_FORMS = ("What is {a}{op}{b}?", "Compute {a}{op}{b}.", "{a}{op}{b} = ?")


def worked_steps(a: int, b: int, op: str) -> str:
    """The column-by-column working of ``a op b`` (two-digit operands; for '-', a >= b)."""
    (a_tens, a_units), (b_tens, b_units) = divmod(a, 10), divmod(b, 10)
    if op == "+":
        units = a_units + b_units
        carry = units // 10
        return (f"units {a_units}+{b_units}={units}" + (", carry 1" if carry else "")
                + f"; tens {a_tens}+{b_tens}" + ("+1" if carry else "") + f"={a_tens + b_tens + carry}")
    borrow = int(a_units < b_units)
    return (f"units {a_units + 10 * borrow}-{b_units}={a_units + 10 * borrow - b_units}"
            + (", borrow 1" if borrow else "") + f"; tens {a_tens}" + ("-1" if borrow else "")
            + f"-{b_tens}={a_tens - borrow - b_tens}")


def question(a: int, b: int, op: str, rng: random.Random) -> tuple[str, str, str]:
    """(user text, worked steps, answer) of one question."""
    answer = a + b if op == "+" else a - b
    return rng.choice(QUESTION_FORMS).format(a=a, b=b, op=op), worked_steps(a, b, op), str(answer)


def all_questions(seed: int) -> list[tuple[int, int, str]]:
    """Every (a, b, op) with two-digit operands (a >= b for differences), shuffled."""
    pairs = [(a, b, "+") for a in range(10, 100) for b in range(10, 100)]
    pairs += [(a, b, "-") for a in range(10, 100) for b in range(10, a + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs


def conversation(questions: list[tuple[int, int, str]], rng: random.Random) -> list[dict]:
    """A system turn drawn from SYSTEM_PROMPTS with a switch (or none), then each question and its reply."""
    system = rng.choice(SYSTEM_PROMPTS)
    mode = None if rng.random() < NO_SWITCH_FRACTION else rng.choice(("on", "off"))
    if mode is not None:
        system = system_with_switch(system, mode)
    messages = [{"role": "system", "content": system}] if system else []
    for a, b, op in questions:
        text, steps, answer = question(a, b, op, rng)
        reply = answer if mode == "off" else f"{THINK_START}{steps}{THINK_END}{answer}"
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    return messages


def write_data(folder: Path, train: list, seed: int) -> tuple[Path, int]:
    """The training questions as conversations, MULTI_TURN_FRACTION of them holding 2 or 3 questions:
    the JSONL file and the number of conversations."""
    rng = random.Random(seed)
    chats, start, conversations = folder / "chats.jsonl", 0, 0
    with open(chats, "w") as handle:
        while start < len(train):
            count = rng.choice((2, 3)) if rng.random() < MULTI_TURN_FRACTION else 1
            handle.write(json.dumps({"messages": conversation(train[start:start + count], rng)}) + "\n")
            start, conversations = start + count, conversations + 1
    return chats, conversations


def sft(args, folder: Path, store: Path, model_vocab: int) -> dict:
    """Train with ``meshlm train``; its time and last logged losses."""
    run_dir = folder / "run"
    overrides = [f"data.prefixes=[{store}]", "data.blend=null", "data.split=100,0,0",
                 f"train.steps={args.steps}", f"train.run_dir={run_dir}", f"train.seq_len={args.seq_len}",
                 f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}",
                 "train.eval_every=0", f"train.save_every={args.steps}", "train.log_every=10",
                 "train.progress=false", "train.tensorboard=false", "train.plot=false", f"train.device={args.device}",
                 f"optim.lr={args.lr}", f"optim.min_lr={args.lr / 10}",
                 f"optim.warmup_steps={max(1, args.steps // 20)}"]
    if args.init_from:
        overrides += [f"train.init_from={resolve_model_dir(args.init_from)}", "train.init_model_config=true"]
    else:
        overrides += [f"model.vocab_size={model_vocab}", "model.hidden_size=128", "model.pattern=*-*-*-*-",
                      "model.num_attention_heads=4", "model.num_kv_heads=2", "model.tie_embeddings=true"]
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        code = meshlm(["train", *overrides])
    if code != 0:
        raise SystemExit(f"meshlm train failed with status {code}")
    seconds = time.perf_counter() - started
    losses = [record["loss"] for record in map(json.loads, (run_dir / METRICS_FILE).read_text().splitlines())
              if "loss" in record]
    return {"run_dir": str(run_dir), "seconds": round(seconds, 1), "first_loss": round(losses[0], 4),
            "last_loss": round(losses[-1], 4)}


def toggle_figures(model_dir: Path, held_out: list, seed: int, max_new_tokens: int, device: str) -> dict:
    """Per mode: the fraction of replies with a think block, and of right answers."""
    model, tokenizer = load_model(model_dir, map_location=device), load_tokenizer(find_tokenizer_file(model_dir))
    valid = min(tokenizer.vocab_size, model.config.vocab_size)
    figures = {}
    for mode in ("on", "off"):
        rng = random.Random(seed)  # the same questions and system prompts under both modes
        cases = [(question(a, b, op, rng), rng.choice(SYSTEM_PROMPTS)) for a, b, op in held_out]
        prompts = [chat_prompt(tokenizer, text, system, mode) for (text, _, _), system in cases]
        stop = prompts[0][1]
        outputs = generate(model, [ids for ids, _ in prompts], max_new_tokens, SamplingConfig(greedy=True),
                           eos_token_id=stop, valid_vocab_size=valid)
        replies = [split_reply(tokenizer, reply_ids(ids, stop)) for ids in outputs]
        figures[f"reasoning_{mode}"] = {
            "think_block_fraction": sum(thinking is not None for thinking, _ in replies) / len(replies),
            "answer_accuracy": sum(answer.strip() == expected for (thinking, answer), ((_, _, expected), _)
                                   in zip(replies, cases)) / len(replies),
            "mean_reply_tokens": round(sum(len(reply_ids(ids, stop)) for ids in outputs) / len(outputs), 1)}
    return figures


def transcripts(model_dir: Path, text: str, follow_up: str, max_new_tokens: int, device: str) -> dict:
    """``meshlm generate --chat --reasoning on|off`` and a piped ``meshlm chat`` session."""
    shown = {}
    for mode in ("on", "off"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            meshlm(["generate", str(model_dir), "--chat", "--reasoning", mode, "--prompt", text, "--greedy",
                   "--max-new-tokens", str(max_new_tokens), "--device", device])
        shown[f"generate_reasoning_{mode}"] = out.getvalue().rstrip("\n")
    session_input = f"{text}\n/no_think\n{text}\n/think\n{follow_up}\n/exit\n"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    finished = subprocess.run([sys.executable, "-m", "meshlm", "chat", str(model_dir), "--reasoning", "on",
                               "--greedy", "--max-new-tokens", str(max_new_tokens), "--device", device],
                              input=session_input, capture_output=True, text=True, env=env, timeout=300)
    shown["chat_stdin"] = session_input
    shown["chat_stdout"] = finished.stdout
    shown["chat_stderr"] = finished.stderr.strip()
    return shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--train-size", type=int, default=4000, help="training questions")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out questions")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--init-from", metavar="CKPT", help="start from this meshlm checkpoint and its tokenizer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", help="keep the data, store and run here (default: a temporary folder)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(args.out_dir or temporary)
        folder.mkdir(parents=True, exist_ok=True)
        questions = all_questions(args.seed)
        train, held_out = questions[:args.train_size], questions[args.train_size:args.train_size + args.eval_size]
        chats, conversations = write_data(folder, train, args.seed)
        if args.init_from:
            model_dir = resolve_model_dir(args.init_from)
            tokenizer, model_vocab = find_tokenizer_file(model_dir), read_model_config(model_dir).vocab_size
        else:
            texts = folder / "texts.jsonl"
            texts.write_text("".join(json.dumps({"text": " ".join(m["content"] for m in json.loads(line)["messages"])})
                                     + "\n" for line in chats.read_text().splitlines()))
            tokenizer, model_vocab = train_tokenizer([texts], vocab_size=320, out=folder / "tokenizer.json"), 384
        with contextlib.redirect_stdout(sys.stderr):
            code = meshlm(["preprocess", "--chat", "--input", str(chats), "--tokenizer", str(tokenizer),
                           "--out", str(folder / "sft"), "--max-vocab-size", str(model_vocab)])
        if code != 0:
            raise SystemExit(f"meshlm preprocess --chat failed with status {code}")
        training = sft(args, folder, folder / "sft", model_vocab)
        model_dir = resolve_model_dir(training["run_dir"])
        report = {"task": "two-digit sums and differences; /think: <think>column steps</think>answer",
                  "train_questions": len(train), "train_conversations": conversations,
                  "held_out_questions": len(held_out), "steps": args.steps,
                  "seq_len": args.seq_len, "batch": args.batch, "init_from": args.init_from, "train": training}
        report.update(toggle_figures(model_dir, held_out, args.seed + 1, args.max_new_tokens, args.device))
        (a, b, op), (c, d, op2) = held_out[:2]
        report["transcript"] = transcripts(model_dir, f"What is {a}{op}{b}?", f"What is {c}{op2}{d}?",
                                           args.max_new_tokens, args.device)
        report["train"].pop("run_dir")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
