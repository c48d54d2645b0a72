"""Reading ahead: the next step's micro-batches come from a background thread, with the same bits."""

from __future__ import annotations

import threading
import time

import torch

from meshlm.training.data_loading import BatchPrefetcher, read_batch
from meshlm.training.trainer import Trainer


def same_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_a_read_ahead_is_handed_out_only_for_its_own_samples(make_config):
    dataset = Trainer(make_config()).data.train
    batches = BatchPrefetcher(dataset, micro_batch_size=2)
    expected = [read_batch(dataset, first, 2, torch.device("cpu")) for first in (4, 6)]
    batches.prefetch([4, 6])
    assert same_batches(batches.take([4, 6]), expected)
    assert batches.reads[-1].first_samples == (4, 6) and batches.reads[-1].thread == BatchPrefetcher.THREAD_NAME
    batches.prefetch([8, 10])
    moved = batches.take([0, 2])  # the data position moved (a checkpoint loaded): read here, not the stale one
    assert same_batches(moved, [read_batch(dataset, first, 2, torch.device("cpu")) for first in (0, 2)])
    # (0, 2) was read here; the thread may still be finishing the stale (8, 10) read, so look it up by samples
    assert [read.thread for read in batches.reads if read.first_samples == (0, 2)] == [threading.current_thread().name]
    assert not moved[0]["input_ids"].is_pinned()  # CPU run: never pinned
    thread = batches.thread
    assert thread.daemon and thread.is_alive()
    batches.close()
    assert batches.thread is None and not thread.is_alive()


def timed_run(config, monkeypatch):
    """Train ``config``; returns (trainer, losses, [(start, end) of each step's forward_backward],
    the read-ahead threads seen during the run)."""
    spans, threads, original = [], set(), Trainer.forward_backward

    def forward_backward(self, micro_batches):
        started = time.perf_counter()
        if self.batches.thread is not None:
            threads.add(self.batches.thread)
        # A step that computes for a while (the tiny model takes milliseconds; the machine may be
        # busy): up to 5 s, until the next step's read-ahead has finished, if there is one.
        reads_before = len(self.batches.reads)
        while self.batches.pending is not None and len(self.batches.reads) == reads_before \
                and time.perf_counter() < started + 5:
            time.sleep(0.005)
        try:
            return original(self, micro_batches)
        finally:
            spans.append((started, time.perf_counter()))

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    trainer = Trainer(config)
    result = trainer.run()
    monkeypatch.undo()
    return trainer, result.losses, spans, threads


def test_training_with_the_read_ahead_is_bitwise_the_same(make_config, tmp_path, monkeypatch):
    steps = 5
    plain_config = make_config(f"train.steps={steps}", "train.prefetch_batches=false", "train.eval_every=0",
                               f"train.run_dir={tmp_path / 'plain'}")
    plain, plain_losses, _, plain_threads = timed_run(plain_config, monkeypatch)
    ahead, ahead_losses, spans, threads = timed_run(make_config(f"train.steps={steps}", "train.eval_every=0"),
                                                    monkeypatch)
    assert ahead_losses == plain_losses and len(ahead_losses) == steps
    for a, b in zip(ahead.model.state_dict().values(), plain.model.state_dict().values()):
        assert torch.equal(a, b)
    assert all(read.thread == threading.current_thread().name for read in plain.batches.reads) and not plain_threads

    # Step 1 is read on the spot; step s + 1 by the background thread, while step s's
    # forward/backward runs (it overlaps the step's compute).
    reads = list(ahead.batches.reads)
    assert [read.first_samples[0] for read in reads] == [4 * step for step in range(steps)]
    assert reads[0].thread == threading.current_thread().name
    assert all(read.thread == BatchPrefetcher.THREAD_NAME for read in reads[1:])
    assert all(reads[step + 1].finished < spans[step][1] for step in range(steps - 1))
    assert len(threads) == 1 and not threads.pop().is_alive() and ahead.batches.thread is None  # the run closed it


def test_a_moved_data_position_is_read_at_its_new_place(make_config):
    trainer = Trainer(make_config("train.steps=4"))
    trainer.train_step()  # reads step 1 on the spot, step 2's samples ahead
    assert trainer.batches.pending is not None and trainer.batches.pending[0] == (4, 6)
    trainer.state.consumed_samples = 12  # e.g. a checkpoint of another position was loaded
    batches = trainer.next_micro_batches()
    expected = [read_batch(trainer.data.train, first, 2, trainer.device) for first in (12, 14)]
    assert all(torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])
               for got, want in zip(batches, expected))
    assert [batch["dropout_key"].sample_ids.tolist() for batch in batches] == [[12, 13], [14, 15]]
    trainer.batches.close()
