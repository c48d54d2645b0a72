"""A reward model started from a language model: the backbone from its folder, a fresh reward head.

    meshlm train ... model.head=reward train.objective=reward train.init_from=runs/sft

The usual way to train a reward model is from the SFT model (InstructGPT; Nemotron-4
340B-Reward starts from the 340B base and replaces "the final softmax layer" by the reward head).
The folder then holds a model with ``model.head=lm``: every tensor of the reward model but
``reward_head.weight`` is in it under the same name (its ``output.weight`` is not read), and the
head gets its initial value from (train.seed, its name), as a new run's would. Any other
difference between the folder's model and the run's is refused as for any ``train.init_from``
(``initial_weights.py``).
"""

from __future__ import annotations

from meshlm.checkpoint.materialize import InitialValues

HEAD_FIELDS = ("head", "reward_attributes")
"""The model fields in which a reward model may differ from the LM folder it starts from."""


def starts_from_language_model(run_model, saved_model) -> bool:
    """True when a reward model (``run_model``) starts from a language model's folder (``saved_model``)."""
    return run_model.head == "reward" and saved_model.head == "lm"


class RewardHeadSource:
    """Fills ``reward_head.*`` with initial values and everything else from ``backbone`` (the LM folder)."""

    def __init__(self, backbone, model_config, seed: int):
        self.backbone, self.initial = backbone, InitialValues(model_config, seed)

    def fill(self, targets: dict) -> None:
        head = {name: target for name, target in targets.items() if name.startswith("reward_head.")}
        self.initial.fill(head)
        self.backbone.fill({name: target for name, target in targets.items() if name not in head})


__all__ = ["HEAD_FIELDS", "RewardHeadSource", "starts_from_language_model"]
