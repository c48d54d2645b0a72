"""The shapes chat data is shipped in, each read as one conversation of ``messages``.

Fine-tuning sets come in a few layouts; ``meshlm preprocess --chat`` takes each record in any of
them (told apart by their keys, record by record) and renders them all with one chat template:

- **messages** (meshlm, OpenAI, Hugging Face chat datasets)::

      {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

- **ShareGPT** (Vicuna, and most community sets: ``from`` / ``value``; an optional top-level
  ``system``)::

      {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}

  ``human``/``user`` are the user, ``gpt``/``assistant``/``chatgpt`` the assistant, ``system`` the
  system, ``tool``/``observation``/``function_response`` a tool's result, and ``function_call`` an
  assistant tool call whose value is the call's JSON (``{"name": ..., "arguments": {...}}``);
- **Alpaca** (``instruction``, optional ``input``, ``output``; optional ``system`` and
  ``history``, a list of earlier ``[question, answer]`` pairs)::

      {"instruction": "Translate to French.", "input": "cheese", "output": "fromage"}

  The user turn is the instruction, followed after a blank line by the input when there is one;
- **prompt / completion** (OpenAI's legacy fine-tuning files, TRL's prompt-completion sets): each
  a string (one user turn, one assistant turn) or a list of messages.

A record's own ``messages`` key (``--text-key``, default ``messages``) is looked for first, so a
set that happens to carry other keys too reads as messages. A record of none of these shapes is
refused with its file and line and the keys it has.
"""

from __future__ import annotations

import json

from meshlm.errors import DataError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system", "tool": "tool", "observation": "tool",
                  "function_response": "tool"}
"""ShareGPT's ``from`` values -> roles (``function_call`` is an assistant tool call, read apart)."""
SHAPES = ('{"messages": [{"role", "content"}, ...]}, ShareGPT\'s {"conversations": [{"from", "value"}, ...]}, '
          'Alpaca\'s {"instruction", "input", "output"} or {"prompt", "completion"}')


def conversation(record: object, where: str, messages_key: str = "messages") -> object:
    """The ``messages`` of ``record`` (found at ``where``), whichever shape it has (module docstring).
    The messages themselves are checked by the caller (``chat.check_messages``)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object; each record must be one of "
                        f"{SHAPES}.")
    if messages_key in record:
        return record[messages_key]
    if "conversations" in record:
        return from_sharegpt(record, where)
    if "instruction" in record and "output" in record:
        return from_alpaca(record, where)
    if "prompt" in record and "completion" in record:
        return from_prompt_completion(record, where)
    raise DataError(f"{where}: not a conversation (keys here: {', '.join(map(repr, record)) or 'none'}); each record "
                    f"must be one of {SHAPES}.")


def text_field(record: dict, key: str, where: str) -> str:
    value = record.get(key, "")
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__}.")
    return value


def from_sharegpt(record: dict, where: str) -> list[dict]:
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise DataError(f"{where}: 'conversations' must be a list of {{\"from\", \"value\"}} objects.")
    system = text_field(record, "system", where)
    messages = [{"role": "system", "content": system}] if system else []
    for index, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if not isinstance(value, str):
            raise DataError(f"{where}: conversations[{index}] needs a string 'value' (and a 'from').")
        if speaker == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call(value, where, index)]})
        elif speaker in SHAREGPT_ROLES:
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
        else:
            raise DataError(f"{where}: conversations[{index}] is from {speaker!r}; use one of "
                            f"{', '.join([*SHAREGPT_ROLES, 'function_call'])}.")
    return messages


def tool_call(value: str, where: str, index: int) -> dict:
    try:
        call = json.loads(value)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: conversations[{index}] is a function_call whose value is not JSON ({error.msg}); "
                        "write the call as {\"name\": ..., \"arguments\": {...}}.") from error
    return call


def from_alpaca(record: dict, where: str) -> list[dict]:
    instruction, extra = text_field(record, "instruction", where), text_field(record, "input", where)
    system = text_field(record, "system", where)
    messages = [{"role": "system", "content": system}] if system else []
    history = record.get("history") or []
    if not isinstance(history, list) or not all(isinstance(pair, list) and len(pair) == 2
                                                and all(isinstance(text, str) for text in pair) for pair in history):
        raise DataError(f"{where}: 'history' must be a list of [question, answer] string pairs.")
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    user = f"{instruction}\n\n{extra}" if instruction and extra else instruction or extra
    return [*messages, {"role": "user", "content": user},
            {"role": "assistant", "content": text_field(record, "output", where)}]


def from_prompt_completion(record: dict, where: str) -> list:
    parts = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
        value = record[key]
        if isinstance(value, str):
            parts.append([{"role": role, "content": value}])
        elif isinstance(value, list):
            parts.append(value)
        else:
            raise DataError(f"{where}: {key!r} must be a string or a list of messages, got {type(value).__name__}.")
    return parts[0] + parts[1]


__all__ = ["SHAPES", "SHAREGPT_ROLES", "conversation", "from_alpaca", "from_prompt_completion", "from_sharegpt"]
