"""Low-communication data parallelism: local SGD, DiLoCo and PALSGD (``parallel.dp_sync``).

Data parallelism (``data_parallel.py``) sums every gradient over the DP ranks every step. Across a
slow link -- data centres, weak inter-node networks -- that reduction dominates the step. The
methods here let each DP *replica* (a whole TP x PP x CP model group) take ``parallel.sync_every``
= H optimizer steps on its own data with no DP communication at all ("inner" steps: the gradient
is the replica's own mean, its AdamW state its own), and reconcile the replicas only every H-th
step:

* ``local_sgd`` (Stich 2019; Lin et al. 2020): the parameters are averaged over DP.
* ``diloco`` (Douillard et al. 2023): the *outer gradient* is the DP average of
  (global parameters - replica parameters), the change the replicas made since the last sync, and
  an outer optimizer -- Nesterov-momentum SGD, ``parallel.outer_lr`` 0.7 and
  ``parallel.outer_momentum`` 0.9 as published -- updates the global copy, which every replica
  then loads. Outer lr 1 without momentum is local SGD again.
* ``palsgd`` (pseudo-asynchronous local SGD): after ``parallel.palsgd_warmup`` ordinary DDP steps,
  each inner step is, with probability p = ``parallel.palsgd_p``, a *pseudo-synchronization*: the
  replica is pulled toward its last global copy, theta <- theta - (lr / p) eta (theta - theta_global)
  with eta = ``parallel.palsgd_eta``, with no forward, backward or communication (and no data);
  otherwise an ordinary inner step with its learning rate scaled by 1 / (1 - p). Every H steps
  after the warm-up, the DiLoCo outer step. The draw of step s on replica r is a fixed function of
  (train.seed, r, s) -- no generator state to save, the same draws after a resume.

Local SGD and DiLoCo may start the same way: ``parallel.local_warmup`` ordinary DDP steps first
(post-local SGD, Lin et al. 2020: the replicas' early steps, under a fresh optimizer and a
warming learning rate, are the ones that drift apart most), the global copy taken at its end.

The outer step in bytes. The deltas are reduce-scattered (each rank receives the DP sum of its
1/dp slice), the owner applies the outer optimizer to its slice -- so the outer momentum is
sharded over DP like ZeRO-1's optimizer state -- and the slices' *updates* are all-gathered, so
every replica subtracts the same values from its whole global copy. Together that is one
all-reduce's bytes, 2 (dp-1)/dp x 4 bytes per parameter, once per H steps;
``parallel.outer_sync_dtype=bf16`` sends the deltas and the updates in bf16 (half the bytes; the
values sent are small differences, not the parameters, so bf16's 8 bits of mantissa cost little),
and every replica applies the same rounded update, so the global copies stay identical.

The global copy is kept whole on every replica (4 bytes per parameter): the deltas are taken
against it, and PALSGD's pull reads it at any step without communication. Local SGD needs no
copy: it averages the parameters themselves (in fp32).

Overlap (``parallel.outer_overlap``, Streaming DiLoCo's one-step-stale sync, Douillard et al.
2025): at the sync step the replicas' messages -- changes for DiLoCo/PALSGD, parameters for
local SGD -- go into one asynchronous all-reduce, and the next inner step runs meanwhile; after
it, each replica applies the outer step to the global copy (every rank the whole of it, so the
outer momentum is not sharded in this mode) and loads the new global copy *plus its own progress
since the sync* (theta_now - theta_at_sync). The last step of a run syncs without overlap, so a
run still ends with one model. A checkpoint written while a sync is pending waits for the
all-reduce (its result does not depend on when it is read) and stores the reduced message and
each replica's anchor theta_at_sync, so a resume applies the same sync after the same step.

The parameters reconciled are the fp32 values the inner optimizer updates (the model's own
parameters in fp32, ``MixedPrecision``'s masters otherwise), of this rank's TP/PP/CP shard: the
ranks of one DP group hold the same shard, so each DP group syncs independently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

from meshlm.errors import ConfigError, check_choice
from meshlm.parallel.collectives import all_gather_into_, all_reduce_, reduce_scatter_into_
from meshlm.parallel.simulated_link import parse_link

DP_SYNC_MODES = ("every_step", "local_sgd", "diloco", "palsgd")
OUTER_OPTIMIZERS = ("nesterov", "sgd")
SYNC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_dp_sync(parallel) -> None:
    """parallel.dp_sync and its settings, refused at start-up with the field and the fix (called by
    ``meshlm.parallel.mesh.check_layout``)."""
    parse_link(parallel.simulate_link)  # refuses a malformed value
    check_choice("parallel.dp_sync", parallel.dp_sync, DP_SYNC_MODES)
    check_choice("parallel.outer_optimizer", parallel.outer_optimizer, OUTER_OPTIMIZERS)
    check_choice("parallel.outer_sync_dtype", parallel.outer_sync_dtype, tuple(SYNC_DTYPES))
    if not isinstance(parallel.sync_every, int) or parallel.sync_every < 1:
        raise ConfigError(f"parallel.sync_every={parallel.sync_every!r} must be a positive integer (steps between "
                          "outer synchronizations).")
    if not parallel.outer_lr > 0 or not 0 <= parallel.outer_momentum < 1:
        raise ConfigError(f"parallel.outer_lr={parallel.outer_lr} must be > 0 and parallel.outer_momentum="
                          f"{parallel.outer_momentum} in [0, 1) (DiLoCo: 0.7 and 0.9).")
    if not 0 < parallel.palsgd_p < 1 or not parallel.palsgd_eta > 0:
        raise ConfigError(f"parallel.palsgd_p={parallel.palsgd_p} must be in (0, 1) and parallel.palsgd_eta="
                          f"{parallel.palsgd_eta} > 0 (the authors' 0.2 and 1.0).")
    for name in ("palsgd_warmup", "local_warmup"):
        value = getattr(parallel, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"parallel.{name}={value!r} must be an integer >= 0.")
    if parallel.dp_sync == "palsgd" and parallel.local_warmup:
        raise ConfigError(f"parallel.local_warmup={parallel.local_warmup} is for local_sgd and diloco; PALSGD's "
                          "DDP warm-up is parallel.palsgd_warmup: set that instead (and local_warmup=0).")
    if parallel.dp_sync == "every_step":
        return
    if parallel.sharding_stage > 0:
        raise ConfigError(f"parallel.dp_sync={parallel.dp_sync} keeps a whole optimizer state on every replica; "
                          f"parallel.zero_stage={parallel.sharding_stage} shards it over DP, which needs DP "
                          "communication every step: set parallel.zero_stage=0 and distributed_optimizer=false.")
    if parallel.ep > 1:
        raise ConfigError(f"parallel.dp_sync={parallel.dp_sync} with parallel.ep={parallel.ep}: expert parallelism "
                          "folds its groups over the DP ranks, so a replica is not one model group; use "
                          "parallel.ep=1 (experts are then replicated and synced like every weight).")
    if parallel.dp_sync == "local_sgd" and parallel.outer_sync_dtype != "fp32":
        raise ConfigError("parallel.outer_sync_dtype=bf16 sends parameter changes, which local_sgd does not "
                          "have (it averages the parameters, in fp32); use parallel.dp_sync=diloco, or "
                          "outer_sync_dtype=fp32.")


def replica_context(context):
    """The parallel context one DP replica trains in between syncs: the CP group stands in for
    dp_cp and edp (its gradients are summed over CP only -- each CP rank saw other tokens of the
    same sequences), there is no DP group, and the replica's own ranks are its world (where its
    gradient norm is summed). Data sampling, checkpoints and the outer step keep the real context."""
    replica_size = context.world_size // context.dp_size
    return dataclasses.replace(context, dp_size=1, dp_rank=0, dp_group=None, dp_cp_size=context.cp_size,
                               dp_cp_rank=context.cp_rank, dp_cp_group=context.cp_group, edp_size=context.cp_size,
                               edp_rank=context.cp_rank, edp_group=context.cp_group, world_size=replica_size,
                               world_group=context.replica_group)


def uniform_draw(seed: int, replica: int, step: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, replica, step): PALSGD's coin, reproducible and
    stateless (the same after a resume, whatever the layout of the replica)."""
    digest = hashlib.blake2b(f"palsgd:{seed}:{replica}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


class LowCommunicationSync:
    """One rank's part of ``parallel.dp_sync`` (not ``every_step``): which steps are local, the
    PALSGD coin and pull, and the outer step over ``context.dp_group``.

    ``parameters``: (name, fp32 tensor) pairs the inner optimizer updates, the same on every rank
    of the DP group (names and shapes). The trainer asks, for each step s (0-based):
    ``replicas_independent(s)`` (else an ordinary DDP step: PALSGD's warm-up),
    ``is_pseudo_sync(s)`` (then ``pull_toward_global(lr)`` replaces the step),
    ``inner_lr(lr, s)``, and after the step ``is_outer_step(s)`` -> ``outer_step()``.
    """

    def __init__(self, parallel, parameters: list[tuple[str, torch.Tensor]], context, seed: int):
        self.mode, self.every = parallel.dp_sync, parallel.sync_every
        self.outer_optimizer, self.outer_lr = parallel.outer_optimizer, parallel.outer_lr
        self.outer_momentum = parallel.outer_momentum
        self.sync_dtype = SYNC_DTYPES[parallel.outer_sync_dtype]
        self.probability, self.eta = parallel.palsgd_p, parallel.palsgd_eta
        self.warmup = parallel.palsgd_warmup if self.mode == "palsgd" else parallel.local_warmup
        self.overlap = parallel.outer_overlap
        self.seed = seed
        self.group, self.dp_size, self.dp_rank = context.dp_group, context.dp_size, context.dp_rank
        pairs = [(name, param) for name, param in parameters if param.requires_grad]
        self.names = [name for name, _ in pairs]
        self.params = [param for _, param in pairs]
        self.offsets = [0]
        for param in self.params:
            self.offsets.append(self.offsets[-1] + param.numel())
        self.numel = self.offsets[-1]
        self.spans = list(zip(self.names, self.params, self.offsets, self.offsets[1:]))
        """(name, parameter, start, end): where each parameter sits in the flat vector."""
        self.shard_size = math.ceil(self.numel / self.dp_size) if self.numel else 0
        self.padded = self.shard_size * self.dp_size
        device = self.device = self.params[0].device if self.params else context.device
        keeps_copy = self.mode in ("diloco", "palsgd")
        self.global_copy = self.flat_parameters() if keeps_copy else None
        momentum_size = self.padded if self.overlap else self.shard_size  # overlap: every rank the whole step
        self.momentum = (torch.zeros(momentum_size, dtype=torch.float32, device=device)
                         if keeps_copy and self.outer_momentum > 0 else None)
        self.pending = None
        """Overlap: the all-reduce in flight (its work handle, or None once settled), else None."""
        if self.overlap:
            message_dtype = self.sync_dtype if keeps_copy else torch.float32
            self.message = torch.zeros(self.padded, dtype=message_dtype, device=device)
            self.anchor = torch.zeros(self.padded, dtype=torch.float32, device=device)
            self.pending_flag = torch.zeros(1, dtype=torch.float32, device=device)

    # --- which step is what -------------------------------------------------------------------------
    def replicas_independent(self, step: int) -> bool:
        """False during the warm-up (palsgd_warmup, local_warmup), whose steps reduce gradients over
        DP as every_step does."""
        return step >= self.warmup

    def is_pseudo_sync(self, step: int) -> bool:
        """PALSGD after the warm-up: this replica's coin for this step came up (probability p)."""
        return (self.mode == "palsgd" and step >= self.warmup
                and uniform_draw(self.seed, self.dp_rank, step) < self.probability)

    def pseudo_syncs(self, replica: int, steps: int) -> int:
        """How many of steps [0, steps) were pseudo-synchronizations on ``replica`` (they do not
        step its AdamW: a resumed replica's optimizer step count is replica 0's saved count
        shifted by the difference)."""
        if self.mode != "palsgd":
            return 0
        return sum(uniform_draw(self.seed, replica, step) < self.probability for step in range(self.warmup, steps))

    def inner_lr(self, lr: float, step: int) -> float:
        """PALSGD's ordinary inner steps use lr / (1 - p): on average they are 1 - p of the steps."""
        if self.mode == "palsgd" and step >= self.warmup:
            return lr / (1.0 - self.probability)
        return lr

    def finish_replica_gradients(self, buffer: torch.Tensor, step: int) -> None:
        """After the replica's backward (its CP sum done): each micro-batch loss was divided by the
        step's count over ALL replicas, so x dp makes ``buffer`` the replica's own mean gradient;
        in the warm-up the DP sum instead (an all-reduce: an ordinary DDP step)."""
        if self.replicas_independent(step):
            buffer.mul_(self.dp_size)
        else:
            all_reduce_(buffer, self.group)

    def is_outer_step(self, step: int) -> bool:
        """Every sync_every-th step after the warm-up (counting this one)."""
        done = step + 1 - self.warmup
        return done > 0 and done % self.every == 0

    def starts_local_phase(self, step: int) -> bool:
        """The first step after the warm-up: DiLoCo's and PALSGD's global copy is taken (the
        replicas agree; local SGD keeps none)."""
        return self.global_copy is not None and step == self.warmup

    # --- the parameters as one flat vector ------------------------------------------------------------
    def flat_parameters(self) -> torch.Tensor:
        """This rank's parameters, concatenated (fp32) and zero-padded to a multiple of dp."""
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for _, param, start, end in self.spans:
            flat[start:end].copy_(param.detach().reshape(-1))
        return flat

    @torch.no_grad()
    def load_into_parameters(self, flat: torch.Tensor) -> None:
        for _, param, start, end in self.spans:
            param.copy_(flat[start:end].view_as(param))

    def take_global_copy(self) -> None:
        """global copy <- the parameters (at the end of the warm-up, when they agree)."""
        self.global_copy.copy_(self.flat_parameters())

    # --- PALSGD's pull ---------------------------------------------------------------------------------
    @torch.no_grad()
    def pull_toward_global(self, lr: float) -> None:
        """theta <- theta - (lr / p) eta (theta - theta_global), parameter by parameter; no communication."""
        weight = lr / self.probability * self.eta
        for _, param, start, end in self.spans:
            param.lerp_(self.global_copy[start:end].view_as(param), weight)

    # --- the outer step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def outer_step(self) -> None:
        """Reconcile the replicas over DP now (a collective: every rank of the DP group calls it)."""
        if self.overlap:  # the overlapped step applied at once: no progress since the sync
            self.start_overlapped_outer_step()
            self.finish_overlapped_outer_step()
            return
        if self.mode == "local_sgd":
            flat = self.flat_parameters()
            all_reduce_(flat, self.group)
            self.load_into_parameters(flat.div_(self.dp_size))
            return
        deltas = (self.global_copy - self.flat_parameters()).to(self.sync_dtype)
        summed = torch.empty(self.shard_size, dtype=self.sync_dtype, device=deltas.device)
        reduce_scatter_into_(summed, deltas, self.group)
        update = self.outer_update(summed.float().div_(self.dp_size))
        gathered = torch.empty(self.padded, dtype=self.sync_dtype, device=deltas.device)
        all_gather_into_(gathered, update.to(self.sync_dtype), self.group)
        self.global_copy.sub_(gathered.float())
        self.load_into_parameters(self.global_copy)

    # --- the overlapped outer step ------------------------------------------------------------------------
    def start_overlapped_outer_step(self) -> None:
        """Launch the sync's all-reduce and return at once (a collective: every DP rank calls it)."""
        self.finish_overlapped_outer_step()  # at most one in flight
        self.anchor.copy_(self.flat_parameters())
        if self.mode == "local_sgd":
            self.message.copy_(self.anchor)
        else:
            self.message.copy_(self.global_copy - self.anchor)
        self.pending = all_reduce_(self.message, self.group, async_op=True)
        self.pending_flag.fill_(1.0)

    def settle(self) -> None:
        """Wait for the all-reduce in flight, if any (the sync itself is applied later)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    @torch.no_grad()
    def finish_overlapped_outer_step(self) -> bool:
        """Apply a pending sync: the outer step on the reduced message, then every replica loads
        the new global copy plus its own progress since the sync. Whether there was one."""
        if not self.overlap or not self.pending_flag.item():
            return False
        self.settle()
        mean = self.message.float().div_(self.dp_size)
        if self.mode == "local_sgd":
            target = mean
        else:
            self.global_copy.sub_(self.outer_update(mean))
            target = self.global_copy
        progress = self.flat_parameters().sub_(self.anchor)
        self.load_into_parameters(target + progress)
        self.pending_flag.zero_()
        return True

    def outer_update(self, outer_grad: torch.Tensor) -> torch.Tensor:
        """What the outer optimizer subtracts from this rank's slice of the global copy: lr x g
        (no momentum), lr x m (heavy-ball 'sgd') or lr x (g + mu m) ('nesterov', torch's SGD
        with nesterov=True), with m <- mu m + g."""
        if self.momentum is None:
            return outer_grad.mul_(self.outer_lr)
        self.momentum.mul_(self.outer_momentum).add_(outer_grad)
        if self.outer_optimizer == "nesterov":
            return outer_grad.add_(self.momentum, alpha=self.outer_momentum).mul_(self.outer_lr)
        return self.momentum.mul(self.outer_lr)

    # --- checkpoints -----------------------------------------------------------------------------------------
    def momentum_segments(self):
        """(name, parameter, first element, view of this rank's momentum) for every parameter
        that overlaps this rank's slice [dp_rank * shard, (dp_rank + 1) * shard) of the flat vector."""
        if self.momentum is None:
            return []
        if self.overlap:  # whole on every rank (replicated, like the global copy)
            return [(name, param, 0, self.momentum[start:stop]) for name, param, start, stop in self.spans]
        begin, end = self.dp_rank * self.shard_size, (self.dp_rank + 1) * self.shard_size
        segments = []
        for name, param, start, stop in self.spans:
            low, high = max(start, begin), min(stop, end)
            if low < high:
                segments.append((name, param, low - start, self.momentum[low - begin:high - begin]))
        return segments

    def overlap_views(self):
        """Overlap: (kind, name, parameter, view) of the reduced message ('pending', the same on every
        replica) and of this replica's anchor ('anchor'), for checkpoints; settles the all-reduce first."""
        if not self.overlap:
            return []
        self.settle()
        views = []
        for kind, flat in (("pending", self.message), ("anchor", self.anchor)):
            views += [(kind, name, param, flat[start:stop].view_as(param)) for name, param, start, stop in self.spans]
        return views

    def global_views(self):
        """(name, parameter, view of the global copy shaped like it) for every parameter."""
        if self.global_copy is None:
            return []
        return [(name, param, self.global_copy[start:stop].view_as(param)) for name, param, start, stop in self.spans]


__all__ = ["DP_SYNC_MODES", "LowCommunicationSync", "OUTER_OPTIMIZERS", "SYNC_DTYPES", "check_dp_sync",
           "replica_context", "uniform_draw"]
