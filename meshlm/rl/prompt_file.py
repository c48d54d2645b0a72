"""``rl.env=prompts``: RL on the prompts of a file of your own, with a held-out part.

    meshlm rl CONFIG.yaml train.init_from=runs/sft --prompts data/math.jsonl
    # rl.env=prompts rl.prompts=data/math.jsonl, as overrides or in the config

The file holds one record per line (JSON Lines, or a ``.json`` array; compressed is fine:
``meshlm/data/jsonl.py``)::

    {"prompt": "Natalia sold clips to 48 of her friends ... How many clips did she sell?", "answer": 72}

``prompt`` (a non-empty string) is the user turn, rendered with the model's chat template after
the record's ``system`` turn (or ``rl.system``'s); a record may give ``messages`` instead, a whole
context ending with the user turn to answer (its content is then the ``prompt`` the reward
function gets). Every other field goes to the reward function. Without ``train.reward_fn`` the
reward is the final-answer match of ``answers.py`` and every record needs an ``answer``; with one,
records may carry whatever that function reads (unit tests, a rubric), and those without an
``answer`` count as solved in the accuracy when their reward is at least 1.0
(``GRPOTrainer.is_correct``).

The environment keeps the contract of the built-in one (``environments.py``), so resuming and
data parallelism work unchanged:

- **held out**: ``rl.eval_prompts`` records drawn by a permutation seeded by ``train.seed``; every
  record whose context (prompt, system, messages) equals a held-out one (a duplicate line) is left
  out of training too, so the held-out accuracy measures prompts the policy never trained on;
- **training stream**: record ``i`` is item ``i mod n`` of the permutation of the n training
  records seeded by (``train.seed``, epoch ``i div n``): every epoch visits each prompt once in a
  new order, and record ``i`` is a function of the file, the seed and ``i`` alone.

The whole file is read at start-up on every rank (prompt files are small next to a corpus) and
checked line by line, so a bad record stops the run before any step with its file and line.
Editing the file between a run and its resume changes the stream from then on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from meshlm.data.jsonl import json_records
from meshlm.errors import ConfigError, DataError
from meshlm.rl.answers import answer_matches, answer_reward

RECORD_FORMAT = '{"prompt": "...", "answer": ...}'


def read_prompt_records(path: str, needs_answers: bool) -> tuple[list[dict], list[str]]:
    """(records, where each was found) of the prompt file ``path``, each checked."""
    if not Path(path).is_file():
        raise ConfigError(f"rl.prompts={path}: no such file; give a JSON-lines file with one {RECORD_FORMAT} "
                          "per line.")
    records, places = [], []
    try:
        for where, record in json_records(path, line_hint=f"each line must be one {RECORD_FORMAT} object"):
            records.append(check_record(record, where, needs_answers))
            places.append(where)
    except DataError as error:
        raise ConfigError(f"rl.prompts: {error}") from error
    return records, places


def check_record(record: object, where: str, needs_answers: bool) -> dict:
    if not isinstance(record, dict):
        raise ConfigError(f"rl.prompts: {where}: a JSON {type(record).__name__}, not an object; write one "
                          f"{RECORD_FORMAT} per line.")
    record = dict(record)
    if "messages" in record:
        record["prompt"] = last_user_turn(record["messages"], where)
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"rl.prompts: {where}: needs a non-empty string under 'prompt', or 'messages' ending with "
                          f"a user turn (keys here: {', '.join(map(repr, record)) or 'none'}).")
    if not isinstance(record.get("system", ""), str):
        raise ConfigError(f"rl.prompts: {where}: 'system' must be a string (the system turn before the prompt).")
    if needs_answers:
        answer = record.get("answer")
        if answer is None or isinstance(answer, (bool, list, dict)) or answer == "":
            found = "no 'answer'" if "answer" not in record else f"'answer' {answer!r}"
            raise ConfigError(f"rl.prompts: {where}: {found}; without train.reward_fn the reward compares the "
                              "reply's final answer with a number or string under 'answer', so give every record "
                              "one, or set train.reward_fn=module:function.")
    return record


def last_user_turn(messages: object, where: str) -> str:
    """The content of the user turn that ends ``messages`` (a record's multi-turn context), checked."""
    shape_ok = isinstance(messages, list) and messages and all(
        isinstance(message, dict) and message.get("role") in ("system", "user", "assistant", "tool")
        and isinstance(message.get("content"), str) for message in messages)
    if not shape_ok or messages[-1]["role"] != "user":
        raise ConfigError(f"rl.prompts: {where}: 'messages' must be a list of {{\"role\", \"content\"}} turns "
                          "(system, user, assistant, tool) ending with the user turn the policy answers.")
    return messages[-1]["content"]


def prompt_key(record: dict) -> str:
    """What makes two records the same prompt: their whole context, as the policy sees it."""
    return json.dumps([record.get("messages"), record.get("system"), record["prompt"]], sort_keys=True)


class PromptFileEnvironment:
    """The records of ``path``, split into a held-out set and an epoch-shuffled training stream."""

    def __init__(self, path: str, seed: int, eval_prompts: int, prompts_per_step: int, needs_answers: bool = True):
        self.path, self.seed = path, seed
        self.records, self.places = read_prompt_records(path, needs_answers)
        records = self.records
        order = list(range(len(records)))
        random.Random(f"{seed}:held-out").shuffle(order)
        held_out_indices = sorted(order[:eval_prompts])
        self.held_out = [records[index] for index in held_out_indices]
        held_out_prompts = {prompt_key(record) for record in self.held_out}
        self.training = [record for record in records if prompt_key(record) not in held_out_prompts]
        if len(self.held_out) < eval_prompts or len(self.training) < prompts_per_step:
            raise ConfigError(f"rl.prompts={path} holds {len(records)} prompts ({len(self.training)} once "
                              f"rl.eval_prompts={eval_prompts} and their duplicates are held out), too few to hold "
                              f"out {eval_prompts} and train on rl.prompts_per_step={prompts_per_step} others; "
                              "lower rl.eval_prompts or add prompts.")
        self.epoch_orders: dict[int, list[int]] = {}

    def epoch_order(self, epoch: int) -> list[int]:
        """The training records' order in ``epoch`` (the latest two epochs are kept)."""
        if epoch not in self.epoch_orders:
            order = list(range(len(self.training)))
            random.Random(f"{self.seed}:train-epoch:{epoch}").shuffle(order)
            self.epoch_orders = {key: value for key, value in self.epoch_orders.items() if key == epoch - 1}
            self.epoch_orders[epoch] = order
        return self.epoch_orders[epoch]

    def train_record(self, index: int) -> dict:
        """Record ``index`` of the training stream (never a held-out prompt)."""
        epoch, position = divmod(index, len(self.training))
        return self.training[self.epoch_order(epoch)[position]]

    def longest_prompt(self, encode) -> tuple[int, str]:
        """(tokens, where) of the longest prompt as ``encode`` renders it (chat template included)."""
        return max((len(encode(record)), place) for record, place in zip(self.records, self.places))

    @staticmethod
    def reward(prompt: str, completion: str, **fields) -> float:
        return answer_reward(prompt, completion, **fields)

    @staticmethod
    def is_correct(record: dict, completion: str) -> bool | None:
        """Whether ``completion`` answers ``record``; None for a record without an answer."""
        return answer_matches(completion, record["answer"]) if "answer" in record else None


__all__ = ["PromptFileEnvironment", "RECORD_FORMAT", "check_record", "read_prompt_records"]
