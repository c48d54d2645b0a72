"""The names of meshlm's files on disk, and the helpers that write and check them safely.

Every format shares these names: a single-file model (``model_files.py``), a distributed training
checkpoint (``distributed.py``) and an older single-process one (``training_checkpoint.py``).
Nothing is written in place: a file goes to a temporary name and is renamed
(``write_json_atomic``), a folder is swapped in whole (``replace_directory``), and every file of
a checkpoint is recorded with its size and CRC-32 (``file_checksum``) so a reader can tell a
truncated or altered file from an intact one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshlm.data.tokenizer import tokenizer_format
from meshlm.errors import CheckpointError

# --- a model folder --------------------------------------------------------------------------------------
FORMAT_NAME = "meshlm"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
METADATA_FILE = ".metadata"
"""A distributed checkpoint's index (torch.distributed.checkpoint); its weights are in shards."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken", "tokenizer_config.json",
                   "special_tokens_map.json")
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILE_BY_FORMAT = {"huggingface": "tokenizer.json", "sentencepiece": "tokenizer.model",
                            "tiktoken": "tokenizer.tiktoken"}
"""The name a tokenizer gets in a model folder, by ``meshlm.data.tokenizer.tokenizer_format``."""

# --- a run's checkpoints ---------------------------------------------------------------------------------
CHECKPOINTS_DIR = "checkpoints"
TRAINING_FILE = "training.json"
OPTIMIZER_FILE = "optimizer.pt"
PRECISION_FILE = "precision.pt"
RNG_FILE = "rng.pt"
RUN_CONFIG_FILE = "run.yaml"
STATE_FILE = "trainer_state.json"
COMPLETE_FILE = "complete.json"
"""The completion marker: written last, by global rank 0, once every rank has written its shards."""
BEST_POINTER_FILE = "best_checkpoint.json"
"""RUN_DIR/best_checkpoint.json: the checkpoint of the best validation loss (train.keep_best)."""
BEST_ALIAS = "best"
"""``RUN_DIR/best`` names that checkpoint wherever a model path is taken (``locate.resolve_model_dir``)."""
MOVE_AWAY_HINT = "move {directory} out of the checkpoints folder to resume from the one before it."


# --- writing and checking files ------------------------------------------------------------------------------
def write_json_atomic(path: Path, payload: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: missing or not valid JSON ({error}); "
                              f"{MOVE_AWAY_HINT.format(directory=path.parent)}") from error


def file_checksum(path: Path) -> dict:
    """{"bytes": size, "crc32": CRC-32} of a file, read in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as stream:
        while block := stream.read(16 << 20):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"bytes": size, "crc32": crc}


def fsync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable (where the platform allows opening a folder)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def replace_directory(source: Path, destination: Path) -> None:
    """Rename ``source`` to ``destination``; an existing destination is swapped out, then removed."""
    if not destination.exists():
        os.rename(source, destination)
        return
    old = destination.with_name(f"{destination.name}.old-{os.getpid()}")
    os.rename(destination, old)
    os.rename(source, destination)
    shutil.rmtree(old)


@contextmanager
def folder_written_atomically(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write a folder into; renamed to ``out`` when the block ends
    without an error, removed otherwise, so ``out`` is either complete or absent."""
    temporary = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    try:
        yield temporary
        os.replace(temporary, out)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


def copy_tokenizer_files(source: Path, destination: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and source.resolve() != destination.resolve():
            shutil.copyfile(source / name, destination / name)
            copied.append(name)
    return copied


def copy_tokenizer(tokenizer_file: Path, destination: Path) -> None:
    """Copy the run's tokenizer under the name of its format in a model folder (``tokenizer.json``,
    ``tokenizer.model`` for SentencePiece, ``tokenizer.tiktoken``), plus its special-token configs."""
    if not tokenizer_file.is_file():
        raise CheckpointError(f"{tokenizer_file}: the run's tokenizer file is missing; cannot copy it into "
                              "the checkpoint (set data.tokenizer to an existing tokenizer.json).")
    shutil.copyfile(tokenizer_file, destination / TOKENIZER_FILE_BY_FORMAT[tokenizer_format(tokenizer_file)])
    for name in TOKENIZER_SIDE_FILES:
        if (tokenizer_file.parent / name).is_file():
            shutil.copyfile(tokenizer_file.parent / name, destination / name)


__all__ = ["CHECKPOINTS_DIR", "COMPLETE_FILE", "CONFIG_FILE", "FORMAT_NAME", "FORMAT_VERSION", "METADATA_FILE",
           "MOVE_AWAY_HINT", "OPTIMIZER_FILE", "PRECISION_FILE", "RNG_FILE", "RUN_CONFIG_FILE", "STATE_FILE",
           "TOKENIZER_FILES", "TOKENIZER_FILE_BY_FORMAT", "TOKENIZER_SIDE_FILES", "TRAINING_FILE", "WEIGHTS_FILE",
           "copy_tokenizer", "copy_tokenizer_files", "file_checksum", "folder_written_atomically", "fsync_directory", "read_json",
           "replace_directory", "write_json_atomic"]
