"""``meshlm serve``: a model behind an OpenAI-compatible HTTP API, for the clients and tools that speak it.

    meshlm serve runs/sft [--host 127.0.0.1] [--port 8000] [--name sft] [--max-tokens 256]
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints (JSON in, JSON out; the request and response fields of OpenAI's API that apply):

* ``POST /v1/completions``: ``prompt`` (one string) continued as text;
* ``POST /v1/chat/completions``: ``messages`` (``role`` and ``content`` strings) rendered by the
  checkpoint tokenizer's chat template (``meshlm/inference/chat.py``, as ``meshlm chat`` renders
  them), the reply cut at the template's end of turn; a reply that opens with a think block comes
  back as ``reasoning_content`` beside ``content``, as reasoning models' APIs return it;
* ``GET /v1/models`` (the one model, by ``--name``) and ``GET /health``.

Sampling: ``max_tokens`` (or ``max_completion_tokens``; default ``--max-tokens``), ``temperature``
(0 is greedy decoding, as OpenAI defines it; default 1), ``top_p``, ``top_k`` (an extension, as
vLLM's), ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, in [-2, 2]),
``repetition_penalty`` (an extension, as vLLM's; ``penalties.py``), ``seed`` (default 0: the same
request gives the same reply), ``stop`` (up to 4 strings: the text ends before the first one found,
which is not returned), ``n`` (up to 16 replies, choice i sampled with seed + i; streamed as chunks
of each choice's index, then one with the usage alone) and ``stream``. With ``"stream": true`` the
reply comes as server-sent events, one ``data: {chunk}`` per piece of new text (``delta`` in chat,
``text`` in completions), a last chunk with ``finish_reason`` and ``usage``, then ``data: [DONE]``.
Text is held back while it could still become a stop string or ends inside a UTF-8 character, so
the streamed pieces join to exactly the non-streamed text. ``finish_reason`` is ``stop`` (end of
turn, eos or a stop string) or ``length`` (``max_tokens`` reached). ``usage`` counts the prompt's
and the reply's tokens.

Log-probabilities (``logprobs.py``): chat's ``logprobs: true`` with ``top_logprobs`` (0-20) returns
``logprobs.content``, one ``{token, logprob, bytes, top_logprobs}`` per reply token; completions'
``logprobs: N`` (0-20) returns the legacy parallel lists (``tokens``, ``token_logprobs``,
``top_logprobs`` -- the N likeliest plus the chosen token --, ``text_offset``: offsets into the
joined token texts), and ``echo: true`` puts the prompt before the reply and scores its tokens too
(the first one's is null), with ``max_tokens`` 0 for the prompt alone: how evaluation harnesses
read a continuation's log-likelihood. They are the model's own distribution (before temperature,
top-k/p and penalties): the reply's tokens scored by the continuous batcher as they are drawn, the
prompt's by one forward over it; the end token is not listed. Streamed, each chunk carries the
log-probabilities of the tokens that came since the choice's previous chunk (``text_offset``
counting on across chunks), the last chunk those whose text a stop string cut, so the chunks'
lists join to the whole reply's; with ``echo`` the first chunk is the prompt. A server without
the batcher (a LongRoPE model) scores a whole reply after it and returns them unstreamed only.

Tool calling (chat): ``tools`` (OpenAI's function definitions) are rendered into the prompt by the
chat template (``meshlm/data/chat.py``, as SFT rendered them), and the calls a reply writes --
meshlm's ``<|tool_call|>{json}``, Hermes' ``<tool_call>{json}</tool_call>``, Mistral's
``[TOOL_CALLS]`` or Llama 3's JSON reply, whichever the template uses (``tool_calls.py``) -- come
back as ``message.tool_calls`` (``id``, ``type``, ``function.name``, ``function.arguments`` as a
JSON string) with the text before them as the content and ``finish_reason`` ``tool_calls``;
streamed, the content's pieces stop at the first call marker and the calls come whole in one
``delta.tool_calls`` when the reply ends. Messages carry the conversation on: an assistant's
``tool_calls`` and a ``tool`` message's result (with its ``tool_call_id``). ``parallel_tool_calls``
false returns a reply's first call only. ``tool_choice``: ``auto`` (the model decides), ``none``
(tools not offered), ``required`` or a named function (``{"type": "function", "function": {"name":
...}}``): the prompt then ends with the start of a call -- the format's marker, and for a named
function the call's JSON up to its arguments (``tool_calls.forced_call_prefix``) -- and the model
writes the rest of exactly one call, held by constrained decoding to an offered function's name and
its ``parameters`` schema (``tool_calls.forced_call_grammar``; a schema with keywords decoding cannot
hold to, such as ``pattern``, leaves the arguments any JSON object). With ``auto``, where the format's
call marker is one token (meshlm's ``<|tool_call|>``, Qwen's ``<tool_call>``, Mistral's
``[TOOL_CALLS]``), the text is free until the model writes the marker, the call after it is held
to the same grammar, and after a call only whitespace, another call or the end may follow
(``constrained/triggered.py``: ``CallsInText``). A model whose template has no call format meshlm
reads gets ``tools`` refused.

Structured outputs: ``response_format`` ``{"type": "json_object"}`` holds the reply to one JSON
object, ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` to one document of
the schema (``constrained/``: before each token, those that cannot lead to a document the schema
accepts are set to -inf, and the reply ends where the document does, ``finish_reason`` ``stop``;
a reasoning model may think first: a reply that opens a think block is free until it closes, and
the document follows, ``AfterThinking``).
Keywords that bound values by content (``pattern``, ``format``, ``minimum``, ...) are refused by
name; ``response_format`` with ``tools`` is refused (a reply is either a document or a call).
Grammars are kept by schema, so repeated requests with one schema reuse its token masks.

Fields meshlm cannot honour are refused rather than ignored -- ``functions`` (the deprecated form of
``tools``), ``logit_bias``, ``best_of``, ``suffix`` -- with status 400 and one sentence naming the
field (OpenAI's error object: ``{"error": {"message", "type", "param"}}``); unknown fields are
ignored, as OpenAI's clients send many. A prompt that does not fit the model's positions, or a bad value, is a 400 too;
nothing a request does stops the server.

Concurrent requests are decoded together by continuous batching (``continuous_batching.py``): a
request joins the running batch before the next decode step and leaves it when its reply ends, up
to ``--max-batch-size`` at once (default 8), and gets the tokens it would get alone. Its tokens
reach the response as they are drawn: the batcher's thread turns them into text and hands the
pieces to the request's own thread, which writes them, so a slow client never holds up the
batch. ``--max-batch-size 1`` serves them one at a time in the order they arrive; a LongRoPE
model, whose batch cannot be shared, is served that way by ``generate`` under a lock. A
client that closes a streamed reply's connection stops its generation at the next token.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from meshlm.data.chat import load_chat_template, token_id, tool_definitions
from meshlm.data.reasoning import THINK_END, THINK_START
from meshlm.data.tokenizer import Tokenizer
from meshlm.errors import ConfigError, DataError
from meshlm.inference.chat import conversation_prompt, stop_ids
from meshlm.inference.constrained.grammar import Grammar, GrammarCache
from meshlm.inference.constrained.response_format import response_format_grammar
from meshlm.inference.constrained.token_constraint import DecodingConstraint, TokenConstraint
from meshlm.inference.constrained.triggered import AfterThinking, CallsInText
from meshlm.inference.continuous_batching import ContinuousBatcher, GenerationRequest
from meshlm.inference.generate import generate
from meshlm.inference.logprobs import TokenLogProb, sequence_log_probs
from meshlm.inference.sampling import SamplingConfig
from meshlm.inference.tool_calls import (MISTRAL_ARGUMENTS, ToolCall, ToolCallSyntax, forced_call_grammar,
                                         forced_call_prefix, split_tool_calls, tool_call_syntax)

MAX_STOP_STRINGS = 4
REFUSED = ("functions", "logit_bias", "best_of", "suffix")
MAX_CHOICES = 16
"""The most replies (``n``) one request may ask for."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives a token's log-probabilities list (OpenAI's bound for chat's ``top_logprobs``)."""
"""Fields meshlm does not implement: refused unless they hold their default (0, false, null, empty)."""
MESSAGES_FORMAT = "messages must be a non-empty list of {\"role\": ..., \"content\": \"text\"} objects."


