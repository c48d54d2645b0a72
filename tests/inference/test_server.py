"""``meshlm serve`` (meshlm/inference/server.py) over real HTTP on a free port: completions and chat
completions equal what ``generate`` gives the same prompt, streamed pieces join to the same text,
stop strings cut it (also when streamed a token at a time), a think block comes back as
``reasoning_content``, and bad requests get a 400 naming the field while the server goes on."""

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.data.chat import token_id
from meshlm.data.tokenizer import load_tokenizer
from meshlm.inference.chat import conversation_prompt, reply_ids
from meshlm.inference.continuous_batching import ContinuousBatcher
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.inference.server import ServedModel, make_server
from tests.helpers.generation_model import tiny_model

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory, chat_tokenizer_dir):
    return save_model(tiny_model(), tmp_path_factory.mktemp("served") / "model", tokenizer_dir=chat_tokenizer_dir)


def serving(model_dir, tokenizer, max_batch_size: int = 8):
    """A running server for the model in ``model_dir`` (stop it with ``stop``) and its base URL;
    ``max_batch_size`` as ``meshlm serve --max-batch-size`` (1: one request at a time)."""
    served = ServedModel("tiny", load_model(model_dir).eval(), tokenizer, tokenizer.eos_token_id, MAX_TOKENS)
    if max_batch_size > 1:
        served.batcher = ContinuousBatcher(served.model, max_batch_size, served.valid_vocab_size)
    server = make_server(served, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def served_by(server) -> ServedModel:
    return server.RequestHandlerClass.served


def stop(server) -> None:
    server.shutdown()
    server.server_close()
    if served_by(server).batcher is not None:
        served_by(server).batcher.close()


SERVERS = {}
"""Base URL -> the running server of the module's ``url`` fixture."""


@pytest.fixture(scope="module", params=[8, 1], ids=["batched", "one_at_a_time"])
def url(chat_model_dir, tokenizer, request):
    """Every test of a served reply runs against both kinds of server: the continuous batcher and
    one request at a time (``generate`` under a lock)."""
    server, base = serving(chat_model_dir, tokenizer, request.param)
    SERVERS[base] = server
    yield base
    stop(server)


def post(url: str, path: str, body) -> tuple[int, object]:
    """(status, JSON body) of a POST, or (status, [chunk, ...]) of a streamed one."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read().decode()
            if response.headers["Content-Type"] == "text/event-stream":
                events = [line[len("data: "):] for line in raw.split("\n\n") if line]
                assert events[-1] == "[DONE]"
                return response.status, [json.loads(event) for event in events[:-1]]
            return response.status, json.loads(raw)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read().decode())


def expected_ids(model_dir, prompt: list[int], stop: list[int], max_tokens: int = MAX_TOKENS, **sampling):
    """What ``generate`` gives the prompt, sampling the tokenizer's ids only (the model's vocabulary is padded)."""
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    [new] = generate(load_model(model_dir), [prompt], max_tokens, SamplingConfig(**sampling), eos_token_id=stop,
                     valid_vocab_size=tokenizer.vocab_size)
    return new


def test_a_completion_is_what_generate_gives_the_prompt(url, chat_model_dir, tokenizer):
    status, body = post(url, "/v1/completions", {"model": "tiny", "prompt": "the cat", "temperature": 0})
    assert status == 200 and body["object"] == "text_completion" and body["model"] == "tiny"
    prompt = tokenizer.encode("the cat")
    new = expected_ids(chat_model_dir, prompt, [tokenizer.eos_token_id], greedy=True)
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode([token for token in new if token != tokenizer.eos_token_id])
    assert choice["finish_reason"] == ("stop" if new[-1] == tokenizer.eos_token_id else "length")
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(new),
                             "total_tokens": len(prompt) + len(new)}
    status, sampled = post(url, "/v1/completions", {"prompt": "the cat", "temperature": 0.8, "top_p": 0.9,
                                                    "seed": 3, "max_tokens": 5})
    new = expected_ids(chat_model_dir, prompt, [tokenizer.eos_token_id], 5, temperature=0.8, top_p=0.9, seed=3)
    assert sampled["choices"][0]["text"] == tokenizer.decode([t for t in new if t != tokenizer.eos_token_id])
    penalties = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.4}
    status, penalized = post(url, "/v1/completions", {"prompt": "the cat", "temperature": 0, "max_tokens": 10,
                                                      **penalties})
    new = expected_ids(chat_model_dir, prompt, [tokenizer.eos_token_id], 10, greedy=True, **penalties)
    assert penalized["choices"][0]["text"] == tokenizer.decode([t for t in new if t != tokenizer.eos_token_id])


def test_a_chat_reply_is_the_templated_prompt_continued_to_its_end_of_turn(url, chat_model_dir, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a dog sat"}]
    status, body = post(url, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 8})
    assert status == 200 and body["object"] == "chat.completion"
    stop = [token_id(tokenizer, "<|end|>"), tokenizer.eos_token_id]
    new = expected_ids(chat_model_dir, conversation_prompt(tokenizer, messages), stop, 8, greedy=True)
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": tokenizer.decode(reply_ids(new, stop))}
    assert body["usage"]["prompt_tokens"] == len(conversation_prompt(tokenizer, messages))


def test_text_content_parts_read_as_one_string(url):
    plain = {"messages": [{"role": "user", "content": "the cat sat"}], "temperature": 0, "max_tokens": 5}
    parts = {**plain, "messages": [{"role": "user", "content": [{"type": "text", "text": "the cat"},
                                                                 {"type": "text", "text": " sat"}]}]}
    assert post(url, "/v1/chat/completions", parts)[1]["choices"] == post(url, "/v1/chat/completions", plain)[1][
        "choices"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "the dog", "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the mat"}], "temperature": 0}),
])
def test_streamed_pieces_join_to_the_reply_and_end_with_its_reason(url, path, body):
    _, whole = post(url, path, body)
    status, chunks = post(url, path, {**body, "stream": True})
    assert status == 200 and len(chunks) >= 2
    chat = path.endswith("chat/completions")
    pieces = [chunk["choices"][0]["delta"].get("content", "") if chat else chunk["choices"][0]["text"]
              for chunk in chunks]
    expected = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    assert "".join(pieces) == expected and len([piece for piece in pieces if piece]) > 1  # more than one piece
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][:-1] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
    if chat:  # the role once, in the first chunk
        assert [chunk["choices"][0]["delta"].get("role") for chunk in chunks] == ["assistant"] + [None] * (
            len(chunks) - 1)


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(url, tokenizer):
    _, free = post(url, "/v1/completions", {"prompt": "the cat", "temperature": 0, "max_tokens": 20})
    text = free["choices"][0]["text"]
    assert len(text) > 6
    stop = text[3:6]  # three characters from inside the text, wherever the tokens split them
    _, cut = post(url, "/v1/completions", {"prompt": "the cat", "temperature": 0, "max_tokens": 20, "stop": [stop]})
    assert cut["choices"][0] == {"index": 0, "text": text[:text.find(stop)], "finish_reason": "stop"}
    _, chunks = post(url, "/v1/completions", {"prompt": "the cat", "temperature": 0, "max_tokens": 20,
                                              "stop": stop, "stream": True})
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == text[:text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_think_block_comes_back_as_reasoning_content(thinking_model_dir, tokenizer):
    server, base = serving(thinking_model_dir, tokenizer)
    try:
        body = {"messages": [{"role": "user", "content": "the cat"}], "temperature": 0}
        _, whole = post(base, "/v1/chat/completions", body)
        assert whole["choices"][0]["message"] == {"role": "assistant", "content": "mat",
                                                  "reasoning_content": "cat dog"}
        assert whole["choices"][0]["finish_reason"] == "stop"
        _, chunks = post(base, "/v1/chat/completions", {**body, "stream": True})
        deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
        assert "".join(delta.get("reasoning_content", "") for delta in deltas) == "cat dog"
        assert "".join(delta.get("content", "") for delta in deltas) == "mat"
        # held to a schema, the model still thinks first; its answer after the block is the document
        _, held = post(base, "/v1/chat/completions", {**body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "yes_no", "schema": {"enum": ["yes", "no"]}}}})
        message = held["choices"][0]["message"]
        assert message["reasoning_content"] == "cat dog" and json.loads(message["content"]) in ("yes", "no"), held
        assert held["choices"][0]["finish_reason"] == "stop"
    finally:
        stop(server)


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/completions", b"{not json", 400, "the request body is not valid JSON"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt must be one string"),
    ("/v1/completions", {"prompt": "a", "n": 17}, 400, "n=17 must be >= 1 and <= 16"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens=0 must be >= 1"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature=-1.0 must be >= 0.0"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p=0.0 must be > 0.0"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, 400,
     "presence_penalty=2.5 must be >= -2.0 and <= 2.0"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty=0.0 must be > 0.0"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 1}}, 400, "logit_bias is not supported"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs=21 must be >= 0 and <= 20"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens=0 must be >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format must be {\"type\": \"text\"}"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema must be an object holding the JSON Schema"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}}}}},
     400, "response_format.json_schema.schema.properties.day: format bound values by their content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": 3}, 400,
     "logprobs must be true or false in chat"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream must be true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "content parts of type ['image_url'] are not supported"),
    ("/v1/completions", {"prompt": "a", "seed": -1}, 400, "seed=-1 must be >= 0"),
    ("/v1/embeddings", {"input": "a"}, 404, "no route POST /v1/embeddings"),
])
def test_bad_requests_are_refused_by_field_and_the_server_goes_on(url, path, body, status, message):
    got, reply = post(url, path, body)
    assert got == status and message in reply["error"]["message"], reply
    assert post(url, "/v1/completions", {"prompt": "the", "max_tokens": 2, "presence_penalty": 0,
                                         "logprobs": None, "response_format": {"type": "text"}})[0] == 200


def test_a_failure_inside_is_a_500_and_the_server_goes_on(url, monkeypatch):
    from meshlm.inference import continuous_batching, server

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(server, "generate", broken)  # one at a time
    monkeypatch.setattr(continuous_batching, "prefill", broken)  # batched
    status, reply = post(url, "/v1/completions", {"prompt": "the"})
    expected = {"message": "meshlm serve failed on this request: RuntimeError: boom", "type": "server_error",
                "param": None}
    assert status == 500 and reply["error"] == expected
    streamed = json.dumps({"prompt": "the", "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=streamed)
    with urllib.request.urlopen(request, timeout=60) as response:  # after the headers: the error as one event
        assert response.read().decode() == f"data: {json.dumps({'error': expected})}\n\n"
    monkeypatch.undo()
    assert post(url, "/v1/completions", {"prompt": "the", "max_tokens": 2})[0] == 200


def test_a_client_leaving_a_stream_stops_its_generation(url):
    """The connection closed after the first piece: the server stops generating there (the next
    request is answered at once, the lock free) and prints no traceback."""
    import http.client
    import time

    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "the", "max_tokens": 100_000, "stream": True}))
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.close()
    started = time.perf_counter()
    assert post(url, "/v1/completions", {"prompt": "the", "max_tokens": 2})[0] == 200
    assert time.perf_counter() - started < 30  # 100,000 tokens would take minutes on this CPU
    batcher = served_by(SERVERS[url]).batcher
    if batcher is not None:  # the other request did not have to wait: the row itself has left the batch
        while batcher.rows and time.perf_counter() - started < 30:
            time.sleep(0.05)
        assert not batcher.rows


def test_concurrent_requests_are_decoded_together_each_as_alone(chat_model_dir, tokenizer):
    """Six requests at once, greedy and sampled, streamed and not, to a batching server: each reply is
    what ``generate`` gives its prompt alone, and the batcher did decode several at a time."""
    server, base = serving(chat_model_dir, tokenizer, max_batch_size=4)
    bodies = [{"prompt": prompt, "max_tokens": 24, **sampling, "stream": stream}
              for prompt, sampling, stream in [("the cat", {"temperature": 0}, False), ("a dog", {"seed": 5}, True),
                                                ("the mat and the", {"temperature": 0}, True),
                                                ("a", {"seed": 1, "top_k": 20}, False),
                                                ("the dog sat on a log", {"temperature": 0.7, "seed": 2}, False),
                                                ("cat", {"temperature": 0}, True)]]
    replies = [None] * len(bodies)

    def ask(index):
        replies[index] = post(base, "/v1/completions", bodies[index])

    try:
        threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert served_by(server).batcher.largest_batch > 1
    finally:
        stop(server)
    for body, (status, reply) in zip(bodies, replies):
        assert status == 200
        sampling = {"greedy": True} if body.get("temperature") == 0 else {
            "temperature": body.get("temperature", 1.0), "top_k": body.get("top_k", 0), "seed": body["seed"]}
        new = expected_ids(chat_model_dir, tokenizer.encode(body["prompt"]), [tokenizer.eos_token_id], 24, **sampling)
        text = tokenizer.decode([token for token in new if token != tokenizer.eos_token_id])
        got = "".join(chunk["choices"][0]["text"] for chunk in reply) if body["stream"] else reply["choices"][0]["text"]
        assert got == text, body


def test_models_and_health(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        assert json.loads(response.read())["data"] == [{"id": "tiny", "object": "model", "created": 0,
                                                        "owned_by": "meshlm"}]
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}


def test_the_command_refuses_a_taken_port_and_bad_settings(chat_model_dir, tokenizer):
    from meshlm.cli import main
    from meshlm.errors import ConfigError

    server, base = serving(chat_model_dir, tokenizer)
    try:
        port = base.rsplit(":", 1)[1]
        assert main(["serve", str(chat_model_dir), "--port", port, "--device", "cpu"]) == 2  # one clear line
        with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1"):
            make_server(ServedModel("tiny", torch.nn.Linear(1, 1), tokenizer, None), "127.0.0.1", int(port))
    finally:
        stop(server)
    assert main(["serve", str(chat_model_dir), "--max-tokens", "0"]) == 2
    assert main(["serve", str(chat_model_dir), "--max-batch-size", "0"]) == 2
    assert main(["serve", str(chat_model_dir), "--prefill-chunk", "-1"]) == 2


def reference_log_probs(model_dir, ids: list[int], vocab: int) -> torch.Tensor:
    """log-softmax of a plain full forward's logits over the tokenizer's ids: row i scores ids[i + 1]."""
    with torch.no_grad():
        logits = load_model(model_dir)(torch.tensor([ids])).logits[0, :-1, :vocab].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_score_the_reply_and_echo_scores_the_prompt(url, chat_model_dir, tokenizer):
    prompt = tokenizer.encode("the cat sat")
    status, body = post(url, "/v1/completions", {"prompt": "the cat sat", "temperature": 0, "max_tokens": 6,
                                                 "logprobs": 3})
    assert status == 200
    new = expected_ids(chat_model_dir, prompt, [tokenizer.eos_token_id], 6, greedy=True)
    reply = [token for token in new if token != tokenizer.eos_token_id]
    reference = reference_log_probs(chat_model_dir, prompt + reply, tokenizer.vocab_size)
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(reply) > 0
    for index, token in enumerate(reply):
        row = reference[len(prompt) + index - 1]
        assert logprobs["token_logprobs"][index] == pytest.approx(row[token].item(), abs=1e-4)
        assert logprobs["tokens"][index] == tokenizer.token_bytes(token).decode("utf-8", errors="replace")
        top = logprobs["top_logprobs"][index]  # greedy: the chosen token is the likeliest
        assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-4)
        assert 1 <= len(top) <= 3  # (tokens that are parts of one character share the text U+FFFD)
    assert "".join(logprobs["tokens"]) == body["choices"][0]["text"]
    assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])
    # echo with no new tokens: the prompt's log-likelihood, its first token unscored
    status, echoed = post(url, "/v1/completions", {"prompt": "the cat sat", "max_tokens": 0, "echo": True,
                                                   "logprobs": 0})
    assert status == 200 and echoed["choices"][0]["text"] == "the cat sat"
    scored = echoed["choices"][0]["logprobs"]["token_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt) and echoed["usage"]["completion_tokens"] == 0
    assert scored[1:] == pytest.approx([reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4)


def test_chat_logprobs_list_each_reply_token_with_its_bytes_and_alternatives(url, chat_model_dir, tokenizer):
    messages = [{"role": "user", "content": "a dog sat"}]
    status, body = post(url, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 6,
                                                      "logprobs": True, "top_logprobs": 2})
    assert status == 200
    stop = [token_id(tokenizer, "<|end|>"), tokenizer.eos_token_id]
    prompt = conversation_prompt(tokenizer, messages)
    new = expected_ids(chat_model_dir, prompt, stop, 6, greedy=True)
    reply = new[:-1] if new[-1] in stop else new
    content = body["choices"][0]["logprobs"]["content"]
    assert [bytes(entry["bytes"]) for entry in content] == [tokenizer.token_bytes(token) for token in reply]
    reference = reference_log_probs(chat_model_dir, prompt + reply, tokenizer.vocab_size)
    for index, (entry, token) in enumerate(zip(content, reply)):
        assert entry["logprob"] == pytest.approx(reference[len(prompt) + index - 1, token].item(), abs=1e-4)
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1][
            "logprob"]
    plain = post(url, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 6})[1]
    assert "logprobs" not in plain["choices"][0] and plain["choices"][0]["message"] == body["choices"][0]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_sample_with_successive_seeds(url, chat_model_dir, tokenizer, stream):
    """``n`` replies to one prompt: choice i is what ``generate`` samples with seed + i, streamed as
    chunks of each choice's index (the role once per choice), then the usage alone."""
    body = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 8, "seed": 4, "n": 3,
            "temperature": 1.2, "stream": stream}
    status, reply = post(url, "/v1/chat/completions", body)
    assert status == 200
    stop = [token_id(tokenizer, "<|end|>"), tokenizer.eos_token_id]
    prompt = conversation_prompt(tokenizer, body["messages"])
    expected = [tokenizer.decode(reply_ids(expected_ids(chat_model_dir, prompt, stop, 8, temperature=1.2, seed=4 + i),
                                           stop)) for i in range(3)]
    assert len(set(expected)) > 1  # the seeds give different replies: the test can tell them apart
    if stream:
        texts = ["".join(chunk["choices"][0]["delta"].get("content", "") for chunk in reply
                         if chunk["choices"] and chunk["choices"][0]["index"] == index) for index in range(3)]
        roles = [chunk["choices"][0]["index"] for chunk in reply if chunk["choices"] and "role" in
                 chunk["choices"][0]["delta"]]
        assert sorted(roles) == [0, 1, 2] and reply[-1]["choices"] == [] and "usage" in reply[-1]
        completion_tokens = reply[-1]["usage"]["completion_tokens"]
    else:
        assert [choice["index"] for choice in reply["choices"]] == [0, 1, 2]
        texts = [choice["message"]["content"] for choice in reply["choices"]]
        completion_tokens = reply["usage"]["completion_tokens"]
    assert texts == expected
    assert completion_tokens == sum(len(expected_ids(chat_model_dir, prompt, stop, 8, temperature=1.2, seed=4 + i))
                                    for i in range(3))


