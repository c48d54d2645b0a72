"""What holding replies to a JSON Schema costs: token masks, and decoding tokens/s against free text.

    python -m bench.constrained_decoding [--vocab-sizes 4096,32768] [--requests 8] [--max-new-tokens 128]
                                         [--repeats 3] [--device cpu] [--out FILE.json]

Constrained decoding (``meshlm/inference/constrained/``) adds, before every drawn token, a mask of
the tokens the grammar allows from the reply's state: a walk of the vocabulary's byte trie the first
time a state is met, a dictionary lookup after. This measures both parts:

* ``masks``: a byte-level BPE trained here on Python standard-library source (offline) at each of
  ``--vocab-sizes``; a document of the schema below tokenized by it, and the mask of the state
  before each of its tokens computed on a fresh grammar (``cold``: the trie walk) and again
  (``warm``: remembered) -- medians in milliseconds, the time to build the trie, and how many
  distinct states the document met;
* ``decoding``: the demo model's shape (``configs/demo.yaml``) with that vocabulary and random
  weights, ``--requests`` prompts decoded together by ``ContinuousBatcher``, sampled at temperature
  1 up to ``--max-new-tokens``: free text, ``json_object`` and the schema, timed alternately
  (``bench/timing.py``), each with a fresh grammar per round so the cold walks are counted: tokens/s
  and its ratio to free text, wall milliseconds per token and the constraint's own share of them
  (its masking, advancing and end checks, timed inside the last round), and whether every reply
  that ended is valid JSON. Replies held to a grammar may end early (a closed object), and a batch
  that thins out decodes fewer tokens a second, so the milliseconds the constraint itself takes
  per token say more than the tokens/s ratio. A random model also meets far more distinct states
  (whitespace runs, odd keys) than a trained one, so its cold walks are the worst case.

One JSON object on stdout (and in ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from bench.timing import interleaved_medians
from meshlm.config import load_run_config
from meshlm.data.tokenizer import load_tokenizer
from meshlm.inference.constrained.grammar import Grammar
from meshlm.inference.constrained.json_schema import ANY_OBJECT, read_schema
from meshlm.inference.constrained.token_constraint import TokenConstraint
from meshlm.inference.constrained.vocabulary import Vocabulary
from meshlm.inference.continuous_batching import ContinuousBatcher, GenerationRequest
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.language_model import LanguageModel

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
SCHEMA = {"type": "object", "required": ["name", "age", "address", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer"},
                         "email": {"type": ["string", "null"]},
                         "address": {"type": "object", "required": ["city"],
                                     "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                    "zip": {"type": "string", "maxLength": 10}}},
                         "tags": {"type": "array", "items": {"enum": ["admin", "staff", "guest"]}, "maxItems": 3},
                         "score": {"type": "number"}}}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": None,
            "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
            "tags": ["admin", "staff"], "score": 97.5}


def train_tokenizer(vocab_size: int, folder: Path, text_bytes: int = 3_000_000):
    """A byte-level BPE of ``vocab_size`` tokens trained on the first ``text_bytes`` of standard-library source."""
    sources, taken = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        sources.append(text)
        taken += len(text)
        if taken >= text_bytes:
            break
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(sources, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    return load_tokenizer(folder / "tokenizer.json")


def mask_costs(tokenizer) -> dict:
    started = time.perf_counter()
    vocabulary = Vocabulary(tokenizer.text_tokens())
    trie_seconds = time.perf_counter() - started
    grammar = Grammar(read_schema(SCHEMA, "bench"), vocabulary)
    ids = tokenizer.encode(json.dumps(DOCUMENT, indent=2), add_special_tokens=False)
    states, state = [], grammar.initial
    for token in ids:
        states.append(state)
        state = grammar.feed(state, vocabulary.token_bytes[token])
        assert state is not None, "the document's tokens must fit the schema"
    assert grammar.complete(state)
    timings = {}
    for kind in ("cold", "warm"):
        seconds = []
        for state in states:
            begun = time.perf_counter()
            grammar.mask(state)
            seconds.append(time.perf_counter() - begun)
        timings[kind] = seconds
    cold_walks = [seconds for position, (seconds, state) in enumerate(zip(timings["cold"], states))
                  if states.index(state) == position]  # a state's first meeting walks the trie; later ones look up
    return {"vocab_size": tokenizer.vocab_size, "trie_build_s": round(trie_seconds, 3), "document_tokens": len(ids),
            "distinct_states": len(set(states)),
            "cold_mask_ms_median": round(1e3 * statistics.median(cold_walks), 3),
            "cold_mask_ms_max": round(1e3 * max(cold_walks), 3),
            "warm_mask_ms_median": round(1e3 * statistics.median(timings["warm"]), 4)}


def decoding(tokenizer, requests: int, new_tokens: int, repeats: int, device: str) -> dict:
    config = load_run_config(CONFIG).model
    config.vocab_size = tokenizer.vocab_size
    torch.manual_seed(0)
    model = LanguageModel(config).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(tokenizer.vocab_size, (int(length),), generator=generator).tolist()
               for length in torch.randint(16, 64, (requests,), generator=generator)]
    vocabulary = Vocabulary(tokenizer.text_tokens())
    end = [tokenizer.eos_token_id]
    nodes = {"free": None, "json_object": ANY_OBJECT, "schema": read_schema(SCHEMA, "bench")}
    replies: dict[str, list[list[int]]] = {}
    tokens: dict[str, int] = {}
    constraint_seconds: dict[str, float] = {}

    def run(name: str) -> float:
        node = nodes[name]
        grammar = None if node is None else Grammar(node, vocabulary)  # fresh: its walks are counted
        batcher = ContinuousBatcher(model, requests, tokenizer.vocab_size)
        TimedConstraint.seconds = 0.0
        try:
            started = time.perf_counter()
            jobs = [batcher.submit(GenerationRequest(prompt, new_tokens, SamplingConfig(seed=index), end,
                                                     constraint=None if grammar is None
                                                     else TimedConstraint(grammar, end)))
                    for index, prompt in enumerate(prompts)]
            replies[name] = [job.wait() for job in jobs]
            seconds = time.perf_counter() - started
        finally:
            batcher.close()
        tokens[name] = sum(map(len, replies[name]))
        constraint_seconds[name] = TimedConstraint.seconds
        return seconds

    medians = interleaved_medians({name: (lambda name=name: run(name)) for name in nodes}, repeats)
    result = {}
    for name, seconds in medians.items():
        ended = [ids for ids in replies[name] if ids and ids[-1] in end]
        valid = None
        if nodes[name] is not None:
            valid = all(is_json(b"".join(vocabulary.token_bytes[token] for token in ids[:-1])) for ids in ended)
        result[name] = {"seconds": round(seconds, 3), "tokens": tokens[name],
                        "tokens_per_s": round(tokens[name] / seconds, 1), "replies_ended": len(ended),
                        "ended_replies_valid_json": valid,
                        "ms_per_token": round(1e3 * seconds / tokens[name], 3),
                        "constraint_ms_per_token_last_round": round(1e3 * constraint_seconds[name] / tokens[name], 3)}
    for name in ("json_object", "schema"):
        result[name]["tokens_per_s_vs_free"] = round(result[name]["tokens_per_s"] / result["free"]["tokens_per_s"], 3)
    return result


class TimedConstraint(TokenConstraint):
    """A ``TokenConstraint`` that adds the seconds its work takes (masking, advancing, asking whether
    the reply must end) to ``seconds``: the constraint's own cost, apart from the model's."""

    seconds = 0.0

    def _timed(self, method, *args):
        started = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            TimedConstraint.seconds += time.perf_counter() - started

    def mask_logits(self, logits):
        return self._timed(TokenConstraint.mask_logits, logits)

    def advance(self, token):
        return self._timed(TokenConstraint.advance, token)

    @property
    def finished(self):
        return self._timed(lambda constraint: TokenConstraint.finished.fget(constraint))


def is_json(data: bytes) -> bool:
    try:
        json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-sizes", default="4096,32768")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokenizer-dir", default="/tmp/meshlm-bench-constrained")
    parser.add_argument("--out")
    args = parser.parse_args()
    summary = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "threads": torch.get_num_threads(), "schema": SCHEMA, "runs": []}
    for size in map(int, args.vocab_sizes.split(",")):
        tokenizer = train_tokenizer(size, Path(args.tokenizer_dir) / str(size))
        entry = {"masks": mask_costs(tokenizer)}
        entry["decoding"] = decoding(tokenizer, args.requests, args.max_new_tokens, args.repeats, args.device)
        summary["runs"].append(entry)
        print(json.dumps(entry), file=sys.stderr)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
