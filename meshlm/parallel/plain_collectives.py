"""The plain collectives and point-to-point messages: the only calls of torch.distributed's
communication functions in meshlm, each one checked.

Everything that moves data between ranks comes here -- the autograd pairs of ``collectives.py``,
the gradient buckets of data parallelism, the pipeline's messages, context parallelism's ring,
the loss sums, the checkpoints' object exchanges -- so that each call is checked in one place
(callers import these from ``meshlm.parallel.collectives``). Every function takes a ``Group``
(``groups.py``) and, before it issues anything:

* refuses a tensor that does not live on the group's device -- the run's -- with a
  ``WrongDevice`` error naming the operation, the group and the tensor (always on: it costs a
  comparison of two devices);
* appends a ``Call`` (group, operation, shapes, dtypes) to the run's ``CollectiveLog`` when
  ``parallel.check_collectives`` is on (the group carries the log; ``collective_log.py``).

A group of None (one rank) makes every function a no-op. The ``torch.distributed`` functions
are looked up at call time (``dist.all_reduce``, not an imported name) so that
``meshlm.parallel.comm_log.record_communication`` can count them.

Object collectives (``all_gather_objects``, ``broadcast_objects``, ``gather_objects``) pickle
Python objects into byte tensors on the device torch picks for the backend: the CPU for gloo,
the *current* CUDA device for NCCL. So they run with the group's device made current, whatever
device another part of the program left current.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from meshlm.parallel.collective_log import Call, WrongDevice
from meshlm.parallel.communication_waits import watched
from meshlm.parallel.groups import Group, on_device
from meshlm.parallel.simulated_link import delayed

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# --- the checks every call goes through -------------------------------------------------------------

def _refuse_off_device(op: str, group: Group, tensors: dict[str, torch.Tensor]) -> None:
    for role, tensor in tensors.items():
        if not on_device(group.device, tensor):
            raise WrongDevice(f"{op} over group {group.describe()}: the {role} tensor (shape {tuple(tensor.shape)}, "
                              f"{tensor.dtype}) is on {tensor.device}, but this run's device is {group.device}; "
                              f"create it on the run's device (context.device): NCCL moves only tensors on "
                              f"its rank's GPU.")


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _checked(op: str, group: Group, tensors: dict[str, torch.Tensor], shapes=None) -> None:
    """Refuse a tensor off the group's device; record the call. ``shapes`` overrides the
    recorded shapes (None for a size that may differ between ranks)."""
    _refuse_off_device(op, group, tensors)
    if group.log is not None:
        shapes = tuple(tuple(tensor.shape) for tensor in tensors.values()) if shapes is None else tuple(shapes)
        group.log.record(Call(group.name, group.ranks, op, shapes, tuple(_dtype(t) for t in tensors.values())))


def _over_link(group: Group, op: str, tensor: torch.Tensor, issued: float, work, async_op: bool):
    """The collective's result, held back by the group's simulated link (``parallel.simulate_link``);
    an asynchronous handle's ``wait()`` counted as a wait (``Group.waits``)."""
    if group.link is not None:
        work = delayed(group.link, op, tensor.numel() * tensor.element_size(), group.size, issued, work, async_op)
    return watched(work, group.waits, group.name) if async_op else work


def _issued(group: Group, op: str, tensor: torch.Tensor, async_op: bool, start):
    """``start()`` (the torch.distributed call), counted as a wait while it blocks and held back by
    the group's simulated link; ``tensor`` is the one whose bytes the link carries."""
    issued = time.perf_counter()
    with _waiting(group, async_op):
        return _over_link(group, op, tensor, issued, start(), async_op)


def _waiting(group: Group, async_op: bool = False):
    """A synchronous call counted as a wait on its group from issue to return (``Group.waits``:
    the power timeline and the power floor; ``communication_waits.py``)."""
    if group.waits is None or async_op:
        return contextlib.nullcontext()
    return group.waits.waiting(group.name)


