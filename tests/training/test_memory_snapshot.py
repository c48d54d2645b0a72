"""train.memory_snapshot (meshlm/training/memory_snapshot.py): the CUDA allocator's history. Its
recording and files are checked on a GPU (tests/gpu/test_model_kinds.py); here, that a run on
another device refuses it before any work, and that the recorder does nothing when it is off."""

from __future__ import annotations

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.training.memory_snapshot import MemorySnapshots
from meshlm.training.trainer import Trainer


def test_a_cpu_run_refuses_the_cuda_allocators_history(make_config):
    with pytest.raises(ConfigError, match=r"^train.memory_snapshot=true records the CUDA caching allocator, but this "
                                          r"run is on cpu; set train.memory_snapshot=false \(or train.device=cuda\).$"):
        Trainer(make_config("train.memory_snapshot=true"))


def test_switched_off_it_records_and_writes_nothing(tmp_path):
    snapshots = MemorySnapshots(False, torch.device("cpu"), tmp_path, rank=0)
    snapshots.start()
    assert not snapshots.recording
    assert snapshots.after_step(1) is None and snapshots.on_out_of_memory() is None
    snapshots.stop()
    assert list(tmp_path.iterdir()) == []
