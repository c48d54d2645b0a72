"""``train.init_from``: start a run from the weights of an existing model, with a fresh optimizer.

    meshlm upcycle runs/dense/checkpoints/step_1000 models/moe --experts 8 --top-k 2
    meshlm train configs/moe.yaml train.init_from=models/moe train.run_dir=runs/moe

The folder is a model folder (``config.json`` + ``model.safetensors``, as ``save_model``,
``meshlm convert`` and ``meshlm upcycle`` write it), a training checkpoint's ``step_N`` folder
(whose weights are read chunk by chunk from its distributed shards) or a run directory (its
newest checkpoint; ``meshlm/checkpoint/locate.py``). Each rank reads only the slices it holds
(``meshlm/checkpoint/materialize.py``), never the whole model. Only the weights (and buffers
such as a router's expert bias) are taken: the optimizer moments, the step counter, the
learning-rate schedule and the data position all start from zero, as for continued
pre-training or upcycling.

The folder's model must be the run's, so that the weights mean what the run thinks they mean
(an upcycled checkpoint, for instance, is exact only under the routing settings it was built
for). The two configs are compared as resolved: a size left unset (``ffn_hidden_size: null``)
equals the number it stands for (the 256 an imported Hugging Face model spells out), and the
training-only fields (dropout, the scan implementation) may differ. A true difference is named
in the error with the ``model.key=value`` overrides that make the run match the folder. A run
that already has a checkpoint in its ``run_dir`` resumes from it and ignores ``init_from``.

LoRA (``model.lora_rank`` > 0, ``meshlm/models/lora.py``) on a folder whose model has no adapters
is fine-tuning that model: its weights are read, the adapters start fresh (from train.seed and
their names), and the model fields may differ in the adapter fields (``ADAPTER_FIELDS``) only.

    meshlm train configs/sft.yaml train.init_from=runs/base model.lora_rank=16

With ``train.init_model_config=true`` the run takes its model from the folder instead
(``model_from_init_folder``): the YAML's ``model`` section is ignored -- a one-line note names
the fields in which it differs -- except for the training-only fields (dropout, the scan), which
stay the run's. So a pruned, upcycled or imported model trains without its shape in the YAML:

    meshlm train configs/tiny.yaml train.init_from=models/pruned train.init_model_config=true
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.materialize import InitialValues
from meshlm.checkpoint.model_files import read_model_config, weights_source
from meshlm.config import format_override
from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.config import ADAPTER_FIELDS, TRAINING_ONLY_FIELDS, ModelConfig
from meshlm.models.lora import is_adapter_tensor
from meshlm.training.reward_init import HEAD_FIELDS, RewardHeadSource, starts_from_language_model

RESOLVED_FIELDS = ("num_kv_heads", "head_dim", "ffn_hidden_size", "moe_ffn_hidden_size", "mamba_num_heads")
"""Fields where None stands for a size derived from the others (``ModelConfig.resolved_*``)."""
DERIVATION_ONLY_FIELDS = ("mamba_expand",)
"""Fields read only to derive one of ``RESOLVED_FIELDS`` (mamba_expand gives mamba_num_heads)."""


def initial_weights_source(path: str | Path, model_config: ModelConfig, seed: int = 0):
    """Where the run's weights come from when it starts from ``path`` (checked first: the folder's
    model must be ``model_config``'s): its ``model.safetensors``, read by slice, or a training
    checkpoint's shards, read by chunk (``meshlm/checkpoint/materialize.py``). A reward model may
    start from a language model's folder: its new head then takes its initial value from ``seed``
    (``reward_init.py``)."""
    directory = resolve_model_dir(path)
    saved = read_model_config(directory)  # CheckpointError when it is not a meshlm model folder
    new_head = starts_from_language_model(model_config, saved)
    if new_head:  # compare the backbones: the head is the one thing that may differ
        saved = dataclasses.replace(saved, **{name: getattr(model_config, name) for name in HEAD_FIELDS})
    new_adapters = model_config.lora_rank > 0 and saved.lora_rank == 0
    if new_adapters:  # LoRA on a model without adapters: its weights, fresh adapters
        saved = dataclasses.replace(saved, **{name: getattr(model_config, name) for name in ADAPTER_FIELDS})
    if saved.lora_rank and not model_config.lora_rank:
        raise CheckpointError(f"train.init_from={path} holds a LoRA model (model.lora_rank={saved.lora_rank}) and the "
                              "run has no adapters; to train all of its weights, fold the adapters in first with "
                              f"`meshlm merge-lora {path} MERGED` and start from MERGED, or to go on training its "
                              f"adapters add model.lora_rank={saved.lora_rank} (and its lora_alpha and lora_targets).")
    run, folder = resolved_model(model_config), resolved_model(saved)
    differing = differing_fields(run, folder)
    if differing:
        differences = "; ".join(f"model.{key}: folder {folder.get(key)!r} vs run {run.get(key)!r}"
                                for key in differing)
        overrides = " ".join(format_override(f"model.{key}", value)
                             for key, value in matching_overrides(model_config, saved).items())
        raise CheckpointError(f"train.init_from={path} holds a different model ({differences}); add "
                              f"{overrides} to the run (or copy the 'model' section of "
                              f"{directory / 'config.json'} into its config).")
    source = weights_source(directory)
    if new_head:
        source = RewardHeadSource(source, model_config, seed)
    if new_adapters:
        source = FreshAdaptersSource(source, model_config, seed)
    return source


class FreshAdaptersSource:
    """Fills the LoRA adapters' tensors (``meshlm/models/lora.py``) with their initial values from
    (seed, name), as a new run's, and everything else from ``weights`` (the folder's model)."""

    def __init__(self, weights, model_config, seed: int):
        self.weights, self.initial = weights, InitialValues(model_config, seed)

    def fill(self, targets: dict) -> None:
        adapters = {name: target for name, target in targets.items() if is_adapter_tensor(name)}
        self.initial.fill(adapters)
        self.weights.fill({name: target for name, target in targets.items() if name not in adapters})


def model_from_init_folder(config):
    """``config`` (a RunConfig) with the model of ``train.init_from``'s folder when
    ``train.init_model_config`` is set (the run's training-only fields kept), else ``config``."""
    train = config.train
    if not train.init_model_config:
        return config
    if train.init_from is None:
        raise ConfigError("train.init_model_config=true takes the model from train.init_from, which is not set; "
                          "set train.init_from=DIR (a model folder, checkpoint or run directory) or drop "
                          "train.init_model_config.")
    directory = resolve_model_dir(train.init_from)
    values = read_model_config(directory).to_dict()
    values.update({name: getattr(config.model, name) for name in TRAINING_ONLY_FIELDS})
    if starts_from_language_model(config.model, read_model_config(directory)):  # a reward model keeps its head
        values.update({name: getattr(config.model, name) for name in HEAD_FIELDS})
    if config.model.lora_rank and not values["lora_rank"]:  # LoRA on the folder's model keeps its adapters
        values.update({name: getattr(config.model, name) for name in ADAPTER_FIELDS})
    model = ModelConfig.from_dict(values)
    differing = differing_fields(resolved_model(config.model), resolved_model(model))
    if differing and int(os.environ.get("RANK", "0")) == 0:
        warnings.warn(f"train.init_model_config=true: the model is {directory / 'config.json'}'s, so the config's "
                      f"{', '.join(f'model.{key}' for key in differing)} are ignored.", stacklevel=2)
    return dataclasses.replace(config, model=model)


def differing_fields(run: dict, folder: dict) -> list[str]:
    return [key for key in sorted(set(run) | set(folder)) if run.get(key) != folder.get(key)]


def matching_overrides(model_config: ModelConfig, saved: ModelConfig) -> dict:
    """{field: the folder's value} that make the run's model the folder's. Setting a field can
    change a size the run leaves unset (a new ffn_hidden_size is also the new
    moe_ffn_hidden_size), so the run is re-resolved with the overrides until nothing differs."""
    folder, overrides = resolved_model(saved), {}
    for _ in range(len(RESOLVED_FIELDS) + 1):
        try:
            run = resolved_model(ModelConfig.from_dict({**model_config.to_dict(), **overrides}))
        except ConfigError:
            break  # not a model on its own: the overrides so far, the error names the rest
        differing = differing_fields(run, folder)
        if not differing:
            break
        overrides.update({key: folder[key] for key in differing if key in folder})
    return overrides


def resolved_model(config: ModelConfig) -> dict:
    """The config as the model it builds: every derived size spelled out, the training-only fields
    dropped, in JSON's types (tuples become lists)."""
    values = config.to_dict()
    values.update({name: getattr(config, f"resolved_{name}") for name in RESOLVED_FIELDS})
    for name in (*DERIVATION_ONLY_FIELDS, *TRAINING_ONLY_FIELDS):
        values.pop(name)
    return json.loads(json.dumps(values))


__all__ = ["DERIVATION_ONLY_FIELDS", "FreshAdaptersSource", "RESOLVED_FIELDS", "initial_weights_source",
           "matching_overrides", "model_from_init_folder", "resolved_model"]