class RequestError(Exception):
    """A request meshlm refuses: the HTTP status, one sentence, and the field it is about."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.error_type = message, param, status, error_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param}}


def server_failure(error: Exception) -> RequestError:
    """A failure inside meshlm (a bug) as the 500 its client gets."""
    return RequestError(f"meshlm serve failed on this request: {type(error).__name__}: {error}", status=500,
                        error_type="server_error")


@dataclass
class ServedModel:
    """What the server answers with: the model, its tokenizer and the defaults of ``meshlm serve``."""

    name: str
    model: object
    tokenizer: Tokenizer
    eos_token_id: int | list[int] | None
    max_tokens: int = 256
    """New tokens when a request names no ``max_tokens``."""
    batcher: ContinuousBatcher | None = None
    """Decodes concurrent requests together (``meshlm serve --max-batch-size``); None: one at a time,
    each by ``generate`` under ``lock``."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    grammars: GrammarCache | None = None
    """The grammars of the requests held to a schema so far (``response_format``, forced tool calls),
    made on first use."""
    grammars_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def valid_vocab_size(self) -> int:
        return min(self.tokenizer.vocab_size, self.model.config.vocab_size)

    def grammar(self, key: str, node) -> Grammar:
        """The grammar kept under ``key`` over this model's vocabulary (``GrammarCache``)."""
        with self.grammars_lock:
            if self.grammars is None:
                self.grammars = GrammarCache(self.tokenizer, self.valid_vocab_size)
        return self.grammars.grammar(key, node)


