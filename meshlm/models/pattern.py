"""Parse a layer pattern string into block kinds and pipeline-stage boundaries.

Symbols: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE, ``L`` linear (one hidden x hidden
matrix in place of a mixer), ``0`` no-op (a removed block: the identity); ``|`` is not a block.

``"M-M*|-M-E"`` is eight blocks (M, -, M, *, -, M, -, E) with a pipeline-stage boundary after the
fourth. Whitespace is ignored so long patterns can be written in readable groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError

BLOCK_KINDS = {
    "M": "mamba2",
    "*": "attention",
    "-": "mlp",
    "E": "moe",
    "L": "linear",
    "0": "no-op",
}
LINEAR = "L"
"""Puzzle's "linear replacement" (Bercovich et al. 2024): h + W norm(h), W one hidden x hidden matrix."""
NO_OP = "0"
"""A removed block (Puzzle's "no-op"): h passes through unchanged; no parameters, no cache, no FLOPs."""
STAGE_BOUNDARY = "|"


@dataclass(frozen=True)
class ParsedPattern:
    kinds: tuple[str, ...]
    """One symbol per block, boundaries removed."""
    stage_starts: tuple[int, ...]
    """Index of the first block of each explicitly marked stage (always starts with 0)."""


def parse_pattern(pattern: str, field_name: str = "pattern") -> ParsedPattern:
    """Split a pattern into block symbols and the block indices where stages start."""
    if not isinstance(pattern, str):
        raise ConfigError(f"{field_name}={pattern!r} must be a string such as '*-*-' or 'M-M*-E'.")
    kinds: list[str] = []
    stage_starts = [0]
    for position, symbol in enumerate(pattern):
        if symbol.isspace():
            continue
        if symbol == STAGE_BOUNDARY:
            if not kinds or stage_starts[-1] == len(kinds):
                raise ConfigError(f"{field_name}={pattern!r}: the '|' at position {position} would make an empty "
                                  "pipeline stage; put at least one block between boundaries.")
            stage_starts.append(len(kinds))
            continue
        if symbol not in BLOCK_KINDS:
            allowed = ", ".join(f"'{s}' {name}" for s, name in BLOCK_KINDS.items())
            raise ConfigError(f"{field_name}={pattern!r}: unknown symbol {symbol!r} at position {position}; "
                              f"use {allowed}, and '|' for a pipeline-stage boundary.")
        kinds.append(symbol)
    if not kinds:
        raise ConfigError(f"{field_name}={pattern!r} has no blocks; write at least one of M * - E L 0.")
    if len(stage_starts) > 1 and stage_starts[-1] == len(kinds):
        raise ConfigError(f"{field_name}={pattern!r} ends with '|', which would make an empty last stage.")
    return ParsedPattern(tuple(kinds), tuple(stage_starts))


def parallel_residual_pairs(kinds) -> list[tuple[int, int]]:
    """The blocks ``model.parallel_residual`` runs side by side: each attention block (``*``) and
    the MLP, MoE or Mamba-2 block (``-``, ``E``, ``M``) right after it, as (attention, partner)
    positions in ``kinds``, left to right. ``"*-*-"`` pairs (0, 1) and (2, 3); in ``"M*-*0-"`` only
    (1, 2); Falcon-H1's ``"*M-*M-"`` pairs (0, 1) and (3, 4), each MLP after its pair."""
    pairs, index = [], 0
    while index < len(kinds) - 1:
        if kinds[index] == "*" and kinds[index + 1] in ("-", "E", "M"):
            pairs.append((index, index + 1))
            index += 2
        else:
            index += 1
    return pairs
