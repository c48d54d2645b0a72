import json

import numpy as np
import pytest

from meshlm.data.blend import Blend, BlendedDataset, build_blend_indices, build_datasets, load_blend
from meshlm.data.indexed import TokenStoreWriter
from meshlm.errors import DataError

SEQ_LEN = 8


def write_store(prefix, first_token, num_documents=40):
    """Documents whose tokens all lie in [first_token, first_token + 1000): the range tells the store."""
    rng = np.random.default_rng(first_token)
    with TokenStoreWriter(prefix, vocab_size=4000) as writer:
        for _ in range(num_documents):
            writer.add_document(first_token + rng.integers(0, 1000, size=int(rng.integers(1, 30))))


def test_blend_proportions_are_exact_at_every_prefix():
    weights = [0.5, 0.3, 0.2]
    indices = build_blend_indices(weights, 1000)
    one_hot = np.eye(3)[indices["blend_index"]]
    counts_so_far = np.cumsum(one_hot, axis=0)
    targets = np.arange(1, 1001)[:, None] * np.array(weights)
    assert np.abs(counts_so_far - targets).max() <= 1.0
    assert counts_so_far[-1].tolist() == [500, 300, 200]
    for corpus in range(3):  # the k-th pick of a corpus asks it for its sample k
        picks = indices["blend_sample_index"][indices["blend_index"] == corpus]
        assert picks.tolist() == list(range(len(picks)))
    assert build_blend_indices([1 / 3, 2 / 3], 7)["blend_index"].tolist() == [1, 0, 1, 1, 0, 1, 1]


def test_blended_dataset_draws_each_corpus_in_proportion(tmp_path):
    write_store(tmp_path / "low", 0)
    write_store(tmp_path / "high", 2000)
    blend = Blend([str(tmp_path / "low"), str(tmp_path / "high")], [0.7, 0.3])
    dataset = BlendedDataset(blend, SEQ_LEN, num_samples=50, seed=5)
    from_high = [bool((dataset[index]["input_ids"] >= 2000).all()) for index in range(50)]
    from_low = [bool((dataset[index]["labels"] < 1000).all()) for index in range(50)]
    assert sum(from_high) == 15 and sum(from_low) == 35
    assert from_high == (dataset.blend_index == 1).tolist()
    assert [len(part) for part in dataset.datasets] == [35, 15]
    again = BlendedDataset(blend, SEQ_LEN, num_samples=50, seed=5)
    assert not again.indices_were_built and not any(part.indices_were_built for part in again.datasets)
    assert all(np.array_equal(again[i]["input_ids"], dataset[i]["input_ids"]) for i in range(50))
    resumed = dataset.from_sample(20)
    assert len(resumed) == 30 and np.array_equal(resumed[3]["labels"], dataset[23]["labels"])


def test_load_blend_resolves_paths_beside_the_file_json_or_yaml(tmp_path):
    (tmp_path / "blend.json").write_text(json.dumps(
        {"tokenizer": "tok.json", "datasets": [{"prefix": "a", "weight": 3}, {"prefix": "sub/b", "weight": 1}]}))
    blend = load_blend(tmp_path / "blend.json")
    assert blend.prefixes == [str(tmp_path / "a"), str(tmp_path / "sub/b")]
    assert blend.weights == [0.75, 0.25] and blend.tokenizer == str(tmp_path / "tok.json")
    (tmp_path / "blend.yaml").write_text("datasets:\n  - {prefix: a, weight: 1}\n")
    assert load_blend(tmp_path / "blend.yaml").weights == [1.0]


@pytest.mark.parametrize("payload, message", [
    ('{"datasets": []}', "expected"), ('{"datasets": [{"prefix": "a"}]}', "expected"),
    ('{"datasets": [{"prefix": "a", "weight": 0}]}', "must all be positive"), ("{oops", "not valid JSON")])
def test_bad_blend_files_name_the_file(tmp_path, payload, message):
    (tmp_path / "blend.json").write_text(payload)
    with pytest.raises(DataError, match=rf"blend\.json: .*{message}"):
        load_blend(tmp_path / "blend.json")


def test_build_datasets_gives_one_blend_per_split(tmp_path):
    write_store(tmp_path / "low", 0, num_documents=100)
    write_store(tmp_path / "high", 2000, num_documents=100)
    (tmp_path / "blend.json").write_text(json.dumps(
        {"datasets": [{"prefix": "low", "weight": 1}, {"prefix": "high", "weight": 1}]}))
    datasets = build_datasets(tmp_path / "blend.json", SEQ_LEN, {"train": 40, "valid": 4}, split="90,10,0")
    assert len(datasets["train"]) == 40 and len(datasets["valid"]) == 4
    train_docs = set(datasets["train"].datasets[0].documents.tolist())
    valid_docs = set(datasets["valid"].datasets[0].documents.tolist())
    assert train_docs == set(range(90)) and valid_docs == set(range(90, 100))
    with pytest.raises(DataError, match="unknown splits"):
        build_datasets(tmp_path / "blend.json", SEQ_LEN, {"dev": 4})
