"""Preprocessing streams: its peak memory does not grow with the size of the input."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from meshlm.data.tokenizer_training import write_tokenizer_config

WORDS = ["preprocessing", "streams", "documents", "through", "bounded", "batches", "tokens", "memory"]
INPUT_BYTES = 50_000_000

MEASURE = textwrap.dedent("""
    import json, resource, sys
    from meshlm.data.preprocess import preprocess
    from meshlm.data.tokenizer import load_tokenizer
    small, large, tokenizer, out = sys.argv[1:]
    def peak_kib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    load_tokenizer(tokenizer).encode_batch(["warm up the tokenizer"] * 64)
    start = peak_kib()
    preprocess([small], tokenizer, out, append_eos=True, show_progress=False)
    after_small = peak_kib()
    result = preprocess([large], tokenizer, out, append_eos=True, show_progress=False)
    after_large = peak_kib()
    print(json.dumps({"small_kib": after_small - start, "large_extra_kib": after_large - after_small,
                      "documents": result.num_documents}))
""")


def write_word_tokenizer(path):
    """A word-level tokenizer: fast, so the test measures streaming rather than BPE speed."""
    vocab = {token: index for index, token in enumerate(["<|bos|>", "<|eos|>", "<|pad|>", "<unk>"] + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    write_tokenizer_config(path.parent)  # names <|eos|>
    return path


def write_large_jsonl(path, total_bytes):
    line = json.dumps({"text": " ".join(WORDS[(index * 7) % len(WORDS)] for index in range(120))}) + "\n"
    block = line * 1000
    with open(path, "w") as handle:
        for _ in range(total_bytes // len(block) + 1):
            handle.write(block)
    return path.stat().st_size


def test_peak_memory_stays_far_below_the_input_size(tmp_path):
    """Peak RSS after a 5 MB input and after a 50 MB one: the larger input adds (almost) nothing."""
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    small_bytes = write_large_jsonl(tmp_path / "small.jsonl", INPUT_BYTES // 10)
    input_bytes = write_large_jsonl(tmp_path / "large.jsonl", INPUT_BYTES)
    completed = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "small.jsonl"),
                                str(tmp_path / "large.jsonl"), str(tokenizer), str(tmp_path / "out")],
                               capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["documents"] == input_bytes // len(open(tmp_path / "large.jsonl").readline())
    small_growth, large_extra = report["small_kib"] * 1024, report["large_extra_kib"] * 1024
    assert small_growth + large_extra < input_bytes / 4, f"peak RSS grew {(small_growth + large_extra) / 1e6:.1f} MB"
    assert large_extra < (input_bytes - small_bytes) / 20, f"10x the input added {large_extra / 1e6:.1f} MB of peak RSS"
