"""The whole single-process state dict of a pipelined model, assembled from its stages by name.

A pipeline stage holds only its own parameters, under single-process names, so the whole model
is the union of the stages' state dicts (the last stage's copy of a tied embedding equals the
first stage's and is counted once). Checkpoints need nothing of this: each rank writes and
reads its own tensors by name (``meshlm/checkpoint/distributed.py``). Tests and tools that want
the full parameters on every rank use ``gather_pipeline_state_dict``.
"""

from __future__ import annotations

import torch

from meshlm.parallel.collectives import all_gather_objects
from meshlm.parallel.tensor.sharding import gather_full_state_dict


def merge_named(states: list[dict]) -> dict:
    """Union of name -> value dicts; a name held by several stages (a tied copy) keeps the first."""
    merged = {}
    for state in states:
        for name, value in state.items():
            merged.setdefault(name, value)
    return merged


def gather_pipeline_state_dict(model, context) -> dict[str, torch.Tensor]:
    """The whole single-process state dict (on CPU) on every rank: TP shards gathered, then every
    stage's tensors exchanged over the pipeline. Collective; for tests and tools, not for the step."""
    local = {name: value.detach().cpu() for name, value in gather_full_state_dict(model, context).items()}
    if context.pp_size == 1:
        return local
    return merge_named(all_gather_objects(local, context.pp_group))


__all__ = ["gather_pipeline_state_dict", "merge_named"]
