"""``meshlm score``: a reward model's scores of preference pairs or rated replies, and how well it ranks them.

    meshlm score runs/rm --input heldout_pairs.jsonl            # per-pair scores, pairwise accuracy
    meshlm score runs/rm --input rated.jsonl --json             # per-attribute scores and MSE, as JSON

CKPT is a reward model (``model.head=reward``; a model folder, ``step_N`` checkpoint or run
directory). The input is the JSONL of ``meshlm preprocess --preference`` (``meshlm/data/preference.py``):
pairs (``prompt`` or ``messages``, ``chosen``, ``rejected``) or rated replies (``messages`` ending
with the reply, and ``scores``). Each reply is rendered with the chat template of the model's
tokenizer exactly as for training, and scored at its last token (``meshlm/models/reward_head.py``);
a conversation longer than ``--max-len`` (default: the model's training ``seq_len``) keeps its last
``--max-len`` tokens, as training does.

For pairs it prints each pair's chosen and rejected score and, at the end, the **pairwise
accuracy**: the fraction of pairs whose chosen reply scores higher (with several attributes, the
first one's scores are compared). For rated replies it prints each attribute's score beside its
rating and the **mean squared error** per attribute over the rated entries. One process; scoring
is a forward pass per example on the device (``--device``, default cuda when there is one).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from meshlm.data.chat import encode_segments, load_chat_template
from meshlm.data.preference import PAIRS, final_reply_segments, read_examples
from meshlm.data.readers import expand_inputs
from meshlm.data.tokenizer import find_tokenizer_file
from meshlm.errors import ConfigError
from meshlm.evaluation.loading import load_for_evaluation
from meshlm.models.context import SequenceContext
from meshlm.models.reward_head import last_token_rewards


@torch.no_grad()
def score_rows(model, rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """fp32 scores [len(rows), attributes] of token rows (right-padded into one batch)."""
    length = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.int64)
    for index, row in enumerate(rows):
        input_ids[index, :len(row)] = torch.tensor(row, dtype=torch.int64)
    input_ids = input_ids.to(device)
    context = SequenceContext.for_tokens(input_ids)
    hidden = model.run_blocks(model.embed(input_ids, context), context)
    last_index = torch.tensor([len(row) - 1 for row in rows], device=device)
    return last_token_rewards(model.reward_head, model.final_norm(hidden), last_index).cpu()


def score_file(model, tokenizer, template, files: list[Path], max_len: int, device: torch.device) -> dict:
    """{"kind", "attributes", "examples": [...], and "pairwise_accuracy" or "mse"} for the examples of ``files``."""
    attributes = list(model.config.reward_attributes)
    examples, correct, squared, counts = [], 0, {name: 0.0 for name in attributes}, {name: 0 for name in attributes}
    kind = None
    for where, example_kind, example in read_examples(files):
        kind = kind or example_kind
        conversations = [example["chosen"], example["rejected"]] if example_kind == PAIRS else [example["messages"]]
        rows = [encode_segments(tokenizer, final_reply_segments(template, messages, example["tools"]))[0][-max_len:]
                .tolist()
                for messages in conversations]
        scores = score_rows(model, rows, device)
        record = {"where": where}
        if example_kind == PAIRS:
            record.update(chosen=scores[0].tolist(), rejected=scores[1].tolist())
            record["correct"] = bool(scores[0, 0] > scores[1, 0])
            correct += record["correct"]
        else:
            record.update(scores=dict(zip(attributes, scores[0].tolist())), targets=example["scores"])
            for name, value in example["scores"].items():
                if name in squared:
                    squared[name] += (record["scores"][name] - value) ** 2
                    counts[name] += 1
        examples.append(record)
    result = {"kind": kind, "attributes": attributes, "examples": examples}
    pairs = sum(1 for record in examples if "chosen" in record)
    if pairs:
        result["pairwise_accuracy"] = correct / pairs
    if any(counts.values()):
        result["mse"] = {name: squared[name] / counts[name] for name in attributes if counts[name]}
        result["mse_all"] = sum(squared.values()) / sum(counts.values())
    return result


def format_scores(values: list[float], attributes: list[str]) -> str:
    if len(attributes) == 1:
        return f"{values[0]:+.4f}"
    return "[" + ", ".join(f"{name} {value:+.4f}" for name, value in zip(attributes, values)) + "]"


def print_result(result: dict) -> None:
    attributes = result["attributes"]
    for number, record in enumerate(result["examples"], start=1):
        if "chosen" in record:
            verdict = "ok" if record["correct"] else "WRONG"
            print(f"pair {number} ({record['where']}): chosen {format_scores(record['chosen'], attributes)}  "
                  f"rejected {format_scores(record['rejected'], attributes)}  {verdict}")
        else:
            parts = [f"{name} {value:+.4f}" + (f" (rated {record['targets'][name]:g})" if name in record['targets']
                                                else "") for name, value in record["scores"].items()]
            print(f"example {number} ({record['where']}): " + ", ".join(parts))
    if "pairwise_accuracy" in result:
        pairs = sum(1 for record in result["examples"] if "chosen" in record)
        correct = sum(1 for record in result["examples"] if record.get("correct"))
        print(f"pairwise accuracy: {100 * result['pairwise_accuracy']:.1f}% ({correct}/{pairs} pairs)")
    if "mse" in result:
        per_attribute = ", ".join(f"{name} {value:.4f}" for name, value in result["mse"].items())
        print(f"mean squared error: {per_attribute}; all attributes {result['mse_all']:.4f}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a reward model: model folder, step_N checkpoint or run")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="preference JSONL: pairs (prompt/messages, chosen, rejected) or rated replies "
                             "(messages, scores)")
    parser.add_argument("--tokenizer", help="tokenizer file (default: the one saved with the model)")
    parser.add_argument("--max-len", type=int, help="keep at most this many last tokens per conversation "
                                                    "(default: the model's training seq_len)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    loaded = load_for_evaluation(args.checkpoint, args.tokenizer, args.device)
    model = loaded.model
    if model.config.head != "reward":
        raise ConfigError(f"{args.checkpoint} is a language model (model.head={model.config.head}); `meshlm score` "
                          "reads reward models, trained with model.head=reward train.objective=reward.")
    if loaded.tokenizer is None:
        raise ConfigError(f"{args.checkpoint} has no tokenizer saved with it; pass --tokenizer FILE (the one the "
                          "preference store was written with, PREFIX.tokenizer/tokenizer.json).")
    template = load_chat_template(args.tokenizer or find_tokenizer_file(loaded.directory))
    max_len = args.max_len or loaded.default_seq_len
    if max_len < 2:
        raise ConfigError(f"--max-len {max_len} must be at least 2 tokens.")
    result = score_file(model, loaded.tokenizer, template, expand_inputs(args.input), max_len, loaded.device)
    if args.json:
        print(json.dumps(result))
    else:
        print_result(result)
    return 0


__all__ = ["add_arguments", "run", "score_file", "score_rows"]
