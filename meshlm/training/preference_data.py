"""The datasets of a reward-model or DPO run: preference stores, checked against the objective.

``build_training_data`` (``data_loading.py``) hands over here when ``train.objective`` is not 'lm'
or a store of the run is a preference store (``meshlm preprocess --preference``;
``meshlm/data/preference.py``). The store's kind must suit the objective -- pairs for
``train.objective=dpo`` and for a Bradley-Terry reward model, rated replies for
``train.reward_loss=mse``, whose store must rate exactly the model's ``model.reward_attributes``
(matched by name) -- and an ordinary token store cannot feed either; each mismatch is one sentence
naming the setting to change. A sample is one example (a pair or a rated reply), so
``train.global_batch_size`` examples make a step, and a DP rank reads its contiguous share of them
as with token stores.
"""

from __future__ import annotations

import numpy as np

from meshlm.data.preference import PAIRS, SCORES, build_preference_datasets, preference_kind
from meshlm.errors import ConfigError


def needed_kind(train) -> str | None:
    """The store kind ``train.objective`` reads: rated replies for an MSE reward model, pairs for a
    Bradley-Terry one and for DPO (two rows per example), None for language modelling."""
    if train.objective == "lm":
        return None
    return SCORES if train.objective == "reward" and train.reward_loss == "mse" else PAIRS


def check_store_kind(config, prefixes: list[str]) -> str:
    """The stores' kind ('pairs' or 'scores'), refused (ConfigError) when it does not suit the run."""
    train, kinds = config.train, {prefix: preference_kind(prefix) for prefix in prefixes}
    plain = [prefix for prefix, kind in kinds.items() if kind is None]
    if train.objective == "lm":
        prefix = next(prefix for prefix, kind in kinds.items() if kind is not None)
        raise ConfigError(f"{prefix} is a preference store ({kinds[prefix]}), which language-model training cannot "
                          "read; set train.objective=reward (with model.head=reward) or train.objective=dpo.")
    if plain:
        raise ConfigError(f"train.objective={train.objective} reads preference stores, but {plain[0]} is a plain token "
                          "store; write one with `meshlm preprocess --preference` and list it in data.prefixes.")
    kind = next(iter(kinds.values()))
    needed = needed_kind(train)
    if kind != needed or len(set(kinds.values())) > 1:
        wrong = next(prefix for prefix, found in kinds.items() if found != needed)
        setting = "train.reward_loss=mse" if needed == SCORES else (
            "train.objective=dpo" if train.objective == "dpo" else "train.reward_loss=bradley_terry")
        fix = ("use train.reward_loss=mse for rated replies" if needed == PAIRS and train.objective == "reward"
               else "use train.reward_loss=bradley_terry for pairs" if needed == SCORES
               else "DPO needs chosen/rejected pairs")
        raise ConfigError(f"{setting} needs a store of {needed}, but {wrong} holds {kinds[wrong]}; {fix}.")
    return kind


def attribute_columns(model_attributes: list[str], store_attributes: list[str], prefix: str) -> list[int]:
    """The store's column of each of the model's attributes, refused unless they are the same names."""
    if sorted(model_attributes) != sorted(store_attributes):
        raise ConfigError(f"model.reward_attributes={model_attributes} but {prefix} rates {store_attributes}; set "
                          f"model.reward_attributes=[{','.join(store_attributes)}].")
    return [store_attributes.index(name) for name in model_attributes]


def build_preference_data(config, prefixes: list[str]) -> dict:
    """{'train': dataset, 'valid': dataset (when train.eval_every > 0)} of a reward or DPO run."""
    train, data = config.train, config.data
    kind = check_store_kind(config, prefixes)
    if data.weights is not None:
        raise ConfigError("data.weights does not apply to preference stores (their examples are read in turn, each "
                          "once per epoch); set data.weights=null.")
    num_samples = {"train": train.steps * train.global_batch_size}
    if train.eval_every > 0:
        num_samples["valid"] = train.eval_batches * train.micro_batch_size
    datasets = build_preference_datasets(prefixes, train.seq_len, num_samples, seed=train.seed, split=data.split)
    if kind == SCORES:
        store = datasets["train"].stores[0]
        columns = attribute_columns(config.model.reward_attributes, store.attributes, prefixes[0])
        for member in store_list(datasets):  # the splits share their stores: each reordered once
            member.scores = np.ascontiguousarray(member.scores[:, columns])
    return datasets


def store_list(datasets: dict) -> list:
    """The distinct stores behind ``datasets``."""
    stores = {}
    for dataset in datasets.values():
        stores.update({id(store): store for store in dataset.stores})
    return list(stores.values())


__all__ = ["attribute_columns", "build_preference_data", "check_store_kind"]
