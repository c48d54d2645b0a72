"""The single-process state of a pipelined model: the stages' pieces merged by name, and back.

Checkpoints keep the single-process format (``meshlm/checkpoint/training_checkpoint.py``). A
pipeline stage holds only its own parameters -- under single-process names -- so

* **saving**: each stage first builds its full-tensor states as without pipelining (TP shards
  gathered, the distributed optimizer's moments gathered over DP), then the pipeline that holds
  global rank 0 gathers them to its first stage (``gather_to_first_stage``), which merges them:
  model and precision states by name (the last stage's copy of a tied embedding equals the first
  stage's and is dropped), the optimizer state group by group, in the single-process parameter
  order, with the packed indices renumbered as ``torch.optim.AdamW.state_dict`` numbers them;
* **loading**: every rank reads the full files and keeps the entries of its own parameters
  (``select_optimizer_state``, ``select_names``) -- the stage's own optimizer then sees exactly
  the state dict it would have saved itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

HYPERPARAMETER_KEYS_EXCLUDED = ("params", "param_names")


def gather_to_first_stage(item, context) -> list | None:
    """Every stage's ``item`` (any picklable object), in stage order, on the pipeline's first rank
    (None elsewhere). Collective over the pipeline group."""
    gathered = [None] * context.pp_size if context.is_first_stage else None
    dist.gather_object(item, gathered, dst=context.pp_ranks[0], group=context.pp_group)
    return gathered


def merge_named(states: list[dict]) -> dict:
    """Union of name -> value dicts; a name held by several stages (a tied copy) keeps the first."""
    merged = {}
    for state in states:
        for name, value in state.items():
            merged.setdefault(name, value)
    return merged


def merge_optimizer_states(states: list[dict], parameter_order: list[str]) -> dict:
    """One single-process AdamW state dict from the stages' ones (see the module docstring)."""
    position = {name: index for index, name in enumerate(parameter_order)}
    groups: dict[str, tuple[dict, dict]] = {}
    for state in states:
        for group in state["param_groups"]:
            settings = {key: value for key, value in group.items() if key not in HYPERPARAMETER_KEYS_EXCLUDED}
            _, entries = groups.setdefault(group.get("name"), (settings, {}))
            for name, packed in zip(group["param_names"], group["params"]):
                entries.setdefault(name, state["state"].get(packed))
    merged_groups, merged_state, count = [], {}, 0
    for settings, entries in groups.values():
        names = sorted(entries, key=lambda name: position.get(name, len(position)))
        packed = list(range(count, count + len(names)))
        count += len(names)
        merged_state.update({index: entries[name] for index, name in zip(packed, names) if entries[name]})
        merged_groups.append({**settings, "param_names": names, "params": packed})
    return {"state": merged_state, "param_groups": merged_groups}


def select_optimizer_state(state: dict, names: set[str]) -> dict:
    """The part of a single-process AdamW state dict that covers ``names``, renumbered (groups
    left empty are dropped, as ``build_optimizer`` drops them)."""
    groups, entries, count = [], {}, 0
    for group in state["param_groups"]:
        members = [(name, packed) for name, packed in zip(group["param_names"], group["params"]) if name in names]
        if not members:
            continue
        renumbered = list(range(count, count + len(members)))
        count += len(members)
        for index, (_, packed) in zip(renumbered, members):
            if state["state"].get(packed):
                entries[index] = state["state"][packed]
        groups.append({**group, "param_names": [name for name, _ in members], "params": renumbered})
    return {"state": entries, "param_groups": groups}


def select_names(state: dict | None, names: set[str]) -> dict | None:
    """The entries of a name -> value dict that belong to ``names``."""
    return None if state is None else {name: value for name, value in state.items() if name in names}


def gather_pipeline_state_dict(model, context) -> dict[str, torch.Tensor]:
    """The whole single-process state dict on every rank: TP shards gathered, then every stage's
    tensors exchanged over the pipeline. Collective; for tests and tools, not for the step."""
    from meshlm.parallel.tensor_parallel import gather_full_state_dict

    local = {name: value.detach().cpu() for name, value in gather_full_state_dict(model, context).items()}
    if context.pp_size == 1:
        return local
    everyone = [None] * context.pp_size
    dist.all_gather_object(everyone, local, group=context.pp_group)
    return merge_named(everyone)


__all__ = ["gather_pipeline_state_dict", "gather_to_first_stage", "merge_named", "merge_optimizer_states",
           "select_names", "select_optimizer_state"]
