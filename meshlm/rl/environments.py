"""Where RL prompts come from, and how a reply is judged: the built-in arithmetic environment
(and ``build_environment``, which also builds a prompt file's: ``prompt_file.py``).

An environment hands out **records**: ``{"prompt": "What is 17 + 25?", "answer": 42}`` -- the
prompt (a user turn, rendered with the model's chat template) and the fields a reward function
is given (``meshlm/rl/reward_functions.py``). It has two disjoint parts:

- the **training** stream: record ``i`` for every ``i >= 0``, a function of (seed, i) alone, so step
  ``s`` of a run reads records ``[s * P, (s + 1) * P)`` (P = ``rl.prompts_per_step``) at any
  data-parallel size and after any resume, exactly as the trainer reads samples by index;
- the **held-out** set: ``rl.eval_prompts`` fixed records, drawn from their own seed and never
  handed out for training (a training draw that lands on one is redrawn), so accuracy on them
  measures what the policy learned rather than what it memorized.

**Arithmetic** (``rl.env=arithmetic``): ``a OP b`` with operands of 1 to ``rl.digits`` digits and
OP drawn from ``rl.operations`` ('+', '-', '*'); the reward is 1.0 when the last integer in the
reply equals the answer, else 0.0 -- verifiable, as RL with verifiable rewards needs (DeepSeek-R1
2025, §2.2.2: rule-based accuracy rewards). It is small enough that a tiny model learns it on a
CPU, which makes the whole loop testable offline.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.rl.prompt_file import PromptFileEnvironment

INTEGER = re.compile(r"-?\d+")


def final_number(text: str) -> int | None:
    """The last integer written in ``text`` (a leading '-' counts), or None when there is none."""
    found = INTEGER.findall(text)
    return int(found[-1]) if found else None


def arithmetic_reward(prompt: str, completion: str, answer: int, **fields) -> float:
    """1.0 when the completion's last integer is ``answer``, else 0.0 (the arithmetic environment's reward)."""
    return float(final_number(completion) == int(answer))


@dataclass
class ArithmeticEnvironment:
    """Seeded "What is a OP b?" questions; see the module docstring."""

    seed: int
    digits: int = 2
    operations: str = "+-"
    eval_prompts: int = 64

    def __post_init__(self) -> None:
        self.held_out = [self.draw(random.Random(f"{self.seed}:held-out:{index}")) for index in range(self.eval_prompts)]
        self.held_out_prompts = {record["prompt"] for record in self.held_out}
        distinct = self.question_count()
        if distinct < 2 * self.eval_prompts:
            raise ConfigError(f"rl.digits={self.digits} with rl.operations={self.operations!r} allows only {distinct} "
                              f"questions, too few to hold out rl.eval_prompts={self.eval_prompts} and train on the "
                              "rest; raise rl.digits or lower rl.eval_prompts.")

    def question_count(self) -> int:
        return len(self.operations) * (10 ** self.digits) ** 2

    def draw(self, rng: random.Random) -> dict:
        """One question: operands with a uniformly drawn digit count, then a uniform value of it."""
        a, b = (self.operand(rng) for _ in range(2))
        operation = rng.choice(self.operations)
        answer = a + b if operation == "+" else a - b if operation == "-" else a * b
        return {"prompt": f"What is {a} {operation} {b}?", "answer": answer}

    def operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)

    def train_record(self, index: int) -> dict:
        """Record ``index`` of the training stream (never a held-out question)."""
        for attempt in range(1000):
            record = self.draw(random.Random(f"{self.seed}:train:{index}:{attempt}"))
            if record["prompt"] not in self.held_out_prompts:
                return record
        raise RuntimeError("unreachable: fewer than half the questions are held out")

    @staticmethod
    def reward(prompt: str, completion: str, **fields) -> float:
        return arithmetic_reward(prompt, completion, **fields)

    @staticmethod
    def is_correct(record: dict, completion: str) -> bool:
        """Whether ``completion`` answers ``record`` (what held-out accuracy counts)."""
        return final_number(completion) == int(record["answer"])


ENVIRONMENTS = {"arithmetic": ArithmeticEnvironment, "prompts": PromptFileEnvironment}
"""rl.env name -> environment class."""


def build_environment(rl, seed: int, needs_answers: bool = True) -> ArithmeticEnvironment | PromptFileEnvironment:
    """The environment ``rl.env`` names, seeded by the run's ``train.seed``; ``needs_answers``: the
    prompt file's records must carry answers (no train.reward_fn to judge them)."""
    if rl.env not in ENVIRONMENTS:
        raise ConfigError(f"rl.env={rl.env!r} is not a built-in environment ({', '.join(ENVIRONMENTS)}); "
                          "use rl.env=arithmetic, or rl.env=prompts with rl.prompts=FILE for prompts of your own.")
    if rl.env == "prompts":
        return PromptFileEnvironment(rl.prompts, seed, rl.eval_prompts, rl.prompts_per_step, needs_answers)
    return ArithmeticEnvironment(seed=seed, digits=rl.digits, operations=rl.operations, eval_prompts=rl.eval_prompts)


__all__ = ["ENVIRONMENTS", "ArithmeticEnvironment", "arithmetic_reward", "build_environment", "final_number"]
