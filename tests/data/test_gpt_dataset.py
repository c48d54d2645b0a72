import numpy as np
import pytest
import torch

from meshlm.data.gpt_dataset import GPTDataset, parse_split, split_document_range
from meshlm.data.indexed import TokenStoreWriter
from meshlm.errors import DataError

SEQ_LEN = 8


def write_counting_store(prefix, lengths, first_token=0):
    """Documents of the given lengths whose tokens count up from ``first_token``: every token is unique,
    so a token tells which document and position it came from."""
    with TokenStoreWriter(prefix, vocab_size=65536) as writer:
        start = first_token
        for length in lengths:
            writer.add_document(np.arange(start, start + length))
            start += length
    return np.arange(first_token, start)


LENGTHS = [5, 0, 13, 1, 7, 22, 3, 9, 0, 16, 4, 11]


def test_packing_covers_every_token_once_in_order(tmp_path):
    stream = write_counting_store(tmp_path / "c", LENGTHS)
    dataset = GPTDataset(tmp_path / "c", SEQ_LEN, shuffle=False)
    assert len(dataset) == (len(stream) - 1) // SEQ_LEN
    samples = [dataset[index] for index in range(len(dataset))]
    inputs = torch.cat([sample["input_ids"] for sample in samples]).numpy()
    labels = torch.cat([sample["labels"] for sample in samples]).numpy()
    assert np.array_equal(inputs, stream[:len(inputs)]) and len(stream) - len(inputs) <= SEQ_LEN
    assert np.array_equal(labels, stream[1:len(inputs) + 1])
    assert samples[0]["input_ids"].dtype == torch.long and samples[0]["input_ids"].shape == (SEQ_LEN,)


def test_every_epoch_is_a_fresh_permutation_of_all_documents(tmp_path):
    stream = write_counting_store(tmp_path / "c", LENGTHS)
    num_samples = 3 * len(stream) // SEQ_LEN - 1  # three epochs, the last one partly
    dataset = GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=num_samples, seed=3)
    epochs = dataset.document_index.reshape(3, len(LENGTHS))
    assert all(sorted(epoch) == list(range(len(LENGTHS))) for epoch in epochs)
    assert not np.array_equal(epochs[0], epochs[1])
    stream_inputs = np.concatenate([dataset.stream_sample(k)[:-1] for k in range(num_samples)])
    for epoch in range(2):  # each full epoch holds every token exactly once
        assert np.array_equal(np.sort(stream_inputs[epoch * len(stream):(epoch + 1) * len(stream)]), stream)
    assert sorted(dataset.shuffle_index.tolist()) == list(range(num_samples))
    shuffled = dataset[5]["input_ids"].numpy()
    assert np.array_equal(shuffled, dataset.stream_sample(int(dataset.shuffle_index[5]))[:-1])


def test_shuffle_is_deterministic_by_seed(tmp_path):
    write_counting_store(tmp_path / "c", LENGTHS * 4)

    def samples(seed, cache):
        dataset = GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=40, seed=seed, cache_dir=tmp_path / cache)
        assert dataset.indices_were_built
        return torch.stack([dataset[index]["input_ids"] for index in range(len(dataset))])

    seed_1, seed_1_again, seed_2 = samples(1, "a"), samples(1, "b"), samples(2, "c")
    assert torch.equal(seed_1, seed_1_again)
    assert not torch.equal(seed_1, seed_2)


def test_asking_for_more_samples_keeps_the_first_ones(tmp_path):
    """Prefix stability: a run resumed with more train.steps reads the same samples up to where
    it stopped (epochs and shuffle windows have their own generators)."""
    write_counting_store(tmp_path / "c", LENGTHS * 3)
    short = GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=30, seed=5, cache_dir=tmp_path / "short")
    long = GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=200, seed=5, cache_dir=tmp_path / "long")
    window = (3 * sum(LENGTHS)) // SEQ_LEN
    assert 30 % window and 200 > 2 * window  # a partial window, and several epochs later
    for index in range(30):
        assert torch.equal(short[index]["input_ids"], long[index]["input_ids"]), index
    first_window = long.shuffle_index[:window]
    assert sorted(first_window.tolist()) == list(range(window))  # shuffled within its window
    assert not np.array_equal(first_window, np.arange(window))
    assert len(set(long.shuffle_index.tolist())) == 200  # no sample twice


def test_splits_are_disjoint_document_ranges(tmp_path):
    lengths = [10 + index % 7 for index in range(50)]
    stream = write_counting_store(tmp_path / "c", lengths)
    document_of_token = np.repeat(np.arange(len(lengths)), lengths)
    assert parse_split("8,1,1") == pytest.approx([0.8, 0.1, 0.1]) and parse_split("1") == [1.0, 0.0, 0.0]
    seen = {}
    for name in ("train", "valid", "test"):
        start, stop = split_document_range(len(lengths), "80,10,10", name)
        dataset = GPTDataset(tmp_path / "c", SEQ_LEN, split="80,10,10", split_name=name)
        tokens = np.concatenate([dataset[index]["input_ids"].numpy() for index in range(len(dataset))])
        seen[name] = set(document_of_token[tokens - stream[0]].tolist())
        assert seen[name] <= set(range(start, stop)) and dataset.documents.tolist() == list(range(start, stop))
    assert split_document_range(50, "80,10,10", "valid") == (40, 45)
    assert not (seen["train"] & seen["valid"] or seen["train"] & seen["test"] or seen["valid"] & seen["test"])