def _quiet(group: Group | None) -> bool:
    return group is None or group.size == 1


# --- tensors --------------------------------------------------------------------------------------------

def all_reduce_(tensor: torch.Tensor, group: Group | None, op: str = "sum", async_op: bool = False):
    """Reduce ``tensor`` over the group in place (``op``: sum, max or min); returns the work
    handle when ``async_op``."""
    if _quiet(group):
        return None
    _checked("all_reduce" if op == "sum" else f"all_reduce({op})", group, {"reduced": tensor})
    return _issued(group, "all_reduce", tensor, async_op,
                   lambda: dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group.process_group, async_op=async_op))


def all_gather_into_(output: torch.Tensor, input: torch.Tensor, group: Group | None, async_op: bool = False):
    """Every rank's ``input`` concatenated along dim 0, in group-rank order, into ``output``."""
    if _quiet(group):
        output.copy_(input.reshape(output.shape))
        return None
    _checked("all_gather", group, {"output": output, "input": input})
    # torch 2.13 renamed the single-tensor all-gather (the old name warns); older torch has only the old one.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _issued(group, "all_gather", output, async_op,
                   lambda: gather(output, input, group=group.process_group, async_op=async_op))


def reduce_scatter_into_(output: torch.Tensor, input: torch.Tensor, group: Group | None, async_op: bool = False):
    """The sum of ``input`` over the group, of which this rank keeps its slice (dim 0) in ``output``."""
    if _quiet(group):
        output.copy_(input.reshape(output.shape))
        return None
    _checked("reduce_scatter", group, {"output": output, "input": input})
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _issued(group, "reduce_scatter", input, async_op,
                   lambda: scatter(output, input, group=group.process_group, async_op=async_op))


def all_to_all_(output: torch.Tensor, input: torch.Tensor, group: Group | None, output_splits: list[int] | None = None,
                input_splits: list[int] | None = None, async_op: bool = False):
    """Rows of ``input`` cut into consecutive pieces (equal, or ``input_splits``), piece j to rank
    j; the pieces received land in ``output`` in rank order. Uneven splits differ between ranks,
    so only the rows' trailing shape is compared across ranks."""
    if _quiet(group):
        output.copy_(input)
        return None
    uneven = output_splits is not None or input_splits is not None
    shapes = [(None, *output.shape[1:]), (None, *input.shape[1:])] if uneven else None
    _checked("all_to_all(uneven)" if uneven else "all_to_all", group, {"output": output, "input": input}, shapes)
    return _issued(group, "all_to_all", input, async_op,
                   lambda: dist.all_to_all_single(output, input, output_splits, input_splits,
                                                  group=group.process_group, async_op=async_op))


def barrier(group: Group | None) -> None:
    """Wait until every rank of the group has arrived."""
    if _quiet(group):
        return
    _checked("barrier", group, {})
    device_ids = [group.device.index] if group.device.type == "cuda" and group.device.index is not None else None
    with _waiting(group):
        dist.barrier(group=group.process_group, device_ids=device_ids)


