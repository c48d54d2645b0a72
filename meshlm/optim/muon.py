"""Muon: momentum orthogonalized by Newton-Schulz, for the blocks' weight matrices; AdamW for the rest.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks") treats a
weight matrix as a linear map and steps along the *orthogonalized* momentum: with the momentum
M = U S V^T, the update is U V^T -- every singular direction moved by the same amount, so the
few directions that dominate a raw gradient no longer drown out the rest. U V^T is computed
without an SVD, by five iterations of a quintic Newton-Schulz map on X = M / ||M||_F:

    A = X X^T,   X <- a X + (b A + c A A) X,      (a, b, c) = (3.4445, -4.7750, 2.0315)

whose coefficients drive every singular value of X into about [0.7, 1.2] quickly (not exactly to
1: fast convergence near zero matters more than the final precision). Per step of a matrix W
(A x B) with gradient G, as in Liu et al. 2025 ("Muon is scalable for LLM training", the
Moonlight recipe, Algorithm 1):

    M <- mu M + G                               (fp32 momentum, mu = optim.muon_momentum)
    U  = G + mu M  (Nesterov)  or  M            (optim.muon_nesterov)
    W <- W (1 - lr wd) - lr * r sqrt(max(A, B)) * NS5(U)

An orthogonal A x B matrix has RMS 1 / sqrt(max(A, B)), so the factor r sqrt(max(A, B)) gives
every update an RMS of r (``optim.muon_update_rms``, Moonlight's 0.2, the RMS AdamW's updates
typically have): one learning rate, one weight decay and one schedule serve both optimizers,
and AdamW's hyperparameters carry over. A stacked expert weight [E, A, B] is E matrices,
orthogonalized each on its own.

**Which parameters.** Muon is for the hidden matrices: the 2-D (and stacked 3-D expert) weights
of the blocks and MTP depths -- attention q/k/v/o, MLPs, experts, Mamba-2's in/out projections,
the MTP projection. Everything else steps with AdamW exactly as ``adamw.py`` builds it (same
groups, same fused kernel): the token embedding and output head (a lookup table and a
classifier, not maps between hidden spaces), norms, biases, Mamba's A_log/D/dt_bias and its
depthwise convolution, routers. ``muon_parameter`` is the rule.

**Layouts: the single-process update at any layout.** Orthogonalizing a shard is not
orthogonalizing the matrix, so where tensor (or expert-tensor) parallelism cuts a matrix, the
momentum-updated matrices U are dealt round-robin over the ranks of the TP (ETP) group: an
all-to-all brings each matrix whole to its rank (reassembled with the shard metadata the
checkpoints use: Mamba's in_proj is [z, x, B, C, dt], each partition split on its own), which
runs Newton-Schulz on it, and a second all-to-all returns every rank its rows or columns of the
result (``meshlm/parallel/tensor/orthogonal_updates.py``): each Newton-Schulz runs once, not
once per TP rank. Replicated parameters (the KV projections when there are fewer KV heads than
TP ranks) are whole already; their partial gradients are summed over TP before the step.
Experts split over EP are whole experts on each rank: nothing to gather. Data, context and
pipeline parallelism leave each rank whole matrices (with summed gradients) and need nothing.
ZeRO cuts the flat parameter buffer at arbitrary element ranges: there the distributed
optimizer runs Distributed Muon (Liu et al. 2025, Algorithm 3; ``DistributedOptimizer.muon_update``
in ``meshlm/parallel/data/distributed_optimizer.py``): the momentum sharded like Adam's, the
directions all-gathered over DP bucket by bucket, each matrix orthogonalized by the ranks that
own a piece of it, at every ZeRO stage.

**State.** ``momentum_buffer`` (fp32, the parameter's shape) per Muon parameter -- half of
AdamW's two moments -- and AdamW's ``step``/``exp_avg``/``exp_avg_sq`` for the others. The
checkpoint stores them as ``optim/NAME/momentum_buffer`` and ``optim/NAME/exp_avg(_sq)`` in
single-process shapes (``meshlm/checkpoint/global_state.py``), so a Muon run resumes at any layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.adamw import adamw

from meshlm.optim.adamw import adamw_step_tensor, build_adamw_groups, fused_supported

NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic iteration (Jordan et al. 2024): the largest slope at zero for which
every singular value still ends in about [0.7, 1.2] after five steps."""
MUON_GROUP = "muon"
"""The name of the parameter group Muon steps; the others are AdamW's ("decay", "no_decay")."""
MOMENTUM_KEY = "momentum_buffer"
"""The state key of a Muon parameter's momentum (and its checkpoint key, ``optim/NAME/momentum_buffer``)."""
ADAMW_EXCLUDED_SUFFIXES = ("router.weight", "shared_expert_gate.weight", "conv1d.weight", "bias")
"""Matrices (or stacked filters) inside the blocks that stay with AdamW: an MoE router's logits
(a classifier over experts, sensitive to scale), the shared expert's one-row gate (a logit, not a
map between hidden spaces), Mamba's depthwise convolution (one small filter per channel) and the
stacked experts' biases ([E, F], [E, d]: one vector per expert, not a map)."""


