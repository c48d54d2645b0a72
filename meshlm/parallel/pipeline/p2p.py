"""Point-to-point messages between pipeline stages: batched, tagged, with shapes known ahead.

Between virtual stages v and v + 1 travel the activations (forward) and their gradients
(backward), one tensor per micro-batch each way. Its shape is known before it is sent -- micro-
batch size x local sequence length (sequence / tp under sequence parallelism, / cp under context
parallelism) x hidden size, in the model's compute dtype -- so the receiver allocates its buffer
itself and no message ever carries a shape (no per-step handshake).

After each action the executor issues, in ONE batch (``collectives.send_and_receive``), the
send of the tensor it just produced and the receive of the tensor its next action needs, then
waits for the receive only. A send never blocks the sender: its handle (and tensor) is kept
until it completes, and all are waited for at the end of the schedule. So a rank waits only when
its next action's input has not been produced yet -- the dependency the schedule simulator
checks (``schedules.simulate``).

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

from dataclasses import dataclass

import torch

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


class PointToPoint:
    """Batched sends and receives of fixed-shape tensors over one pipeline's process group."""

    def __init__(self, group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 num_virtual_stages: int):
        self.group, self.shape, self.dtype, self.device = group, tuple(shape), dtype, device
        self.num_virtual_stages = num_virtual_stages
        self.pending_sends: list[tuple[object, torch.Tensor]] = []

    def exchange(self, sends: list[tuple[Message, torch.Tensor]], receive: Message | None) -> torch.Tensor | None:
        """Start ``sends`` and ``receive`` in one batch; return the received tensor once it is here."""
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
            return None
        works = send_and_receive(outgoing, incoming, self.group)  # sends first
        if len(works) == len(outgoing) + len(incoming):  # one handle per op (gloo): keep the sends going
            self.pending_sends += [(work, tensor) for work, (tensor, _, _) in zip(works, outgoing)]
            if receive is not None:
                works[-1].wait()
        else:  # one handle for the whole batch (a coalescing backend)
            for work in works:
                work.wait()
        self._forget_completed_sends()
        return buffer

    def _forget_completed_sends(self) -> None:
        self.pending_sends = [(work, tensor) for work, tensor in self.pending_sends if not work.is_completed()]

    def wait_sends(self) -> None:
        """Wait for every send still in flight (at the end of a schedule)."""
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends = []


__all__ = ["ACTIVATION", "GRADIENT", "Message", "PointToPoint"]
