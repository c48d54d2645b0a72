"""Domain tokenizers (ChipNeMo): fewer tokens per byte of Python, and the loss after equal DAPT steps.

    python -m bench.domain_tokenizer [--add 2048 8192] [--dapt-add 2048] [--general-steps 200]
                                     [--dapt-steps 200] [--data-dir data/demo]

The demo corpus (``meshlm data demo``, built into ``--data-dir`` when missing) has Shakespeare, a
Python sample of the standard library and a 4096-token BPE trained on both. The Python documents
are split: the last ``--held-out`` fraction is held out, never seen by the tokenizer extension or
training. The extension learns on the rest, plus (``--extension-text stdlib``, the default) the
other standard-library files the demo did not take (~10 MB; none of them is held out).

1. **Compression.** For each ``--add N``: ``meshlm tokenizer extend`` of the demo tokenizer, its
   time (``--repeats`` runs, median) and the held-out Python's tokens per byte before and after.
2. **Domain-adaptive pretraining.** A small model (hidden 128, ``*-*-``) trains
   ``--general-steps`` steps on Shakespeare with the demo tokenizer. Two copies then train
   ``--dapt-steps`` more on the Python training documents, same batch shape and learning rate:
   one kept on the demo tokenizer, one adapted (``adapt-vocab``) to the tokenizer extended with
   ``--dapt-add`` tokens. Their losses are compared in bits per byte of the held-out Python (the
   tokenizers differ, so per-token losses are not comparable): before DAPT, after it, and the
   bytes of Python each saw. Equal steps give the extended model more text (fewer tokens per
   byte), as in ChipNeMo.

About 2-4 minutes on two CPU cores. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tokenizers
import torch

from meshlm.adapt.vocab import adapt_vocab_model
from meshlm.data.demo_corpus import build_demo_corpus, python_source_files
from meshlm.data.tokenizer_extension import base_pieces, extend_tokenizer
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

SEQ_LEN, BATCH = 128, 16
EOS_ID = 1  # <|eos|> of meshlm-trained tokenizers


def read_jsonl(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def extension_documents(train: list[str], held_out: list[str], mode: str) -> list[str]:
    """The text the extension learns on: the Python training documents, plus in 'stdlib' mode every
    other standard-library file that is not a held-out document."""
    if mode == "demo":
        return train
    held, taken = set(held_out), set(train)
    extra = []
    for path in python_source_files(10**12):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text not in held and text not in taken:
            extra.append(text)
    return train + extra


def tokens_per_byte(tokenizer: tokenizers.Tokenizer, documents: list[str]) -> float:
    tokens = sum(len(encoding.ids) for encoding in tokenizer.encode_batch(documents, add_special_tokens=False))
    return tokens / sum(len(text.encode()) for text in documents)


def token_stream(tokenizer: tokenizers.Tokenizer, documents: list[str]) -> torch.Tensor:
    ids = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.extend(encoding.ids + [EOS_ID])
    return torch.tensor(ids)


def train_steps(model: LanguageModel, stream: torch.Tensor, steps: int, lr: float, seed: int) -> float:
    """``steps`` AdamW steps on random windows of ``stream``; returns the mean loss of the last 20."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    model.train()
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH,), generator=generator)
        window = torch.stack([stream[start:start + SEQ_LEN + 1] for start in starts.tolist()])
        loss = model(window[:, :-1], labels=window[:, 1:]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return statistics.fmean(losses[-20:])


@torch.no_grad()
def bits_per_byte(model: LanguageModel, tokenizer: tokenizers.Tokenizer, documents: list[str]) -> float:
    """Summed next-token loss over the documents (cut in windows of SEQ_LEN), in bits, per byte of their text."""
    stream = token_stream(tokenizer, documents)
    usable = (len(stream) - 1) // SEQ_LEN * SEQ_LEN
    inputs, labels = stream[:usable].view(-1, SEQ_LEN), stream[1:usable + 1].view(-1, SEQ_LEN)
    total = 0.0
    for start in range(0, len(inputs), 32):
        logits = model(inputs[start:start + 32]).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[start:start + 32].flatten(),
                                                   reduction="sum").item()
    covered = tokenizer.decode(stream[:usable + 1].tolist(), skip_special_tokens=False)
    return total / math.log(2) / len(covered.replace("<|eos|>", "").encode())


def first_bytes(documents: list[str], budget: int) -> list[str]:
    """The first documents holding ``budget`` bytes of text (the last one cut)."""
    chosen, total = [], 0
    for text in documents:
        if total >= budget:
            break
        chosen.append(text.encode()[:budget - total].decode(errors="ignore"))
        total += len(chosen[-1].encode())
    return chosen