def joined_stream_logprobs(chunks: list[dict], chat: bool, index: int = 0):
    """The log-probabilities of a streamed reply's chunks of choice ``index``, joined: chat's
    ``content`` entries, or completions' parallel lists."""
    parts = [chunk["choices"][0]["logprobs"] for chunk in chunks
             if chunk["choices"] and chunk["choices"][0]["index"] == index and "logprobs" in chunk["choices"][0]]
    if chat:
        return {"content": [entry for part in parts for entry in part["content"]]}
    return {key: [value for part in parts for value in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def assert_same_log_probs(streamed, whole) -> None:
    """The same tokens and alternatives with the same log-probabilities (each list's values to 1e-5:
    the batch a token was drawn in may differ between the two requests' runs)."""
    def values(tree):
        if isinstance(tree, dict):
            return [item for key in sorted(tree) for item in [key, *values(tree[key])]]
        if isinstance(tree, list):
            return [item for value in tree for item in values(value)]
        return [tree]
    streamed_values, whole_values = values(streamed), values(whole)
    assert [value for value in streamed_values if not isinstance(value, float)] == [
        value for value in whole_values if not isinstance(value, float)]
    assert [value for value in streamed_values if isinstance(value, float)] == pytest.approx(
        [value for value in whole_values if isinstance(value, float)], abs=1e-5)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "the dog", "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "the dog", "temperature": 0.9, "logprobs": 1, "echo": True, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the mat"}], "temperature": 0,
                              "logprobs": True, "top_logprobs": 3}),
])
def test_streamed_chunks_carry_the_logprobs_of_their_tokens(url, path, body):
    """Streamed, each chunk lists the log-probabilities of its tokens, and the chunks' lists join to
    the whole reply's (``text_offset`` counting on across chunks; with ``echo`` the prompt's first).
    A server without the continuous batcher scores whole replies only, and says so."""
    chat = path.endswith("chat/completions")
    status, chunks = post(url, path, {**body, "stream": True})
    if served_by(SERVERS[url]).batcher is None:
        assert status == 400 and "set stream to false" in chunks["error"]["message"], chunks
        return
    _, whole = post(url, path, body)
    assert status == 200
    for index, choice in enumerate(whole["choices"]):
        streamed = joined_stream_logprobs(chunks, chat, index)
        assert_same_log_probs(streamed, choice["logprobs"])
        if not chat:
            text = "".join(chunk["choices"][0]["text"] for chunk in chunks
                           if chunk["choices"] and chunk["choices"][0]["index"] == index)
            assert text == choice["text"]
        carrying = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["index"] == index
                    and "logprobs" in chunk["choices"][0]]
        assert len(carrying) > 1  # piece by piece, not all at the end
    if body.get("echo"):  # the prompt comes first, its first token unscored
        first = next(chunk for chunk in chunks if chunk["choices"][0]["index"] == 1)["choices"][0]
        assert first["text"] == "the dog" and first["logprobs"]["token_logprobs"][0] is None


