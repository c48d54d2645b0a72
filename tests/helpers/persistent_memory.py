"""The persistent bytes of a built ``Trainer``, by what holds them: what the planner's exact
parameter-state prediction (``meshlm/planning/memory.py``) is checked against.

After one step every buffer exists (torch's AdamW allocates its moments at its first step). We
walk what the trainer holds and count each storage once: the model's parameters (weights), the
gradient buffers of the reducers or, in one process, the masters' ``.grad`` (gradients), and the
optimizer's state, its fp32 master values and the masters that are not the model's own
parameters (optimizer).
"""

from __future__ import annotations

import torch


def _storages(tensors) -> dict[int, int]:
    found = {}
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def _reducers(trainer) -> list:
    reducer = trainer.reducer
    if reducer is None:
        return []
    return list(getattr(reducer, "reducers", [reducer]))


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    parts = list(getattr(optimizer, "optimizers", [optimizer]))
    tensors = []
    for part in parts:
        if hasattr(part, "exp_avg"):  # DistributedOptimizer
            tensors += [part.exp_avg, part.exp_avg_sq]
            if part.shard_values:
                tensors.append(part.values)
        else:  # torch AdamW
            for state in part.state.values():
                tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


def persistent_bytes(trainer) -> dict[str, int]:
    """{'weights', 'gradients', 'optimizer'}: bytes of this rank's storages, each counted once."""
    weights = _storages(trainer.model.parameters())
    for part in getattr(trainer.optimizer, "optimizers", [trainer.optimizer]):  # ZeRO-3: the parameters' shard
        weights.update(_storages([getattr(part, "model_shard", None)]))
    if trainer.reducer is None:
        gradients = _storages(param.grad for param in trainer.master_parameters)
    else:
        gradients = {}
        for reducer in _reducers(trainer):  # ZeRO-2/3 keep a shard, the others a full buffer
            shard = getattr(reducer, "shard", None)
            gradients.update(_storages([shard if isinstance(shard, torch.Tensor) else reducer.buffer]))
    optimizer = _storages(_optimizer_tensors(trainer.optimizer))
    masters = _storages(trainer.master_parameters)
    for pointer, size in masters.items():
        if pointer not in weights:
            optimizer.setdefault(pointer, size)
    for pointer in list(optimizer):
        if pointer in weights:
            del optimizer[pointer]
    return {"weights": sum(weights.values()), "gradients": sum(gradients.values()),
            "optimizer": sum(optimizer.values())}


__all__ = ["persistent_bytes"]
