"""Continuous batching: requests join a decoding batch as they arrive and leave it as they finish.

A server answering one request at a time leaves most of the hardware idle: a decode step of one
sequence reads every weight to produce one token, and a step of 16 sequences reads the same
weights for 16 tokens, in little more time while decoding is bound by reading weights (on a GPU
up to batches of dozens or hundreds). Batching the requests that happen to be waiting together
(*static* batching) helps, but a batch then runs until its longest reply is done: a short reply
holds its row empty, and a request arriving meanwhile waits for the whole batch. *Continuous*
batching schedules every decode step instead (Yu et al. 2022, "Orca: A Distributed Serving
System for Transformer-Based Generative Models", §3.2, iteration-level scheduling; what vLLM
and SGLang do): before each step the requests that arrived are prefilled and join the batch,
and after it the finished ones leave, so the batch is as full as the load allows at every step.

``ContinuousBatcher`` runs that loop on one worker thread that owns the model:

1. **Admit**: the waiting requests (up to ``max_batch_size`` rows in all) are prefilled together,
   left-padded as ``generate`` pads a batch, and each draws its first token; those not finished
   by it join the running batch's cache (``InferenceCache.join``: right-aligned on the latest
   token, the shorter side left-padded), their drawn token waiting to be fed like everyone else's.
   With ``prefill_chunk`` the prompts run that many columns an iteration, each chunk followed by a
   decode step of the running batch (*chunked prefill*, as vLLM and SGLang schedule it): a long
   prompt arriving costs the others' replies a pause of one chunk, not of the whole prompt.
   Requests arriving meanwhile wait for the next admission.
2. **Step**: one forward of every row's latest token; each row draws its next token with its own
   sampling settings and random generator (``SamplingConfig.make_generator``), so a request's
   draws do not depend on who else is in the batch.
3. **Leave**: a row ends at an end id, at its ``max_new_tokens``, when its ``on_token`` callback
   says so (a stop string) or when it is cancelled (a client that went away); it is dropped from
   the cache (``InferenceCache.select``) and the columns that now hold padding in every row are
   cut off (``drop_leading_padding``), so the cache is as long as its longest live sequence.

Every row attends to exactly its own tokens and positions count real tokens only (``generate``'s
left padding), so a request gets the tokens it would get alone: greedy replies are the same, and
sampled ones too for the same seed -- up to the rounding of a batched matmul against a single
row's, which can only matter where two logits tie to the last bits.

A request with ``top_logprobs`` gets each drawn token scored as it is drawn: its log-probability
under the model (a log-softmax of the step's logits, before temperature, top-k/p and penalties
reshape them for sampling, as vLLM returns them) and the likeliest alternatives, in ``log_probs``
before ``on_token`` sees the token -- so a streamed reply can carry them piece by piece. Other
work with the model -- scoring a prompt's log-probabilities (``echo``) -- runs on the same thread
between two steps (``call``), so nothing else touches the model while it decodes.

A request with a ``constraint`` (``constrained/``: a JSON Schema, a forced tool call) draws only the
tokens its grammar allows: the others' logits are set to -inf in its row before sampling, and the
reply ends where the grammar lets nothing follow. The masks are remembered per grammar state, so a
constrained row costs little more than a plain one once its states have been met.

With ``compile`` each decode step runs compiled (``decode_step.py``: the blocks fused by
``torch.compile``, the cache's bookkeeping eager), where the model allows it (no MoE blocks). The
batch's size and its buffers' length change as requests come and go; after the first such change
TorchDynamo compiles the step once more with those sizes symbolic, and then keeps that graph
(``python -m bench.serving --pattern M-M*-M-*- --compile``, 2 CPU cores: 16 requests of 64 tokens
at 1510 tokens/s against 1056 eagerly, 1.43x, the same tokens).

Memory: the rows share one set of KV buffers as long as the longest live sequence (left padding,
not paging): a long request makes every row's buffers that long while it lasts. vLLM's paged
attention (Kwon et al. 2023) removes that waste with per-block KV allocation and a kernel that
reads scattered blocks; here ``max_batch_size`` bounds it. Speculative decoding, LongRoPE's
re-prefill past the original context and the compiled decode step are ``generate``'s alone: a
server of such a model answers one request at a time (``max_batch_size`` 1).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshlm.errors import ConfigError
from meshlm.inference.constrained.token_constraint import DecodingConstraint
from meshlm.inference.decode_step import DecodeStep
from meshlm.inference.generate import check_prompts, left_pad
from meshlm.inference.logprobs import TokenLogProb, drawn_log_probs
from meshlm.inference.penalties import TokenPenalties
from meshlm.inference.prefill import hidden_states, prefill
from meshlm.inference.sampling import SamplingConfig, restrict_vocab, sample_next
from meshlm.models.cache import InferenceCache
from meshlm.models.position_embedding import check_positions_fit

DEFAULT_MAX_BATCH_SIZE = 8
_WAKE = object()
"""Put in ``waiting`` by ``call``: wakes a worker blocked waiting for requests."""


@dataclass(eq=False)
class GenerationRequest:
    """One prompt to continue, how, and (filled in by the batcher) what came of it."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    end_ids: list[int] = field(default_factory=list)
    """Ids that end the reply when drawn (kept as its last token, as ``generate`` keeps an eos)."""
    on_token: Callable[[int], bool] | None = None
    """Called on the batcher's thread with each new token; returning True ends the reply there."""
    new_ids: list[int] = field(default_factory=list)
    """The tokens drawn so far."""
    error: BaseException | None = None
    """What stopped the batcher on this request's batch, if anything did."""
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    """Set by another thread (``cancel``): the request leaves the batch before its next token."""
    on_done: Callable[[], None] | None = None
    """Called on the batcher's thread once the request has finished, failed or been dropped."""
    top_logprobs: int | None = None
    """Score each drawn token (module docstring) with this many likeliest alternatives (0-20); None: not scored."""
    log_probs: list[TokenLogProb] = field(default_factory=list)
    """With ``top_logprobs``: one per token of ``new_ids``, added before ``on_token`` is called with it."""
    constraint: DecodingConstraint | None = None
    """Hold the reply to a grammar (``constrained/token_constraint.py``): only the tokens it allows are
    drawn, and the reply ends where the grammar says nothing may follow."""

    def cancel(self) -> None:
        self.cancelled = True

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the request done (the batcher calls it once): ``wait`` returns, ``on_done`` is called."""
        self.error = error
        self.done.set()
        if self.on_done is not None:
            self.on_done()

    def wait(self) -> list[int]:
        """The new tokens, once the request has finished (re-raising what failed it)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.new_ids