@dataclass
class CompletionRequest:
    """One request's prompt ids, the ids that end its reply, and how to sample it."""

    prompt_ids: list[int]
    end_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: list[str]
    stream: bool
    chat: bool
    top_logprobs: int | None = None
    """Return each reply token's log-probability and this many likeliest alternatives (None: no
    log-probabilities; chat's ``logprobs`` + ``top_logprobs``, completions' ``logprobs``)."""
    echo: bool = False
    """Completions: the prompt comes back before the reply, its tokens scored too with logprobs."""
    n: int = 1
    """Replies (choices) to the one prompt; choice i samples with seed ``seed + i``."""
    tool_syntax: ToolCallSyntax | None = None
    """Chat with ``tools`` offered: how the model marks a call, read back out of its replies."""
    one_tool_call: bool = False
    """``parallel_tool_calls: false``: a reply's first call only is returned."""
    reply_prefix: str = ""
    """``tool_choice`` required or a named function: the start of a call, put at the end of the
    prompt (``tool_calls.forced_call_prefix``) and read as the start of each reply."""
    grammar: Grammar | None = None
    """The grammar each reply is held to (``response_format``, or the forced call), None: free text."""
    grammar_written: bytes = b""
    """The part of the grammar's document the prompt already holds (the forced call's opening)."""
    call_marker: int | None = None
    """``tool_choice`` auto: the grammar holds each call after this marker token, the rest is free."""
    think: tuple[int, int] | None = None
    """A reasoning model's think tokens: the grammar holds the reply after its think block."""

    def constraint(self) -> DecodingConstraint | None:
        """A new reply's constraint (one per choice), or None."""
        if self.grammar is None:
            return None
        if self.call_marker is not None:
            return CallsInText(self.grammar, self.call_marker, self.end_ids)
        if self.think is not None:
            return AfterThinking(self.grammar, self.end_ids, self.think)
        return TokenConstraint(self.grammar, self.end_ids, self.grammar_written)

    def choice_sampling(self, index: int) -> SamplingConfig:
        """Choice ``index``'s sampling: the request's, its seed moved on by the index."""
        return dataclasses.replace(self.sampling, seed=self.sampling.seed + index)


def _number(body: dict, name: str, default, kind=float, low=None, high=None, low_open: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    whole = isinstance(value, (int, float)) and float(value).is_integer()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not whole):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, not {value!r}.", name)
    value = kind(value)
    if low is not None and (value <= low if low_open else value < low) or high is not None and value > high:
        bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise RequestError(f"{name}={value} must be {bounds}.", name)
    return value


def message_text(content) -> str:
    """A message's ``content``: a string, or OpenAI's list of parts of which meshlm takes the text ones."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        kinds = {part.get("type") for part in content}
        if kinds <= {"text"} and all(isinstance(part.get("text"), str) for part in content):
            return "".join(part["text"] for part in content)
        raise RequestError(f"message content parts of type {sorted(map(str, kinds - {'text'}))} are not supported: "
                           "meshlm serve reads text parts only.", "messages")
    raise RequestError(MESSAGES_FORMAT, "messages")


def parse_request(body, chat: bool, served: ServedModel) -> CompletionRequest:
    """A request's JSON body checked field by field (the module docstring); RequestError names the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object.")
    for name in REFUSED:
        if body.get(name):  # 0, false, null and [] are the defaults: accepted
            raise RequestError(f"{name} is not supported by meshlm serve; leave it out.", name)
    try:
        grammar = response_format_grammar(body.get("response_format"))  # (key, node) or None
    except ConfigError as error:
        raise RequestError(str(error), "response_format") from error
    grammar_field, grammar_written, call_marker = "response_format", b"", None
    choices = _number(body, "n", 1, int, low=1, high=MAX_CHOICES)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(message, dict) and isinstance(message.get("role"), str) for message in messages):
            raise RequestError(MESSAGES_FORMAT, "messages")
        messages = [request_message(message) for message in messages]
        tools, tool_syntax, reply_prefix, call_grammar = tool_fields(body, served)
        if grammar is not None and tools is not None:
            raise RequestError("response_format and tools cannot be combined: a reply is either held to the schema "
                               "or free to call a tool; drop one (or set tool_choice to none).", "response_format")
        if call_grammar is not None:
            grammar, grammar_field = call_grammar[:2], "tool_choice"
            grammar_written, call_marker = call_grammar[2:]
        try:
            prompt_ids, end_ids = conversation_prompt(served.tokenizer, messages, tools), stop_ids(served.tokenizer)
        except (ConfigError, DataError) as error:
            raise RequestError(str(error), "messages") from error
        prompt_ids += served.tokenizer.encode(reply_prefix, add_special_tokens=False) if reply_prefix else []
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be one string (meshlm serve answers one prompt a request).", "prompt")
        if body.get("tools"):
            raise RequestError("tools belong to /v1/chat/completions.", "tools")
        prompt_ids, tool_syntax, reply_prefix = served.tokenizer.encode(prompt), None, ""
        eos = served.eos_token_id
        end_ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    if not prompt_ids:
        raise RequestError("the prompt is empty: give at least one token of text.", "messages" if chat else "prompt")
    top_logprobs, echo = log_prob_fields(body, chat)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, served.max_tokens, int, low=0 if echo else 1)
    temperature = _number(body, "temperature", 1.0, float, low=0.0, high=2.0)
    top_p = _number(body, "top_p", 1.0, float, low=0.0, high=1.0, low_open=True)
    top_k = _number(body, "top_k", 0, int, low=0)
    seed = _number(body, "seed", 0, int, low=0, high=2 ** 63 - 1)
    penalties = {"presence_penalty": _number(body, "presence_penalty", 0.0, float, low=-2.0, high=2.0),
                 "frequency_penalty": _number(body, "frequency_penalty", 0.0, float, low=-2.0, high=2.0),
                 "repetition_penalty": _number(body, "repetition_penalty", 1.0, float, low=0.0, low_open=True)}
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them.", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, not {stream!r}.", "stream")
    if stream and (top_logprobs is not None or echo) and served.batcher is None:
        raise RequestError("this server decodes one request at a time (a LongRoPE model) and returns logprobs and "
                           "echo with whole replies only; set stream to false to get them.",
                           "logprobs" if top_logprobs is not None else "echo")
    sampling = (SamplingConfig(greedy=True, seed=seed, **penalties) if temperature == 0 else
                SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **penalties))
    request = CompletionRequest(prompt_ids, end_ids, max_tokens, sampling, list(stop), stream, chat, top_logprobs,
                                echo, choices, tool_syntax, body.get("parallel_tool_calls", True) is False,
                                reply_prefix)
    if grammar is not None:
        request.grammar, request.grammar_written = served.grammar(*grammar), grammar_written
        request.call_marker = call_marker
        think = token_id(served.tokenizer, THINK_START), token_id(served.tokenizer, THINK_END)
        if chat and grammar_field == "response_format" and None not in think:
            request.think = think
        try:  # refused here, before a streamed reply's headers go
            TokenConstraint(request.grammar, request.end_ids, grammar_written)
        except ConfigError as error:
            raise RequestError(str(error), grammar_field) from error
    return request


