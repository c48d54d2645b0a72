"""What a piece of autograd code keeps and creates: the tensors saved for backward, and the
largest tensor any op returns. Shared by memory tests and bench/ scripts.

``SavedStorages`` records, through ``torch.autograd.graph.saved_tensors_hooks``, every tensor
autograd saves while the ``with`` body runs, and the distinct storages behind them (views and
tensors saved twice count once; ``excluded`` storages, e.g. parameters, not at all): their bytes
are the activation memory held between forward and backward. ``LargestTensor`` is a dispatch
mode that records the elements and bytes of the biggest tensor an op returns while active.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SavedStorages:
    """``with SavedStorages() as saved: ...`` then ``saved.nbytes``, ``saved.pointers``, ``saved.tensors``."""

    def __init__(self, excluded: set[int] = frozenset()):
        self.excluded = excluded
        """Storage data pointers not to count (parameters, say)."""
        self.storages: dict[int, int] = {}
        self.tensors: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tensors.append(tensor)
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.excluded:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedStorages:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    @property
    def pointers(self) -> set[int]:
        return set(self.storages)


def saved_bytes_by_block_kind(model, micro_batch: int, seq: int, dtype: torch.dtype,
                              sequence_shards: int = 1) -> dict[str, int]:
    """Bytes each block kind of ``model`` saves for backward in one forward over random hidden
    states of ``micro_batch`` x ``seq`` tokens (``seq / sequence_shards`` of them on this rank under
    sequence parallelism); distinct storages, parameters not counted. A training forward: any
    dropout the model has draws its masks."""
    from meshlm.models.context import SequenceContext
    from meshlm.models.dropout import DropoutKey

    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    context = SequenceContext.for_tokens(torch.zeros(micro_batch, seq, dtype=torch.long),
                                         dropout_key=DropoutKey(seed=0, step=0, sample_ids=torch.arange(micro_batch)))
    hidden = torch.randn(micro_batch, seq // sequence_shards, model.config.hidden_size, dtype=dtype,
                         requires_grad=True)
    found: dict[str, int] = {}
    keep = []  # the graph stays alive: no storage is freed and reused between blocks
    for kind, block in zip(model.config.block_kinds, model.blocks):
        with SavedStorages(parameters) as saved:
            hidden = block(hidden, context)
        keep.append(hidden)
        found[kind] = found.get(kind, 0) + saved.nbytes
    return found


class LargestTensor(TorchDispatchMode):
    """Records the elements (``numel``) and bytes (``bytes``) of the biggest tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
                self.bytes = max(self.bytes, tensor.numel() * tensor.element_size())
        return result
