"""A slow link for testing (``parallel.simulate_link=BANDWIDTH,LATENCY``): DP collectives wait as
if their bytes crossed a link of that bandwidth and latency.

Low-communication data parallelism (``meshlm/parallel/data/low_communication.py``) pays off when
the data-parallel link is slow -- between data centres, or over weak inter-node networks. On one
machine every rank shares memory, so a 1 Gbps link is simulated: each collective over a group that
carries a ``SimulatedLink`` (the DP groups: dp, dp_cp and edp) is held back until

    delay = bytes each rank sends / bandwidth + latency

has passed since it was issued, the alpha-beta model of a link. "Bytes each rank sends" is what a
bandwidth-optimal ring puts on the wire (``comm_log.RING_FACTOR``: 2 (n-1)/n of the tensor for an
all-reduce, (n-1)/n for an all-gather or a reduce-scatter). A synchronous collective sleeps out
what remains of its delay after the real one returns; an asynchronous one returns a handle whose
``wait()`` does, so a reduction that overlaps computation costs only the part of the delay the
computation did not cover -- as on a real link.

The link is one wire per process, shared by every group that carries it: a message starts
sending only when the ones issued before it have left (``busy_until``), so two gradient buckets
in flight at once take twice one bucket's bytes/bandwidth, not one (the latency, a propagation
delay, overlaps). Without the queue, a reduction split into k overlapping buckets would cross
the link k times faster than the link allows.

This is a testing aid for CPU runs (the real link's time is added to, not replaced; a GPU run
has real links to measure): it makes the wall-clock effect of local SGD, DiLoCo and PALSGD
visible on this machine, it does not model congestion, message splitting or topology.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from meshlm.errors import ConfigError
from meshlm.parallel.comm_log import RING_FACTOR

BITS_PER_SECOND = {"bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass
class SimulatedLink:
    bandwidth_bits_per_s: float
    latency_s: float
    busy_until: float = field(default=0.0, compare=False)
    """``time.perf_counter()`` at which the last message issued has left this process's wire."""

    def transfer_s(self, op: str, message_bytes: int, group_size: int) -> float:
        """Seconds the wire is busy sending what one rank sends in a collective ``op`` on a
        ``message_bytes`` tensor (the comm_log convention: the whole tensor, the gathered
        output, the scattered input)."""
        return RING_FACTOR[op](group_size) * message_bytes * 8 / self.bandwidth_bits_per_s

    def deadline(self, op: str, message_bytes: int, group_size: int, issued: float) -> float:
        """When a collective issued at ``issued`` completes: it starts sending once the wire is
        free, occupies it for its transfer time, and arrives a latency later."""
        start = max(issued, self.busy_until)
        self.busy_until = start + self.transfer_s(op, message_bytes, group_size)
        return self.busy_until + self.latency_s


def parse_link(text: str | None) -> SimulatedLink | None:
    """``'1Gbps,5ms'`` -> SimulatedLink(1e9, 0.005); None or '' -> None (no simulation)."""
    if not text:
        return None
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*,\s*([0-9.]+)\s*([a-z]+)\s*", text)
    rate = BITS_PER_SECOND.get(match.group(2).lower()) if match else None
    unit = SECONDS.get(match.group(4)) if match else None
    if rate is None or unit is None or float(match.group(1)) <= 0:
        raise ConfigError(f"parallel.simulate_link={text!r} is not BANDWIDTH,LATENCY; write e.g. '1Gbps,5ms' "
                          f"(bandwidth in bps/Kbps/Mbps/Gbps/Tbps, latency in s/ms/us).")
    return SimulatedLink(float(match.group(1)) * rate, float(match.group(3)) * unit)


def sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class DelayedWork:
    """An asynchronous collective's handle whose ``wait()`` also waits out the link's delay,
    counted from when the collective was issued."""

    def __init__(self, work, deadline: float):
        self.work, self.deadline = work, deadline

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs) if self.work is not None else True
        sleep_until(self.deadline)
        return result

    def is_completed(self) -> bool:
        return (self.work is None or self.work.is_completed()) and time.perf_counter() >= self.deadline


def delayed(link: SimulatedLink | None, op: str, message_bytes: int, group_size: int, issued: float, work,
            async_op: bool):
    """What a plain collective returns over ``link``: the handle wrapped (async) or the delay
    slept out (sync); unchanged without a link."""
    if link is None:
        return work
    deadline = link.deadline(op, message_bytes, group_size, issued)
    if async_op:
        return DelayedWork(work, deadline)
    sleep_until(deadline)
    return work


__all__ = ["DelayedWork", "SimulatedLink", "delayed", "parse_link"]
