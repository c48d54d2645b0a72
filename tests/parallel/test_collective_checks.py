"""The collectives' checks: a tensor off the run's device is refused, and ``parallel.check_collectives``
finds ranks whose collectives disagree (meshlm/parallel/collective_checks.py).

Planted on real gloo ranks, in ways gloo survives (NCCL would not): two ranks issuing
asynchronous all-reduces over two shared groups in opposite orders; a member issuing a
different shape over a group; a message received as another shape than it was sent. Each must
stop with one message naming the step, the two ranks and the first diverging call. A CPU tensor
handed to a collective of a context whose run device is ``meta`` is refused naming the
operation, the group and the tensor. The comparison itself is also checked on hand-made records.
And the checker finds what the fixed launch order of the gradient buckets prevents: two ranks
whose dense and expert gradients arrive in different orders launch their dp_cp and edp buckets
in opposite orders, unless the two reducers share one order (``ReducerGroup``).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshlm
from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.parallel.collective_checks import compare_collectives, first_disagreement
from meshlm.parallel.collective_log import Call, CollectiveMismatch, WrongDevice
from meshlm.parallel.collectives import all_reduce_, reduce_from_group, send_and_receive
from meshlm.parallel.data.expert_data_parallel import ReducerGroup, expert_data_context
from meshlm.parallel.data.grad_reducer import GradientReducer
from meshlm.parallel.groups import group_of
from meshlm.parallel.mesh import build_parallel_context
from tests.helpers.distributed import run_distributed

CPU = torch.device("cpu")


def checked_context():
    """Pure data parallelism over the spawned world, with check_collectives on."""
    return build_parallel_context(ParallelConfig(check_collectives=True), ModelConfig(pattern="*-"), CPU)


def mismatch_message(context, when: str) -> str:
    with pytest.raises(CollectiveMismatch) as error:
        compare_collectives(context, when)
    return str(error.value)


# --- planted on real ranks -----------------------------------------------------------------------------

def opposite_orders() -> str:
    """Rank 0 all-reduces over group a then b, rank 1 over b then a (asynchronous: gloo gets through)."""
    context = checked_context()
    first, second = (group_of(dist.new_group([0, 1]), name, CPU, context.collective_log) for name in ("a", "b"))
    all_reduce_(torch.ones(3), context.dp_group)  # the same on both ranks: fine
    order = (first, second) if context.rank == 0 else (second, first)
    works = [all_reduce_(torch.ones(4), group, async_op=True) for group in order]
    for work in works:
        work.wait()
    return mismatch_message(context, "after step 7")


def test_opposite_orders_over_two_shared_groups_stop_the_run():
    for message in run_distributed(opposite_orders, 2):
        assert message.startswith("collective check after step 7: ranks 0 and 1 issue calls over the groups they "
                                  "share in opposite orders"), message
        assert "after 1 calls in the same order" in message, message
        assert "rank 0 issued group a (ranks [0, 1]) call #0, all_reduce [(4)] float32" in message, message
        assert "rank 1 issued group b (ranks [0, 1]) call #0, all_reduce [(4)] float32" in message, message
        assert "deadlock" in message and "\n" not in message


def other_shape_and_message() -> list[str]:
    """Over dp, rank 1 all-reduces a (2, 3) where rank 0 all-reduces a (6,) (same bytes: gloo does not
    notice); then the same sequence but a message received as (3, 2) that was sent as (2, 3)."""
    context = checked_context()
    all_reduce_(torch.ones(6) if context.rank == 0 else torch.ones(2, 3), context.dp_group)
    messages = [mismatch_message(context, "after step 2")]
    pipe = dataclasses.replace(context.dp_group, name="pp")
    peer = 1 - context.rank
    if context.rank == 0:
        works = send_and_receive([(torch.ones(2, 3), peer, 5)], [], pipe)
    else:
        works = send_and_receive([], [(torch.empty(3, 2), peer, 5)], pipe)
    for work in works:
        work.wait()
    messages.append(mismatch_message(context, "after step 3"))
    all_reduce_(torch.ones(2), context.dp_group)
    compare_collectives(context, "after step 4")  # agrees again: no error
    return messages


def test_a_different_shape_or_message_stops_the_run():
    for sequence, message in run_distributed(other_shape_and_message, 2):
        assert sequence == ("collective check after step 2: ranks 0 and 1 diverge on group dp (ranks [0, 1]) at its "
                            "call #0: rank 0 issued all_reduce [(6)] float32, rank 1 issued all_reduce [(2, 3)] "
                            "float32; every member of a group must issue the same collectives with the same shapes "
                            "and dtypes in the same order, or NCCL hangs or mixes up data."), sequence
        assert message.startswith("collective check after step 3: ranks 0 and 1 diverge on their pp p2p messages "
                                   "from rank 0 to rank 1 at message #0: rank 0 sent send [(2, 3)] float32 to rank 1 "
                                   "(tag 5), rank 1 expected recv [(3, 2)] float32 from rank 0 (tag 5)"), message


def cpu_tensors_on_a_meta_run() -> list[str]:
    """A context whose run device is ``meta``: every collective refuses the CPU tensors handed to it."""
    real = checked_context()
    meta = torch.device("meta")
    context = dataclasses.replace(real, device=meta, dp_group=dataclasses.replace(real.dp_group, device=meta))
    messages = []
    for call in (lambda: all_reduce_(torch.ones(2, 3), context.dp_group),
                 lambda: reduce_from_group(torch.ones(4, requires_grad=True), context.dp_group),
                 lambda: send_and_receive([(torch.ones(5), 1 - context.rank, 3)], [], context.dp_group)):
        with pytest.raises(WrongDevice) as error:
            call()
        messages.append(str(error.value))
    assert real.collective_log.take() == [], "a refused call is not issued, so not recorded"
    return messages


def test_a_cpu_tensor_is_refused_by_a_collective_of_a_meta_run():
    for reduced, autograd, sent in run_distributed(cpu_tensors_on_a_meta_run, 2):
        assert reduced == ("all_reduce over group dp (ranks [0, 1]): the reduced tensor (shape (2, 3), torch.float32) "
                           "is on cpu, but this run's device is meta; create it on the run's device (context.device): "
                           "NCCL moves only tensors on its rank's GPU."), reduced
        assert autograd.startswith("all_reduce over group dp (ranks [0, 1]): the reduced tensor (shape (4,)"), autograd
        assert sent.startswith("send over group dp (ranks [0, 1]): the sent (peer ") and "shape (5,)" in sent, sent


# --- one place ------------------------------------------------------------------------------------------

COMMUNICATION = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                 "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
                 "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp",
                 "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "gather",
                 "scatter", "reduce"}
"""torch.distributed's functions that move data between ranks."""


