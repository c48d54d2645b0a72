"""Continuous batching (meshlm/inference/continuous_batching.py): requests that join a decoding batch
at any step -- shorter or longer than what it holds, greedy or sampled, through full attention,
sliding windows, Mamba and experts -- get exactly the tokens ``generate`` gives each alone; a
request ends at its end id, its token budget, its callback or a cancel without disturbing the
others; a failure fails its batch only; bad requests are refused before they queue."""

import json
import threading

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.inference.continuous_batching import ContinuousBatcher, GenerationRequest
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from tests.inference.test_generate import GREEDY, PATTERNS, PROMPTS, longrope_model, tiny_model

LONG_PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 12, 14, 16, 18, 20, 22, 24, 26]


def sliding_model() -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                                     num_kv_heads=2, init_std=0.1, sliding_window=3,
                                     sliding_window_pattern="SF")).eval()


MODELS = {**{name: (lambda name=name: tiny_model(PATTERNS[name])) for name in ("dense", "hybrid", "hybrid_moe")},
          "sliding": sliding_model}


def staggered(batcher: ContinuousBatcher, requests: list[GenerationRequest], after: int = 3) -> list[list[int]]:
    """Submit the first request, and each next one when the one before has drawn ``after`` tokens
    (from the batcher's thread: it joins while the others decode); the new tokens of all."""
    submitted = [threading.Event() for _ in requests]

    def chain(index: int):
        own = requests[index].on_token

        def on_token(token: int) -> bool:
            if len(requests[index].new_ids) == after and index + 1 < len(requests):
                batcher.submit(requests[index + 1])
                submitted[index + 1].set()
            return own(token) if own is not None else False
        return on_token

    for index, request in enumerate(requests):
        request.on_token = chain(index)
    batcher.submit(requests[0])
    submitted[0].set()
    for event in submitted:
        assert event.wait(60), "a request was never submitted: the one before it ended too early"
    return [request.wait() for request in requests]


@pytest.mark.parametrize("prefill_chunk", [None, 4], ids=["whole prompts", "chunked prefill"])
@pytest.mark.parametrize("name", MODELS)
def test_requests_joining_mid_decoding_get_the_tokens_they_get_alone(name, prefill_chunk):
    """Prompts of 9, 2, 5 and 1 tokens join one after another, then a 17-token prompt joins a batch
    whose sequences are shorter (the batch is padded to it), each budget different; prompts run
    whole or 4 columns an iteration between the batch's steps."""
    model = MODELS[name]()
    prompts, budgets = PROMPTS + [LONG_PROMPT], [12, 9, 14, 6, 10]
    alone = [generate(model, [prompt], budget, GREEDY)[0] for prompt, budget in zip(prompts, budgets)]
    batcher = ContinuousBatcher(model, max_batch_size=8, prefill_chunk=prefill_chunk)
    try:
        requests = [GenerationRequest(prompt, budget, GREEDY) for prompt, budget in zip(prompts, budgets)]
        assert staggered(batcher, requests) == alone
        assert batcher.largest_batch >= 3
    finally:
        batcher.close()


def test_a_long_prompt_prefills_a_chunk_at_a_time_while_the_batch_goes_on_decoding():
    model = tiny_model(PATTERNS["hybrid"])
    batcher = ContinuousBatcher(model, max_batch_size=2, prefill_chunk=4)
    long = GenerationRequest(LONG_PROMPT, 5, GREEDY)  # 17 tokens: 5 chunks of at most 4
    waiting_for_long = []
    try:
        running = GenerationRequest(PROMPTS[0], 30, GREEDY)

        def on_token(token: int) -> bool:
            if len(running.new_ids) == 2:
                batcher.submit(long)
            elif len(running.new_ids) > 2 and not long.new_ids:
                waiting_for_long.append(token)  # drawn while the long prompt was still prefilling
            return False

        running.on_token = on_token
        assert batcher.generate(running) == generate(model, [PROMPTS[0]], 30, GREEDY)[0]
        assert long.wait() == generate(model, [LONG_PROMPT], 5, GREEDY)[0]
    finally:
        batcher.close()
    assert len(waiting_for_long) >= 4  # one decode step after each of the first chunks
    with pytest.raises(ConfigError, match="prefill_chunk=0"):
        ContinuousBatcher(model, prefill_chunk=0)


