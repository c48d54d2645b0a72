"""The dynamic loss scaler of fp16 training (Micikevicius et al. 2017, §3.2).

fp16 has a narrow exponent range: gradients smaller than about 6e-8 round to zero. Multiplying
the loss by a large factor S before ``backward()`` multiplies every gradient by S, lifting the
small ones into range; the optimizer then divides by S again (in fp32, on the master copies).
Too large an S makes some gradient overflow to inf, so S is found while training:

- a step whose gradients contain inf/nan is skipped (the trainer does not call the optimizer);
- overflows lower S by ``backoff_factor``, but only after ``hysteresis`` of them: each overflow
  decrements a counter, and S is lowered when the counter reaches zero (and on every further
  overflow until the counter is reset), so one unlucky batch does not halve S;
- after ``growth_interval`` consecutive clean steps S grows by ``growth_factor`` and the
  hysteresis counter is reset -- S keeps probing upwards, so it tracks the largest safe value.

These are Megatron-LM's semantics (``DynamicGradScaler``). S never drops below
``min_scale``. The scale is a Python float: multiplying the loss by it costs no device sync.
bf16 shares fp32's exponent range and needs no scaling.
"""

from __future__ import annotations

from meshlm.errors import ConfigError


class DynamicLossScaler:
    def __init__(self, initial_scale: float = 2.0 ** 16, growth_interval: int = 1000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, hysteresis: int = 2, min_scale: float = 1.0):
        checks = [
            ("initial_loss_scale", initial_scale, initial_scale > 0, "a positive number such as 65536"),
            ("min_loss_scale", min_scale, 0 < min_scale <= initial_scale, "positive and <= initial_loss_scale"),
            ("growth_interval", growth_interval, growth_interval >= 1, "a positive integer"),
            ("growth_factor", growth_factor, growth_factor > 1, "a number > 1 such as 2.0"),
            ("backoff_factor", backoff_factor, 0 < backoff_factor < 1, "a number in (0, 1) such as 0.5"),
            ("hysteresis", hysteresis, hysteresis >= 1, "a positive integer (1 = lower on every overflow)"),
        ]
        for name, value, ok, expected in checks:
            if not ok:
                raise ConfigError(f"precision.{name}={value} is invalid; use {expected}.")
        self.scale = float(initial_scale)
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.clean_steps = 0
        """Consecutive steps without overflow since the last growth or overflow."""
        self.hysteresis_left = hysteresis
        """Overflows still tolerated before the scale is lowered."""

    @classmethod
    def from_config(cls, config) -> "DynamicLossScaler":
        """Build from a ``PrecisionConfig``."""
        return cls(config.initial_loss_scale, config.growth_interval, config.growth_factor,
                   config.backoff_factor, config.hysteresis, config.min_loss_scale)

    def update(self, found_nonfinite: bool) -> None:
        """Advance by one optimizer step whose gradients were (or were not) finite."""
        if found_nonfinite:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
