"""``train.init_from``: start a run from the weights of an existing model, with a fresh optimizer.

    meshlm upcycle runs/dense/checkpoints/step_1000 models/moe --experts 8 --top-k 2
    meshlm train configs/moe.yaml train.init_from=models/moe train.run_dir=runs/moe

The folder is a model folder (``config.json`` + ``model.safetensors``, as ``save_model``,
``meshlm convert`` and ``meshlm upcycle`` write it) or a training checkpoint's ``step_N``
folder (whose weights are read chunk by chunk from its distributed shards). Each rank reads
only the slices it holds (``meshlm/checkpoint/materialize.py``), never the whole model. Only the weights (and
buffers such as a router's expert bias) are taken: the optimizer moments, the step counter,
the learning-rate schedule and the data position all start from zero, as for continued
pre-training or upcycling.

The folder's model config must equal the run's ``model`` section field by field, so that the
weights mean what the run thinks they mean (an upcycled checkpoint, for instance, is exact only
under the routing settings it was built for); a difference is named in the error. A run that
already has a checkpoint in its ``run_dir`` resumes from it and ignores ``init_from``.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.checkpoint.model_files import read_model_config, weights_source
from meshlm.errors import CheckpointError


def initial_weights_source(path: str | Path, model_config):
    """Where the run's weights come from when it starts from ``path`` (checked first: the folder's
    model config must equal ``model_config``): its ``model.safetensors``, read by slice, or a
    training checkpoint's shards, read by chunk (``meshlm/checkpoint/materialize.py``)."""
    directory = Path(path)
    saved = read_model_config(directory)  # CheckpointError when it is not a meshlm model folder
    run, folder = _plain(model_config.to_dict()), _plain(saved.to_dict())
    differences = [f"model.{key}: folder {folder.get(key)!r} vs run {run.get(key)!r}"
                   for key in sorted(set(run) | set(folder)) if run.get(key) != folder.get(key)]
    if differences:
        raise CheckpointError(f"train.init_from={directory} holds a different model ({'; '.join(differences)}); "
                              f"copy the 'model' section of {directory / 'config.json'} into the run's config.")
    return weights_source(directory)


def _plain(values: dict) -> dict:
    """A config dict as JSON would give it back (tuples become lists), for comparison."""
    return json.loads(json.dumps(values))


__all__ = ["initial_weights_source"]
