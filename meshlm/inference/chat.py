"""``meshlm generate --chat``: a prompt rendered as a user turn, the reply cut at the end of the turn.

A model fine-tuned on conversations (``meshlm preprocess --chat``) answers text laid out as it
was trained: the chat template of the tokenizer saved with the checkpoint (its own Jinja
``chat_template``, else meshlm's default, ``meshlm/data/chat.py``). The prompt is an optional
system turn and one user turn, followed by the assistant header (``<|assistant|>\\n``), and it is
tokenized as training tokenized the untrained text before a reply. Generation stops at the
template's end-of-turn token (``<|end|>``, ``<|im_end|>``, ...) or the tokenizer's eos, and only
the reply is printed: the end token is dropped.
"""

from __future__ import annotations

from meshlm.data.chat import load_chat_template, token_id
from meshlm.data.tokenizer import Tokenizer
from meshlm.errors import ConfigError


def chat_messages(text: str, system: str | None = None) -> list[dict]:
    """``text`` as a user turn, after a system turn when ``system`` is given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}]


def chat_prompt(tokenizer: Tokenizer, text: str, system: str | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids ending with the assistant header, the ids that end the reply)."""
    template = load_chat_template(tokenizer.source)
    end = template.end_of_turn()
    end_id = token_id(tokenizer, end)
    if end_id is None and tokenizer.eos_token_id is None:
        raise ConfigError(f"{tokenizer.source}: the chat template ends a turn with {end!r}, which this tokenizer "
                          "does not have as one token; use the tokenizer written by `meshlm preprocess --chat` "
                          "(pass --tokenizer PREFIX.tokenizer).")
    stop_ids = [token for token in (end_id, tokenizer.eos_token_id) if token is not None]
    ids = tokenizer.encode(template.prompt(chat_messages(text, system)), add_special_tokens=False)
    return ids, list(dict.fromkeys(stop_ids))


def reply_ids(new_ids: list[int], stop_ids: list[int]) -> list[int]:
    """The generated ids without the end-of-turn token that closed them."""
    return new_ids[:-1] if new_ids and new_ids[-1] in stop_ids else new_ids


__all__ = ["chat_messages", "chat_prompt", "reply_ids"]
