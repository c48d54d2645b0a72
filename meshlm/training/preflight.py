"""Checks at the start of ``meshlm train`` that catch a run which would do nothing, or nothing useful.

- ``finished_run``: the run directory's newest checkpoint is already at (or past) ``train.steps``.
  A plain re-run of the same command says so and trains nothing; a re-run that also changes
  settings (on the command line, or in the config file since the checkpoint was written) is
  refused with a ``ConfigError``, because those settings would silently be ignored -- the usual
  mistake is a new parallel layout or learning rate given to a run that has already ended.
  Continuing means raising ``train.steps``; starting afresh means a new ``train.run_dir``.
- ``startup_warnings``: settings that are valid but almost certainly not meant -- an MoE model
  with no load balancing at all (routing tends to collapse onto a few experts; Shazeer et al.
  2017, Fedus et al. 2021), a warmup as long as the whole run.

The memory estimate, the third start-up check, has its own file (``memory_estimate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshlm.checkpoint.files import CONFIG_FILE, read_json
from meshlm.checkpoint.folders import checkpoint_dirs, is_complete
from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.pattern import parse_pattern

CONTINUE_KEYS = ("train.steps", "train.run_dir")
"""The keys a re-run of a finished run may give: the one that extends it, the one that names it."""


@dataclass(frozen=True)
class FinishedRun:
    checkpoint: Path
    step: int
    steps: int

    def message(self) -> str:
        return (f"the run in {self.checkpoint.parent.parent} is already complete: its newest checkpoint "
                f"{self.checkpoint} is at step {self.step} of train.steps={self.steps}, so nothing was trained; "
                f"to continue it, pass train.steps=M with M > {self.step}, or start a new run with "
                "train.run_dir=NEW_DIR.")


def finished_run(config, command_line_keys=()) -> FinishedRun | None:
    """The run directory's newest complete checkpoint when it is at or past ``train.steps``, else None.

    Raises ConfigError when the run is finished but ``command_line_keys`` (the dotted keys given
    as overrides) include others than ``CONTINUE_KEYS``, or when ``config`` differs from the
    checkpoint's saved run config in anything but those keys: those settings would be ignored."""
    found = checkpoint_dirs(config.train.run_dir)
    if not found or found[-1][0] < config.train.steps or not is_complete(found[-1][1]):
        return None
    finished = FinishedRun(found[-1][1], found[-1][0], config.train.steps)
    ignored = sorted(key for key in dict.fromkeys(command_line_keys) if key not in CONTINUE_KEYS)
    changed = changed_settings(finished.checkpoint, config)
    if ignored or changed:
        what = (f"the settings given on the command line ({', '.join(ignored)})" if ignored else
                f"the settings that differ from the checkpoint's ({'; '.join(changed)})")
        raise ConfigError(f"the run in {finished.checkpoint.parent.parent} is already complete (step {finished.step} "
                          f"of train.steps={finished.steps}), so {what} would be ignored; to continue it with them, "
                          f"also pass train.steps=M with M > {finished.step}, or start a new run with "
                          "train.run_dir=NEW_DIR.")
    return finished


def changed_settings(checkpoint: Path, config) -> list[str]:
    """``section.key: checkpoint X, now Y`` for every setting of ``config`` that differs from the run
    config saved with ``checkpoint`` (``CONTINUE_KEYS`` aside; a precision.dtype of 'auto' matches the
    dtype it was resolved to; keys the checkpoint does not record are not compared)."""
    try:
        saved = read_json(checkpoint / CONFIG_FILE).get("run") or {}
    except CheckpointError:
        return []
    changes = []
    for section, values in config.to_dict().items():
        before = saved.get(section) or {}
        for key, now in values.items():
            name = f"{section}.{key}"
            if name in CONTINUE_KEYS or key not in before or before[key] == now:
                continue
            if name == "precision.dtype" and now == "auto":
                continue
            changes.append(f"{name}: checkpoint {before[key]!r}, now {now!r}")
    return changes


def startup_warnings(config) -> list[str]:
    """One sentence for each valid but probably unintended setting of the run ``config``."""
    return [message for message in (moe_balancing_warning(config.model), warmup_warning(config)) if message]


def moe_balancing_warning(model) -> str | None:
    kinds = set(model.block_kinds)
    if model.mtp_depth:
        kinds |= set(parse_pattern(model.mtp_pattern, "model.mtp_pattern").kinds)
    if "E" not in kinds or model.moe_top_k >= model.moe_num_experts:  # every expert sees every token anyway
        return None
    if model.moe_aux_loss_coeff > 0 or model.moe_bias_update_rate > 0:
        return None
    return (f"model.pattern={model.pattern!r} has MoE blocks but no load balancing (model.moe_aux_loss_coeff=0 and "
            "model.moe_bias_update_rate=0), so the router may send most tokens to a few experts; set "
            "model.moe_aux_loss_coeff (e.g. 0.01) or model.moe_bias_update_rate (e.g. 0.001, aux-loss-free).")


def warmup_warning(config) -> str | None:
    warmup, steps, lr = config.optim.warmup_steps, config.train.steps, config.optim.lr
    if warmup == 0 or warmup < steps:
        return None
    return (f"optim.warmup_steps={warmup} >= train.steps={steps}: the whole run is warmup, so the learning rate "
            f"rises until the last step (to {lr * steps / warmup:.3g}; optim.lr={lr:g}) and never decays; set "
            f"optim.warmup_steps below train.steps (e.g. {max(1, steps // 10)}) or raise train.steps.")


__all__ = ["CONTINUE_KEYS", "FinishedRun", "changed_settings", "finished_run", "moe_balancing_warning",
           "startup_warnings", "warmup_warning"]
