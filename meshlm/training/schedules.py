"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay (WSD) or constant.

``learning_rate(step, config, total_steps)`` is the rate used by optimizer step ``step``
(0, 1, ..., total_steps - 1). With W = warmup_steps, peak lr and floor min_lr:

    warmup     s < W:   lr * (s + 1) / W          (the first step already moves; step W-1 uses lr)
    cosine     s >= W:  min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,
                        p = (s - W) / (total_steps - 1 - W)       (lr at s = W, min_lr at the last step)
    wsd        s >= W:  lr on the plateau; over the last D = round(decay_fraction * total_steps)
                        steps, lr + (min_lr - lr) * (s - (total_steps - D) + 1) / D
                        (each decay step lowers the rate; the last step uses min_lr)
    constant   s >= W:  lr

Cosine decay is the GPT-3 / Chinchilla default. WSD (Hu et al. 2024, MiniCPM; Hägele et al.
2024) holds the peak rate and decays only at the end, so a run can be extended, or branched
into a decay at any point, without knowing its length in advance. Warmup takes precedence
over the decay if the two overlap; steps past the end use the final rate.
"""

from __future__ import annotations

import math

from meshlm.errors import ConfigError


def learning_rate(step: int, config, total_steps: int) -> float:
    """The learning rate for optimizer step ``step`` of a run of ``total_steps`` steps."""
    warmup = config.warmup_steps
    if step < warmup:
        return config.lr * (step + 1) / warmup
    last = total_steps - 1
    if config.schedule == "constant":
        return config.lr
    if config.schedule == "cosine":
        decay_intervals = last - warmup
        progress = 1.0 if decay_intervals <= 0 else min(1.0, (step - warmup) / decay_intervals)
        return config.min_lr + (config.lr - config.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if config.schedule == "wsd":
        decay_steps = math.floor(config.decay_fraction * total_steps + 0.5)
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return config.lr
        fraction = min(1.0, (step - decay_start + 1) / decay_steps)
        return config.lr + (config.min_lr - config.lr) * fraction
    raise ConfigError(f"optim.schedule={config.schedule!r} is not one of cosine, wsd, constant.")
