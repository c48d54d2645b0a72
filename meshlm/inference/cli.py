"""``meshlm generate``: continue prompts with a saved model or the latest checkpoint of a run.

    meshlm generate runs/x --prompt "ROMEO:" --max-new-tokens 64 --temperature 0.8 --top-p 0.95
    meshlm generate runs/x/checkpoints/step_2000 --prompt-ids 1,2,3 --max-new-tokens 16 --greedy --json
    meshlm generate runs/x --prompt-file story.txt --max-new-tokens 256

CKPT is a model directory (``config.json`` + ``model.safetensors``), or a training run / a
folder of checkpoints, in which case the ``step_N`` folder with the highest N is used. Text
prompts need a tokenizer: ``tokenizer.json`` beside the model, or ``--tokenizer PATH``. The
tokenizer also supplies the eos token (``--eos-id`` overrides it) and the true vocabulary
size, so a model whose vocabulary was padded never emits an id the tokenizer cannot decode.
``--prompt-file FILE`` reads a text prompt whole from a UTF-8 file (``-``: standard input), newlines
and all, for prompts too long or too full of quotes for a shell argument; it and ``--prompt``
each give one prompt per use (they go with ``--chat`` alike), in the order given.
Each prompt gets at most ``--max-new-tokens`` new tokens (default 128) and stops early at its
eos token. Output is one line per prompt: the generated text (or ids without a tokenizer), or with
``--json`` an object ``{"ids": [...], "text": "..."}`` holding the new tokens only.

    meshlm generate runs/sft --chat --prompt "What is 2+2?" [--system "Be brief."]

``--chat`` renders each prompt as a user turn with the checkpoint tokenizer's chat template,
stops at the end of the assistant's turn and prints only the reply (``meshlm/inference/chat.py``).
``--reasoning on|off`` ends the system turn with ``/think`` or ``/no_think`` (the reasoning toggle,
``meshlm/data/reasoning.py``); a reply's think block prints as ``<think>...</think>`` before the
answer (with ``--json``: a ``"thinking"`` field, and ``"text"`` holds the answer).

    meshlm generate runs/x --prompt-ids 1,2,3 --max-new-tokens 256 --greedy --prefill-chunk 4096 --stats
    meshlm generate runs/demo-mtp --prompt "ROMEO:" --max-new-tokens 128 --greedy --speculative mtp --stats

``--prefill-chunk N`` runs each prompt through the model N tokens per forward (memory bounded for
long prompts; the same tokens). ``--speculative mtp`` drafts tokens with the model's
multi-token-prediction depths and verifies them in one forward (greedy: the same tokens as plain
greedy decoding; sampled: tokens with plain sampling's distribution, by the speculative-sampling
rule; ``meshlm/inference/speculative.py``). ``--stats`` prints one JSON line to
stderr: prefill and decode tokens/s and cache bytes (``meshlm/inference/stats.py``); with
``--speculative`` also the drafts accepted, and the speed-up over plain decoding of the same
prompts with the same settings, which it then runs too (one prompt at a time, as speculative
decoding does).
``--input FILE --output FILE`` generates for a file of prompt records in batches, appending to the
output as it goes and continuing there when rerun (``meshlm/inference/batch_generate.py``).
``--json-schema FILE`` holds every reply to a JSON Schema (``meshlm/inference/constrained/``: only
the tokens that keep the text on its way to a document of the schema are drawn, and the reply ends
with it; ``{"type": "object"}`` for any JSON object): structured records for synthetic data, with
``--input`` too.
``--compile`` decodes with the per-token step under torch.compile (``meshlm/inference/decode_step.py``):
the same tokens up to float rounding, each step several times faster on a CPU, after a first step
that compiles (tens of seconds; ``--stats`` reports it as ``compile_seconds``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.model_files import load_model
from meshlm.data.readers import read_whole_text
from meshlm.data.tokenizer import Tokenizer, find_tokenizer_file, load_tokenizer
from meshlm.errors import ConfigError, DataError
from meshlm.inference.batch_generate import DEFAULT_BATCH_SIZE, generate_file
from meshlm.inference.chat import chat_prompt, reply_ids, reply_record, show_reply, stop_ids
from meshlm.inference.constrained.grammar import Grammar, GrammarCache
from meshlm.inference.constrained.json_schema import read_schema
from meshlm.inference.constrained.token_constraint import TokenConstraint
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.inference.speculative import SPECULATIVE_METHODS
from meshlm.inference.stats import GenerationStats

DEFAULT_MAX_NEW_TOKENS = 128
"""New tokens per prompt when ``--max-new-tokens`` is not given (generation also stops at eos)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="model directory, training checkpoint, or run directory (latest step_N is used)")
    # Text prompts (--prompt, --prompt-file: one list, in the order given) or token ids, not both;
    # checked in ``check_prompts``, as argparse's groups cannot say "one or more of these two".
    parser.add_argument("--prompt", action="append", metavar="TEXT", help="a text prompt (repeatable)")
    parser.add_argument("--prompt-file", action="append", type=PromptFile, metavar="FILE", dest="prompt",
                        help="a text prompt read whole from a UTF-8 file, newlines kept; - reads standard input "
                             "(repeatable, and with --prompt: for a long prompt or code, which a shell argument "
                             "mangles)")
    parser.add_argument("--prompt-ids", action="append", type=parse_token_ids, metavar="ID,ID,...",
                        help="a prompt given as comma-separated token ids (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                        help=f"stop each prompt after N new tokens, or at its eos (default {DEFAULT_MAX_NEW_TOKENS})")
    add_sampling_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or a directory holding one")
    parser.add_argument("--eos-id", type=int, help="stop a prompt at this token id (default: the tokenizer's eos)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--prefill-chunk", type=int, metavar="N",
                        help="run prompts through the model N tokens per forward (default: whole prompts)")
    parser.add_argument("--speculative", choices=SPECULATIVE_METHODS,
                        help="mtp: draft with the model's multi-token-prediction depths, verify in one forward "
                             "(greedy or sampled)")
    parser.add_argument("--draft-tokens", type=int, metavar="K",
                        help="with --speculative mtp: tokens drafted a step, 1 to model.mtp_depth (default: all)")
    parser.add_argument("--compile", action="store_true",
                        help="decode with the per-token step compiled by torch.compile (Inductor): faster steps "
                             "after a first one that compiles for tens of seconds; plain decoding only")
    parser.add_argument("--chat", action="store_true",
                        help="render each --prompt as a user turn with the chat template; print only the reply")
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system turn before the prompt")
    parser.add_argument("--reasoning", choices=("on", "off"),
                        help="with --chat: end the system turn with /think (on) or /no_think (off), the toggle "
                             "a reasoning model was fine-tuned with; a think block is printed marked")
    parser.add_argument("--stats", action="store_true",
                        help="print prefill/decode tokens/s, cache bytes (and drafts accepted) as JSON on stderr")
    parser.add_argument("--input", metavar="FILE.jsonl",
                        help='prompts from a file, one {"prompt": ...} record per line (with --chat also "system" '
                             'or "messages"), generated in batches into --output (meshlm/inference/batch_generate.py)')
    parser.add_argument("--output", metavar="FILE.jsonl",
                        help="with --input: each record with what was generated, appended a batch at a time; "
                             "rerunning continues after the last complete line")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="N",
                        help=f"with --input: prompts per generate call (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--json-schema", metavar="FILE.json",
                        help="hold every reply to this JSON Schema (constrained decoding; {\"type\": \"object\"}: "
                             "any JSON object)")


