"""Point-to-point messages between pipeline stages: batched, tagged, with shapes known ahead.

Between virtual stages v and v + 1 travel the activations (forward) and their gradients
(backward), one tensor per micro-batch each way. Its shape is known before it is sent -- micro-
batch size x local sequence length (sequence / tp under sequence parallelism, / cp under context
parallelism) x hidden size, in the model's compute dtype -- so the receiver allocates its buffer
itself and no message ever carries a shape (no per-step handshake).

Every message goes through ``collectives.send_and_receive`` (device-checked, and recorded for
``parallel.check_collectives``). A send never blocks the sender: its handle (and tensor) is kept until it completes, and all are
waited for at the end of the schedule. When a receive is posted depends on the backend
(``receives_early``):

* **gloo** (every op its own asynchronous request): the receive of an action's input is posted
  *before the compute it waits behind* -- before the previous action runs -- so the message can
  arrive while this rank computes, instead of starting its transfer only once the rank is free
  to post it. The executor waits for it just before the action that needs it.
* **NCCL**: one stream carries a pair of ranks' sends and receives in issue order, so a receive
  posted alone, before a send its peer is waiting for, could block that send behind it: the
  receive of the next action's input goes out in ONE ``batch_isend_irecv`` call with the send
  of what the current action produced (a group NCCL completes as a whole), after that action,
  as Megatron-LM does.

Either way a rank waits only when its next action's input has not been produced yet -- the
dependency the schedule simulator checks (``schedules.simulate``).

Messages are matched by (peer, tag), the tag naming the kind, micro-batch and receiving virtual
stage: two ranks may exchange several messages of the same shape in different orders (with
pp = 2 and vp > 1 the same pair carries activations one way and gradients the other, and the
order in which each side issues them depends on its schedule), and a tag-less match by issue
order could silently hand one micro-batch's activation to another. Gloo honours tags (this is
what the tests run); NCCL ignores them and matches by issue order per pair, which our schedules
do not guarantee for pp = 2 with vp > 1, so that layout is refused on NCCL
(``meshlm.parallel.mesh.check_backend``) -- untested on GPUs here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshlm.parallel.collectives import send_and_receive

ACTIVATION, GRADIENT = 0, 1


@dataclass(frozen=True)
class Message:
    kind: int
    """ACTIVATION (to virtual stage v from v - 1) or GRADIENT (to v from v + 1)."""
    microbatch: int
    virtual_stage: int
    """The receiving virtual stage."""
    peer: int
    """Global rank on the other side."""

    def tag(self, num_virtual_stages: int) -> int:
        return (self.microbatch * num_virtual_stages + self.virtual_stage) * 2 + self.kind


class Receive:
    """A receive in flight: ``wait()`` returns its tensor once it is here (None: nothing was posted)."""

    def __init__(self, buffer: torch.Tensor | None = None, work=None, posted_at: float | None = None):
        self.buffer, self.work, self.posted_at = buffer, work, posted_at
        """``time.perf_counter()`` when it was posted."""

    def wait(self) -> torch.Tensor | None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buffer


class PointToPoint:
    """Batched sends and receives of fixed-shape tensors over one pipeline's process group."""

    def __init__(self, group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 num_virtual_stages: int):
        self.group, self.shape, self.dtype, self.device = group, tuple(shape), dtype, device
        self.num_virtual_stages = num_virtual_stages
        self.pending_sends: list[tuple[object, torch.Tensor]] = []
        self.receives_early = dist.get_backend(group.process_group) == "gloo"
        """Post each receive on its own, before the compute it waits behind (see the module docstring)."""

    def exchange(self, sends: list[tuple[Message, torch.Tensor]], receive: Message | None) -> torch.Tensor | None:
        """Start ``sends`` and ``receive`` in one batch; return the received tensor once it is here."""
        return self.start(sends, receive).wait()

    def start(self, sends: list[tuple[Message, torch.Tensor]], receive: Message | None) -> Receive:
        """Start ``sends`` and ``receive`` in one batch; the receive is waited for by ``Receive.wait``."""
        posted_at = time.perf_counter()
        outgoing = []
        for message, tensor in sends:
            if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
                raise RuntimeError(f"pipeline message {message} has shape {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"but every stage expects {self.shape} {self.dtype}")
            outgoing.append((tensor.detach().contiguous(), message.peer, message.tag(self.num_virtual_stages)))
        buffer, incoming = None, []
        if receive is not None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            incoming.append((buffer, receive.peer, receive.tag(self.num_virtual_stages)))
        if not outgoing and not incoming:
            return Receive()
        works = send_and_receive(outgoing, incoming, self.group)  # checked and recorded; sends first
        pending = None
        if len(works) == len(outgoing) + len(incoming):  # one handle per op (gloo): sends go on, the receive for wait()
            self.pending_sends += [(work, tensor) for work, (tensor, _, _) in zip(works, outgoing)]
            pending = works[-1] if receive is not None else None
        else:  # one handle for the whole batch (a coalescing backend)
            for work in works:
                work.wait()
        self._forget_completed_sends()
        return Receive(buffer, pending, posted_at)

    def _forget_completed_sends(self) -> None:
        self.pending_sends = [(work, tensor) for work, tensor in self.pending_sends if not work.is_completed()]

    def wait_sends(self) -> None:
        """Wait for every send still in flight (at the end of a schedule)."""
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends = []


__all__ = ["ACTIVATION", "GRADIENT", "Message", "PointToPoint", "Receive"]
