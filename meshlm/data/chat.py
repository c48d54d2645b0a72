"""Chat templates: a conversation (``messages``) as text, with the part the model learns marked.

Supervised fine-tuning (SFT) trains a model on conversations. A conversation is a list of
messages ``{"role": ..., "content": ...}`` with roles ``system``, ``user``, ``assistant`` and
``tool``; a *chat template* turns it into one text with markers around each turn, and the
loss counts only the assistant's turns (their content and the end-of-turn marker), since the
model is to learn to answer, not to write the user's questions (InstructGPT, Ouyang et al.
2022; the "loss on completions only" of most SFT recipes).

**Which template.** The tokenizer's own, when its ``tokenizer_config.json`` has a
``chat_template`` (the Jinja template Hugging Face models ship; rendered with ``jinja2`` in a
sandbox, as ``transformers`` does); otherwise meshlm's default::

    <|system|>\\n{content}<|end|>\\n
    <|user|>\\n{content}<|end|>\\n
    <|assistant|>\\n{content}{tool calls}<|end|>\\n
    <|tool|>\\n{content}<|end|>\\n

Every marker is one special token (``DEFAULT_SPECIAL_TOKENS``; ``meshlm preprocess --chat`` adds
the missing ones to the tokenizer it writes beside the store). An assistant message may carry
``tool_calls``, a list of ``{"name": ..., "arguments": {...}}`` (or OpenAI's
``{"type": "function", "function": {...}}``, whose ``arguments`` may be a JSON string); each is
rendered after the content as ``<|tool_call|>{"name": "...", "arguments": {...}}`` (compact
JSON), and is trained like the content. A ``tool`` message holds what the tool returned.

**Tools offered.** A conversation may come with ``tools``, the functions the assistant may call
(OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters"}}]``, or the
bare function objects). A Jinja template gets them as ``tools``, as ``transformers``'
``apply_chat_template(tools=...)`` passes them (Qwen's, Llama's and Hermes' templates list them in
the system turn); the default template appends them to the system turn (one is added first if
the conversation has none) after ``TOOLS_INTRODUCTION``, one compact JSON object a line. Either
way they are part of the prompt, never trained.

**Where the mask comes from: the rendering itself.** ``ChatTemplate.segments`` returns the text
as segments, each flagged trained or not; the flags are never guessed from token boundaries.
The default template builds the segments directly: an assistant turn is ``<|assistant|>\\n``
(not trained), ``content + tool calls + <|end|>`` (trained), ``\\n`` (not trained). A Jinja
template is rendered prefix by prefix: before assistant message k, the first k messages with the
generation prompt (``add_generation_prompt=True``, i.e. up to and including the assistant
header); after it, the first k + 1 messages. The text the assistant message added is the
difference of the two renderings, trained up to its trailing whitespace. Each rendering must
extend the previous one; a template that rewrites earlier turns (e.g. one that drops old
reasoning) is refused by name, since its training text is not one fixed string.

``encode_segments`` tokenizes runs of equally flagged segments one run at a time and gives each
token its run's flag; generation (``meshlm generate --chat``) tokenizes the prompt -- all of it
untrained -- the same way, so the model sees at inference the tokens it was trained on.

**The reasoning toggle** (``meshlm/data/reasoning.py``): a system turn ending with ``/think`` or
``/no_think`` asks for a reply that opens with a ``<think>...</think>`` block, or for the answer
alone; the block is part of the assistant's content, so it is rendered and trained like it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshlm.data.tokenizer import Tokenizer, tokenizer_config
from meshlm.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_SPECIAL_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|tool_call|>", "<|end|>")
"""The markers of meshlm's default template, each one special token."""
END_OF_TURN = "<|end|>"
TOOLS_INTRODUCTION = "You may call these functions, each call written as <|tool_call|> and a JSON object:"
"""What the default template writes before the offered tools (module docstring)."""
PROBE_REPLY = "\uE000meshlm-probe\uE000"
"""A reply no real conversation holds, rendered to find what a template puts after a reply."""


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool
    """True for text the loss counts: an assistant turn's content, tool calls and end marker."""


