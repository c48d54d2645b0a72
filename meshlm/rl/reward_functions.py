"""``train.reward_fn=module:function``: a Python reward function, loaded and checked once.

A reward function scores one completion::

    def exact_answer(prompt: str, completion: str, **fields) -> float:
        return float(completion.strip() == str(fields["answer"]))

``prompt`` is the environment record's question (the user turn, before the chat template),
``completion`` the generated reply as text (the end-of-turn token removed) and ``fields`` the
record's other fields (the arithmetic environment's: ``answer``). It must return a finite number;
anything else stops the run with one sentence naming the function, the prompt and the value. The
module is imported as Python imports it (the current directory and PYTHONPATH first), on every
rank, so a module beside the config works under torchrun too. Without ``train.reward_fn`` the
environment's own reward is used (``environments.py``).
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

from meshlm.errors import ConfigError

RewardFunction = Callable[..., float]


def load_reward_fn(spec: str) -> RewardFunction:
    """The function ``spec`` ('module:function') names; ConfigError when it does not import or is not callable."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ConfigError(f"train.reward_fn={spec!r} must look like module:function "
                          "(e.g. train.reward_fn=my_rewards:exact_answer).")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or anything the module raised while importing
        raise ConfigError(f"train.reward_fn={spec!r}: module {module_name!r} does not import ({error}); make it "
                          "importable (run from its directory or add it to PYTHONPATH).") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"train.reward_fn={spec!r}: module {module_name!r} has no function {function_name!r}; "
                          "name a function defined in it.")
    return function


def score(function: RewardFunction, name: str, record: dict, completion: str) -> float:
    """``function(prompt, completion, **fields)`` as a float; ConfigError unless it is a finite number."""
    fields = {key: value for key, value in record.items() if key != "prompt"}
    value = function(record["prompt"], completion, **fields)
    if not isinstance(value, (int, float)) or not math.isfinite(value):  # bool counts: True is 1.0
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor or numpy scalar
            return score(lambda *args, **kwargs: value.item(), name, record, completion)
        raise ConfigError(f"{name} returned {value!r} for the prompt {record['prompt']!r}; a reward function must "
                          "return a finite number (e.g. 1.0 for a right answer, 0.0 otherwise).")
    return float(value)


__all__ = ["RewardFunction", "load_reward_fn", "score"]
