"""Mixed-precision training with fp32 master weights (Micikevicius et al. 2017).

In bf16 and fp16 runs the model's own parameters are cast to the low-precision dtype, so the
forward and backward matmuls run in it and the activations and gradients are half the size.
The optimizer never touches them. It updates an fp32 *master copy* of every parameter:

    loss -> scale_loss(loss).backward()       grads in bf16/fp16 (scaled by S for fp16)
         -> moved into master.grad as fp32    (after every backward, so micro-batches
                                                accumulate in fp32, like Megatron's main_grad)
    gradients_to_master()                     divide by S; an inf/nan global norm -> the trainer skips
    optimizer.step()                          AdamW on the fp32 masters
    master_to_model()                         cast the updated masters back into the model

The master copy matters because an update lr * m / sqrt(v) is often below the spacing of
bf16/fp16 numbers near the weight (bf16 keeps 8 significant bits): added to a low-precision
weight it would round away, and training would stall. In fp32 it accumulates.

fp16 also needs *loss scaling* (``loss_scaler.py``): its smallest normal number is 6e-5, so
small gradients underflow unless the loss is multiplied by a large S first. bf16 has fp32's
exponent range and uses S = 1. The model computes logits and the loss in fp32 itself, so no
autocast is needed; ``autocast()`` exists only as a no-op hook for callers that want one.

Bytes per parameter with Adam (plus activations, which scale with batch and sequence):

    fp32:        4 weight + 4 grad + 8 Adam moments (m, v)                        = 16
    bf16/fp16:   2 weight + 4 fp32 master + 8 moments + 4 fp32 master grad
                 (+ 2 for the low-precision grad while a backward is producing it) = 18 (20 peak)

A frozen parameter (``requires_grad`` False: the base weights under LoRA, ``meshlm/models/lora.py``)
is never updated, so it needs no master: it is its own entry in the master list, cast to the low
precision like the others, and costs 2 bytes per parameter, not 18.

So mixed precision does not save parameter memory on its own -- it saves activation memory and
time, and the 12 bytes of master state are what a distributed (sharded) optimizer splits
across data-parallel ranks (Rajbhandari et al. 2020, ZeRO).

In fp32 nothing changes: the model's parameters are the master parameters and every method
below is a no-op apart from the inf/nan check.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from meshlm.errors import CheckpointError, ConfigError
from meshlm.precision.device_defaults import resolve_dtype
from meshlm.precision.loss_scaler import DynamicLossScaler

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """``sharded_masters=True`` (a distributed optimizer will own the masters, ZeRO): the fp32
    masters are not copied here. Each master shares the fp32 model parameter's storage until
    ``hand_masters_to(owner)``: the owner copies out its DP shard, then the model's parameters are
    cast, so no rank ever holds a second full fp32 copy of its parameters."""

    def __init__(self, model: nn.Module, config, sharded_masters: bool = False):
        self.model_parameters: list[tuple[str, nn.Parameter]] = list(model.named_parameters())
        device = self.model_parameters[0][1].device if self.model_parameters else torch.device("cpu")
        dtype_name = resolve_dtype(config.dtype, device)  # the trainer resolves 'auto' itself, earlier
        if dtype_name not in DTYPES:
            raise ConfigError(f"precision.dtype={config.dtype!r} is not one of auto, {', '.join(DTYPES)}.")
        self.dtype_name = dtype_name
        self.dtype = DTYPES[dtype_name]
        self.scaler = DynamicLossScaler.from_config(config) if dtype_name == "fp16" else None
        self.master_owner = None
        """A distributed optimizer holding the masters' values sharded (see ``hand_masters_to``)."""
        self.deferred = False
        """True until ``hand_masters_to``: masters share the (still fp32) model parameters' storage."""
        self.grad_movers: dict[str, object] = {}
        """Parameter name -> the hook handle of its gradient mover."""
        self.owner_gradients: list[torch.Tensor] = []
        """ZeRO-2/3: the owner's fp32 gradient shards, which take the place of ``master.grad``."""
        if self.dtype == torch.float32:
            self.masters = self.model_parameters
            return
        self.deferred = sharded_masters
        self.masters = [(name, param if not param.requires_grad else  # frozen: it is its own master
                         nn.Parameter(param.detach().float() if sharded_masters else param.detach().float().clone()))
                        for name, param in self.model_parameters]
        for (name, param), (_, master) in zip(self.model_parameters, self.masters):
            if not sharded_masters or master is param:
                param.data = param.data.to(self.dtype)
            if master is not param:
                self.grad_movers[name] = param.register_post_accumulate_grad_hook(_grad_mover(master))

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def master_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(model parameter name, fp32 parameter the optimizer should update) pairs."""
        return list(self.masters)

    def hand_masters_to(self, owner) -> None:
        """Let a sharded optimizer own the fp32 masters' values (ZeRO-1 in bf16/fp16).

        ``owner`` (``meshlm.parallel.data.distributed_optimizer.DistributedOptimizer``) keeps only its
        DP shard of them and gathers updated values into the model itself, so ``master_to_model``
        has nothing left to do; the masters stay here as gradient holders, and ``state_dict`` /
        ``load_state_dict`` reach their values through ``owner.full_master_weights()`` /
        ``owner.load_master_weights()`` (collective over the DP group).
        """
        if self.low_precision:
            self.master_owner = owner
        for part in getattr(owner, "optimizers", [owner]):
            if self.low_precision and getattr(part.reducer, "shards_gradients", False):
                for name in part.reducer.names:  # ZeRO-2/3: the owner's hooks read the model's gradients
                    handle = self.grad_movers.pop(name, None)
                    if handle is not None:
                        handle.remove()
                self.owner_gradients.append(part.reducer.shard)
        if self.deferred:  # what the owner did not take gets its own copy now
            for (_, param), (_, master) in zip(self.model_parameters, self.masters):
                if param.dtype != self.dtype and master is not param:
                    master.data = master.data.clone()
                    param.data = param.data.to(self.dtype)
            self.deferred = False

    def autocast(self):
        """No-op: the parameters already are in the compute dtype, and the loss is fp32."""
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: times the loss scale, and nan-poisoned when not finite.

        A non-finite loss can have finite gradients (an inf added by a term whose gradient is
        zero), yet its step must be skipped on every rank. Multiplying by nan instead of 1 makes
        every gradient of this rank nan, so the global gradient norm that decides the skip (one
        all-reduce over the world) reports it to all ranks, with no extra collective and no
        host sync here. A finite loss is multiplied by exactly 1: gradients are unchanged.
        """
        loss = loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
        return loss * self.scaler.scale if self.scaler is not None else loss

    def gradients_to_master(self, check_nonfinite: bool = True) -> bool:
        """Unscale the fp32 master gradients; True if any of them holds an inf or nan.

        Gradients still left on the model (a backward without the hook, or grads written by
        hand) are moved first. The check is one fused norm per tensor and a single sync. A caller
        that takes the global gradient norm next (the trainer: it clips or logs by it) passes
        ``check_nonfinite=False``: that norm is non-finite exactly when some entry is, so the check
        would only read every gradient once more and wait for the GPU once more; False is returned.
        """
        if self.low_precision:
            for (_, param), (_, master) in zip(self.model_parameters, self.masters):
                if param.grad is not None:
                    _grad_mover(master)(param)
        grads = [master.grad for _, master in self.masters if master.grad is not None] + self.owner_gradients
        if not grads:
            return False
        if self.loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)
        if not check_nonfinite:
            return False
        # A 2-norm is non-finite exactly when some entry is (or the sum of squares overflows,
        # which the global-norm clipping would also report); unlike the inf-norm it has a fused
        # multi-tensor kernel (measured: 3 ms instead of 38 ms for a 25M-parameter model on CPU).
        norms = torch.stack(torch._foreach_norm(grads))
        return not bool(torch.isfinite(norms).all())

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Cast the (just updated) fp32 masters into the low-precision model parameters."""
        if self.low_precision and self.master_owner is None:
            pairs = [(param, master) for (_, param), (_, master) in zip(self.model_parameters, self.masters)
                     if master is not param]
            if pairs:
                torch._foreach_copy_([param for param, _ in pairs], [master for _, master in pairs])

    def update_scale(self, found_nonfinite: bool) -> None:
        """Feed one step's overflow flag to the loss scaler (fp16 only; otherwise nothing)."""
        if self.scaler is not None:
            self.scaler.update(found_nonfinite)

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Loss-scaler state and (in bf16/fp16) the fp32 master weights, for exact resumption."""
        masters = None
        if self.low_precision:
            owned = self.master_owner.full_master_weights() if self.master_owner is not None else {}
            masters = {name: owned[name] if name in owned else master.detach() for name, master in self.masters
                       if name in owned or master.requires_grad}  # a frozen parameter is in the model's state
        return {"dtype": self.dtype_name,
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "master_weights": masters}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore; call after the model's own weights are loaded.

        A state without master weights (saved by an fp32 run) re-seeds the masters from the
        model. A state with them (bf16/fp16 run) also overwrites an fp32 model's weights, so the
        bf16-rounded copy in the model checkpoint does not lose the fp32 bits.
        """
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        saved = state.get("master_weights")
        if saved is None:
            if self.low_precision:  # re-seed the masters from the model
                saved = {name: param.detach().float() for name, param in self.model_parameters}
            else:
                return
        missing = [name for name, master in self.masters if name not in saved and master.requires_grad]
        if missing:
            raise CheckpointError(f"the precision state has no master weight for {missing[0]} "
                                  f"({len(missing)} missing); it was saved for a different model.")
        if self.master_owner is not None:
            self.master_owner.load_master_weights(saved)  # keeps its shard, refreshes the model
            owned = set(self.master_owner.reducer.names)
            for (name, param), (_, master) in zip(self.model_parameters, self.masters):
                if name not in owned and master is not param and name in saved:  # not the owner's: whole here
                    master.copy_(saved[name])
                    param.copy_(master)
            return
        for name, master in self.masters:
            if master.requires_grad:  # a frozen parameter has no master of its own: the model's state holds it
                master.copy_(saved[name])
        self.master_to_model()


def _grad_mover(master: nn.Parameter):
    """A post-accumulate-grad hook: add the parameter's gradient into ``master.grad`` in fp32."""

    def move(param: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = param.grad.float() if param.grad.dtype != torch.float32 else param.grad.clone()
        else:
            master.grad.add_(param.grad)
        param.grad = None

    return move