def check_messages(messages, where: str) -> None:
    """Raise DataError (naming ``where``, e.g. "chat.jsonl, line 3") unless ``messages`` is a
    conversation this module can render: known roles, string contents, one assistant turn or more."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects.")
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise DataError(f"{where}: message {index} has role {role!r}; use one of {', '.join(ROLES)}.")
        content, calls = message.get("content"), message.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise DataError(f"{where}: message {index} ({role}) has tool_calls; only an assistant message may, "
                            "as a list of {\"name\", \"arguments\"} objects.")
        if not isinstance(content, str) and not (role == "assistant" and calls and content is None):
            raise DataError(f"{where}: message {index} ({role}) needs a string 'content' (an assistant message "
                            "with tool_calls may have none).")
        for call in calls or []:
            tool_call_json(call, where)
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing would be trained; "
                        "add the assistant's reply or drop the line.")


def tool_definitions(tools, where: str) -> list[dict] | None:
    """``tools`` (module docstring) checked and in OpenAI's form, ``{"type": "function", "function":
    {...}}`` each; None for none. DataError names ``where`` and what is wrong."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of function definitions, got {type(tools).__name__}.")
    definitions = []
    for index, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(tool, dict) and tool.get("type", "function") != "function":
            raise DataError(f"{where}: tool {index} has type {tool.get('type')!r}; only 'function' tools exist.")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise DataError(f"{where}: tool {index} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"description\": ..., \"parameters\": {{...}}}}}}, got {tool!r}.")
        definitions.append({"type": "function", "function": function})
    return definitions


def tools_text(tools: list[dict]) -> str:
    """The default template's list of offered tools: the introduction, then one function a line."""
    return "\n".join([TOOLS_INTRODUCTION, *(json.dumps(tool["function"], ensure_ascii=False, separators=(",", ":"))
                                           for tool in tools)])


