"""meshlm/checkpoint/loading.py: what a resume says when it cannot keep every DP replica of a
``parallel.dp_sync`` checkpoint (``replica_warning``; the trainer shows it as a one-line note)."""

from __future__ import annotations

import json

import pytest

from meshlm.checkpoint.files import TRAINING_FILE
from meshlm.checkpoint.loading import replica_warning


def saved_at_dp(tmp_path, dp: int):
    (tmp_path / TRAINING_FILE).write_text(json.dumps({"step": 3, "layout": {"dp": dp, "tp": 1}}))
    return tmp_path


@pytest.mark.parametrize("before, now, dp_sync, expected", [
    (4, 2, "diloco", "at parallel.dp=2 replicas 2..3 are dropped with the progress since the last sync"),
    (2, 1, "diloco", "at parallel.dp=1 replica 1 is dropped"),
    (2, 4, "palsgd", "at parallel.dp=4 replicas 2..3 are started as copies of replica 0's weights"),
    (2, 2, "every_step", "with parallel.dp_sync=every_step the run continues from replica 0's weights"),
])
def test_a_resume_that_cannot_keep_every_replica_says_what_becomes_of_them(tmp_path, before, now, dp_sync,
                                                                            expected):
    message = replica_warning(saved_at_dp(tmp_path, before), {"parallel": {"dp_sync": "diloco"}}, dp_sync, now)
    assert message is not None and expected in message
    assert f"saved by {before} DP replicas training apart (parallel.dp_sync=diloco)" in message


@pytest.mark.parametrize("saved_mode, before, now, dp_sync", [
    ("diloco", 2, 2, "diloco"),          # the same DP size: every replica kept
    ("diloco", 2, 2, "local_sgd"),       # another low-communication mode keeps the replicas too
    ("every_step", 4, 2, "every_step"),  # DDP's replicas are identical: nothing to say
    ("diloco", 1, 1, "every_step"),      # one replica: nothing dropped
])
def test_nothing_is_said_where_every_replica_is_kept_or_they_are_identical(tmp_path, saved_mode, before, now,
                                                                           dp_sync):
    assert replica_warning(saved_at_dp(tmp_path, before), {"parallel": {"dp_sync": saved_mode}}, dp_sync, now) is None


def test_a_checkpoint_without_its_training_file_gets_no_note(tmp_path):
    assert replica_warning(tmp_path, {"parallel": {"dp_sync": "diloco"}}, "diloco", 1) is None
