"""What the hardware FP8 GEMMs were asked: each ``torch._scaled_mm`` call's ``use_fast_accum``.

Shared by the dense layers' and the experts' tests of ``precision.fp8_fast_accumulation``
(tests/precision/test_quantized_linear.py, test_quantized_experts.py). The real kernel still runs.
"""

from __future__ import annotations

import torch


def record_fast_accumulation(monkeypatch) -> list[bool]:
    """A list that fills, in call order, with the ``use_fast_accum`` of every ``torch._scaled_mm`` call
    from here to the end of the test."""
    calls, real = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: calls.append(kwargs["use_fast_accum"]) or
                        real(*args, **kwargs))
    return calls