def request_message(message: dict) -> dict:
    """One chat message as the template gets it: its role and text, an assistant's ``tool_calls``
    (its content may then be null) and a tool result's ``tool_call_id`` and ``name``."""
    calls = message.get("tool_calls")
    if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
        raise RequestError("tool_calls belong to assistant messages, as a list of calls.", "messages")
    content = message.get("content")
    kept = {"role": message["role"], "content": "" if content is None and calls else message_text(content)}
    if calls:
        kept["tool_calls"] = calls
    kept.update({key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)})
    return kept


def tool_fields(body: dict, served: ServedModel) -> tuple[list[dict] | None, ToolCallSyntax | None, str,
                                                          tuple | None]:
    """(the offered functions in OpenAI's form, how the model marks a call, the start of a call that
    ``tool_choice`` forces or "", the calls' grammar or None), or (None, None, "", None) without
    ``tools`` or with ``tool_choice: "none"``; what meshlm cannot do is refused by field. The grammar
    is ``(key, node, bytes the prompt holds, marker id)``: for a forced call that of
    ``tool_calls.forced_call_grammar`` (marker None: it holds from the first token); with ``auto``, for
    a format whose call marker is one token, the grammar of any call after it (``CallsInText``)."""
    choice = body.get("tool_choice")
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise RequestError("parallel_tool_calls must be true or false.", "parallel_tool_calls")
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) else None
    if choice not in (None, "auto", "none", "required") and not (isinstance(named, str) and named):
        raise RequestError(f"tool_choice={choice!r} must be 'auto', 'none', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    try:
        tools = tool_definitions(body.get("tools"), "tools")
    except DataError as error:
        raise RequestError(str(error), "tools") from error
    forced = choice == "required" or named is not None
    if forced:
        if tools is None:
            raise RequestError("tool_choice asks for a call but no tools are offered; add tools.", "tool_choice")
        if named is not None and named not in [tool["function"]["name"] for tool in tools]:
            raise RequestError(f"tool_choice names the function {named!r}, which tools does not offer.", "tool_choice")
    if tools is None or choice == "none":
        return None, None, "", None
    template = load_chat_template(served.tokenizer.source)
    syntax = tool_call_syntax(served.tokenizer, template)
    if syntax is None:
        raise RequestError(f"{served.name}'s chat template writes tool calls in no format meshlm reads (meshlm's "
                           "<|tool_call|>, Hermes' <tool_call>, Mistral's [TOOL_CALLS] or Llama 3's JSON reply); "
                           "leave tools out.", "tools")
    if forced:
        key, node, written = forced_call_grammar(syntax, template, tools, named)
        return tools, syntax, forced_call_prefix(syntax, template, named), (key, node, written, None)
    marker = token_id(served.tokenizer, syntax.start)
    if syntax.whole_reply or marker is None or MISTRAL_ARGUMENTS in (template.jinja or ""):
        return tools, syntax, "", None  # no single marker token to wait for: the calls are read as written
    key, node, _ = forced_call_grammar(syntax, template, tools)
    return tools, syntax, "", ("after marker " + key, node, b"", marker)


def log_prob_fields(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(how many alternatives each token's log-probabilities list, None: none; echo): chat's
    ``logprobs`` (true/false) with ``top_logprobs``, completions' ``logprobs`` (a count) and ``echo``."""
    if chat:
        wanted = body.get("logprobs") or False
        if not isinstance(wanted, bool):
            raise RequestError(f"logprobs must be true or false in chat, not {wanted!r}.", "logprobs")
        top = _number(body, "top_logprobs", 0, int, low=0, high=MAX_TOP_LOGPROBS)
        if body.get("top_logprobs") is not None and not wanted:
            raise RequestError("top_logprobs needs logprobs: true.", "top_logprobs")
        if body.get("echo"):
            raise RequestError("echo belongs to /v1/completions; chat replies never repeat the messages.", "echo")
        return (top if wanted else None), False
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise RequestError(f"echo must be true or false, not {echo!r}.", "echo")
    if body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs belongs to chat; in /v1/completions logprobs is the count.", "top_logprobs")
    logprobs = body.get("logprobs")
    return (None if logprobs is None or logprobs is False
            else _number(body, "logprobs", 0, int, low=0, high=MAX_TOP_LOGPROBS)), echo


class ReplyText:
    """The reply as its tokens arrive: the text so far, the stop strings looked for in it, and how
    much of it may be sent (not what could still grow into a stop string or a UTF-8 character).

    In chat, where the tokenizer has ``<think>`` and ``</think>`` as single tokens (``meshlm
    preprocess --chat`` adds them), a reply opening with ``<think>`` is its reasoning up to
    ``</think>`` and its answer after, each stripped of the whitespace around it (trailing
    whitespace is held back until more text follows); elsewhere the reply is all answer."""

    def __init__(self, tokenizer: Tokenizer, end_ids: list[int], stop: list[str], chat: bool,
                 tool_syntax: ToolCallSyntax | None = None, prefix: str = ""):
        self.tokenizer, self.end_ids, self.stop = tokenizer, end_ids, stop
        self.prefix = prefix
        """The start of the reply the prompt already holds (a forced tool call): read as the reply's own."""
        self.tool_syntax = tool_syntax
        """With tools offered: the text from the first call marker on is held back (not content) and
        read as calls when the reply ends (``finish``); the reply is decoded with special tokens kept."""
        self.calls: list[ToolCall] = []
        self.finished = False
        self.ids: list[int] = []
        self.text, self.reasoning, self.ended = "", "", False
        """``ended``: by an end id or a stop string (else the reply ran to max_tokens)."""
        self.sent = self.reasoning_sent = 0
        self.log_probs_sent = 0
        """Streamed with log-probabilities: how many of the reply's tokens have had theirs sent."""
        start, end = token_id(tokenizer, THINK_START), token_id(tokenizer, THINK_END)
        self.think = (start, end) if chat and start is not None and end is not None else None

    def add(self, token: int) -> bool:
        """Take one token; True when the reply has ended (end id or stop string)."""
        if token in self.end_ids:
            self.ended = True
            self.finish()
            return True
        self.ids.append(token)
        answer = self.ids
        if self.think is not None and self.ids[0] == self.think[0]:
            close = self.ids.index(self.think[1]) if self.think[1] in self.ids else len(self.ids)
            self.reasoning = self.tokenizer.decode(self.ids[1:close]).strip()
            answer = self.ids[close + 1:]
            self.text = self.decode(answer).lstrip()
        else:
            self.text = self.prefix + self.decode(answer)
        found = [index for index in (self.text.find(stop) for stop in self.stop) if index >= 0]
        if found:
            self.text, self.ended = self.text[:min(found)], True
            self.finish()
        return self.ended

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.tool_syntax is None)

    @property
    def content(self) -> str:
        """The text before the first tool-call marker (all of it without tools offered)."""
        start = -1 if self.tool_syntax is None else self.tool_syntax.call_start(self.text)
        return self.text if start < 0 else self.text[:start]

    def finish(self) -> None:
        """The reply has ended: read its tool calls (once). Well-formed ones leave the text before them
        as the content; otherwise the whole text is content (``tool_calls.split_tool_calls``)."""
        if self.tool_syntax is not None and not self.finished:
            self.text, self.calls = split_tool_calls(self.text, self.tool_syntax)
        self.finished = True

    def _sendable(self, text: str, final: bool, stops: list[str]) -> int:
        if final:
            return len(text)
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)  # a character still being spelt
        held = max((size for stop in stops for size in range(len(stop) - 1, 0, -1)
                    if text[:end].endswith(stop[:size])), default=0)
        return end - held

    def new_pieces(self, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) text not sent yet that can be sent now."""
        reasoning_done = final or (self.think is not None and self.think[1] in self.ids)
        reasoning_end = self._sendable(self.reasoning, reasoning_done, [])
        text = self.text if final else self.content  # a call being written is not content
        held = self.stop + ([self.tool_syntax.start] if self.tool_syntax is not None
                            and not self.tool_syntax.whole_reply else [])
        answer_end = self._sendable(text, final, held)
        pieces = (self.reasoning[self.reasoning_sent:reasoning_end], text[self.sent:answer_end])
        self.reasoning_sent, self.sent = max(self.reasoning_sent, reasoning_end), max(self.sent, answer_end)
        return pieces


Pieces = Callable[[int, str, str, list[TokenLogProb]], None]
"""``on_pieces(choice, reasoning, answer, log_probs)``: a streamed reply's next sendable text and the
log-probabilities of the tokens drawn since the previous call (empty unless the request asks)."""


def run_completion(served: ServedModel, request: CompletionRequest, on_pieces: Pieces | None = None) -> dict:
    """Generate a request's ``n`` replies (``on_pieces`` with each sendable piece, to stream them):
    ``{"choices": [{"text", "reasoning", "finish_reason"[, "logprobs"]}], "usage"}``."""
    replies = [ReplyText(served.tokenizer, request.end_ids, request.stop, request.chat, request.tool_syntax,
                         request.reply_prefix) for _ in range(request.n)]
    constraints = [request.constraint() for _ in replies]
    try:
        if request.max_tokens == 0:  # echo alone: the prompt scored, nothing generated
            new_ids, scored = [[] for _ in replies], [[] for _ in replies]
        elif served.batcher is not None:
            new_ids, scored = batched_choices(served.batcher, request, replies, on_pieces, constraints)
        else:
            new_ids, scored = sequential_choices(served, request, replies, on_pieces, constraints), None
    except ConfigError as error:  # a prompt too long for the model's positions, say
        raise RequestError(str(error), "messages" if request.chat else "prompt") from error
    echoed = prompt_log_probs(served, request) if scored is not None and on_pieces is None else []  # once for all
    choices = []
    for index, (reply, ids, constraint) in enumerate(zip(replies, new_ids, constraints)):
        kept = len(ids) - 1 if ids and ids[-1] in request.end_ids else len(ids)  # not the end token
        whole = constraint is not None and constraint.complete  # a document that ended by itself
        reply.finish()
        if request.one_tool_call:
            reply.calls = reply.calls[:1]
        if on_pieces is not None:  # what the last token left held back (a reply that ran to max_tokens)
            rest = reply.new_pieces(final=True)
            unsent = scored[index][reply.log_probs_sent:kept] if scored is not None else []
            if any(rest) or unsent:
                on_pieces(index, *rest, unsent)
        choice = {"text": reply.text, "reasoning": reply.reasoning, "tool_calls": reply.calls,
                  "finish_reason": "tool_calls" if reply.calls else "stop" if reply.ended or whole else "length"}
        if request.top_logprobs is not None and on_pieces is None:  # (streamed: sent with the pieces)
            choice["logprobs"] = (scored_tokens(served, request, ids[:kept]) if scored is None
                                  else echoed + scored[index][:kept])
        choices.append(choice)
    prompt, completion = len(request.prompt_ids), sum(len(ids) for ids in new_ids)
    return {"choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def token_handler(reply: ReplyText, index: int, send: Pieces | None,
                  scored: list[TokenLogProb] | None = None) -> Callable[[int], bool]:
    """The per-token callback of choice ``index``: ``reply`` takes the token, the pieces it makes
    sendable go to ``send`` with the log-probabilities in ``scored`` (the batcher's list for the
    choice, the token's already in it) not sent yet -- an end token's never; True once the reply
    has ended."""
    def on_token(token: int) -> bool:
        ended = reply.add(token)
        if send is not None:
            pieces = reply.new_pieces(final=ended)
            if any(pieces):
                scored_end = len(scored or ()) - (token in reply.end_ids)
                new_log_probs = scored[reply.log_probs_sent:scored_end] if scored else []
                reply.log_probs_sent = max(reply.log_probs_sent, scored_end)
                send(index, *pieces, new_log_probs)
        return ended
    return on_token


def sequential_choices(served: ServedModel, request: CompletionRequest, replies: list[ReplyText],
                       on_pieces: Callable[[int, str, str], None] | None,
                       constraints: list[DecodingConstraint | None]) -> list[list[int]]:
    """The choices' new ids one after another by ``generate`` under the model's lock (one request at
    a time), pieces handed to ``on_pieces`` as they are drawn."""
    new_ids = []
    with served.lock:
        for index, reply in enumerate(replies):
            on_token = token_handler(reply, index, on_pieces)  # no log-probabilities streamed (parse_request)
            new_ids.append(generate(served.model, [request.prompt_ids], request.max_tokens,
                                    request.choice_sampling(index), eos_token_id=request.end_ids or None,
                                    valid_vocab_size=served.valid_vocab_size,
                                    on_token=lambda row, token: on_token(token),
                                    constraints=None if constraints[index] is None else [constraints[index]])[0])
    return new_ids


def batched_choices(batcher: ContinuousBatcher, request: CompletionRequest, replies: list[ReplyText],
                    on_pieces: Pieces | None, constraints: list[DecodingConstraint | None]
                    ) -> tuple[list[list[int]], list[list[TokenLogProb]]]:
    """The choices' new ids and their tokens' log-probabilities (empty unless asked for) from the
    batcher, decoded side by side: its thread adds each token to its reply and queues the sendable
    pieces, which this (the request's) thread hands to ``on_pieces`` as they come. Should
    ``on_pieces`` raise (the client went away), the choices are cancelled: they leave the batch at
    their next token."""
    pieces: queue.SimpleQueue = queue.SimpleQueue()
    finished = object()
    queued = None if on_pieces is None else lambda *item: pieces.put(item)
    jobs = [GenerationRequest(request.prompt_ids, request.max_tokens, request.choice_sampling(index),
                              request.end_ids, on_done=lambda: pieces.put(finished),
                              top_logprobs=request.top_logprobs, constraint=constraints[index])
            for index in range(len(replies))]
    for index, (job, reply) in enumerate(zip(jobs, replies)):
        job.on_token = token_handler(reply, index, queued, job.log_probs)
    batcher.check(jobs[0])  # the same prompt for all: refused before any is queued
    for job in jobs:
        batcher.submit(job)
    try:
        remaining = len(jobs)
        while remaining:
            item = pieces.get()
            if item is finished:
                remaining -= 1
            else:
                on_pieces(*item)
    except BaseException:
        for job in jobs:
            job.cancel()
        raise
    return [job.wait() for job in jobs], [job.log_probs for job in jobs]


def prompt_log_probs(served: ServedModel, request: CompletionRequest) -> list[TokenLogProb]:
    """With ``echo``, the prompt's tokens scored (the first has no log-probability): one forward on
    the batcher's thread; else nothing."""
    if not request.echo or request.top_logprobs is None:
        return []
    return with_the_model(served, lambda: sequence_log_probs(served.model, request.prompt_ids, 0,
                                                             request.top_logprobs, served.valid_vocab_size))


def with_the_model(served: ServedModel, work: Callable[[], list]) -> list:
    """``work()`` where nothing else uses the model meanwhile: on the batcher's thread, or under the lock."""
    if served.batcher is not None:
        return served.batcher.call(work)
    with served.lock:
        return work()


def scored_tokens(served: ServedModel, request: CompletionRequest, reply_ids: list[int]) -> list[TokenLogProb]:
    """The reply's tokens (with ``echo`` the prompt's first) and their log-probabilities, scored in
    one forward on the thread that owns the model (``logprobs.py``)."""
    first = 0 if request.echo else len(request.prompt_ids)
    return with_the_model(served, lambda: sequence_log_probs(served.model, request.prompt_ids + reply_ids, first,
                                                             request.top_logprobs, served.valid_vocab_size))


def completion_body(served: ServedModel, request: CompletionRequest, result: dict, reply_id: str, created: int
                    ) -> dict:
    """The non-streamed response object."""
    choices = []
    for index, reply in enumerate(result["choices"]):
        if request.chat:
            message = {"role": "assistant", "content": reply["text"] or (None if reply["tool_calls"] else "")}
            if reply["reasoning"]:
                message["reasoning_content"] = reply["reasoning"]
            if reply["tool_calls"]:
                message["tool_calls"] = [call.as_openai() for call in reply["tool_calls"]]
            choice = {"index": index, "message": message, "finish_reason": reply["finish_reason"]}
            if "logprobs" in reply:
                choice["logprobs"] = chat_logprobs(served.tokenizer, reply["logprobs"])
        else:
            prompt_text = served.tokenizer.decode(request.prompt_ids) if request.echo else ""
            choice = {"index": index, "text": prompt_text + reply["text"], "finish_reason": reply["finish_reason"]}
            if "logprobs" in reply:
                choice["logprobs"] = completion_logprobs(served.tokenizer, reply["logprobs"])
            elif request.echo:
                choice["logprobs"] = None
        choices.append(choice)
    return {"id": reply_id, "object": "chat.completion" if request.chat else "text_completion", "created": created,
            "model": served.name, "choices": choices, "usage": result["usage"]}


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """A token's own text: its bytes as UTF-8, U+FFFD for part of a character."""
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def token_entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict:
    """One token as chat's logprobs spell it: its text, log-probability and raw bytes (a token may hold
    part of a UTF-8 character, whose text is then U+FFFD)."""
    return {"token": token_text(tokenizer, token), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token))}


def chat_logprobs(tokenizer: Tokenizer, scored: list[TokenLogProb]) -> dict:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    return {"content": [{**token_entry(tokenizer, item.token, item.logprob),
                         "top_logprobs": [token_entry(tokenizer, token, logprob) for token, logprob in item.top]}
                        for item in scored]}


def completion_logprobs(tokenizer: Tokenizer, scored: list[TokenLogProb], offset: int = 0) -> dict:
    """Completions' ``logprobs``: parallel lists of the tokens' text, log-probabilities (None for the
    prompt's first token), the likeliest alternatives scored (``logprobs``: N) plus the chosen token ({text:
    log-probability}), and each token's character offset in the tokens' texts joined (from ``offset``:
    where a streamed chunk's tokens start)."""
    tokens, offsets, length = [], [], offset
    for item in scored:
        text = token_text(tokenizer, item.token)
        tokens.append(text)
        offsets.append(length)
        length += len(text)
    alternatives = []
    for item, text in zip(scored, tokens):
        if item.logprob is None:
            alternatives.append(None)
            continue
        choices = {token_text(tokenizer, token): logprob for token, logprob in item.top}
        choices.setdefault(text, item.logprob)
        alternatives.append(choices)
    return {"tokens": tokens, "token_logprobs": [item.logprob for item in scored], "top_logprobs": alternatives,
            "text_offset": offsets}


def chunk_body(served: ServedModel, request: CompletionRequest, reply_id: str, created: int, index: int = 0,
               reasoning: str = "", text: str = "", finish_reason: str | None = None, usage: dict | None = None,
               first: bool = False, logprobs: dict | None = None, tool_calls: list[ToolCall] = ()) -> dict:
    """One streamed chunk of choice ``index``: new text (``delta`` in chat, the ``role`` in the
    choice's first) and its tokens' ``logprobs`` (chat's or completions' form, already built), or
    its last one with ``finish_reason``; ``index`` None: no choice, the usage alone (after the last
    choice's end, when there are several)."""
    kind = "chat.completion.chunk" if request.chat else "text_completion"
    if index is None:
        choices = []
    elif request.chat:
        delta = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:  # each whole, in one delta (a reply's calls are read when it ends)
            delta["tool_calls"] = [{"index": number, **call.as_openai()} for number, call in enumerate(tool_calls)]
        choices = [{"index": index, "delta": delta, "finish_reason": finish_reason}]
    else:
        choices = [{"index": index, "text": text, "finish_reason": finish_reason}]
    if logprobs is not None:
        choices[0]["logprobs"] = logprobs
    body = {"id": reply_id, "object": kind, "created": created, "model": served.name, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


class ClientGone(Exception):
    """The client closed the connection of a streamed reply: its generation stops there."""


class Handler(BaseHTTPRequestHandler):
    """One HTTP request: routes, JSON bodies, errors as OpenAI's error object."""

    served: ServedModel
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 -- the base class's name
        pass  # one line per request would flood a terminal; errors are returned to the client

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 -- the base class's name
        if self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{"id": self.served.name, "object": "model",
                                                               "created": 0, "owned_by": "meshlm"}]})
        elif self.path == "/health":
            self._send_json(200, {"status": "ok"})
        else:
            self._send_json(404, RequestError(f"no route GET {self.path}; use /v1/models or /health.",
                                              status=404).body())

    def do_POST(self):  # noqa: N802 -- the base class's name
        routes = {"/v1/completions": False, "/v1/chat/completions": True}
        if self.path not in routes:
            self._send_json(404, RequestError(f"no route POST {self.path}; use /v1/completions or "
                                              "/v1/chat/completions.", status=404).body())
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise RequestError(f"the request body is not valid JSON ({error}).") from error
            request = parse_request(body, routes[self.path], self.served)
            reply_id, created = f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
            if request.stream:
                self._stream(request, reply_id, created)
                return
            result = run_completion(self.served, request)
            self._send_json(200, completion_body(self.served, request, result, reply_id, created))
        except RequestError as error:
            self._send_json(error.status, error.body())
        except Exception as error:  # noqa: BLE001 -- a bug: the client hears of it, the server goes on
            failure = server_failure(error)
            self._send_json(failure.status, failure.body())

    def _stream(self, request: CompletionRequest, reply_id: str, created: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        started: set[int] = set()  # the choices whose first chunk (with chat's role) has gone
        offsets = [0] * request.n  # completions' text_offset: the characters of token text sent per choice

        def event(body) -> None:
            try:
                self.wfile.write(f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode())
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError) as error:  # the client went away: stop generating
                raise ClientGone from error

        def chunk(index: int, **fields) -> None:
            event(chunk_body(self.served, request, reply_id, created, index, first=index not in started, **fields))
            started.add(index)

        def pieces(index: int, reasoning: str, text: str, log_probs: list[TokenLogProb]) -> None:
            logprobs = None
            if request.top_logprobs is not None and request.chat:
                logprobs = chat_logprobs(self.served.tokenizer, log_probs)
            elif request.top_logprobs is not None:
                logprobs = completion_logprobs(self.served.tokenizer, log_probs, offsets[index])
                offsets[index] += sum(map(len, logprobs["tokens"]))
            chunk(index, reasoning=reasoning, text=text, logprobs=logprobs)

        try:
            try:
                if request.echo:  # the prompt first, in each choice's first chunk
                    prompt_text, scored = self.served.tokenizer.decode(request.prompt_ids), prompt_log_probs(
                        self.served, request)
                    for index in range(request.n):
                        pieces(index, "", prompt_text, scored)
                result = run_completion(self.served, request, pieces)
            except ClientGone:
                raise
            except RequestError as error:  # after the headers: the error goes as one event
                event(error.body())
                return
            except Exception as error:  # noqa: BLE001 -- a bug, after the headers: one event too
                event(server_failure(error).body())
                return
            for index, choice in enumerate(result["choices"]):
                if choice["tool_calls"]:
                    chunk(index, tool_calls=choice["tool_calls"])
            if request.n == 1:  # the usage in the one choice's last chunk
                chunk(0, finish_reason=result["choices"][0]["finish_reason"], usage=result["usage"])
            else:  # each choice's end, then the usage alone
                for index, choice in enumerate(result["choices"]):
                    chunk(index, finish_reason=choice["finish_reason"])
                event(chunk_body(self.served, request, reply_id, created, None, usage=result["usage"]))
            event("[DONE]")
        except ClientGone:
            pass


def make_server(served: ServedModel, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) answering for ``served`` on ``host``:``port`` (0: any free port)."""
    handler = type("ServedHandler", (Handler,), {"served": served})
    try:
        return ThreadingHTTPServer((host, port), handler)
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port} ({error.strerror or error}); choose another --port or "
                          "--host.") from error


__all__ = ["RequestError", "ServedModel", "make_server", "parse_request", "run_completion"]
