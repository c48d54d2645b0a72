"""The live progress line of `meshlm rl`: the trainer's, with the step's reward and accuracy.

    step 12/100 | loss -0.013 | reward 0.625 | acc 62.5% | len 4.2 | lr 1.0e-05 | ... | ETA 1m23s

``loss`` is GRPO's (``grpo.py``): near zero by construction (the advantages of a group sum to
zero), so the reward and the accuracy of the step's completions are what show progress.
"""

from __future__ import annotations

from meshlm.training.metrics import ProgressLine, progress_text


def rl_progress_text(record: dict, total_steps: int, eta_seconds: float) -> str:
    parts = progress_text(record, total_steps, eta_seconds).split(" | ")
    parts[2:2] = [f"reward {record['reward_mean']:.3f}", f"acc {100 * record['accuracy']:.1f}%",
                  f"len {record['completion_length']:.1f}"]
    return " | ".join(parts)


class RLProgressLine(ProgressLine):
    """``ProgressLine`` drawing ``rl_progress_text``."""

    def update(self, record: dict, logged: bool) -> None:
        text = rl_progress_text(record, self.total_steps, self.eta(record["step"]))
        if self.live:
            self.stream.write("\r\033[K" + text + ("\n" if logged else ""))
        elif logged:
            self.stream.write(text + "\n")
        self.stream.flush()


__all__ = ["RLProgressLine", "rl_progress_text"]