def send_and_receive(sends: list[tuple[torch.Tensor, int, int]], receives: list[tuple[torch.Tensor, int, int]],
                     group: Group) -> list:
    """Start (tensor, peer, tag) sends and receives (peers: global ranks) in one batch; returns
    torch's work handles, sends first (one per operation, or a single one on a backend that
    coalesces the batch). Each message is recorded on its pair of ranks ("<group> p2p").
    A message's tensor must be contiguous."""
    messages = [("send", dist.isend, *send) for send in sends] + [("recv", dist.irecv, *got) for got in receives]
    for kind, _, tensor, peer, tag in messages:  # all checked before any is recorded or issued
        role = f"{'sent' if kind == 'send' else 'received'} (peer {peer}, tag {tag})"
        _refuse_off_device(kind, group, {role: tensor})
    me = group.ranks[group.rank]
    for kind, _, tensor, peer, tag in messages if group.log is not None else ():
        group.log.record(Call(f"{group.name} p2p", tuple(sorted((me, peer))), kind, (tuple(tensor.shape),),
                              (_dtype(tensor),), peer, tag))
    staged = _needs_host_staging(group, [tensor for _, _, tensor, _, _ in messages])
    wire = [tensor if not staged else tensor.cpu() if kind == "send" else torch.empty_like(tensor, device="cpu")
            for kind, _, tensor, _, _ in messages]  # the bytes gloo reads (sends) or writes (receives)
    operations = [dist.P2POp(function, on_wire, peer, group.process_group, tag)
                  for (_, function, _, peer, tag), on_wire in zip(messages, wire)]
    works = dist.batch_isend_irecv(operations) if operations else []
    if staged:  # gloo: one handle per operation, in the order given
        works = [_StagedMessage(work, host, tensor if kind == "recv" else None)
                 for work, host, (kind, _, tensor, _, _) in zip(works, wire, messages)]
    return [watched(work, group.waits, group.name) for work in works]  # each wait() counted (Group.waits)


def _needs_host_staging(group: Group, tensors: list[torch.Tensor]) -> bool:
    """gloo's send and receive hand the tensor's data pointer straight to its TCP transport, which
    can only read and write host memory; its collectives copy CUDA tensors through the host
    themselves, its point-to-point messages do not. So on gloo (several ranks sharing one GPU,
    where NCCL refuses) a CUDA message goes through a host copy."""
    return (any(tensor.is_cuda for tensor in tensors) and group.process_group is not None
            and dist.get_backend(group.process_group) == "gloo")


class _StagedMessage:
    """A gloo message staged through a host tensor: it keeps the host copy alive until the
    message has left, and a receive's ``wait()`` copies the received bytes into its CUDA tensor."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor | None):
        self.work, self.host, self.target = work, host, target

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        if self.target is not None:
            self.target.copy_(self.host)
            self.target = None
        return result

    def is_completed(self) -> bool:
        return self.work.is_completed() and self.target is None


# --- Python objects (through the CPU on gloo, the current GPU on NCCL) ---------------------------------------

def _object_device(group: Group):
    """NCCL's object collectives stage bytes on the current CUDA device: make it the group's."""
    return torch.cuda.device(group.device) if group.device.type == "cuda" else contextlib.nullcontext()


def all_gather_objects(obj, group: Group | None) -> list:
    """Every rank's picklable ``obj``, in group-rank order."""
    if _quiet(group):
        return [obj]
    _checked("all_gather_object", group, {})
    everyone = [None] * group.size
    with _object_device(group), _waiting(group):
        dist.all_gather_object(everyone, obj, group=group.process_group)
    return everyone


def broadcast_objects(objects: list, group: Group | None, source: int = 0) -> list:
    """The list ``objects`` of group rank ``source``, in place on every rank (same length everywhere)."""
    if _quiet(group):
        return objects
    _checked("broadcast_object", group, {}, shapes=[(len(objects),)])
    with _object_device(group), _waiting(group):
        dist.broadcast_object_list(objects, group=group.process_group, group_src=source)
    return objects


def gather_objects(obj, group: Group | None, destination: int = 0) -> list | None:
    """Every rank's ``obj`` in group-rank order on group rank ``destination``; None elsewhere."""
    if _quiet(group):
        return [obj]
    _checked("gather_object", group, {})
    gathered = [None] * group.size if group.rank == destination else None
    with _object_device(group), _waiting(group):
        dist.gather_object(obj, gathered, group=group.process_group, group_dst=destination)
    return gathered


__all__ = ["REDUCE_OPS", "all_gather_into_", "all_gather_objects", "all_reduce_", "all_to_all_", "barrier",
           "broadcast_objects", "gather_objects", "reduce_scatter_into_", "send_and_receive"]