def parse_token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integer token ids") from None


def check_prompts(args: argparse.Namespace) -> None:
    """One or more prompts, as text (``--prompt``, ``--prompt-file``) or as token ids, not both; or
    a file of them (``--input`` with ``--output``)."""
    if getattr(args, "input", None) is not None:
        if args.prompt is not None or args.prompt_ids is not None:
            raise ConfigError("--input reads the prompts from a file; drop --prompt, --prompt-file and --prompt-ids.")
        if args.output is None:
            raise ConfigError("--input writes its completions to a file: add --output FILE.jsonl.")
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size {args.batch_size} must be at least 1.")
        return
    if getattr(args, "output", None) is not None:
        raise ConfigError("--output holds the completions of --input's prompts; add --input FILE.jsonl, or drop "
                          "--output to print them.")
    if args.prompt is None and args.prompt_ids is None:
        raise ConfigError("no prompt given; pass --prompt TEXT, --prompt-file FILE or --prompt-ids ID,ID,... "
                          "(each repeatable).")
    if args.prompt is not None and args.prompt_ids is not None:
        raise ConfigError("--prompt-ids gives prompts as token ids, --prompt and --prompt-file as text; use one "
                          "kind in a run.")


class PromptFile(str):
    """A ``--prompt-file`` path among the ``--prompt`` texts (one list keeps their order), read when
    the command runs (``read_prompts``), not while argparse parses."""