def test_only_plain_collectives_calls_torch_distributed_communication():
    """Every collective is checked because every one goes through meshlm/parallel/plain_collectives.py."""
    found = []
    for path in sorted(Path(meshlm.__file__).parent.rglob("*.py")):
        if path.name == "plain_collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in COMMUNICATION
                    and ast.unparse(node.value) in ("dist", "torch.distributed")):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                found += [f"{path.name}:{node.lineno} imports {alias.name}" for alias in node.names
                          if alias.name in COMMUNICATION]
    assert found == [], found


# --- the comparison on hand-made records ---------------------------------------------------------------

def call(group: str, ranks, op: str = "all_reduce", shape=(4,), peer=None, tag=None) -> Call:
    return Call(group, tuple(ranks), op, (shape,), ("float32",), peer, tag)


def test_agreeing_records_pass_and_each_kind_of_disagreement_is_named():
    tp0, tp1, dp = call("tp", (0, 1)), call("tp", (0, 1)), call("dp", (0, 2))
    send, receive = call("pp p2p", (0, 2), "send", peer=2, tag=1), call("pp p2p", (0, 2), "recv", peer=0, tag=1)
    agreeing = [[tp0, dp, send], [tp1], [dp, receive]]
    assert first_disagreement(agreeing) is None
    missing = first_disagreement([[tp0, dp, send], [], [dp, receive]])
    assert "ranks 0 and 1 diverge on group tp" in missing and "rank 1 issued nothing (only 0 calls)" in missing
    wrong_tag = first_disagreement([[tp0, dp, send], [tp1], [dp, receive._replace(tag=2)]])
    assert "from rank 0 to rank 2 at message #0" in wrong_tag
    swapped = first_disagreement([[tp0, dp, send], [tp1], [receive, dp]])
    assert swapped.startswith("ranks 0 and 2 issue calls over the groups they share in opposite orders: after 0 calls")
    assert "rank 0 issued group dp (ranks [0, 2]) call #0" in swapped
    assert "rank 2 issued group pp p2p (ranks [0, 2]) call #0, recv [(4)] float32 from rank 0 (tag 1)" in swapped
    uneven = call("ep", (0, 1), "all_to_all(uneven)", shape=(None, 8))
    assert first_disagreement([[uneven], [uneven]]) is None


# --- the gradient buckets' fixed launch order ------------------------------------------------------------

def buckets_when_gradients_arrive_in_other_orders(merged: bool) -> tuple[bool, str | None]:
    """Dense parameters reduced over dp_cp and "experts" over edp (the same two ranks), one parameter
    per bucket; the gradients arrive in backward order on rank 0 and dense-first on rank 1.
    ``merged``: the reducers share ReducerGroup's launch order; else each keeps its own. Returns
    (every gradient summed correctly, the checker's message or None)."""
    context = checked_context()
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(6)]  # even: dense, odd: experts, as in an MoE model
    parts = ((range(0, 6, 2), context), (range(1, 6, 2), expert_data_context(context)))
    reducers = [GradientReducer([(f"p{index}", params[index]) for index in indices], part_context, bucket_size_mb=1e-6)
                for indices, part_context in parts]
    finish = ReducerGroup(reducers, params).finish if merged else lambda: [reducer.finish() for reducer in reducers]
    for reducer in reducers:
        reducer.zero_grad()
    for index in ([5, 4, 3, 2, 1, 0] if context.rank == 0 else [4, 2, 0, 5, 3, 1]):
        params[index].grad = torch.full((4,), float(index))
        reducer = reducers[index % 2]
        reducer._ready_hook(index // 2)(params[index])  # what autograd's post-accumulate hook calls
    finish()
    summed = all(torch.equal(param.grad, torch.full((4,), 2.0 * index)) for index, param in enumerate(params))
    try:
        compare_collectives(context, "after step 1")
    except CollectiveMismatch as error:
        return summed, str(error)
    return summed, None


def test_dense_and_expert_buckets_launch_in_one_order_whatever_order_the_gradients_arrive_in():
    assert run_distributed(buckets_when_gradients_arrive_in_other_orders, 2, True) == [(True, None)] * 2
    # Each reducer in its own order: on a world of 2, dp_cp and edp are the same process group (the
    # device mesh reuses the world's), so gloo sums each bucket with whatever the peer launched at
    # the same position -- wrong sums -- and the checker names the opposite orders.
    for summed, message in run_distributed(buckets_when_gradients_arrive_in_other_orders, 2, False):
        assert not summed
        assert "ranks 0 and 1 issue calls over the groups they share in opposite orders" in message, message
        assert "group edp (ranks [0, 1]) call #0" in message and "group dp_cp (ranks [0, 1]) call #0" in message
