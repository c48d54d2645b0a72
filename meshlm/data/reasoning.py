"""The reasoning toggle: a system-prompt switch that turns a model's visible thinking on or off.

Llama-Nemotron (NVIDIA 2025, "Llama-Nemotron: Efficient Reasoning Models", §2) trains one model
to answer either with a long chain of thought or directly, chosen per conversation by the system
prompt ("detailed thinking on/off"); Qwen3 uses the words ``/think`` and ``/no_think``. The model
learns the switch from the data alone: in the SFT set, conversations whose system turn carries
the "on" switch have replies that open with a think block, those carrying "off" have replies
without one. meshlm's convention:

* **The switch** is the last word of the system turn: ``/think`` (``THINK``) or ``/no_think``
  (``NO_THINK``), after the system prompt and one space (``"Be brief. /think"``), or alone when
  there is no other system prompt. ``with_reasoning`` writes it (creating a system turn when the
  conversation has none, replacing a switch already there). A conversation with no switch gets
  whatever the model was trained to do by default.
* **A thinking reply** starts with ``<think>``, the thinking, ``</think>``, then the answer:
  ``"<think>7+5=12, carry 1</think>42"``. The think block is part of the assistant's content, so
  it is trained like the answer (``meshlm/data/chat.py``'s loss mask).
* **Both tags are special tokens.** ``meshlm preprocess --chat`` adds ``<think>`` and ``</think>``
  to the tokenizer it writes when the conversations hold a think block and the tokenizer lacks
  them (as it adds the template's markers), so a think block opens with one token id: cheap to
  generate and exact to detect (``meshlm/inference/chat.py`` splits a reply at that id).

``split_reasoning`` is the text-level split, used where a tokenizer has no single ids for the tags.
"""

from __future__ import annotations

from meshlm.errors import DataError

THINK = "/think"
"""The system-prompt switch asking for a think block before the answer."""
NO_THINK = "/no_think"
"""The system-prompt switch asking for the answer alone."""
THINK_START, THINK_END = "<think>", "</think>"
REASONING_SPECIAL_TOKENS = (THINK_START, THINK_END)
"""Added as special tokens by ``meshlm preprocess --chat`` when the data holds a think block."""
REASONING_MODES = {"on": THINK, "off": NO_THINK}
"""``--reasoning`` value -> the switch it writes into the system turn."""


def strip_switch(system: str) -> str:
    """``system`` without a trailing ``/think`` or ``/no_think`` (and the space before it)."""
    words = system.rstrip()
    for switch in (NO_THINK, THINK):
        if words == switch:
            return ""
        if words.endswith(" " + switch) or words.endswith("\n" + switch):
            return words[:-len(switch) - 1].rstrip()
    return system


def system_with_switch(system: str | None, mode: str) -> str:
    """The system prompt carrying the switch of ``mode`` ('on' or 'off') as its last word."""
    if mode not in REASONING_MODES:
        raise ValueError(f"reasoning mode {mode!r} is not one of {', '.join(REASONING_MODES)}.")
    base = strip_switch(system or "")
    return f"{base} {REASONING_MODES[mode]}" if base else REASONING_MODES[mode]


def with_reasoning(messages: list[dict], mode: str | None) -> list[dict]:
    """``messages`` with the switch of ``mode`` in the system turn (one is created first when there
    is none); ``mode=None`` leaves them as they are. The input list is not modified."""
    if mode is None:
        return list(messages)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": system_with_switch(messages[0].get("content"), mode)}, *messages[1:]]
    return [{"role": "system", "content": system_with_switch(None, mode)}, *messages]


def reasoning_mode(messages: list[dict]) -> str | None:
    """'on' or 'off' when the conversation's system turn ends with a switch, else None."""
    if not messages or messages[0].get("role") != "system":
        return None
    words = (messages[0].get("content") or "").split()
    return next((mode for mode, switch in REASONING_MODES.items() if words and words[-1] == switch), None)


def split_reasoning(reply: str) -> tuple[str | None, str]:
    """(thinking, answer) of a reply: thinking is None when the reply does not open with
    ``<think>``; a think block never closed (the reply was cut off) is all thinking, answer ''.
    Both parts are stripped of surrounding whitespace."""
    text = reply.lstrip()
    if not text.startswith(THINK_START):
        return None, reply.strip()
    thinking, closed, answer = text[len(THINK_START):].partition(THINK_END)
    return thinking.strip(), answer.strip() if closed else ""


def has_think_block(messages: list[dict]) -> bool:
    """True when an assistant message of the conversation opens with a think block."""
    return any(message.get("role") == "assistant" and isinstance(message.get("content"), str)
               and message["content"].lstrip().startswith(THINK_START) for message in messages)


def check_think_blocks(messages: list[dict], where: str) -> None:
    """Raise DataError (naming ``where``) when an assistant message opens a think block it never
    closes: its answer could not be told from its thinking."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") == "assistant" and isinstance(content, str) \
                and content.lstrip().startswith(THINK_START) and THINK_END not in content:
            raise DataError(f"{where}: message {index} (assistant) opens {THINK_START} but never closes it; "
                            f"end the thinking with {THINK_END} before the answer.")


__all__ = ["NO_THINK", "REASONING_MODES", "REASONING_SPECIAL_TOKENS", "THINK", "THINK_END", "THINK_START",
           "check_think_blocks", "has_think_block", "reasoning_mode", "split_reasoning", "strip_switch",
           "system_with_switch", "with_reasoning"]