def read_prompts(prompts: list[str]) -> list[str]:
    """The text prompts, each ``PromptFile`` replaced by its file's whole text (``-``: standard input)."""
    return [read_whole_text(prompt, "--prompt-file", "the prompt") if isinstance(prompt, PromptFile) else prompt
            for prompt in prompts]


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--greedy, --temperature, --top-k, --top-p and the penalties on repeated tokens (read back by
    ``sampling_from_args``)."""
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default 1.0)")
    parser.add_argument("--top-k", type=int, help="sample among the K most likely tokens (default: all)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1.0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                        help="divide the logits of tokens in the prompt or text so far by R (default 1.0: off; "
                             "1.1-1.3 discourages loops; greedy or sampled)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                        help="subtract P from the logits of tokens generated so far (OpenAI's, -2 to 2; default 0)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                        help="subtract F times its count from each generated token's logit (OpenAI's, -2 to 2; "
                             "default 0)")


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    chosen = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                       ("--top-p", args.top_p)) if value is not None]
    if args.greedy:
        if chosen:
            raise ConfigError(f"--greedy always takes the most likely token, so {', '.join(chosen)} "
                              "cannot apply; drop --greedy to sample, or drop the sampling flags.")
        return SamplingConfig(greedy=True, seed=args.seed, **penalties_from_args(args))
    return SamplingConfig(temperature=1.0 if args.temperature is None else args.temperature,
                          top_k=0 if args.top_k is None else args.top_k,
                          top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed, **penalties_from_args(args))


def penalties_from_args(args: argparse.Namespace) -> dict:
    """The SamplingConfig fields of --repetition-penalty, --presence-penalty and --frequency-penalty,
    whose errors name the flags."""
    values = {"repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
              "frequency_penalty": args.frequency_penalty}
    try:
        SamplingConfig(greedy=True, **values)
    except ConfigError as error:
        raise ConfigError(f"--{str(error).replace('_', '-')}") from error
    return values


def find_tokenizer(explicit: str | None, model_dir: Path, given_path: Path) -> Tokenizer | None:
    """The tokenizer named by ``--tokenizer``, else one saved with the model or run, else None."""
    if explicit is not None:
        return load_tokenizer(explicit)
    for directory in dict.fromkeys((model_dir, given_path)):
        try:
            return load_tokenizer(find_tokenizer_file(directory))
        except FileNotFoundError:
            continue
    return None


def load_generation_model(args: argparse.Namespace, missing_tokenizer: str | None):
    """(model folder, tokenizer or None, device, model) of ``args.checkpoint``: the tokenizer named by
    ``--tokenizer`` or saved with the model, the device ``--device`` names (default: cuda when there is
    one), the model loaded there with its LoRA adapters folded in. ``missing_tokenizer``: what the
    error says after "no tokenizer found in MODEL_DIR: " when there is none (None: go on without one)."""
    model_dir = resolve_model_dir(args.checkpoint)
    tokenizer = find_tokenizer(args.tokenizer, model_dir, Path(args.checkpoint))
    if tokenizer is None and missing_tokenizer is not None:
        raise FileNotFoundError(f"no tokenizer found in {model_dir}: {missing_tokenizer}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model_dir, tokenizer, device, load_model(model_dir, map_location=device, merge_lora=True)


def choose_eos(explicit: int | None, tokenizer: Tokenizer | None, model_dir: Path) -> int | list[int] | None:
    """``--eos-id``, else the tokenizer's eos, else the one a converted Hugging Face model declared."""
    if explicit is not None:
        return explicit
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    try:
        return json.loads((model_dir / "config.json").read_text()).get("hf", {}).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return None