def test_sampled_requests_draw_as_alone_whoever_shares_their_batch():
    model = tiny_model(PATTERNS["hybrid"])
    samplings = [SamplingConfig(temperature=0.9, seed=1), GREEDY, SamplingConfig(top_k=5, seed=7),
                 SamplingConfig(top_p=0.8, temperature=1.3, seed=2)]
    alone = [generate(model, [prompt], 10, sampling)[0] for prompt, sampling in zip(PROMPTS, samplings)]
    batcher = ContinuousBatcher(model, max_batch_size=4)
    try:
        requests = [GenerationRequest(prompt, 10, sampling) for prompt, sampling in zip(PROMPTS, samplings)]
        assert staggered(batcher, requests, after=2) == alone
    finally:
        batcher.close()


def test_end_ids_callbacks_and_cancels_end_a_row_and_the_others_go_on():
    model = tiny_model(PATTERNS["dense"])
    free = [generate(model, [prompt], 12, GREEDY)[0] for prompt in PROMPTS[:3]]
    end_id = free[0][4]
    batcher = ContinuousBatcher(model, max_batch_size=3)
    try:
        ended_by_id = GenerationRequest(PROMPTS[0], 12, GREEDY, end_ids=[end_id])
        stopped = GenerationRequest(PROMPTS[1], 12, GREEDY)
        stopped_at = [3]
        cancelled = GenerationRequest(PROMPTS[2], 12, GREEDY)
        callbacks = {id(stopped): lambda token: len(stopped.new_ids) == stopped_at[0]}

        def cancel_after_two(token: int) -> bool:
            if len(cancelled.new_ids) == 2:
                cancelled.cancel()  # as a server's thread does when the client leaves
            return False

        callbacks[id(cancelled)] = cancel_after_two
        for request in (ended_by_id, stopped, cancelled):
            request.on_token = callbacks.get(id(request))
        staggered(batcher, [ended_by_id, stopped, cancelled], after=1)
    finally:
        batcher.close()
    assert ended_by_id.new_ids == free[0][:free[0].index(end_id) + 1]  # the end id kept, as generate keeps eos
    assert stopped.new_ids == free[1][:3]
    assert cancelled.new_ids == free[2][:2]  # left before its next token


def test_a_failure_fails_its_batch_and_the_batcher_goes_on(monkeypatch):
    from meshlm.inference import continuous_batching

    model = tiny_model(PATTERNS["dense"])
    batcher = ContinuousBatcher(model, max_batch_size=2)
    try:
        real_prefill = continuous_batching.prefill

        def failing_once(*args, **kwargs):
            monkeypatch.setattr(continuous_batching, "prefill", real_prefill)
            raise RuntimeError("boom")

        monkeypatch.setattr(continuous_batching, "prefill", failing_once)
        with pytest.raises(RuntimeError, match="boom"):
            batcher.generate(GenerationRequest(PROMPTS[0], 5, GREEDY))
        assert batcher.generate(GenerationRequest(PROMPTS[0], 5, GREEDY)) == generate(model, [PROMPTS[0]], 5,
                                                                                     GREEDY)[0]
    finally:
        batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(GenerationRequest(PROMPTS[0], 5, GREEDY))


def test_bad_requests_and_settings_are_refused_before_they_queue():
    model = tiny_model(PATTERNS["dense"])
    batcher = ContinuousBatcher(model, max_batch_size=2)
    try:
        with pytest.raises(ConfigError, match="outside the model's vocabulary"):
            batcher.submit(GenerationRequest([5, 500], 4, GREEDY))
        with pytest.raises(ConfigError, match="empty"):
            batcher.submit(GenerationRequest([], 4, GREEDY))
        with pytest.raises(ConfigError, match="max_new_tokens=0"):
            batcher.submit(GenerationRequest([5], 0, GREEDY))
        assert batcher.waiting.empty()
    finally:
        batcher.close()
    with pytest.raises(ConfigError, match="max_batch_size=0"):
        ContinuousBatcher(model, max_batch_size=0)
    torch.manual_seed(0)
    learned = LanguageModel(ModelConfig(vocab_size=97, hidden_size=32, pattern="*-", num_attention_heads=4,
                                        num_kv_heads=2, position_embedding="learned", max_position_embeddings=16))
    batcher = ContinuousBatcher(learned)
    try:
        with pytest.raises(ConfigError, match="max_tokens=12 needs 17 positions"):
            batcher.submit(GenerationRequest([1, 2, 3, 4, 5], 12, GREEDY))
    finally:
        batcher.close()
    with pytest.raises(ConfigError, match="one request at a time"):
        ContinuousBatcher(longrope_model())


