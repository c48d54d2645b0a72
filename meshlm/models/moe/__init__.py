"""Mixture-of-Experts: router (router.py), load balancing (balancing.py), token permutation
(dispatch.py), grouped experts (experts.py) and the block that ties them together (layer.py)."""

from meshlm.models.moe.balancing import (balance_loss, global_load_balancing_loss, load_balancing_loss, router_z_loss,
                                         sequence_load_balancing_loss, update_expert_biases)
from meshlm.models.moe.dispatch import DispatchPlan, expert_capacity, permute, plan_dispatch, unpermute
from meshlm.models.moe.experts import GroupedExperts, grouped_linear, grouped_mm_supported
from meshlm.models.moe.layer import MoELayer, set_load_balancing_sum
from meshlm.models.moe.router import MoELosses, Routing, TopKRouter, group_limited_top_k

__all__ = [
    "DispatchPlan", "GroupedExperts", "MoELayer", "MoELosses", "Routing", "TopKRouter", "balance_loss",
    "expert_capacity", "global_load_balancing_loss", "group_limited_top_k", "grouped_linear", "grouped_mm_supported",
    "load_balancing_loss", "permute", "plan_dispatch", "router_z_loss", "sequence_load_balancing_loss",
    "set_load_balancing_sum", "unpermute", "update_expert_biases",
]