def muon_parameter(name: str, parameter: torch.Tensor) -> bool:
    """Whether Muon steps this parameter: a trainable weight matrix (or stacked expert matrices)
    of a block or MTP depth; see the module docstring for what stays with AdamW."""
    in_blocks = name.startswith("blocks.") or name.startswith("mtp.")
    return (parameter.requires_grad and parameter.ndim in (2, 3) and in_blocks
            and not any(name.endswith(suffix) for suffix in ADAMW_EXCLUDED_SUFFIXES))


def orthogonalize(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """About U V^T of ``matrix`` = U S V^T (over its last two dims) by ``steps`` quintic
    Newton-Schulz iterations, in fp32. Runs on the wide orientation (X X^T the smaller Gram)."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = matrix.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def update_scale(shape: torch.Size, update_rms: float) -> float:
    """r sqrt(max(A, B)) for an (E x) A x B matrix: an orthogonal update's RMS brought to r."""
    return update_rms * math.sqrt(max(shape[-2], shape[-1]))


def orthogonalize_here(named: list[tuple[str, torch.Tensor]], transform) -> list[tuple[torch.Tensor, torch.Size]]:
    """[(transform(matrix), its shape)]: every matrix whole on this rank (one process)."""
    return [(transform(tensor), tensor.shape) for _, tensor in named]


class Muon(torch.optim.Optimizer):
    """Muon on the "muon" group, AdamW (torch's kernel) on the "decay" / "no_decay" groups.

    ``orthogonalize_many(named, transform) -> [(result, whole shape)]`` applies ``transform``
    (Newton-Schulz) to the whole matrix behind each (name, tensor): here, or under tensor
    parallelism each whole on one rank of the group that cuts it
    (``meshlm.parallel.tensor.orthogonal_updates.sharded_orthogonalizer``). Every rank of a TP
    group steps the same names in the same order: the groups keep the model's parameter order."""

    def __init__(self, param_groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 momentum: float, nesterov: bool, ns_steps: int, update_rms: float,
                 orthogonalize_many: Callable | None = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, update_rms=update_rms)
        super().__init__(param_groups, defaults)
        self.orthogonalize_many = orthogonalize_many or orthogonalize_here
        adamw_params = [param for group in self.param_groups if group["name"] != MUON_GROUP
                        for param in group["params"]]
        self.fused = fused_supported(adamw_params)
        for group in self.param_groups:
            group.setdefault("fused", self.fused if group["name"] != MUON_GROUP else None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["name"] == MUON_GROUP:
                self.muon_step(group)
            else:
                self.adamw_step(group)
        return loss

    def muon_step(self, group: dict) -> None:
        lr, decay, mu = group["lr"], group["weight_decay"], group["momentum"]
        stepped, directions = [], []
        for name, param in zip(group["param_names"], group["params"]):
            if param.grad is None:
                continue
            state = self.state[param]
            if MOMENTUM_KEY not in state:
                state[MOMENTUM_KEY] = torch.zeros_like(param, memory_format=torch.preserve_format)
            buffer = state[MOMENTUM_KEY]
            buffer.mul_(mu).add_(param.grad)
            stepped.append(param)
            directions.append((name, param.grad.add(buffer, alpha=mu) if group["nesterov"] else buffer))
        updates = self.orthogonalize_many(directions, lambda whole: orthogonalize(whole, group["ns_steps"]))
        for param, (update, whole_shape) in zip(stepped, updates):
            param.mul_(1 - lr * decay)
            param.add_(update.to(param.dtype), alpha=-lr * update_scale(whole_shape, group["update_rms"]))

    def adamw_step(self, group: dict) -> None:
        """torch's AdamW update for the group, with the kernel ``torch.optim.AdamW`` would choose."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "step" not in state:
                state["step"] = adamw_step_tensor(0.0, group, param)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None if group["fused"] else True,
              fused=group["fused"] or None, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def build_muon(parameters_by_name: list[tuple[str, torch.nn.Parameter]], config,
               orthogonalize_many: Callable | None = None) -> Muon:
    """Muon over the blocks' matrices of ``parameters_by_name`` (decayed with optim.weight_decay),
    AdamW's "decay" / "no_decay" groups (``adamw.build_adamw_groups``) over the rest."""
    muon = [(name, param) for name, param in parameters_by_name if muon_parameter(name, param)]
    chosen = {id(param) for _, param in muon}
    rest = [(name, param) for name, param in parameters_by_name if id(param) not in chosen]
    groups = [{"name": MUON_GROUP, "params": muon, "weight_decay": config.weight_decay}] if muon else []
    groups += build_adamw_groups(rest, config)
    return Muon(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                momentum=config.muon_momentum, nesterov=config.muon_nesterov, ns_steps=config.muon_ns_steps,
                update_rms=config.muon_update_rms, orthogonalize_many=orthogonalize_many)


__all__ = ["MOMENTUM_KEY", "MUON_GROUP", "Muon", "build_muon", "muon_parameter", "orthogonalize", "orthogonalize_here",
           "update_scale"]