def test_calls_run_on_the_batchers_thread_between_steps_and_return_or_raise():
    """``call`` (the server scores log-probabilities with it) runs on the thread that owns the model,
    also while a request is decoding, which goes on undisturbed."""
    model = tiny_model(PATTERNS["hybrid"])
    alone = generate(model, [PROMPTS[0]], 12, GREEDY)[0]
    batcher = ContinuousBatcher(model, max_batch_size=2)
    seen = []
    try:
        decoding = GenerationRequest(PROMPTS[0], 12, GREEDY)

        def call_while_decoding(token: int) -> bool:
            if len(decoding.new_ids) == 3:  # from another thread, mid-request
                threading.Thread(target=lambda: seen.append(batcher.call(threading.current_thread))).start()
            return False

        decoding.on_token = call_while_decoding
        assert batcher.generate(decoding) == alone
        assert batcher.call(lambda: 6 * 7) == 42
        with pytest.raises(ZeroDivisionError):
            batcher.call(lambda: 1 / 0)
    finally:
        batcher.close()
    assert [thread.name for thread in seen] == ["meshlm-batcher"]
    with pytest.raises(RuntimeError, match="closed"):
        batcher.call(lambda: 0)


def test_the_compiled_decode_step_serves_a_changing_batch_with_the_same_tokens():
    """``compile``: requests joining and leaving change the batch's size and its buffers' length
    between steps; the compiled step (TorchDynamo's graph, run by aot_eager here to keep the test
    fast) gives the tokens of each request alone."""
    model = tiny_model(PATTERNS["hybrid"])
    prompts, budgets = PROMPTS + [LONG_PROMPT], [12, 9, 14, 6, 10]
    alone = [generate(model, [prompt], budget, GREEDY)[0] for prompt, budget in zip(prompts, budgets)]
    batcher = ContinuousBatcher(model, max_batch_size=8, compile=True, compile_backend="aot_eager")
    try:
        requests = [GenerationRequest(prompt, budget, GREEDY) for prompt, budget in zip(prompts, budgets)]
        assert staggered(batcher, requests) == alone
        assert batcher.decode_step.compiled and batcher.decode_step.calls >= batcher.steps - 1 > 10
    finally:
        batcher.close()


def test_scored_requests_list_each_drawn_tokens_log_probability_under_the_model():
    """``top_logprobs``: each drawn token's log-probability and alternatives, as a forward over prompt
    and reply scores them (``sequence_log_probs``) -- the model's distribution, not the sampled one
    (temperature, top-k, penalties) -- while requests joining the batch and unscored ones go on."""
    from meshlm.inference.logprobs import sequence_log_probs

    model = tiny_model(PATTERNS["hybrid"])
    shaped = SamplingConfig(temperature=1.3, top_k=5, seed=3, repetition_penalty=1.4)
    requests = [GenerationRequest(PROMPTS[0], 7, GREEDY, top_logprobs=3),
                GenerationRequest(PROMPTS[1], 6, shaped, top_logprobs=0),
                GenerationRequest(PROMPTS[2], 5, GREEDY)]
    batcher = ContinuousBatcher(model, max_batch_size=4)
    try:
        staggered(batcher, requests, after=2)
    finally:
        batcher.close()
    assert requests[2].log_probs == []
    for request in requests[:2]:
        expected = sequence_log_probs(model, request.prompt_ids + request.new_ids, len(request.prompt_ids),
                                      request.top_logprobs)
        assert [item.token for item in request.log_probs] == request.new_ids == [item.token for item in expected]
        for got, want in zip(request.log_probs, expected):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
            assert [token for token, _ in got.top] == [token for token, _ in want.top]
            assert [value for _, value in got.top] == pytest.approx([value for _, value in want.top], abs=1e-5)
    assert len(requests[0].log_probs[0].top) == 3 and requests[0].log_probs[0].top[0][0] == requests[0].new_ids[0]