def test_a_stop_string_leaves_its_tokens_log_probabilities_to_the_last_chunk(url):
    """Tokens whose text a stop string cut are listed, as in the whole reply, in the last chunk."""
    _, free = post(url, "/v1/completions", {"prompt": "the cat", "temperature": 0, "max_tokens": 20})
    stop = free["choices"][0]["text"][3:6]
    body = {"prompt": "the cat", "temperature": 0, "max_tokens": 20, "stop": [stop], "logprobs": 0}
    _, whole = post(url, "/v1/completions", body)
    status, chunks = post(url, "/v1/completions", {**body, "stream": True})
    if served_by(SERVERS[url]).batcher is None:  # whole replies only (the test above)
        assert status == 400 and chunks["error"]["param"] == "logprobs"
        return
    streamed = joined_stream_logprobs(chunks, chat=False)
    assert_same_log_probs(streamed, whole["choices"][0]["logprobs"])
    assert len("".join(streamed["tokens"])) > len(whole["choices"][0]["text"])  # the stop string's tokens too


WEATHER_TOOL = {"type": "function", "function": {"name": "wx", "description": "The weather in a city.",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
TOOL_REPLY = ('Let me look.<|tool_call|>{"name":"wx","arguments":{"city":"Paris"}}'
              '<|tool_call|>{"name":"wx","arguments":{"city":"Oslo"}}<|end|>')


@pytest.fixture(scope="module", params=[8, 1], ids=["batched", "one_at_a_time"])
def tool_server(tmp_path_factory, chat_tokenizer_dir, tokenizer, request):
    """A server of a model that answers the weather question, tools offered, with ``TOOL_REPLY``."""
    from meshlm.data.chat import tool_definitions
    from tests.helpers.generation_model import positional_script_model

    prompt = conversation_prompt(tokenizer, [{"role": "user", "content": "weather?"}],
                                 tool_definitions([WEATHER_TOOL], "test"))
    model = positional_script_model(len(prompt), tokenizer.encode(TOOL_REPLY, add_special_tokens=False),
                                    tokenizer.vocab_size)
    folder = save_model(model, tmp_path_factory.mktemp("tool_model") / "model", tokenizer_dir=chat_tokenizer_dir)
    server, base = serving(folder, tokenizer, request.param)
    yield base
    stop(server)


def test_a_reply_with_a_tool_call_comes_back_as_tool_calls(tool_server):
    """With ``tools``, the calls a reply writes (meshlm's ``<|tool_call|>`` here; Hermes' tags for templates
    that use them, tests/inference/test_tool_calls.py) come back as ``message.tool_calls``, the text
    before them as the content, ``finish_reason`` ``tool_calls``; streamed, the content's pieces never
    show the call, which comes whole in one ``delta.tool_calls`` before the last chunk."""
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER_TOOL], "temperature": 0,
            "max_tokens": 128}
    status, whole = post(tool_server, "/v1/chat/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look.", whole
    call, second = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and second["id"] != call["id"]
    assert call["function"] == {"name": "wx", "arguments": '{"city": "Paris"}'}
    assert second["function"] == {"name": "wx", "arguments": '{"city": "Oslo"}'}
    single = post(tool_server, "/v1/chat/completions", {**body, "parallel_tool_calls": False})[1]["choices"][0]
    assert [entry["function"] for entry in single["message"]["tool_calls"]] == [call["function"]]
    status, chunks = post(tool_server, "/v1/chat/completions", {**body, "stream": True})
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(delta.get("content", "") for delta in deltas) == "Let me look."
    streamed = [delta["tool_calls"] for delta in deltas if "tool_calls" in delta]
    assert len(streamed) == 1 and [entry["index"] for entry in streamed[0]] == [0, 1]
    assert [entry["function"] for entry in streamed[0]] == [call["function"], second["function"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the next turn: the call and its result go back into the conversation
    follow_up = {"messages": [body["messages"][0], {"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}],
                 "tools": [WEATHER_TOOL], "max_tokens": 3}
    status, reply = post(tool_server, "/v1/chat/completions", follow_up)
    assert status == 200 and reply["usage"]["prompt_tokens"] > whole["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {"tool_choice": "sometimes"}, "tool_choice", "must be 'auto', 'none', 'required'"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "clock"}}}, "tool_choice",
     "which tools does not offer"),
    ("/v1/chat/completions", {"tools": [], "tool_choice": "required"}, "tool_choice", "no tools are offered"),
    ("/v1/chat/completions", {"parallel_tool_calls": "no"}, "parallel_tool_calls", "must be true or false"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {}}]}, "tools", "tool 0 must be"),
    ("/v1/completions", {"prompt": "a", "tools": [WEATHER_TOOL]}, "tools", "belong to /v1/chat/completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "tool_calls": []}]}, "messages",
     "tool_calls belong to assistant messages"),
])
def test_tool_requests_meshlm_cannot_honour_are_refused_by_field(tool_server, path, body, param, message):
    request = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER_TOOL], **body}
    status, reply = post(tool_server, path, request)
    assert status == 400 and reply["error"]["param"] == param and message in reply["error"]["message"], reply