@dataclass(eq=False)
class _Call:
    """Work other than decoding that must run on the batcher's thread, which owns the model
    (``ContinuousBatcher.call``: scoring a sequence's log-probabilities)."""

    function: Callable[[], object]
    result: object = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Prefill:
    """Admitted requests whose prompts are being run into their own cache, ``prefill_chunk`` columns
    an iteration, between the running batch's decode steps."""

    requests: list[GenerationRequest]
    input_ids: torch.Tensor
    token_mask: torch.Tensor | None
    cache: InferenceCache
    columns_done: int = 0


@dataclass(eq=False)
class _Row:
    """A request in the running batch: its random generator and the token it drew last (not yet fed)."""

    request: GenerationRequest
    generator: torch.Generator | None
    penalties: TokenPenalties | None = None
    """The counts behind the request's repetition, presence and frequency penalties, if it has any."""
    last_token: int = 0


class ContinuousBatcher:
    """Serves ``GenerationRequest``s from any number of threads on one worker thread that batches
    them step by step (module docstring). ``valid_vocab_size``: draw only from the first ids of a
    padded vocabulary. ``close()`` stops the worker (requests still waiting get an error)."""

    def __init__(self, model, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, valid_vocab_size: int | None = None,
                 pad_token_id: int = 0, prefill_chunk: int | None = None, compile: bool = False,
                 compile_backend: str = "inductor"):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"max_batch_size={max_batch_size!r} must be a whole number of sequences >= 1.")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ConfigError(f"prefill_chunk={prefill_chunk!r} must be a number of tokens >= 1, or None to prefill "
                              "each prompt in one forward.")
        if model.config.rope_scaling == "longrope":
            raise ConfigError("this model's LongRoPE (model.rope_scaling=longrope) re-runs a sequence when it "
                              "first passes the original context, which a shared batch cannot do; serve it one "
                              "request at a time (max batch size 1).")
        self.model, self.max_batch_size, self.prefill_chunk = model, max_batch_size, prefill_chunk
        self.valid_vocab_size, self.pad_token_id = valid_vocab_size, pad_token_id
        self.device = next(model.parameters()).device
        self.waiting: queue.Queue[GenerationRequest | object | None] = queue.Queue()
        """Requests to admit (``_WAKE``: look at ``calls``; None: stop)."""
        self.calls: queue.Queue[_Call] = queue.Queue()
        """Functions to run on this thread between decode steps (``call``)."""
        self.rows: list[_Row] = []
        self.cache: InferenceCache | None = None
        self.prefilling: _Prefill | None = None
        """The admitted requests whose prompts are still being run, a chunk an iteration."""
        self.decode_step = DecodeStep(model, compile=True, backend=compile_backend) if compile else None
        """The compiled decode step (``decode_step.py``), taken where the model and cache allow it; None:
        the ordinary cached forward every step."""
        self.steps = 0
        """Decode steps run (a batch of any size is one)."""
        self.largest_batch = 0
        """The most rows one step has decoded together."""
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="meshlm-batcher", daemon=True)
        self._worker.start()

    def check(self, request: GenerationRequest) -> None:
        """Raise ConfigError for a request the model cannot serve (on the caller's thread, before it queues)."""
        check_prompts([request.prompt_ids], self.model.config.vocab_size)
        if request.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={request.max_new_tokens} must be >= 1.")
        check_positions_fit(self.model.config, len(request.prompt_ids) + request.max_new_tokens,
                            f"a prompt of {len(request.prompt_ids)} tokens and max_tokens={request.max_new_tokens}",
                            "shorten the prompt or ask for fewer new tokens")

    def submit(self, request: GenerationRequest) -> GenerationRequest:
        """Queue ``request`` (checked first); it joins the batch before the next decode step."""
        self.check(request)
        if self._closed:
            raise RuntimeError("this batcher is closed")
        self.waiting.put(request)
        return request

    def generate(self, request: GenerationRequest) -> list[int]:
        """Submit ``request`` and wait for its new tokens."""
        return self.submit(request).wait()

    def call(self, function: Callable[[], object]):
        """Run ``function()`` on the batcher's thread between two decode steps and return what it
        returns (raising what it raises): other uses of the model never run beside decoding."""
        if self._closed:
            raise RuntimeError("this batcher is closed")
        task = _Call(function)
        self.calls.put(task)
        self.waiting.put(_WAKE)  # a worker waiting for requests runs the call at once
        while not task.done.wait(0.5):
            if not self._worker.is_alive():
                raise RuntimeError("this batcher was closed before the call ran")
        if task.error is not None:
            raise task.error
        return task.result

    def close(self) -> None:
        self._closed = True
        self.waiting.put(None)
        self._worker.join()

    # --- the worker thread --------------------------------------------------------------------

    def _serve(self) -> None:
        model_was_training = self.model.training
        self.model.eval()
        try:
            while True:
                self._run_calls()
                admitted = [] if self.prefilling is not None else self._take_waiting(block=not self.rows)
                if admitted is None:
                    break
                try:
                    with torch.inference_mode():
                        if admitted:
                            self.prefilling = self._start_prefill(admitted)
                        if self.prefilling is not None:
                            self._prefill_step()
                        if self.rows:
                            self._step()
                except Exception as error:  # noqa: BLE001 -- fail the batch's requests, keep serving
                    prefilling = [] if self.prefilling is None else self.prefilling.requests
                    for request in admitted + prefilling + [row.request for row in self.rows]:
                        if not request.done.is_set():
                            request.finish(error)
                    self.rows, self.cache, self.prefilling = [], None, None
        finally:
            self.model.train(model_was_training)
            self._fail_waiting(RuntimeError("the batcher was closed before this request ran"))

    def _take_waiting(self, block: bool) -> list[GenerationRequest] | None:
        """The requests that may join now (up to the free rows; None once closed)."""
        taken = []
        while len(self.rows) + len(taken) < self.max_batch_size:
            try:
                request = self.waiting.get(block=block and not taken)
            except queue.Empty:
                break
            if request is None:
                return None
            if request is _WAKE:  # a call came: run it before waiting any longer
                if block:
                    break
                continue
            if request.cancelled:
                request.finish()
                continue
            taken.append(request)
        return taken

    def _run_calls(self) -> None:
        """Run the functions handed to ``call`` so far."""
        while True:
            try:
                task = self.calls.get_nowait()
            except queue.Empty:
                return
            try:
                with torch.inference_mode():
                    task.result = task.function()
            except Exception as error:  # noqa: BLE001 -- the caller's to handle
                task.error = error
            task.done.set()

    def _fail_waiting(self, error: Exception) -> None:
        while True:
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                break
            if isinstance(request, GenerationRequest):
                request.finish(error)
        while True:
            try:
                task = self.calls.get_nowait()
            except queue.Empty:
                return
            task.error = error
            task.done.set()

    def _start_prefill(self, requests: list[GenerationRequest]) -> _Prefill:
        """``requests`` left-padded into one batch, with a cache of their own to run them into."""
        input_ids, token_mask = left_pad([request.prompt_ids for request in requests], self.pad_token_id, self.device)
        longest_reply = max(request.max_new_tokens for request in requests)
        return _Prefill(requests, input_ids, token_mask, InferenceCache(max_tokens=input_ids.shape[1] + longest_reply))

    def _prefill_step(self) -> None:
        """Run the next ``prefill_chunk`` columns of the prompts being admitted (all that are left
        without a chunk); after the last, admit them (``_admit``)."""
        pending = self.prefilling
        length = pending.input_ids.shape[1]
        columns = slice(pending.columns_done, length if self.prefill_chunk is None
                        else min(pending.columns_done + self.prefill_chunk, length))
        mask = None if pending.token_mask is None else pending.token_mask[:, columns]
        hidden = prefill(self.model, pending.input_ids[:, columns], mask, pending.cache)
        pending.columns_done = columns.stop
        if pending.columns_done == length:
            self.prefilling = None
            self._admit(pending.requests, pending.cache, self.model.head_logits(hidden)[:, -1])

    def _admit(self, requests: list[GenerationRequest], cache: InferenceCache, logits: torch.Tensor) -> None:
        """Draw the first tokens of the prefilled ``requests`` from their last ``logits``, and join the
        unfinished ones (their ``cache``) to the running batch."""
        vocab_size = logits.shape[-1]
        rows = [_Row(request, request.sampling.make_generator(self.device),
                     TokenPenalties(request.sampling, [request.prompt_ids], vocab_size, self.device)
                     if request.sampling.penalized else None) for request in requests]
        staying = self._draw(rows, logits)
        if not staying:
            return
        if len(staying) < len(rows):
            cache.select(torch.tensor([rows.index(row) for row in staying], device=self.device))
        if self.cache is None:
            self.cache = cache
        else:
            to_feed = max(row.request.max_new_tokens - len(row.request.new_ids) for row in self.rows + staying)
            self.cache.join(cache, capacity=max(self.cache.num_seen_tokens, cache.num_seen_tokens) + to_feed)
        self.rows += staying

    def _step(self) -> None:
        """Feed every row its last token, draw the next, and let the finished rows leave."""
        tokens = torch.tensor([[row.last_token] for row in self.rows], device=self.device)
        if self.decode_step is not None and self.decode_step.supports(self.cache):
            logits = self.decode_step(tokens[:, 0], self.cache)
        else:
            logits = self.model.head_logits(hidden_states(self.model, tokens, self.cache))[:, -1]
        self.steps += 1
        self.largest_batch = max(self.largest_batch, len(self.rows))
        staying = self._draw(self.rows, logits)
        if len(staying) < len(self.rows):
            if staying:
                self.cache.select(torch.tensor([self.rows.index(row) for row in staying], device=self.device))
                self.cache.drop_leading_padding()
            else:
                self.cache = None
        self.rows = staying

    def _draw(self, rows: list[_Row], logits: torch.Tensor) -> list[_Row]:
        """Each row's next token from its logits row, handed to its request; the rows that go on."""
        logits = drawn_from = restrict_vocab(logits, self.valid_vocab_size)
        constrained = [i for i, row in enumerate(rows) if row.request.constraint is not None]
        if constrained:  # the tokens a row's grammar refuses are not drawn (log-probabilities keep the model's)
            drawn_from = logits.clone()
            for i in constrained:
                drawn_from[i] = rows[i].request.constraint.mask_logits(logits[i])
        greedy = [i for i, row in enumerate(rows) if row.request.sampling.greedy and row.penalties is None]
        tokens = [0] * len(rows)
        if greedy:  # one argmax for all plain greedy rows
            for i, token in zip(greedy, drawn_from[greedy].argmax(-1).tolist()):
                tokens[i] = token
        for i in sorted(set(range(len(rows))) - set(greedy)):
            row = rows[i]
            row_logits = drawn_from[i:i + 1] if row.penalties is None else row.penalties.apply(drawn_from[i:i + 1])
            drawn = sample_next(row_logits, row.request.sampling, row.generator)
            if row.penalties is not None:
                row.penalties.add(drawn)
            tokens[i] = int(drawn)
        scored = [i for i, row in enumerate(rows) if row.request.top_logprobs is not None]
        if scored:
            for i, log_prob in zip(scored, drawn_log_probs(logits[scored], [tokens[i] for i in scored],
                                                           max(rows[i].request.top_logprobs for i in scored))):
                rows[i].request.log_probs.append(log_prob.keeping(rows[i].request.top_logprobs))
        staying = []
        for row, token in zip(rows, tokens):
            request = row.request
            if request.cancelled:
                request.finish()
                continue
            request.new_ids.append(token)
            if request.constraint is not None:
                request.constraint.advance(token)
            ended = request.on_token is not None and request.on_token(token)
            ended = ended or request.constraint is not None and request.constraint.finished
            if ended or token in request.end_ids or len(request.new_ids) >= request.max_new_tokens:
                request.finish()
                continue
            row.last_token = token
            staying.append(row)
        return staying


__all__ = ["ContinuousBatcher", "DEFAULT_MAX_BATCH_SIZE", "GenerationRequest"]