def test_indices_are_cached_and_rebuilt_when_settings_or_data_change(tmp_path):
    write_counting_store(tmp_path / "c", LENGTHS)
    first = GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=20)
    cache_files = sorted((tmp_path / "index_cache").iterdir())
    assert first.indices_were_built and len(cache_files) == 3
    mtimes = [path.stat().st_mtime_ns for path in cache_files]
    again = GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=20)
    assert not again.indices_were_built and [path.stat().st_mtime_ns for path in cache_files] == mtimes
    assert torch.equal(again[7]["input_ids"], first[7]["input_ids"])
    assert GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=21).indices_were_built
    assert GPTDataset(tmp_path / "c", SEQ_LEN + 1, num_samples=20).indices_were_built
    assert GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=20, seed=99).indices_were_built
    write_counting_store(tmp_path / "c", LENGTHS[::-1])  # new data, same shape
    assert GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=20).indices_were_built
    assert len(list((tmp_path / "index_cache").iterdir())) == 3 * 5


def test_resume_from_a_sample_offset(tmp_path):
    write_counting_store(tmp_path / "c", LENGTHS)
    dataset = GPTDataset(tmp_path / "c", SEQ_LEN, num_samples=30)
    resumed = dataset.from_sample(17)
    assert len(resumed) == 13
    assert all(torch.equal(resumed[index]["labels"], dataset[17 + index]["labels"]) for index in range(13))
    with pytest.raises(IndexError):
        dataset[30]


def test_unusable_splits_and_settings_are_data_errors(tmp_path):
    write_counting_store(tmp_path / "c", [3, 4])
    with pytest.raises(DataError, match=r"c\.idx: the test split .* holds no tokens"):
        GPTDataset(tmp_path / "c", 2, split="1,0,0", split_name="test")
    with pytest.raises(DataError, match=r"c\.idx: the train split holds 7 tokens, fewer than one sample"):
        GPTDataset(tmp_path / "c", 7)
    with pytest.raises(DataError, match="split='a,b'"):
        GPTDataset(tmp_path / "c", 2, split="a,b")
    with pytest.raises(DataError, match="split_name='dev'"):
        GPTDataset(tmp_path / "c", 2, split_name="dev")


def test_document_boundaries_mark_documents_and_ignore_labels_across_them(tmp_path):
    stream = write_counting_store(tmp_path / "c", LENGTHS)
    starts = np.cumsum([0] + LENGTHS)  # token value v lies in document searchsorted(starts, v, 'right') - 1
    plain = GPTDataset(tmp_path / "c", SEQ_LEN, shuffle=False)
    kept_apart = GPTDataset(tmp_path / "c", SEQ_LEN, shuffle=False, document_boundaries=True)
    assert "document_ids" not in plain[0]
    for index in range(len(kept_apart)):
        sample, reference = kept_apart[index], plain[index]
        assert torch.equal(sample["input_ids"], reference["input_ids"])
        inputs, next_tokens = sample["input_ids"].numpy(), reference["labels"].numpy()
        document_of = lambda tokens: np.searchsorted(starts, tokens, side="right") - 1  # noqa: E731
        same = document_of(inputs) == document_of(next_tokens)
        assert np.array_equal(sample["labels"].numpy(), np.where(same, next_tokens, -100))
        ids = sample["document_ids"].numpy()
        assert ids[0] == 0 and np.all(np.diff(ids) >= 0)
        assert np.array_equal(np.diff(ids) > 0, np.diff(document_of(inputs)) > 0)
    assert len(stream)


def test_ignored_label_is_the_losses():
    from meshlm.data.gpt_dataset import IGNORE_INDEX
    from meshlm.models.losses import IGNORE_INDEX as LOSS_IGNORE_INDEX

    assert IGNORE_INDEX == LOSS_IGNORE_INDEX == -100


def test_loss_mask_keeps_only_trained_targets_within_documents(tmp_path):
    """Chat stores: labels[t] = token t + 1 only where t + 1 is trained and in the same document."""
    documents = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [1, 1, 1]), ([8, 9, 10, 11, 12], [0, 0, 0, 1, 1])]
    with TokenStoreWriter(tmp_path / "chat", vocab_size=16, loss_mask=True) as writer:
        for tokens, mask in documents:
            writer.add_document(tokens, loss_mask=mask)
    whole = GPTDataset(tmp_path / "chat", seq_len=11, shuffle=False, document_boundaries=True)[0]
    assert whole["input_ids"].tolist() == list(range(1, 12))
    # t=3 -> 5 is trained but starts document B, so the boundary rule drops it
    assert whole["labels"].tolist() == [-100, 3, 4, -100, 6, 7, -100, -100, -100, 11, 12]
    assert whole["document_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    windows = GPTDataset(tmp_path / "chat", seq_len=5, shuffle=False, document_boundaries=True)
    assert windows[1]["input_ids"].tolist() == [6, 7, 8, 9, 10]
    assert windows[1]["labels"].tolist() == [7, -100, -100, -100, 11]
    assert windows[1]["document_ids"].tolist() == [0, 0, 1, 1, 1]
