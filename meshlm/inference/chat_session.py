"""``meshlm chat``: a multi-turn conversation with a fine-tuned model, one user turn per line.

    meshlm chat runs/sft [--reasoning on|off] [--system "Be brief."] [--max-new-tokens 256]
                         [--greedy | --temperature 0.7 --top-p 0.9 --seed 0] [--max-context N]
    printf 'What is 17+25?\\n/no_think\\nAnd 3+4?\\n' | meshlm chat runs/sft --greedy

Each line read from stdin is a user turn; the reply is printed when it is generated. The session
keeps the conversation: every turn, the system turn (``--system``, ending with the reasoning
switch when one is set) and all earlier turns are rendered again with the checkpoint tokenizer's
chat template, as ``meshlm generate --chat`` renders one turn (``meshlm/inference/chat.py``), and
the reply is generated with the KV cache (``meshlm/inference/generate.py``). Earlier replies are
kept as generated, think blocks included: meshlm's SFT trains conversations as one fixed text
(``meshlm/data/chat.py`` refuses templates that rewrite earlier turns), so that is what a model it
fine-tuned saw. A tokenizer's own template that drops old thinking (Qwen3's) still does so when it
renders the history.

Lines that are exactly a command steer the session instead of being sent:

* ``/think``, ``/no_think``: switch the reasoning toggle (``meshlm/data/reasoning.py``) for the
  next turns -- the system turn now ends with that switch;
* ``/reset``: forget the conversation (the system prompt and toggle stay);
* ``/exit`` (or the end of the input): end the session.

**The context.** The prompt and the reply's ``--max-new-tokens`` must fit ``--max-context`` tokens
(default: the sequence length the model was trained with, ``trained_seq_len``; a reply is given at
most half of it, with a note when ``--max-new-tokens`` asks for more). When they do not, the
oldest exchanges (a user turn and its reply) are dropped, with a one-line note on stderr; a
message that does not fit even alone is refused with a note, and the session goes on.

With a terminal on stdin a ``you> `` prompt is printed and the commands are listed at the start;
with piped input nothing but the replies is printed (``--json``: one object per reply, with
``"thinking"`` when it has a think block and ``"prompt_tokens"``, the length of the rendered prompt).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable, Iterator

from meshlm.checkpoint.model_files import trained_seq_len
from meshlm.data.reasoning import NO_THINK, THINK, with_reasoning
from meshlm.data.tokenizer import Tokenizer
from meshlm.errors import ConfigError
from meshlm.inference.chat import conversation_prompt, reply_ids, reply_record, show_reply, stop_ids
from meshlm.inference.cli import add_sampling_arguments, load_generation_model, sampling_from_args
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig

DEFAULT_MAX_NEW_TOKENS = 256
"""New tokens per reply when ``--max-new-tokens`` is not given (a reply also stops at its end of turn)."""
RESET, EXIT = "/reset", "/exit"
SESSION_COMMANDS = (THINK, NO_THINK, RESET, EXIT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="model directory, training checkpoint, or run directory (latest step_N is used)")
    parser.add_argument("--reasoning", choices=("on", "off"),
                        help="start with the system turn ending in /think (on) or /no_think (off); "
                             "switch later by typing /think or /no_think")
    parser.add_argument("--system", metavar="TEXT", help="a system prompt kept at the start of the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                        help="stop each reply after N new tokens, or at its end of turn "
                             f"(default {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--max-context", type=int, metavar="N",
                        help="tokens the prompt and reply may fill; older turns are dropped beyond it "
                             "(default: the model's training sequence length)")
    add_sampling_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0; +1 each turn)")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or a directory holding one")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--json", action="store_true", help="print each reply as one JSON object")


class ChatSession:
    """The conversation so far, and the reply to one more user turn (module docstring)."""

    def __init__(self, model, tokenizer: Tokenizer, sampling: SamplingConfig, max_new_tokens: int,
                 max_context: int, system: str | None = None, reasoning: str | None = None,
                 note: Callable[[str], None] = print):
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {max_new_tokens} leaves no room for a reply; use 1 or more.")
        if max_context < 2:
            raise ConfigError(f"--max-context {max_context} leaves no room for a prompt and a reply; use 2 or more.")
        if max_new_tokens > max_context // 2:
            note(f"--max-new-tokens {max_new_tokens} is cut to {max_context // 2}, half the {max_context}-token "
                 "context, so the conversation has room.")
            max_new_tokens = max_context // 2
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.max_new_tokens, self.max_context = max_new_tokens, max_context
        self.system, self.reasoning, self.note = system, reasoning, note
        self.stop_ids = stop_ids(tokenizer)
        self.valid_vocab_size = min(tokenizer.vocab_size, model.config.vocab_size)
        self.history: list[dict] = []
        """User and assistant turns, alternating, oldest first; assistant turns hold whole replies."""
        self.turns = 0

    def messages(self, history: list[dict]) -> list[dict]:
        """The system turn (with the toggle's switch) followed by ``history``."""
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return with_reasoning(system + history, self.reasoning)

    def command(self, line: str) -> bool:
        """Apply a session command; False for ``/exit``."""
        if line in (THINK, NO_THINK):
            self.reasoning = "on" if line == THINK else "off"
            self.note(f"reasoning {self.reasoning}: the system turn now ends with {line}.")
        elif line == RESET:
            self.history = []
            self.note("conversation cleared.")
        return line != EXIT

    def reply(self, text: str) -> dict | None:
        """Generate the reply to the user turn ``text``: its record (``reply_record``, plus
        ``prompt_tokens``), or None when the turn alone does not fit the context."""
        history = self.history + [{"role": "user", "content": text}]
        prompt = conversation_prompt(self.tokenizer, self.messages(history))
        dropped = 0
        while len(prompt) + self.max_new_tokens > self.max_context and len(history) - dropped > 1:
            dropped += 2  # the oldest exchange: a user turn and its reply
            prompt = conversation_prompt(self.tokenizer, self.messages(history[dropped:]))
        if len(prompt) + self.max_new_tokens > self.max_context:
            self.note(f"this message makes a {len(prompt)}-token prompt, and with --max-new-tokens "
                      f"{self.max_new_tokens} it does not fit the {self.max_context}-token context; "
                      "send a shorter one.")
            return None
        if dropped:
            self.note(f"dropped the oldest {dropped // 2} exchange(s) to fit the {self.max_context}-token context.")
        sampling = dataclasses.replace(self.sampling, seed=self.sampling.seed + self.turns)
        [new_ids] = generate(self.model, [prompt], self.max_new_tokens, sampling, eos_token_id=self.stop_ids,
                             valid_vocab_size=self.valid_vocab_size)
        reply = reply_ids(new_ids, self.stop_ids)
        record = {**reply_record(self.tokenizer, reply), "prompt_tokens": len(prompt)}
        content = self.tokenizer.decode(reply, skip_special_tokens=False)  # the think tags too
        self.history = history[dropped:] + [{"role": "assistant", "content": content}]
        self.turns += 1
        return record


def read_turns(interactive: bool) -> Iterator[str]:
    """Lines from stdin without their newline, after a ``you> `` prompt when ``interactive``."""
    while True:
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and not line:
            return
        yield line.rstrip("\r\n")


def run(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)
    model_dir, tokenizer, _, model = load_generation_model(
        args, "a chat needs the tokenizer written by `meshlm preprocess --chat`; pass --tokenizer PATH.")
    interactive = sys.stdin.isatty()
    note = (lambda text: print(text, file=sys.stderr, flush=True)) if interactive else (
        lambda text: print(f"note: {text}", file=sys.stderr, flush=True))
    session = ChatSession(model, tokenizer, sampling, args.max_new_tokens,
                          args.max_context or trained_seq_len(model_dir), args.system, args.reasoning, note)
    if interactive:
        note(f"chatting with {model_dir} (reasoning {session.reasoning or 'as trained'}); commands: "
             f"{', '.join(SESSION_COMMANDS)}; Ctrl-D ends.")
    try:
        for line in read_turns(interactive):
            if line.strip() in SESSION_COMMANDS:
                if not session.command(line.strip()):
                    break
                continue
            if not line.strip():
                continue
            record = session.reply(line)
            if record is not None:
                print(json.dumps(record) if args.json else show_reply(record), flush=True)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


__all__ = ["ChatSession", "DEFAULT_MAX_NEW_TOKENS", "SESSION_COMMANDS", "add_arguments", "read_turns", "run"]
