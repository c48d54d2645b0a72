"""What ``meshlm generate --stats`` reports: prefill and decode speed, cache bytes, drafts accepted.

- **prefill** tokens/s: the prompts' real tokens (padding not counted) over the time taken to
  run them into the caches -- with speculative decoding, into the MTP depths' caches too;
- **decode** tokens/s: the generated tokens over the time after the prefill (the first token,
  drawn from the prefill's logits, included);
- **compile seconds** (``--compile`` only): the first decode step's time spent compiling the
  decode step, kept out of the decode tokens/s;
- **cache bytes**: the most the caches held: KV capacity, Mamba conv and SSM states, and with
  speculative decoding the depths' caches and the states kept for rolling back;
- with speculative decoding: tokens drafted and accepted, the acceptance rate (accepted /
  drafted), and the tokens emitted per verifying forward of the main model (1 + the accepted
  drafts per step: plain decoding has 1).

Times are wall-clock between device synchronizations, so queued GPU work counts where it ran.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def synchronized_time(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class GenerationStats:
    """Counters that ``generate`` adds to (several calls may share one)."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    cache_bytes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_forwards: int = 0
    compile_seconds: float = 0.0
    """Time the compiled decode step spent compiling (``generate(compile=True)``), not in ``decode_seconds``."""

    @contextmanager
    def timing(self, phase: str, device: torch.device):
        """Add the wall-clock time of the ``with`` body to ``{phase}_seconds``."""
        start = synchronized_time(device)
        try:
            yield
        finally:
            seconds = f"{phase}_seconds"
            setattr(self, seconds, getattr(self, seconds) + synchronized_time(device) - start)

    def saw_cache_bytes(self, nbytes: int) -> None:
        self.cache_bytes = max(self.cache_bytes, nbytes)

    def summary(self) -> dict:
        """The one-line report: rates, bytes, and the speculative counters when there were drafts."""
        report = {
            "prefill_tokens": self.prefill_tokens,
            "prefill_tokens_per_s": rate(self.prefill_tokens, self.prefill_seconds),
            "decode_tokens": self.decode_tokens,
            "decode_tokens_per_s": rate(self.decode_tokens, self.decode_seconds),
            "cache_bytes": self.cache_bytes,
        }
        if self.compile_seconds:
            report["compile_seconds"] = round(self.compile_seconds, 2)
        if self.verify_forwards:
            report.update({
                "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": round(self.accepted_tokens / max(self.drafted_tokens, 1), 4),
                "tokens_per_verify_forward": round(
                    (self.accepted_tokens + self.verify_forwards) / self.verify_forwards, 3),
            })
        return report


def rate(count: int, seconds: float) -> float | None:
    return round(count / seconds, 2) if seconds > 0 else None