def test_a_named_tool_choice_starts_the_reply_with_that_call(tmp_path, chat_tokenizer_dir, tokenizer):
    """``tool_choice: {"function": {"name": "wx"}}``: the prompt ends with the start of a call to wx
    (``tool_calls.forced_call_prefix``), so the model writes only its arguments, and the reply is
    read from that start: one call to wx."""
    from meshlm.data.chat import ChatTemplate, tool_definitions
    from meshlm.inference.tool_calls import DEFAULT_SYNTAX, forced_call_prefix
    from tests.helpers.generation_model import positional_script_model

    messages = [{"role": "user", "content": "weather?"}]
    prefix = forced_call_prefix(DEFAULT_SYNTAX, ChatTemplate(), "wx")
    prompt = conversation_prompt(tokenizer, messages, tool_definitions([WEATHER_TOOL], "test")) + tokenizer.encode(
        prefix, add_special_tokens=False)
    model = positional_script_model(len(prompt), tokenizer.encode('{"city":"Oslo"}}<|end|>', add_special_tokens=False),
                                    tokenizer.vocab_size)
    server, base = serving(save_model(model, tmp_path / "model", tokenizer_dir=chat_tokenizer_dir), tokenizer)
    try:
        body = {"messages": messages, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 32,
                "tool_choice": {"type": "function", "function": {"name": "wx"}}}
        status, reply = post(base, "/v1/chat/completions", body)
    finally:
        stop(server)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [call["function"] for call in choice["message"]["tool_calls"]] == [
        {"name": "wx", "arguments": '{"city": "Oslo"}'}]
    assert reply["usage"]["prompt_tokens"] == len(prompt)


