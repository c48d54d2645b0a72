"""AdamW with two parameter groups: matrices decay, everything else does not.

AdamW (Loshchilov & Hutter 2019) applies weight decay as its own step, w <- w - lr * wd * w,
instead of adding wd * w to the gradient where Adam's per-coordinate scaling would distort it.
Decay is a prior that pulls weights towards zero; it makes sense for the matrices that mix
features, and little sense for:

- the token embedding (its rows are looked up, so a rare token's row would mostly shrink;
  an *untied* output head is an ordinary projection and does decay),
- norm weights (they are gains around 1, and decaying them fights the normalization),
- biases and other 1-D parameters (Mamba's A_log, D and dt_bias set time scales).

This is the split GPT-3-style recipes use (nanoGPT, OLMo, Megatron's default minus the
embedding). ``OptimConfig.decay_embeddings_norms_biases`` puts everything into the decay group.
The groups carry a ``name`` ("decay" / "no_decay") and torch's ``param_names``, for logging
and for reading optimizer checkpoints.

The update runs in torch's fused AdamW kernel where it exists (CPU, CUDA): the same math as the
multi-tensor version in one pass per tensor, several times faster on CPU.

The parameters may be the fp32 master copies of a mixed-precision run, so the caller passes
(model name, parameter) pairs: the names decide the groups, the tensors are what gets updated.
"""

from __future__ import annotations

import torch

EMBEDDING_NAMES = ("embedding.weight", "position_embedding.weight")
"""Names (or dotted-name suffixes) of embedding tables (tokens; learned positions); the tied head
shares the first."""


def decays(name: str, parameter: torch.Tensor) -> bool:
    """Whether weight decay applies to this parameter by default: matrices, not embeddings, and not
    biases -- the stacked experts' biases (``experts.down_bias`` [E, d]) are matrices only in shape."""
    is_embedding = any(name == suffix or name.endswith("." + suffix) for suffix in EMBEDDING_NAMES)
    return parameter.ndim >= 2 and not is_embedding and not name.endswith("bias")


def build_adamw_groups(parameters_by_name: list[tuple[str, torch.nn.Parameter]], config) -> list[dict]:
    """The "decay" and "no_decay" parameter groups (empty ones left out) of the trainable parameters,
    each holding (name, parameter) pairs (torch keeps the names as the group's ``param_names``)."""
    groups = {"decay": [], "no_decay": []}
    for name, parameter in parameters_by_name:
        if not parameter.requires_grad:
            continue
        in_decay = config.decay_embeddings_norms_biases or decays(name, parameter)
        groups["decay" if in_decay else "no_decay"].append((name, parameter))
    return [{"name": group_name, "params": members,
             "weight_decay": config.weight_decay if group_name == "decay" else 0.0}
            for group_name, members in groups.items() if members]


def build_adamw(parameters_by_name: list[tuple[str, torch.nn.Parameter]], config) -> torch.optim.AdamW:
    """AdamW over ``parameters_by_name`` with a "decay" and a "no_decay" group (empty ones left out)."""
    param_groups = build_adamw_groups(parameters_by_name, config)
    fused = fused_supported([parameter for group in param_groups for _, parameter in group["params"]])
    return torch.optim.AdamW(param_groups, lr=config.lr, betas=(config.beta1, config.beta2),
                             eps=config.eps, fused=fused or None, foreach=None if fused else True)


def adamw_step_tensor(step: float, group: dict, param: torch.Tensor) -> torch.Tensor:
    """A torch AdamW's step count as its own first step makes it: on the parameter's device for the
    fused or capturable kernels (the fused CUDA kernel refuses a CPU step), else on the CPU."""
    on_parameter_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=param.device if on_parameter_device else "cpu")


def fused_supported(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW kernel (one pass over each tensor) runs on CPU and CUDA for floating
    tensors; measured on CPU for 24M fp32 parameters it steps in 13 ms against 76-165 ms for the
    multi-tensor (foreach) version. Elsewhere (other devices) the foreach version is used."""
    return bool(params) and all(param.device.type in ("cpu", "cuda") and param.is_floating_point()
                                for param in params)