def run(args: argparse.Namespace) -> int:
    if args.reasoning is not None and not args.chat:
        raise ConfigError("--reasoning writes the /think or /no_think switch into a chat system turn; add --chat, "
                          "or drop --reasoning.")
    check_prompts(args)
    if args.prompt is not None:
        args.prompt = read_prompts(args.prompt)
    sampling = sampling_from_args(args)
    model_dir, tokenizer, _, model = load_generation_model(args, None if args.prompt is None else (
        "text prompts need one; pass --tokenizer PATH, or give token ids with --prompt-ids."))
    prompts = (args.prompt_ids if args.prompt is None else [tokenizer.encode(text) for text in args.prompt]
               ) if args.input is None else []
    eos_token_id = choose_eos(args.eos_id, tokenizer, model_dir)
    if args.chat and args.input is None:
        if args.prompt is None:
            raise ConfigError("--chat renders text prompts as user turns; give them with --prompt, not --prompt-ids.")
        prompts, stop_ids = zip(*(chat_prompt(tokenizer, text, args.system, args.reasoning) for text in args.prompt))
        prompts, eos_token_id = list(prompts), stop_ids[0] if args.eos_id is None else args.eos_id
    valid_vocab_size = min(tokenizer.vocab_size, model.config.vocab_size) if tokenizer else None
    grammar = None if args.json_schema is None else schema_grammar(args.json_schema, tokenizer, valid_vocab_size)
    if args.input is not None:
        return generate_from_file(args, model, tokenizer, sampling, eos_token_id, valid_vocab_size, grammar)
    settings = dict(eos_token_id=eos_token_id, valid_vocab_size=valid_vocab_size, prefill_chunk=args.prefill_chunk)
    stats = GenerationStats() if args.stats else None
    ends = [] if eos_token_id is None else list(eos_token_id) if isinstance(eos_token_id, list) else [eos_token_id]
    results = generate(model, prompts, args.max_new_tokens, sampling, speculative=args.speculative,
                       draft_tokens=args.draft_tokens, stats=stats, compile=args.compile,
                       constraints=None if grammar is None else [TokenConstraint(grammar, ends) for _ in prompts],
                       **settings)
    for ids in results:
        if args.chat:  # the reply only; a think block split from the answer (meshlm/inference/chat.py)
            record = reply_record(tokenizer, reply_ids(ids, eos_token_id if isinstance(eos_token_id, list)
                                                       else [eos_token_id]))
            print(json.dumps(record) if args.json else show_reply(record))
            continue
        text = tokenizer.decode(ids) if tokenizer else None
        if args.json:
            print(json.dumps({"ids": ids} if text is None else {"ids": ids, "text": text}))
        else:
            print(text if text is not None else ",".join(map(str, ids)))
    if stats is not None:
        report = stats.summary()
        if args.speculative is not None:
            report.update(compare_with_plain(model, prompts, args.max_new_tokens, sampling, results, stats,
                                             settings))
        print(json.dumps(report), file=sys.stderr)
    return 0


def generate_from_file(args, model, tokenizer, sampling, eos_token_id, valid_vocab_size, grammar=None) -> int:
    """``--input`` / ``--output``: the file's prompts in batches (meshlm/inference/batch_generate.py)."""
    if tokenizer is None:
        raise FileNotFoundError(f"no tokenizer found for {args.checkpoint}: --input holds text prompts; pass "
                                "--tokenizer PATH.")
    if args.speculative is not None or args.stats:
        raise ConfigError("--input generates in batches; --speculative and --stats take --prompt (one prompt at a "
                          "time).")
    if args.chat and args.eos_id is None:
        stops = stop_ids(tokenizer)  # the template's end of turn, and the eos
    else:
        stops = [] if eos_token_id is None else list(eos_token_id) if isinstance(eos_token_id, list) else [eos_token_id]
    settings = dict(eos_token_id=stops or None, valid_vocab_size=valid_vocab_size, prefill_chunk=args.prefill_chunk,
                    compile=args.compile)
    return generate_file(args, model, tokenizer, sampling, stops, settings, grammar)


def schema_grammar(path: str, tokenizer: Tokenizer | None, valid_vocab_size: int | None) -> Grammar:
    """The grammar of the JSON Schema in the file ``path`` over the tokenizer's vocabulary (``--json-schema``)."""
    if tokenizer is None:
        raise FileNotFoundError("--json-schema holds replies to a schema, which needs the tokenizer's token bytes; "
                                "pass --tokenizer PATH.")
    try:
        schema = json.loads(read_whole_text(path, "--json-schema", "the schema"))
    except json.JSONDecodeError as error:
        raise DataError(f"--json-schema {path}: not valid JSON ({error}); write the JSON Schema as one JSON "
                        "object.") from error
    node = read_schema(schema, f"--json-schema {path}")
    return GrammarCache(tokenizer, valid_vocab_size).grammar(json.dumps(schema, sort_keys=True), node)


def compare_with_plain(model, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                       speculative_results, speculative_stats: GenerationStats, settings: dict) -> dict:
    """Decode the prompts again plainly with the same ``sampling``, one at a time as speculative
    decoding does: its decode tokens/s, the speed-up, and whether the tokens are the same (greedy
    only: sampled tokens share a distribution, not the random draws)."""
    plain_stats, plain_results = GenerationStats(), []
    for prompt in prompts:
        plain_results += generate(model, [prompt], max_new_tokens, sampling, stats=plain_stats, **settings)
    plain_rate = plain_stats.summary()["decode_tokens_per_s"]
    speculative_rate = speculative_stats.summary()["decode_tokens_per_s"]
    return {"plain_decode_tokens_per_s": plain_rate,
            "speedup": round(speculative_rate / plain_rate, 3) if plain_rate and speculative_rate else None,
            "same_tokens_as_plain": plain_results == speculative_results if sampling.greedy else None}
