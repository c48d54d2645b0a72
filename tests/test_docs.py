"""The docs stay true: README.md, docs/*.md and the launch scripts of examples/ against the code.

* Every config key written as ``section.key`` names a field of ``RunConfig`` (meshlm/config.py);
  quoted program output (```text blocks) is exempt, since an error message names the wrong key.
* Every ``meshlm`` command line -- in a code block, in an inline code span, or a line of an
  examples/ shell script; also after ``python -m`` or ``torchrun ... -m`` -- uses only flags its
  (sub)command's parser defines, and parses with the real parser (``meshlm.cli.build_parser``;
  parsed, never run). Placeholders (CKPT, HF_DIR) parse as the strings they are; a synopsis line
  with ``[optional]`` parts, ``a | b`` or ``...`` is only checked flag by flag.
* Relative links in the markdown point at files that exist, and nothing in the repository
  refers to material outside it (the ``shared`` folder beside the checkout): a clone stands alone.

Each failure lists every stale reference as ``file:line: what``, so one run shows them all.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import io
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION_NAMES = ("model", "train", "optim", "data", "precision", "parallel")
CONFIG_KEY = re.compile(rf"(?<![\w./-])({'|'.join(SECTION_NAMES)})\.([a-z_][a-z0-9_]*)\b(?![.(]\w|\()")
FILE_SUFFIXES = {"safetensors", "json", "jsonl", "yaml", "yml", "py", "sh", "sbatch", "bin", "idx", "md", "txt",
                 "parquet", "png", "model", "out", "log", "tar"}
"""``model.safetensors``, ``train.sbatch``: file names, not config keys."""
SYNOPSIS_MARKS = ("[", "]", "|", "(", ")", "...", "<", ">")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
"""CKPT, HF_DIR, N: words a reader replaces."""
NON_SHELL_FENCES = {"python", "py", "yaml", "yml", "json", "text", "toml"}
OUTSIDE_REFERENCES = ("../" + "shared", "shared/" + "ARCHITECTURE.md", "shared/" + "REFERENCES.md",
                      "/work/" + "shared")
"""Spelled in pieces so that this file does not match itself."""


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def script_files() -> list[Path]:
    return sorted(path for pattern in ("*.sh", "*.sbatch") for path in (ROOT / "examples").rglob(pattern))


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# --- reading the docs --------------------------------------------------------------------------------------
def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, fence language, lines) of every fenced code block."""
    blocks, inside, language, start, lines = [], False, "", 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"\s*```(\w*)", line)
        if fence and not inside:
            inside, language, start, lines = True, fence[1].lower(), number + 1, []
        elif fence and inside:
            blocks.append((start, language, lines))
            inside = False
        elif inside:
            lines.append(line)
    return blocks


def joined_lines(first: int, lines: list[str]) -> list[tuple[int, str]]:
    """Shell lines with ``\\`` continuations joined, each with the number of its first line."""
    joined, pending, pending_line = [], "", 0
    for offset, line in enumerate(lines):
        if not pending:
            pending_line = first + offset
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        joined.append((pending_line, pending + line))
        pending = ""
    if pending:
        joined.append((pending_line, pending))
    return joined


def inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, content) of every single-backtick code span outside code blocks (spans may wrap)."""
    outside = re.sub(r"```.*?```", lambda match: "\n" * match[0].count("\n"), text, flags=re.S)
    return [(outside.count("\n", 0, match.start()) + 1, " ".join(match[1].split()))
            for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", outside)]


def command_lines(path: Path) -> list[tuple[int, str]]:
    """Every line of shell (code blocks, inline spans, a script's lines) with its line number."""
    text = path.read_text()
    if path.suffix != ".md":
        return joined_lines(1, text.splitlines())
    found = []
    for first, language, lines in code_blocks(text):
        if language not in NON_SHELL_FENCES:
            found += joined_lines(first, lines)
    return found + [(number, span) for number, span in inline_spans(text) if "meshlm " in span]


def meshlm_argv(line: str) -> list[str] | None:
    """The arguments after ``meshlm`` (as a command, or a module run by ``-m``), else None."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: not a command line we can read
        return None
    for index, word in enumerate(words):
        if word == "meshlm" and (index == 0 or words[index - 1] == "-m" or words[index - 1] in ("exec", "srun")):
            return words[index + 1:]
    return None


# --- the checks -----------------------------------------------------------------------------------------
def known_config_keys() -> set[str]:
    from meshlm.config import SECTIONS

    return {f"{section}.{field.name}" for section, cls in SECTIONS.items() for field in dataclasses.fields(cls)}


def output_lines(text: str) -> set[int]:
    """Line numbers inside ```text blocks: a program's output, quoted (an error may name a wrong key)."""
    return {first + offset for first, language, lines in code_blocks(text) if language == "text"
            for offset in range(len(lines))}


def stale_config_keys(path: Path, known: set[str]) -> list[str]:
    problems, text = [], path.read_text()
    quoted = output_lines(text) if path.suffix == ".md" else set()
    for number, line in enumerate(text.splitlines(), 1):
        if number in quoted:
            continue
        for match in CONFIG_KEY.finditer(line):
            key = f"{match[1]}.{match[2]}"
            if match[2] not in FILE_SUFFIXES and key not in known:
                problems.append(f"{relative(path)}:{number}: config key {key} is not a field of RunConfig")
    return problems


def subcommand_parser(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, str, int]:
    """The deepest parser ``argv`` selects (``meshlm checkpoint inspect`` -> inspect's), its name and
    how many words of ``argv`` named it."""
    name, depth = "meshlm", 0
    for word in argv:
        choices = next((action.choices for action in parser._actions
                        if isinstance(action, argparse._SubParsersAction)), None)
        if not choices or word not in choices:
            break
        parser, name, depth = choices[word], f"{name} {word}", depth + 1
    return parser, name, depth


def fill_placeholders(command: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--vocab-size N`` -> ``--vocab-size 1``: an upper-case placeholder after a flag that takes a
    typed value or a choice becomes a value that parses (placeholders elsewhere are plain strings)."""
    options = {flag: action for action in command._actions for flag in action.option_strings}
    filled = list(argv)
    for index in range(1, len(argv)):
        action = options.get(argv[index - 1])
        if action is not None and PLACEHOLDER.fullmatch(argv[index]):
            if action.choices:
                filled[index] = str(next(iter(action.choices)))
            elif action.type is not None:
                filled[index] = "1"
    return filled


@functools.cache
def parser_for(command: str) -> argparse.ArgumentParser:
    """``meshlm``'s parser with ``command``'s arguments (``build_parser`` may load only the chosen
    command's module, or all of them)."""
    from meshlm.cli import build_parser

    return build_parser(command) if inspect.signature(build_parser).parameters else build_parser()


def stale_command(argv: list[str]) -> str | None:
    """Why ``meshlm ARGV`` is wrong (an unknown flag, or argparse's own complaint), or None."""
    parser = parser_for(argv[0])
    command, name, depth = subcommand_parser(parser, argv)
    if depth == len(argv):
        return None  # `meshlm generate` named in a sentence, not a command line
    flags = {flag for action in command._actions for flag in action.option_strings}
    for word in argv:
        for flag in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", word):  # also "[--flag" and "(--flag"
            if flag not in flags:
                return f"`{name}` has no flag {flag}"
    if any(mark in word for word in argv for mark in SYNOPSIS_MARKS):
        return None  # a synopsis: its flags are known, the line itself is not a command
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(fill_placeholders(command, argv))
    except SystemExit as exit_:
        if exit_.code:
            return f"`meshlm {' '.join(argv)}` does not parse: {errors.getvalue().strip().splitlines()[-1]}"
    return None


def stale_commands(path: Path) -> list[str]:
    problems = []
    for number, line in command_lines(path):
        argv = meshlm_argv(line)
        if argv is None or not argv:
            continue
        problem = stale_command(argv)
        if problem is not None:
            problems.append(f"{relative(path)}:{number}: {problem}")
    return problems


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                problems.append(f"{relative(path)}:{number}: link {target} points at nothing")
    return problems


def outside_references(paths: list[Path]) -> list[str]:
    problems = []
    for path in paths:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for needle in OUTSIDE_REFERENCES:
                if needle in line:
                    problems.append(f"{relative(path)}:{number}: refers to {needle}, which a clone does not have")
    return problems


# --- the repository's docs --------------------------------------------------------------------------------
def test_the_docs_exist():
    names = {path.name for path in doc_files()}
    assert {"README.md", "quickstart.md", "configs.md", "data.md", "parallel.md", "multinode.md", "checkpoints.md",
            "hf.md", "generation.md", "troubleshooting.md", "api.md", "design.md", "references.md"} <= names
    assert {relative(path) for path in script_files()} >= {"examples/multinode.sh", "examples/slurm/train.sbatch"}


def test_every_config_key_in_the_docs_exists():
    known = known_config_keys()
    problems = [problem for path in doc_files() + script_files() for problem in stale_config_keys(path, known)]
    assert not problems, "stale config keys (rename or remove them):\n" + "\n".join(problems)


def test_every_meshlm_command_in_the_docs_and_scripts_parses():
    checked = [(path, number) for path in doc_files() + script_files() for number, line in command_lines(path)
               if meshlm_argv(line)]
    assert len(checked) >= 40, f"only {len(checked)} meshlm command lines found: is the scan reading the docs?"
    problems = [problem for path in doc_files() + script_files() for problem in stale_commands(path)]
    assert not problems, "stale meshlm command lines:\n" + "\n".join(problems)


def test_every_relative_link_in_the_docs_resolves():
    problems = [problem for path in doc_files() for problem in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_nothing_refers_to_material_outside_the_repository():
    files = doc_files() + script_files() + [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "examples" / "notebook.py"]
    for folder in ("meshlm", "tests", "bench", "configs"):
        files += sorted(path for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".md", ".yaml", ".txt"))
    problems = outside_references([path for path in files if path.is_file() and path != Path(__file__).resolve()])
    assert not problems, "\n".join(problems)


# --- the checker itself -------------------------------------------------------------------------------------
def test_the_checks_name_the_file_and_line_of_each_stale_reference(tmp_path):
    doc = tmp_path / "guide.md"
    doc.write_text("Set `train.steps` and `train.stepz`; the weights are in model.safetensors.\n"
                   "\n"
                   "```bash\n"
                   "meshlm train configs/tiny.yaml \\\n"
                   "    train.steps=3 --fast           # no such flag\n"
                   "meshlm generate CKPT --prompt hi --max-new-tokens 4\n"
                   "meshlm score CKPT --json  # --input is required\n"
                   "torchrun --nproc_per_node 2 -m meshlm checkpoint inspect runs/x --jsn\n"
                   "meshlm tokenizer train --input FILES --vocab-size N --out tok.json  # N: a placeholder\n"
                   "meshlm convert meshlm-to-hf CKPT HF_DIR [--quantize fp8] [--colour]\n"
                   "```\n"
                   "\n"
                   "Then `meshlm train\n"
                   "--list-kyes`; see [the API](api.md) and ../" "shared/STYLE.md.\n"
                   "```text\n"
                   "meshlm train: error: unknown config key 'train.stepz'.\n"
                   "```\n")
    assert stale_config_keys(doc, known_config_keys()) == [
        f"{doc}:1: config key train.stepz is not a field of RunConfig"]
    assert stale_commands(doc) == [
        f"{doc}:4: `meshlm train` has no flag --fast",
        f"{doc}:7: `meshlm score CKPT --json` does not parse: meshlm score: error: the following arguments are "
        "required: --input",
        f"{doc}:8: `meshlm checkpoint inspect` has no flag --jsn",
        f"{doc}:10: `meshlm convert meshlm-to-hf` has no flag --colour",
        f"{doc}:13: `meshlm train` has no flag --list-kyes"]
    assert broken_links(doc) == [f"{doc}:14: link api.md points at nothing"]
    assert outside_references([doc]) == [f"{doc}:14: refers to ../" "shared, which a clone does not have"]
