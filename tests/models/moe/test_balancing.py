"""Balance losses (micro-batch, sequence, global over gloo ranks) and the aux-loss-free expert bias."""

import pytest
import torch
import torch.distributed as dist

from meshlm.models.config import ModelConfig
from meshlm.models.moe.balancing import (global_load_balancing_loss, load_balancing_loss, sequence_load_balancing_loss,
                                         update_expert_biases)
from meshlm.models.moe.layer import MoELayer, set_load_balancing_sum
from meshlm.models.moe.router import TopKRouter
from tests.helpers.distributed import run_distributed

# Two rows of hand-made probabilities over 3 experts (sum(exp(logits)) = 4 for both):
QUARTER_HALF = [0.25, 0.5, 0.25]   # top-1 -> expert 1
HALF_QUARTER = [0.5, 0.25, 0.25]   # top-1 -> expert 0


def test_sequence_loss_on_hand_made_sequences():
    # sequence 0: tokens -> experts 1, 0; f = (1/2, 1/2, 0), P = (3/8, 3/8, 1/4): 3 * (3/16 + 3/16) = 9/8
    # sequence 1: tokens -> experts 0, 0; f = (1, 0, 0),    P = (1/2, 1/4, 1/4): 3 * 1/2           = 3/2
    probs = torch.tensor([QUARTER_HALF, HALF_QUARTER, HALF_QUARTER, HALF_QUARTER])
    expert_ids = torch.tensor([[1], [0], [0], [0]])
    assert sequence_load_balancing_loss(probs, expert_ids, 2).item() == pytest.approx((9 / 8 + 3 / 2) / 2)
    # one sequence: the micro-batch loss. f = (3/4, 1/4, 0), P = (7/16, 5/16, 1/4): 3 * 26/64 = 39/32
    assert sequence_load_balancing_loss(probs, expert_ids, 1).item() == pytest.approx(39 / 32)
    assert load_balancing_loss(probs, torch.tensor([3, 1, 0]), top_k=1).item() == pytest.approx(39 / 32)


def test_sequence_loss_with_top_2_counts_both_visits():
    probs = torch.full((4, 4), 0.25)
    expert_ids = torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3]])  # each sequence uses two experts only
    # per sequence f = (1/2, 1/2, 0, 0), P = 1/4 each: 4 * (1/8 + 1/8) = 1 (uniform P hides the skew)
    assert sequence_load_balancing_loss(probs, expert_ids, 2).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.4, 0.4, 0.1, 0.1]] * 2 + [[0.1, 0.1, 0.4, 0.4]] * 2)
    # per sequence f = (1/2, 1/2, 0, 0), P = (0.4, 0.4, ...): 4 * 0.4 = 1.6; over the batch it cancels to 1
    assert sequence_load_balancing_loss(skewed, expert_ids, 2).item() == pytest.approx(1.6)
    assert sequence_load_balancing_loss(skewed, expert_ids, 1).item() == pytest.approx(1.0)


def hand_made_layer(aux_loss_type: str) -> MoELayer:
    """hidden 3, top-1 over 3 experts: token e_0 gets logits log(1, 2, 1), token e_1 log(2, 1, 1)."""
    torch.manual_seed(0)
    layer = MoELayer(ModelConfig(pattern="E", hidden_size=3, moe_num_experts=3, moe_top_k=1, moe_ffn_hidden_size=4,
                                 moe_aux_loss_type=aux_loss_type))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, 0] = torch.log(torch.tensor([1.0, 2.0, 1.0]))
        layer.router.weight[:, 1] = torch.log(torch.tensor([2.0, 1.0, 1.0]))
    return layer


def test_layer_treats_the_batch_dimension_as_sequences():
    e0, e1 = [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]
    x = torch.tensor([[e0, e1], [e1, e1]])  # [2 sequences, 2 tokens, hidden 3]: the hand-made example above
    _, losses = hand_made_layer("sequence")(x)
    assert losses.aux_loss.item() == pytest.approx((9 / 8 + 3 / 2) / 2)
    _, losses = hand_made_layer("micro_batch")(x)
    assert losses.aux_loss.item() == pytest.approx(39 / 32)
    _, losses = hand_made_layer("global")(x)  # no process group: the micro-batch loss
    assert losses.aux_loss.item() == pytest.approx(39 / 32)


def sum_over_world(tensor: torch.Tensor) -> None:
    """What the trainer hands the models layer (there: ``collectives.summing_over(dp_cp_group)``)."""
    dist.all_reduce(tensor)


def global_loss_on_each_rank(rows_per_rank: list[list[list[float]]], ids_per_rank: list[list[int]]):
    """In each spawned rank: its share of the tokens, counts summed over the world; loss and dP."""
    rank = dist.get_rank()
    probs = torch.tensor(rows_per_rank[rank], requires_grad=True)
    counts = torch.bincount(torch.tensor(ids_per_rank[rank]), minlength=3)
    loss = global_load_balancing_loss(probs, counts, top_k=1, sum_over_ranks=sum_over_world)
    loss.backward()
    layer = hand_made_layer("global")
    set_load_balancing_sum(layer, sum_over_world)
    e0, e1 = [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]
    x = torch.tensor([[e0, e1]]) if rank == 0 else torch.tensor([[e1, e1]])
    _, layer_losses = layer(x)
    return loss.detach(), probs.grad, layer_losses.aux_loss.detach()


