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
"""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.model_files import read_model_config, weights_source
from meshlm.config import format_override
from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.config import TRAINING_ONLY_FIELDS, ModelConfig

RESOLVED_FIELDS = ("num_kv_heads", "head_dim", "ffn_hidden_size", "moe_ffn_hidden_size", "mamba_num_heads")
"""Fields where None stands for a size derived from the others (``ModelConfig.resolved_*``)."""
DERIVATION_ONLY_FIELDS = ("mamba_expand",)
"""Fields read only to derive one of ``RESOLVED_FIELDS`` (mamba_expand gives mamba_num_heads)."""


def initial_weights_source(path: str | Path, model_config: ModelConfig):
    """Where the run's weights come from when it starts from ``path`` (checked first: the folder's
    model must be ``model_config``'s): its ``model.safetensors``, read by slice, or a training
    checkpoint's shards, read by chunk (``meshlm/checkpoint/materialize.py``)."""
    directory = resolve_model_dir(path)
    saved = read_model_config(directory)  # CheckpointError when it is not a meshlm model folder
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
    return weights_source(directory)


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


__all__ = ["DERIVATION_ONLY_FIELDS", "RESOLVED_FIELDS", "initial_weights_source", "matching_overrides",
           "resolved_model"]
