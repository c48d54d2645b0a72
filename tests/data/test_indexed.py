import struct

import numpy as np
import pytest

from meshlm.data.indexed import HEADER, MAGIC, TokenStore, TokenStoreWriter, dtype_for_vocab
from meshlm.errors import DataError

DOCUMENTS = [[5, 6, 7], [], [8], [1, 2, 3, 4, 9]]


def write_store(prefix, documents=DOCUMENTS, vocab_size=10):
    with TokenStoreWriter(prefix, vocab_size) as writer:
        for document in documents:
            writer.add_document(document)
    return TokenStore(prefix)


def test_round_trip_keeps_documents_and_boundaries(tmp_path):
    store = write_store(tmp_path / "corpus")
    assert (store.num_documents, store.num_tokens, store.vocab_size) == (4, 9, 10)
    assert [store.document(index).tolist() for index in range(4)] == DOCUMENTS
    assert store.document_lengths.tolist() == [3, 0, 1, 5]
    assert (tmp_path / "corpus.bin").stat().st_size == 9 * 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.bin", "corpus.idx"]  # no temp left


def test_add_documents_in_batches_equals_one_by_one(tmp_path):
    with TokenStoreWriter(tmp_path / "batched", 10) as writer:
        writer.add_documents(np.array([5, 6, 7, 8]), np.array([3, 0, 1]))
        writer.add_documents(np.array([1, 2, 3, 4, 9]), np.array([5]))
    assert (tmp_path / "batched.bin").read_bytes() == write_store(tmp_path / "single").tokens.tobytes()
    assert (tmp_path / "batched.idx").read_bytes() == (tmp_path / "single.idx").read_bytes()


def test_dtype_follows_the_vocabulary_size(tmp_path):
    assert dtype_for_vocab(65536) == np.uint16 and dtype_for_vocab(65537) == np.uint32
    store = write_store(tmp_path / "wide", [[70000, 1]], vocab_size=100_000)
    assert store.dtype == np.uint32 and store.document(0).tolist() == [70000, 1]


def test_token_id_beyond_the_vocabulary_names_the_file_and_leaves_nothing(tmp_path):
    with pytest.raises(DataError, match=r"corpus\.bin: token id 12 from doc\.jsonl is outside the vocabulary \[0, 10\)"):
        with TokenStoreWriter(tmp_path / "corpus", 10) as writer:
            writer.add_document([1, 2], source="doc.jsonl")
            writer.add_document([3, 12], source="doc.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_truncated_bin_is_detected(tmp_path):
    write_store(tmp_path / "corpus")
    data = (tmp_path / "corpus.bin").read_bytes()
    (tmp_path / "corpus.bin").write_bytes(data[:-2])
    with pytest.raises(DataError, match=r"corpus\.bin: 16 bytes, but the header says 9 tokens \(18 bytes\)"):
        TokenStore(tmp_path / "corpus")


def test_truncated_idx_is_detected(tmp_path):
    write_store(tmp_path / "corpus")
    data = (tmp_path / "corpus.idx").read_bytes()
    (tmp_path / "corpus.idx").write_bytes(data[:-8])
    with pytest.raises(DataError, match=r"corpus\.idx: .* bytes, but the header says 4 documents"):
        TokenStore(tmp_path / "corpus")
    (tmp_path / "corpus.idx").write_bytes(data[:10])
    with pytest.raises(DataError, match=r"corpus\.idx: only 10 bytes"):
        TokenStore(tmp_path / "corpus")


@pytest.mark.parametrize("field, value, message", [(0, b"NOTMESHL", "not a meshlm token index"),
                                                   (1, 7, "version 7"), (2, 9, "unknown token dtype code 9")])
def test_corrupt_idx_header_names_the_file(tmp_path, field, value, message):
    write_store(tmp_path / "corpus")
    data = bytearray((tmp_path / "corpus.idx").read_bytes())
    header = list(HEADER.unpack(data[:HEADER.size]))
    assert header[0] == MAGIC
    header[field] = value
    data[:HEADER.size] = HEADER.pack(*header)
    (tmp_path / "corpus.idx").write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"corpus\.idx: .*{message}"):
        TokenStore(tmp_path / "corpus")


def test_corrupt_offsets_and_missing_files_name_the_file(tmp_path):
    write_store(tmp_path / "corpus")
    data = bytearray((tmp_path / "corpus.idx").read_bytes())
    data[-8:] = struct.pack("<q", 5)  # last offset no longer equals the token count
    (tmp_path / "corpus.idx").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"corpus\.idx: document offsets run from 0 to 5, not 0 to 9"):
        TokenStore(tmp_path / "corpus")
    with pytest.raises(DataError, match=r"absent\.idx: cannot read"):
        TokenStore(tmp_path / "absent")


def test_metadata_sidecar_is_written_with_the_store_and_a_stale_one_is_refused(tmp_path):
    assert write_store(tmp_path / "old").metadata == {}  # a store without a sidecar (older meshlm) still reads
    assert TokenStore(tmp_path / "old").recorded_tokenizer() is None
    with TokenStoreWriter(tmp_path / "corpus", 10, metadata={"tokenizer": "../tok/tokenizer.json"}) as writer:
        writer.add_document([1, 2, 3])
    store = TokenStore(tmp_path / "corpus")
    assert store.metadata == {"tokenizer": "../tok/tokenizer.json", "num_documents": 1, "num_tokens": 3}
    assert store.recorded_tokenizer() == tmp_path / "../tok/tokenizer.json"
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "corpus.bin", "corpus.idx", "corpus.meta.json", "old.bin", "old.idx"]  # no temporary left
    stale = (tmp_path / "corpus.meta.json").read_text()
    write_store(tmp_path / "corpus")  # rewritten without metadata: the old sidecar goes with the old store
    assert not (tmp_path / "corpus.meta.json").exists() and TokenStore(tmp_path / "corpus").metadata == {}
    (tmp_path / "corpus.meta.json").write_text(stale)  # a sidecar of another store of this prefix
    with pytest.raises(DataError, match=r"corpus\.meta\.json: describes 1 documents and 3 tokens, but .*corpus\.idx "
                                        r"holds 4 and 9; .*delete it or re-run `meshlm preprocess`"):
        TokenStore(tmp_path / "corpus").metadata


def test_a_failed_store_removes_the_folders_it_created(tmp_path):
    with pytest.raises(DataError, match="outside the vocabulary"):
        with TokenStoreWriter(tmp_path / "new" / "deeper" / "corpus", 10) as writer:
            writer.add_document([12])
    assert list(tmp_path.iterdir()) == []
