"""``meshlm generate --chat``: a prompt rendered as a user turn, the reply cut at the end of the turn.

A model fine-tuned on conversations (``meshlm preprocess --chat``) answers text laid out as it
was trained: the chat template of the tokenizer saved with the checkpoint (its own Jinja
``chat_template``, else meshlm's default, ``meshlm/data/chat.py``). The prompt is an optional
system turn and one user turn (or, for ``meshlm chat``, the whole conversation so far), followed
by the assistant header (``<|assistant|>\\n``), and it is tokenized as training tokenized the
untrained text before a reply. Generation stops at the template's end-of-turn token (``<|end|>``,
``<|im_end|>``, ...) or the tokenizer's eos, and only the reply is printed: the end token is dropped.

**The reasoning toggle** (``meshlm/data/reasoning.py``): ``reasoning="on"`` or ``"off"`` writes
``/think`` or ``/no_think`` as the last word of the system turn (creating one when there is no
system prompt), as the model saw it in training. A reply that opens with a think block is split
into its thinking and its answer, at the ids of ``<think>`` and ``</think>`` when the tokenizer has
them as single tokens (``meshlm preprocess --chat`` adds them), else in the decoded text; it is
shown as ``<think>thinking</think>`` on its own line(s), then the answer.
"""

from __future__ import annotations

from meshlm.data.chat import load_chat_template, token_id
from meshlm.data.reasoning import THINK_END, THINK_START, split_reasoning, with_reasoning
from meshlm.data.tokenizer import Tokenizer
from meshlm.errors import ConfigError


def chat_messages(text: str, system: str | None = None, reasoning: str | None = None) -> list[dict]:
    """``text`` as a user turn, after a system turn when ``system`` is given; ``reasoning`` ('on',
    'off' or None) adds the toggle's switch to the system turn."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}]
    return with_reasoning(messages, reasoning)


def record_messages(record: dict, system: str | None = None, reasoning: str | None = None) -> list[dict]:
    """A prompt record (``meshlm rl --prompts``, ``meshlm generate --input``) as chat turns: its
    ``messages`` (a whole context ending with the user turn), else its ``prompt`` as the user turn
    after its own ``system`` turn, or ``system``'s."""
    return record.get("messages") or chat_messages(record["prompt"], record.get("system") or system, reasoning)


def stop_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids that end a reply: the template's end-of-turn token and the tokenizer's eos."""
    end = load_chat_template(tokenizer.source).end_of_turn()
    end_id = token_id(tokenizer, end)
    if end_id is None and tokenizer.eos_token_id is None:
        raise ConfigError(f"{tokenizer.source}: the chat template ends a turn with {end!r}, which this tokenizer "
                          "does not have as one token; use the tokenizer written by `meshlm preprocess --chat` "
                          "(pass --tokenizer PREFIX.tokenizer).")
    return list(dict.fromkeys(token for token in (end_id, tokenizer.eos_token_id) if token is not None))


def conversation_prompt(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The ids of ``messages`` (with the functions ``tools`` offers) rendered by the tokenizer's
    template, ending with the assistant header."""
    return tokenizer.encode(load_chat_template(tokenizer.source).prompt(messages, tools), add_special_tokens=False)


def chat_prompt(tokenizer: Tokenizer, text: str, system: str | None = None,
                reasoning: str | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids ending with the assistant header, the ids that end the reply)."""
    ends = stop_ids(tokenizer)
    return conversation_prompt(tokenizer, chat_messages(text, system, reasoning)), ends


def reply_ids(new_ids: list[int], stop_ids: list[int]) -> list[int]:
    """The generated ids without the end-of-turn token that closed them."""
    return new_ids[:-1] if new_ids and new_ids[-1] in stop_ids else new_ids


def split_reply(tokenizer: Tokenizer, ids: list[int]) -> tuple[str | None, str]:
    """(thinking or None, answer) of a reply's ids (module docstring). Without a think block the
    answer is the decoded reply as it is, unstripped."""
    start, end = token_id(tokenizer, THINK_START), token_id(tokenizer, THINK_END)
    if start is None or end is None:
        thinking, answer = split_reasoning(tokenizer.decode(ids, skip_special_tokens=False))
        return (None, tokenizer.decode(ids)) if thinking is None else (thinking, answer)
    if not ids or ids[0] != start:
        return None, tokenizer.decode(ids)
    close = ids.index(end) if end in ids else len(ids)
    return tokenizer.decode(ids[1:close]).strip(), tokenizer.decode(ids[close + 1:]).strip()


def reply_record(tokenizer: Tokenizer, ids: list[int]) -> dict:
    """``{"ids", "text"}`` of a reply, ``text`` being the answer; ``"thinking"`` too when it has a think block."""
    thinking, answer = split_reply(tokenizer, ids)
    return {"ids": ids, "text": answer} if thinking is None else {"ids": ids, "text": answer, "thinking": thinking}


def show_reply(record: dict) -> str:
    """A reply as printed: the thinking marked by its tags on the first line(s), then the answer."""
    if "thinking" not in record:
        return record["text"]
    return f"{THINK_START}{record['thinking']}{THINK_END}\n{record['text']}"


__all__ = ["chat_messages", "chat_prompt", "conversation_prompt", "record_messages", "reply_ids", "reply_record",
           "show_reply", "split_reply", "stop_ids"]