ANIMAL = {"type": "object", "required": ["animal", "legs", "name"],
          "properties": {"animal": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"},
                         "name": {"type": "string", "maxLength": 8},
                         "friends": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}}}


def is_animal(value) -> bool:
    return (isinstance(value, dict) and {"animal", "legs", "name"} <= set(value) <= set(ANIMAL["properties"])
            and value["animal"] in ("cat", "dog") and type(value["legs"]) is int and len(value["name"]) <= 8
            and all(isinstance(friend, str) and len(friend) <= 6 for friend in value.get("friends", []))
            and len(value.get("friends", [])) <= 2)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_reply_held_to_a_json_schema_is_a_document_of_it(url, path):
    """``response_format`` json_schema: a random tiny model's sampled replies (3 choices) are each one
    JSON document of the schema, ended by the grammar; streamed, the pieces join to the same text."""
    chat = path.endswith("chat/completions")
    body = {"max_tokens": 512, "temperature": 1.0, "seed": 5, "n": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "animal", "schema": ANIMAL}},
            **({"messages": [{"role": "user", "content": "an animal?"}]} if chat else {"prompt": "the cat"})}
    status, reply = post(url, path, body)
    assert status == 200, reply
    texts = [choice["message"]["content"] if chat else choice["text"] for choice in reply["choices"]]
    assert all(choice["finish_reason"] == "stop" for choice in reply["choices"]), reply
    assert all(is_animal(json.loads(text)) for text in texts), texts
    assert len(set(texts)) > 1  # three different samples
    status, chunks = post(url, path, {**body, "n": 1, "stream": True})
    pieces = [chunk["choices"][0]["delta"].get("content", "") if chat else chunk["choices"][0]["text"]
              for chunk in chunks if chunk["choices"]]
    assert "".join(pieces) == texts[0] and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_json_mode_ends_the_reply_where_its_object_closes(tmp_path, chat_tokenizer_dir, tokenizer):
    """``response_format`` json_object: a model that writes an object and then goes on talking is cut
    at the object's end (the grammar allows only the end of turn there), while the same model's reply
    without it runs on; a reply that is the model's own valid choice is not changed."""
    from tests.helpers.generation_model import positional_script_model

    messages = [{"role": "user", "content": "json?"}]
    prompt = conversation_prompt(tokenizer, messages)
    script = tokenizer.encode('{"a": [1, 2]} and more<|end|>', add_special_tokens=False)
    model = positional_script_model(len(prompt), script, tokenizer.vocab_size)
    server, base = serving(save_model(model, tmp_path / "model", tokenizer_dir=chat_tokenizer_dir), tokenizer)
    try:
        body = {"messages": messages, "temperature": 0, "max_tokens": 64}
        free = post(base, "/v1/chat/completions", body)[1]["choices"][0]
        held = post(base, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}})[1]
    finally:
        stop(server)
    assert free["message"]["content"] == '{"a": [1, 2]} and more'
    assert held["choices"][0]["message"]["content"] == '{"a": [1, 2]}', held
    assert held["choices"][0]["finish_reason"] == "stop"
    assert held["usage"]["completion_tokens"] == len(tokenizer.encode('{"a": [1, 2]}', add_special_tokens=False)) + 1


