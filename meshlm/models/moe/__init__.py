"""Mixture-of-Experts: router (router.py), token permutation (dispatch.py), grouped experts
(experts.py) and the block that ties them together (layer.py)."""

from meshlm.models.moe.dispatch import DispatchPlan, expert_capacity, permute, plan_dispatch, unpermute
from meshlm.models.moe.experts import GroupedExperts, grouped_linear, grouped_mm_supported
from meshlm.models.moe.layer import MoELayer
from meshlm.models.moe.router import MoELosses, Routing, TopKRouter, load_balancing_loss, router_z_loss

__all__ = [
    "DispatchPlan", "GroupedExperts", "MoELayer", "MoELosses", "Routing", "TopKRouter",
    "expert_capacity", "grouped_linear", "grouped_mm_supported", "load_balancing_loss", "permute",
    "plan_dispatch", "router_z_loss", "unpermute",
]