def compression(base_file: Path, texts: list[str], held_out: list[str], counts: list[int], repeats: int,
                work: Path) -> tuple[list[dict], dict[int, Path]]:
    corpus = work / "extension.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    base = tokenizers.Tokenizer.from_file(str(base_file))
    before = tokens_per_byte(base, held_out)
    rows, files = [], {}
    for count in counts:
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            extension = extend_tokenizer(base_file, [corpus], count, work / f"ext{count}" / "tokenizer.json")
            seconds.append(time.perf_counter() - started)
        after = tokens_per_byte(tokenizers.Tokenizer.from_file(str(extension.out)), held_out)
        files[count] = extension.out
        rows.append({"new_tokens": len(extension.new_tokens), "vocab_size": extension.vocab_size,
                     "extend_seconds_median": round(statistics.median(seconds), 2),
                     "held_out_tokens_per_byte": {"demo": round(before, 4), "extended": round(after, 4)},
                     "fewer_tokens": f"{100 * (1 - after / before):.1f}%"})
    return rows, files


def dapt(base_file: Path, extended_file: Path, general: list[str], python_train: list[str], held_out: list[str],
         general_steps: int, dapt_steps: int, eval_bytes: int) -> dict:
    held_out = first_bytes(held_out, eval_bytes)
    base, extended = (tokenizers.Tokenizer.from_file(str(path)) for path in (base_file, extended_file))
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=base.get_vocab_size(), hidden_size=128, pattern="*-*-", num_attention_heads=4,
                         ffn_hidden_size=512)
    model = LanguageModel(config, seed=0)
    started = time.perf_counter()
    general_loss = train_steps(model, token_stream(base, general), general_steps, lr=3e-3, seed=1)
    adapted = adapt_vocab_model(model, base_pieces(base, extended), base.get_vocab_size()).eval()
    kept = model
    result = {"eval_bytes": sum(len(text.encode()) for text in held_out), "model": {"hidden_size": 128, "pattern": "*-*-", "parameters": model.num_parameters()},
              "general_steps": general_steps, "general_final_loss": round(general_loss, 3), "dapt_steps": dapt_steps,
              "held_out_bits_per_byte_before_dapt": {"demo_tokenizer": round(bits_per_byte(kept, base, held_out), 4),
                                                     "extended": round(bits_per_byte(adapted, extended, held_out), 4)}}
    after, seen = {}, {}
    for name, network, tokenizer in (("demo_tokenizer", kept, base), ("extended", adapted, extended)):
        stream = token_stream(tokenizer, python_train)
        train_steps(network, stream, dapt_steps, lr=1e-3, seed=2)
        after[name] = round(bits_per_byte(network, tokenizer, held_out), 4)
        bytes_per_token = sum(len(text.encode()) for text in python_train) / len(stream)
        seen[name] = int(dapt_steps * BATCH * SEQ_LEN * bytes_per_token)
    result["held_out_bits_per_byte_after_dapt"] = after
    result["python_bytes_seen_in_dapt"] = seen
    result["extended_vocab_size"] = adapted.config.vocab_size
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="data/demo")
    parser.add_argument("--add", type=int, nargs="+", default=[2048, 8192], help="new-token counts to measure")
    parser.add_argument("--dapt-add", type=int, default=2048, help="new tokens of the DAPT comparison")
    parser.add_argument("--extension-text", choices=("stdlib", "demo"), default="stdlib")
    parser.add_argument("--held-out", type=float, default=0.2, help="fraction of the Python documents held out")
    parser.add_argument("--general-steps", type=int, default=200)
    parser.add_argument("--dapt-steps", type=int, default=200)
    parser.add_argument("--eval-bytes", type=int, default=100_000, help="held-out Python bytes the losses cover")
    parser.add_argument("--repeats", type=int, default=2, help="extension runs per count (median time)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data_dir = Path(args.data_dir)
    build_demo_corpus(data_dir, workers=2)
    python = read_jsonl(data_dir / "python.jsonl")
    cut = int(len(python) * (1 - args.held_out))
    python_train, held_out = python[:cut], python[cut:]
    general = read_jsonl(data_dir / "shakespeare.jsonl")
    texts = extension_documents(python_train, held_out, args.extension_text)
    with tempfile.TemporaryDirectory() as work:
        counts = sorted(set(args.add) | {args.dapt_add})
        rows, files = compression(data_dir / "tokenizer.json", texts, held_out, counts, args.repeats, Path(work))
        report = {"held_out": {"documents": len(held_out), "bytes": sum(len(t.encode()) for t in held_out)},
                  "extension_text": {"mode": args.extension_text, "documents": len(texts),
                                     "bytes": sum(len(t.encode()) for t in texts)},
                  "compression": rows,
                  "dapt": dapt(data_dir / "tokenizer.json", files[args.dapt_add], general, python_train, held_out,
                               args.general_steps, args.dapt_steps, args.eval_bytes)}
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
