"""Which parallel layouts a model can run on N GPUs: enumeration, parsing, applying one to a config.

A layout is the tuple (tp, sp, pp, vp, dp, cp, ep, zero stage, recompute) plus the micro-batch.
The planner proposes only layouts the trainer would accept: each candidate is put into the run
config's ``parallel`` section and checked by the trainer's own rules -- ``RunConfig.validate``
(``meshlm/config.py``: sp needs tp > 1, vp needs pp > 1, ...) and
``meshlm.parallel.mesh.check_layout`` (the world by tp*pp*cp*dp, heads / KV heads / FFN widths /
Mamba heads and groups by tp, experts by ep, ep*etp dividing tp*cp*dp, the sequence by tp under
SP and by 2*cp under CP, the micro-batches by dp, and the pipeline's stage and micro-batch
rules). A refused layout keeps the trainer's one-sentence reason, which ``meshlm plan`` prints.

Enumerated: tp over the divisors of the GPUs per node (tensor parallelism stays inside a node, as
PTD-P advises), sp on whenever tp > 1 (it saves activation memory at no extra communication),
pp and cp over divisors of what remains, dp the rest, ep over divisors of tp*cp*dp for MoE
models, vp in {1, 2} when pp > 1, ZeRO stages {0, 1} (plus 2 and 3 when asked), recompute in
{none, selective, full}.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.parallel.mesh import check_layout

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """One way to lay a run over the GPUs (``parallel.*`` and ``train.recompute``)."""

    tp: int = 1
    sp: bool = False
    pp: int = 1
    vp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    recompute: str = "none"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def describe(self) -> str:
        return (f"tp={self.tp},sp={str(self.sp).lower()},pp={self.pp},vp={self.vp},dp={self.dp},cp={self.cp},"
                f"ep={self.ep},zero={self.zero},recompute={self.recompute}")


LAYOUT_KEYS = tuple(field.name for field in dataclasses.fields(Layout))


def parse_layout(text: str) -> Layout:
    """``tp=2,sp=true,pp=2,dp=2`` -> Layout; omitted keys keep their defaults (dp: 1, so give it)."""
    values: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not equals or key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout item {item!r} is not KEY=VALUE with KEY one of {', '.join(LAYOUT_KEYS)}; "
                              "write e.g. --layout tp=2,sp=true,pp=2,dp=2,zero=1,recompute=selective.")
        if key == "sp":
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"--layout sp={value!r} must be true or false.")
            values[key] = value.lower() == "true"
        elif key == "recompute":
            if value not in RECOMPUTE:
                raise ConfigError(f"--layout recompute={value!r} must be one of {', '.join(RECOMPUTE)}.")
            values[key] = value
        else:
            try:
                number = int(value)
            except ValueError:
                number = 0
            if number < (0 if key == "zero" else 1) or (key == "zero" and number > 3):
                allowed = "0, 1, 2 or 3" if key == "zero" else "a positive integer"
                raise ConfigError(f"--layout {key}={value!r} must be {allowed}.")
            values[key] = number
    return Layout(**values)


def apply_layout(config, layout: Layout, micro_batch: int | None = None):
    """The run config with ``layout`` in ``parallel`` / ``train.recompute`` (and the micro-batch)."""
    parallel = dataclasses.replace(config.parallel, tp=layout.tp, sp=layout.sp, pp=layout.pp, vp=layout.vp,
                                   dp=layout.dp, cp=layout.cp, ep=layout.ep, zero_stage=layout.zero,
                                   distributed_optimizer=False)
    train = dataclasses.replace(config.train, recompute=layout.recompute,
                                micro_batch_size=micro_batch or config.train.micro_batch_size)
    return dataclasses.replace(config, parallel=parallel, train=train)


def refusal(config, layout: Layout, micro_batch: int) -> str | None:
    """The trainer's reason for refusing ``layout`` at ``micro_batch`` (None: accepted)."""
    try:
        candidate = apply_layout(config, layout, micro_batch)
        candidate.validate()
        train = candidate.train
        if train.global_batch_size % (micro_batch * layout.dp):
            raise ConfigError(f"train.global_batch_size={train.global_batch_size} is not a multiple of "
                              f"micro_batch_size * dp = {micro_batch}*{layout.dp}.")
        check_layout(candidate.parallel, candidate.model, layout.world_size, train.seq_len,
                     train.global_batch_size // micro_batch)
    except ConfigError as error:
        return str(error)
    return None


def divisors(number: int) -> list[int]:
    return [value for value in range(1, number + 1) if number % value == 0]


def candidate_layouts(config, gpus: int, gpus_per_node: int, zero_stages=(0, 1),
                      recompute=RECOMPUTE) -> list[Layout]:
    """Every layout of the shape above over ``gpus`` (not yet checked against the model)."""
    is_moe = "E" in config.model.block_kinds or (config.model.mtp_depth and "E" in config.model.mtp_pattern)
    layouts = []
    for tp in divisors(min(gpus, gpus_per_node)):
        for pp in divisors(gpus // tp):
            for cp in divisors(gpus // (tp * pp)):
                dp = gpus // (tp * pp * cp)
                for ep in divisors(tp * cp * dp) if is_moe else [1]:
                    for vp in ((1, 2) if pp > 1 else (1,)):
                        for zero in (zero_stages if dp * cp > 1 else (0,)):
                            for mode in recompute:
                                layouts.append(Layout(tp, tp > 1, pp, vp, dp, cp, ep, zero, mode))
    return layouts


__all__ = ["LAYOUT_KEYS", "Layout", "RECOMPUTE", "apply_layout", "candidate_layouts", "divisors", "parse_layout",
           "refusal"]
