"""The shapes a preference pair is shipped in, each read as two conversations that share a context.

``meshlm preprocess --preference`` takes a pair as any of:

- a context and two replies (meshlm's own shape)::

      {"prompt": "What is 2+2?", "chosen": "4.", "rejected": "5."}
      {"messages": [...context...], "chosen": {"role": "assistant", "content": "4."}, "rejected": "5."}

  ``prompt`` is one user turn (a string) or a list of messages, ``messages`` the whole context;
  a reply is a string, an assistant message, or a list of messages that opens with an assistant
  turn (TRL's conversational pairs: ``"chosen": [{"role": "assistant", ...}]``);
- two whole conversations, each ending with its reply (UltraFeedback's binarized sets, TRL's
  implicit-prompt pairs)::

      {"prompt": "What is 2+2?", "chosen": [{"role": "user", "content": "What is 2+2?"},
       {"role": "assistant", "content": "4."}], "rejected": [{"role": "user", ...}, {"role": "assistant", ...}]}

  A list that opens with any role but the assistant's is a whole conversation; with a
  ``prompt`` or ``messages`` beside it, it must start with that context (UltraFeedback repeats the
  prompt there), and without one the context is what the two conversations share at their start,
  which must be at least one message.

Either way the result is ``{"chosen": messages, "rejected": messages}``; the reply that is judged
(and trained) is each conversation's last (``preference.final_reply_segments``).
"""

from __future__ import annotations

from meshlm.errors import DataError


def as_reply(value, where: str, key: str) -> dict:
    """A reply given as a string or as an assistant message, as an assistant message."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, dict) and value.get("role", "assistant") == "assistant":
        return {**value, "role": "assistant"}
    raise DataError(f"{where}: {key!r} must be the reply as a string, an assistant message "
                    "{\"role\": \"assistant\", \"content\": ...} or a list of messages.")


def context_messages(record: dict, where: str) -> list[dict] | None:
    """The conversation before the judged reply: ``messages``, or ``prompt`` (a user turn or a list
    of messages); None when the record gives neither."""
    for key in ("messages", "prompt"):
        value = record.get(key)
        if isinstance(value, list):
            return list(value)
        if key == "prompt" and isinstance(value, str):
            return [{"role": "user", "content": value}]
        if value is not None:
            shape = ("a list of {\"role\", \"content\"} objects" if key == "messages"
                     else "a string or a list of messages")
            raise DataError(f"{where}: {key!r} must be {shape}.")
    return None


def opens_with_assistant(messages: list) -> bool:
    return isinstance(messages[0], dict) and messages[0].get("role") == "assistant"


def pair_conversations(record: dict, where: str) -> dict[str, list[dict]]:
    """{"chosen": messages, "rejected": messages} of a pair record in any shape (module docstring)."""
    context = context_messages(record, where)
    pair = {}
    for key in ("chosen", "rejected"):
        value = record[key]
        if isinstance(value, list) and value and not opens_with_assistant(value):  # a whole conversation
            if context is not None and value[:len(context)] != context:
                raise DataError(f"{where}: {key!r} is a whole conversation that does not start with the record's "
                                "prompt/messages; give the reply alone, or the conversation from that context on.")
            pair[key] = list(value)
        elif context is None:
            raise DataError(f"{where}: a pair needs its context: 'prompt' (a string or messages), 'messages', or "
                            "'chosen' and 'rejected' as whole conversations.")
        elif isinstance(value, list) and value:
            pair[key] = context + value
        else:
            pair[key] = context + [as_reply(value, where, key)]
    if context is None and pair["chosen"][:1] != pair["rejected"][:1]:
        raise DataError(f"{where}: 'chosen' and 'rejected' start differently, so they are not two replies to one "
                        "prompt; give the shared 'prompt', or conversations that open with the same turns.")
    return pair


__all__ = ["as_reply", "context_messages", "pair_conversations"]