def with_tools_in_system_turn(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` with the default template's tools text at the end of the system turn (a system
    message first when there is none); unchanged without tools."""
    if not tools:
        return messages
    if messages and messages[0]["role"] == "system":
        system = messages[0].get("content") or ""
        return [{**messages[0], "content": (system + "\n\n" if system else "") + tools_text(tools)}, *messages[1:]]
    return [{"role": "system", "content": tools_text(tools)}, *messages]


def tool_call_json(call, where: str = "tool call") -> str:
    """A tool call as the default template writes it: ``{"name": ..., "arguments": ...}``, compact."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where}: a tool call must be {{\"name\": ..., \"arguments\": {{...}}}}, got {call!r}.")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's format carries the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False,
                      separators=(",", ":"))


class ChatTemplate:
    """A Jinja chat template (``source`` names where it came from), or meshlm's default (``jinja=None``)."""

    def __init__(self, jinja: str | None = None, special_tokens: dict[str, str] | None = None, source: str = ""):
        self.jinja, self.source = jinja, source
        self.special_tokens = special_tokens or {}
        self._compiled = None if jinja is None else compile_jinja(jinja)

    @property
    def is_default(self) -> bool:
        return self.jinja is None

    def segments(self, messages: list[dict], tools: list[dict] | None = None) -> list[Segment]:
        """The rendered conversation (offered ``tools``, ``tool_definitions``' form, in its prompt) as
        segments flagged trained or not (module docstring), adjacent segments of the same flag joined
        and empty ones dropped."""
        found = default_segments(messages, tools) if self.is_default else self._jinja_segments(messages, tools)
        return join_runs([segment for segment in found if segment.text])

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The conversation followed by the assistant header: what a reply is generated after."""
        if self.is_default:
            return "".join(segment.text for segment in default_segments(messages, tools)) + "<|assistant|>\n"
        return self.render(messages, add_generation_prompt=True, tools=tools)

    def end_of_turn(self) -> str:
        """What the template writes after an assistant reply, stripped (``<|end|>``, ``<|im_end|>``, ...)."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE_REPLY}]
        reply = "".join(segment.text for segment in self.segments(probe) if segment.trained)
        return reply.split(PROBE_REPLY, 1)[-1].strip()

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         **self.special_tokens)
        except Exception as error:  # jinja2 errors, and raise_exception() called by the template
            raise DataError(f"{self.source}: the chat template failed on this conversation ({error}).") from error

    def _jinja_segments(self, messages: list[dict], tools: list[dict] | None = None) -> list[Segment]:
        segments, done = [], ""
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                header = self.render(messages[:k], add_generation_prompt=True, tools=tools)
                segments.append(Segment(self._added(done, header, k), False))
                done = header
            text = self.render(messages[:k + 1], tools=tools)
            added = self._added(done, text, k + 1)
            if message["role"] == "assistant":
                reply = added.rstrip()
                segments += [Segment(reply, True), Segment(added[len(reply):], False)]
            else:
                segments.append(Segment(added, False))
            done = text
        return segments

    def _added(self, before: str, after: str, count: int) -> str:
        if not after.startswith(before):
            raise DataError(f"{self.source}: the chat template renders the first {count} messages as text that does "
                            "not extend the rendering of fewer messages, so the trained part cannot be located; "
                            "delete chat_template from tokenizer_config.json to use meshlm's default template.")
        return after[len(before):]


def default_segments(messages: list[dict], tools: list[dict] | None = None) -> list[Segment]:
    """meshlm's default template (module docstring), as segments."""
    segments = []
    for message in with_tools_in_system_turn(messages, tools):
        role, content = message["role"], message.get("content") or ""
        if role == "assistant":
            calls = "".join("<|tool_call|>" + tool_call_json(call) for call in message.get("tool_calls") or [])
            segments += [Segment("<|assistant|>\n", False), Segment(content + calls + END_OF_TURN, True),
                         Segment("\n", False)]
        else:
            segments.append(Segment(f"<|{role}|>\n{content}{END_OF_TURN}\n", False))
    return segments


def join_runs(segments: list[Segment]) -> list[Segment]:
    """``segments`` with each run of adjacent equally flagged segments joined into one."""
    runs: list[Segment] = []
    for segment in segments:
        if runs and runs[-1].trained == segment.trained:
            runs[-1] = Segment(runs[-1].text + segment.text, segment.trained)
        else:
            runs.append(segment)
    return runs


def compile_jinja(source: str):
    """A Jinja template compiled as ``transformers`` does: sandboxed, trimmed blocks, ``tojson``
    keeping non-ASCII, and ``raise_exception`` for templates that check their input."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)


def load_chat_template(tokenizer_path: str | Path) -> ChatTemplate:
    """The chat template of the tokenizer at ``tokenizer_path`` (its ``tokenizer_config.json``'s
    ``chat_template``), or meshlm's default when it has none or jinja2 is not installed."""
    folder = Path(tokenizer_path) if Path(tokenizer_path).is_dir() else Path(tokenizer_path).parent
    config = tokenizer_config(folder)
    jinja = config.get("chat_template")
    if isinstance(jinja, list):  # several named templates: take the one named "default"
        jinja = next((entry.get("template") for entry in jinja if isinstance(entry, dict)
                      and entry.get("name") == "default"), None)
    if not isinstance(jinja, str):
        return ChatTemplate(source="meshlm default")
    try:
        import jinja2  # noqa: F401
    except ImportError:
        print(f"note: {folder / 'tokenizer_config.json'} has a chat_template but jinja2 is not installed, so "
              "meshlm's default template is used (pip install jinja2 to use the tokenizer's).", file=sys.stderr)
        return ChatTemplate(source="meshlm default")
    special = {key: (value.get("content") if isinstance(value, dict) else value) for key, value in config.items()
               if key.endswith("_token") and isinstance(value, (str, dict))}
    return ChatTemplate(jinja, {key: value for key, value in special.items() if isinstance(value, str)},
                        source=f"{folder / 'tokenizer_config.json'}")


def token_id(tokenizer: Tokenizer, token: str) -> int | None:
    """The id of ``token`` when the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer.encode(token, add_special_tokens=False) if token else []
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == token else None


def missing_special_tokens(tokenizer: Tokenizer, template: ChatTemplate) -> list[str]:
    """The default template's markers this tokenizer lacks (none for a tokenizer's own template)."""
    return [] if not template.is_default else [t for t in DEFAULT_SPECIAL_TOKENS if token_id(tokenizer, t) is None]


def encode_segments(tokenizer: Tokenizer, segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask of 0/1 per token): each run of equally flagged segments encoded alone."""
    ids, mask = [], []
    for run in join_runs(segments):
        encoded = tokenizer.encode(run.text, add_special_tokens=False)
        ids += encoded
        mask += [int(run.trained)] * len(encoded)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


__all__ = ["ChatTemplate", "DEFAULT_SPECIAL_TOKENS", "END_OF_TURN", "ROLES", "Segment", "TOOLS_INTRODUCTION",
           "check_messages", "default_segments", "encode_segments", "load_chat_template", "missing_special_tokens",
           "token_id", "tool_call_json", "tool_definitions", "tools_text"]