def ascii_vocabulary():
    """A vocabulary for the 97-id test models: id 0 ends a reply, ids 1-95 are the printable ASCII
    characters, id 96 is ``{"``."""
    from meshlm.inference.constrained.vocabulary import Vocabulary

    return Vocabulary([None] + [bytes([byte]) for byte in range(0x20, 0x7F)] + [b'{"'])


SMALL_SCHEMA = {"type": "object", "required": ["n", "ok"],
                "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                               "s": {"type": "string", "maxLength": 3}}}


def test_a_constrained_request_draws_as_alone_beside_free_ones():
    """A request held to a schema (``GenerationRequest.constraint``) joins a batch of free ones: its
    reply is the schema's document and the same tokens ``generate`` draws with the same constraint
    alone, ending by the grammar at the end id; the free requests get their tokens as alone."""
    from meshlm.inference.constrained.grammar import Grammar
    from meshlm.inference.constrained.json_schema import read_schema
    from meshlm.inference.constrained.token_constraint import TokenConstraint

    model = tiny_model(PATTERNS["hybrid"])
    vocabulary = ascii_vocabulary()
    grammar = Grammar(read_schema(SMALL_SCHEMA, "test"), vocabulary)
    samplings = [GREEDY, SamplingConfig(temperature=1.2, seed=4), SamplingConfig(temperature=0.9, seed=2)]
    held = [None, TokenConstraint(grammar, [0]), None]
    alone = [generate(model, [prompt], 200, sampling, eos_token_id=0,
                      constraints=None if constraint is None else [TokenConstraint(grammar, [0])])[0]
             for prompt, sampling, constraint in zip(PROMPTS, samplings, held)]
    document = b"".join(vocabulary.token_bytes[token] for token in alone[1][:-1])
    value = json.loads(document)
    assert alone[1][-1] == 0 and set(value) >= {"n", "ok"} and isinstance(value["ok"], bool), document
    batcher = ContinuousBatcher(model, max_batch_size=3)
    try:
        requests = [GenerationRequest(prompt, 200, sampling, [0], constraint=constraint)
                    for prompt, sampling, constraint in zip(PROMPTS, samplings, held)]
        assert staggered(batcher, requests, after=2) == alone
    finally:
        batcher.close()
    assert held[1].ended and held[1].complete


def test_a_grammar_that_lets_nothing_follow_ends_the_reply_without_an_end_id():
    """A reply held to an enum and given no end id ends at the enum's closing quote, in the batcher
    as in ``generate``; ``generate`` refuses constraints that do not match its prompts, or with
    speculative decoding."""
    from meshlm.inference.constrained.grammar import Grammar
    from meshlm.inference.constrained.json_schema import read_schema
    from meshlm.inference.constrained.token_constraint import TokenConstraint

    model = tiny_model(PATTERNS["dense"])
    grammar = Grammar(read_schema({"enum": ["yes", "no"]}, "test"), ascii_vocabulary())
    batcher = ContinuousBatcher(model, max_batch_size=2)
    try:
        reply = batcher.generate(GenerationRequest(PROMPTS[0], 50, GREEDY, constraint=TokenConstraint(grammar, [])))
    finally:
        batcher.close()
    assert b"".join(grammar.vocabulary.token_bytes[token] for token in reply) in (b'"yes"', b'"no"')
    [alone] = generate(model, [PROMPTS[0]], 50, GREEDY, constraints=[TokenConstraint(grammar, [])])
    assert alone == reply
    with pytest.raises(ConfigError, match="one entry .or None. per prompt"):
        generate(model, PROMPTS[:2], 5, GREEDY, constraints=[None])
    with pytest.raises(ConfigError, match="constrained decoding .a JSON schema. applies to plain decoding"):
        generate(model, PROMPTS[:1], 5, GREEDY, speculative="mtp", constraints=[TokenConstraint(grammar, [])])