def test_global_loss_sums_the_counts_over_the_group_and_keeps_probabilities_local():
    rows = [[QUARTER_HALF, HALF_QUARTER], [HALF_QUARTER, HALF_QUARTER]]
    ids = [[1, 0], [0, 0]]
    results = run_distributed(global_loss_on_each_rank, 2, rows, ids)
    # global f = (3/4, 1/4, 0); rank 0: P = (3/8, 3/8, 1/4) -> 3 * (9/32 + 3/32) = 9/8
    #                           rank 1: P = (1/2, 1/4, 1/4) -> 3 * (3/8 + 1/16) = 21/16
    (loss0, grad0, layer0), (loss1, grad1, layer1) = results
    assert loss0.item() == pytest.approx(9 / 8) and loss1.item() == pytest.approx(21 / 16)
    # the mean over the ranks is the micro-batch loss of all four tokens together (39/32)
    assert ((loss0 + loss1) / 2).item() == pytest.approx(39 / 32)
    # dLoss/dP[t, i] = E * f_i / T_local: the global traffic fractions, here 3 * (3/4, 1/4, 0) / 2
    expected_grad = torch.tensor([[9 / 8, 3 / 8, 0.0]] * 2)
    torch.testing.assert_close(grad0, expected_grad)
    torch.testing.assert_close(grad1, expected_grad)
    # through the layer (the same tokens as rows/ids): the same numbers
    assert layer0.item() == pytest.approx(9 / 8) and layer1.item() == pytest.approx(21 / 16)


def make_router(**overrides) -> TopKRouter:
    values = dict(pattern="E", hidden_size=8, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8,
                  moe_score_function="sigmoid", moe_bias_update_rate=0.1)
    values.update(overrides)
    torch.manual_seed(0)
    return TopKRouter(ModelConfig(**values))


def test_bias_update_on_a_hand_made_imbalance():
    router = make_router()
    router.record_load(torch.tensor([[0, 1], [0, 1], [0, 2]]))  # loads (3, 2, 1, 0), mean 1.5
    assert update_expert_biases(router) == 1
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))
    assert router.recorded_load is None  # consumed
    update_expert_biases(router)  # nothing recorded since: all loads 0 = mean, no change
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))
    router.record_load(torch.tensor([[3, 2], [3, 1]]))  # loads (0, 1, 1, 2), mean 1: experts 1 and 2 stay
    update_expert_biases(router)
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.0, -0.1, 0.1, 0.0]))


def test_a_collapsed_router_is_rebalanced_by_the_bias_alone():
    # A zero router gives every token the same scores; ties go to the lowest experts, so all
    # tokens visit experts 0 and 1. Each update moves the choice towards the idle experts.
    router = make_router()
    with torch.no_grad():
        router.weight.zero_()
    tokens = torch.randn(64, 8)
    assert router(tokens).expert_ids.unique().tolist() == [0, 1]
    update_expert_biases(router)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))
    assert router(tokens).expert_ids.unique().tolist() == [2, 3]
    routing = router(tokens)
    torch.testing.assert_close(routing.weights, torch.full((64, 2), 0.5))  # weights ignore the bias


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_bias_balances_a_skewed_router_over_steps(score_function):
    router = make_router(moe_bias_update_rate=0.003, moe_num_experts=8, moe_score_function=score_function)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(std=0.3, generator=generator)
        router.weight[0] += 0.3  # the tokens have mean 0.5 in every channel: experts 0 and 1 win often
        router.weight[1] += 0.2
    held_out = torch.randn(2048, 8, generator=generator) + 0.5

    def imbalance() -> float:
        """max / mean tokens per expert on the held-out tokens (not recorded)."""
        router.eval()
        loads = torch.bincount(router(held_out).expert_ids.flatten(), minlength=8).float()
        router.train()
        return (loads.max() / loads.mean()).item()

    before = imbalance()
    for _ in range(200):  # "training steps": route a fresh batch, then update the biases
        router(torch.randn(512, 8, generator=generator) + 0.5)
        update_expert_biases(router)
    after = imbalance()
    assert before > 2.0 and after < 1.2, (before, after)


def test_load_is_recorded_only_when_training_with_a_rate():
    tokens = torch.randn(5, 8)
    router = make_router()
    router.eval()
    router(tokens)
    assert router.recorded_load is None
    router.train()
    router(tokens)
    router(tokens)
    assert router.recorded_load.sum().item() == 2 * 5 * 2
    router(tokens, record_load=False)  # expert parallelism records the whole micro-batch itself
    assert router.recorded_load.sum().item() == 2 * 5 * 2
    off = make_router(moe_bias_update_rate=0.0)
    off(tokens)
    assert off.recorded_load is None and update_expert_biases(off) == 0
    assert "recorded_load" not in dict(router.named_buffers())  # never part of the state dict


def biases_after_update_on_each_rank(rate: float):
    """In each spawned rank: a different hand-made load; the update uses their sum."""
    router = make_router(moe_bias_update_rate=rate)
    loads = {0: [[0, 1], [0, 1]], 1: [[0, 2], [3, 2]]}[dist.get_rank()]
    router.record_load(torch.tensor(loads))
    update_expert_biases(router, sum_over_world)
    return router.expert_bias


def test_bias_update_sums_the_loads_over_the_group():
    # summed loads (3, 2, 2, 1), mean 2: expert 0 down, 3 up, 1 and 2 unchanged -- on both ranks
    for bias in run_distributed(biases_after_update_on_each_rank, 2, 0.25):
        torch.testing.assert_close(bias, torch.tensor([-0.25, 0.0, 0.0, 0.25]))