CLOCK_TOOL = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
BOUNDED_WEATHER_TOOL = {"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city"]}}}


def test_a_required_tool_choice_makes_a_random_model_write_one_valid_call(url):
    """``tool_choice: "required"``: a random tiny model's sampled replies are each one call of an
    offered function with arguments of its schema (the grammar of ``tool_calls.forced_call_grammar``)."""
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [BOUNDED_WEATHER_TOOL, CLOCK_TOOL],
            "tool_choice": "required", "temperature": 1.0, "n": 4, "seed": 1, "max_tokens": 256}
    status, reply = post(url, "/v1/chat/completions", body)
    assert status == 200, reply
    for choice in reply["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "clock":
            assert arguments == {"zone": "UTC"} or arguments == {"zone": "CET"}
        else:
            assert call["function"]["name"] == "wx" and set(arguments) in ({"city"}, {"city", "days"})
            assert len(arguments["city"]) <= 10 and type(arguments.get("days", 0)) is int
    named = post(url, "/v1/chat/completions", {**body, "tool_choice": {"type": "function",
                                                                         "function": {"name": "clock"}}})[1]
    assert {choice["message"]["tool_calls"][0]["function"]["name"] for choice in named["choices"]} == {"clock"}
    status, refused = post(url, "/v1/chat/completions", {**body, "tool_choice": "auto",
                                                         "response_format": {"type": "json_object"}})
    assert status == 400 and refused["error"]["param"] == "response_format"
    assert "response_format and tools cannot be combined" in refused["error"]["message"]


def test_with_tool_choice_auto_a_call_the_model_opens_is_held_to_the_offered_functions(tmp_path, chat_tokenizer_dir,
                                                                                      tokenizer):
    """``tool_choice`` auto: text stays free, but after the call marker the call is held to the offered
    functions -- a model that writes a call to a function not offered, with a key its schema lacks,
    gets a call to the offered one instead, and the text after the call is free again."""
    from meshlm.data.chat import tool_definitions
    from tests.helpers.generation_model import positional_script_model

    messages = [{"role": "user", "content": "weather?"}]
    prompt = conversation_prompt(tokenizer, messages, tool_definitions([WEATHER_TOOL], "test"))
    script = 'Hm.<|tool_call|>{"name":"clock","arguments":{"zone":"UTC"}}<|end|>'
    model = positional_script_model(len(prompt), tokenizer.encode(script, add_special_tokens=False),
                                    tokenizer.vocab_size)
    server, base = serving(save_model(model, tmp_path / "model", tokenizer_dir=chat_tokenizer_dir), tokenizer)
    try:
        body = {"messages": messages, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 64}
        held = post(base, "/v1/chat/completions", body)[1]["choices"][0]
    finally:
        stop(server)
    assert held["finish_reason"] == "tool_calls" and held["message"]["content"] == "Hm.", held
    [call] = held["message"]["tool_calls"]
    assert call["function"]["name"] == "wx" and set(json.loads(call["function"]["arguments"])) <= {"city"}, call
