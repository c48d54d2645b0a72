"""Do the ranks agree on their communication? The comparison behind ``parallel.check_collectives``.

Gloo, which runs the CPU tests, forgives what NCCL does not: a rank that issues its collectives
in another order than its peers, or with other shapes, or point-to-point messages the other end
does not expect in that order, makes an NCCL job hang (or mix up data) -- typically only on
the GPUs, only at some layout, only when the router sends an expert no tokens. So under
``parallel.check_collectives`` every rank records its calls (``collective_log.py``; recorded by
``plain_collectives.py`` when issued), and at the end of every step (``Trainer.train_step``),
of every evaluation and of the run, ``compare_collectives`` all-gathers the records over the
world -- with a group view that is not recorded itself -- and checks, on every rank alike:

(a) **Same sequence in every group.** For every group, each member issued the same sequence of
    (operation, shapes, dtypes) over it. For point-to-point messages, every send from rank s to
    rank d is matched, in issue order, by a receive on d from s of the same shape, dtype and
    tag (NCCL matches messages between two ranks by issue order, ignoring tags).
(b) **No opposite orders.** For every two ranks, their calls over the groups they both belong
    to (a point-to-point pair counting as a group of two) come in the same order: no rank
    issues group A's call before group B's while the other issues B's before A's. Two ranks
    waiting in different communicators for each other is NCCL's classic deadlock. Given (a),
    this is checked by comparing each pair of ranks' whole sequences restricted to their
    shared groups: where they first differ, the two groups named there are in opposite orders.
    Two names may even be one communicator (on a world of 2 the device mesh gives dp, dp_cp
    and edp the world's process group): then opposite orders mix up data on gloo too, and (b)
    names them all the same.

An asynchronous collective counts when it is issued, which is when NCCL enqueues it. A mismatch
raises ``CollectiveMismatch`` on every rank (they all compare the same records) with one message
naming the step, the two ranks and the first diverging call; the record restarts empty after each
comparison. The checkpoint's own gloo group is not recorded: an asynchronous save issues its
collectives from a background thread while training goes on, on a communicator of its own.
"""

from __future__ import annotations

from meshlm.parallel.collective_log import Call, CollectiveMismatch
from meshlm.parallel.plain_collectives import all_gather_objects

CONSEQUENCE = {"sequence": "every member of a group must issue the same collectives with the same shapes and dtypes "
                           "in the same order, or NCCL hangs or mixes up data",
               "messages": "NCCL matches the messages between two ranks by issue order, so a mismatch hangs or "
                           "delivers the wrong tensor",
               "order": "two ranks that enter collectives of two shared groups in opposite orders can deadlock "
                        "under NCCL"}


def compare_collectives(context, when: str) -> None:
    """Compare every rank's calls since the last comparison; collective over the world (a no-op
    unless ``parallel.check_collectives``). ``when``: "after step 3", for the message."""
    log = context.collective_log
    if log is None or context.world_group is None:
        return
    records = all_gather_objects(log.take(), context.world_group.unrecorded())
    problem = first_disagreement(records)
    if problem is not None:
        raise CollectiveMismatch(f"collective check {when}: {problem}")


def first_disagreement(records: list[list[Call]]) -> str | None:
    """The first problem in the ranks' records (indexed by global rank), or None."""
    return sequence_disagreement(records) or message_disagreement(records) or order_disagreement(records)


# --- (a) the same sequence over every group ----------------------------------------------------------------

def _signature(call: Call) -> tuple:
    return call.op, call.shapes, call.dtypes


def _first_difference(left: list, right: list, signature) -> int | None:
    """Index of the first position where the two lists differ (by ``signature``), else None."""
    for index in range(max(len(left), len(right))):
        if index >= len(left) or index >= len(right) or signature(left[index]) != signature(right[index]):
            return index
    return None


def _describe_at(calls: list[Call], index: int) -> str:
    return calls[index].describe() if index < len(calls) else f"nothing (only {len(calls)} calls)"


def sequence_disagreement(records: list[list[Call]]) -> str | None:
    """(a) for collectives: the earliest call at which a member of some group differs from its first member."""
    by_group: dict[tuple, dict[int, list[Call]]] = {}
    for rank, calls in enumerate(records):
        for call in calls:
            if call.peer is None:
                by_group.setdefault(call.key(), {}).setdefault(rank, []).append(call)
    for (name, members), by_rank in sorted(by_group.items()):
        first, reference = members[0], by_rank.get(members[0], [])
        found = [(index, member) for member in members[1:]
                 if (index := _first_difference(reference, by_rank.get(member, []), _signature)) is not None]
        if found:
            index, member = min(found)
            return (f"ranks {first} and {member} diverge on group {name} (ranks {list(members)}) at its call #{index}: "
                    f"rank {first} issued {_describe_at(reference, index)}, rank {member} issued "
                    f"{_describe_at(by_rank.get(member, []), index)}; {CONSEQUENCE['sequence']}.")
    return None


def message_disagreement(records: list[list[Call]]) -> str | None:
    """(a) for point-to-point messages: the k-th send from s to d against the k-th receive on d from s."""
    channels: dict[tuple[str, int, int], tuple[list[Call], list[Call]]] = {}
    for rank, calls in enumerate(records):
        for call in calls:
            if call.peer is not None:
                source, target = (rank, call.peer) if call.op == "send" else (call.peer, rank)
                channels.setdefault((call.group, source, target), ([], []))[call.op == "recv"].append(call)
    for (name, source, target), (sends, receives) in sorted(channels.items()):
        index = _first_difference(sends, receives, lambda call: (call.shapes, call.dtypes, call.tag))
        if index is not None:
            return (f"ranks {source} and {target} diverge on their {name} messages from rank {source} to rank "
                    f"{target} at message #{index}: rank {source} sent {_describe_at(sends, index)}, rank {target} "
                    f"expected {_describe_at(receives, index)}; {CONSEQUENCE['messages']}.")
    return None


# --- (b) no two shared groups in opposite orders ----------------------------------------------------------

def order_disagreement(records: list[list[Call]]) -> str | None:
    """(b): for every two ranks, their calls over the groups they share, compared in order."""
    for first in range(len(records)):
        for second in range(first + 1, len(records)):
            shared = [[call for call in records[rank] if first in call.ranks and second in call.ranks]
                      for rank in (first, second)]
            keys = [[call.key() for call in calls] for calls in shared]
            index = _first_difference(keys[0], keys[1], lambda key: key)
            if index is not None:
                return _opposite_orders(first, second, shared, keys, index)
    return None


def _opposite_orders(first: int, second: int, shared: list[list[Call]], keys: list[list[tuple]], index: int) -> str:
    def what(side: int) -> str:
        if index >= len(keys[side]):
            return "nothing"
        key = keys[side][index]
        number = keys[side][:index].count(key)
        return f"group {key[0]} (ranks {list(key[1])}) call #{number}, {shared[side][index].describe()}"

    return (f"ranks {first} and {second} issue calls over the groups they share in opposite orders: after "
            f"{index} calls in the same order, rank {first} issued {what(0)}, while rank {second} issued "
            f"{what(1)}; {CONSEQUENCE['order']}.")


__all__ = ["compare_collectives", "first_disagreement", "message_disagreement", "order_disagreement",
           "sequence_disagreement"]
