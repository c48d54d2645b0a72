"""Build this rank's share of the model: on ``meta`` first, then only its shards get values.

    LanguageModel on meta          the single-process model: shapes, names, no storage
    parallelize_model              keep this rank's TP / EP slices (still meta)
    apply_context_parallel, recompute, MoE balancing sum
    PipelinedModel.build           keep this rank's pipeline stages (still meta)
    materialize                    allocate the shards on the run's device and fill them:
                                   initial values (seed, name) or ``train.init_from``'s files

No rank ever allocates the whole model: a rank's peak is its own shards plus one full tensor
(the initial value being sliced; ``meshlm/checkpoint/materialize.py``), and its values are the
single-process model's, so the layout does not change the run. ``train.init_from`` is read by
slice (safetensors) or by chunk (a distributed checkpoint), never whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.checkpoint.materialize import InitialValues, materialize
from meshlm.models.language_model import LanguageModel
from meshlm.models.moe.layer import set_load_balancing_sum
from meshlm.optim.muon import muon_parameter
from meshlm.parallel.collectives import summing_over
from meshlm.parallel.context.context_parallel import apply_context_parallel
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.pipeline.pipelined_model import PipelinedModel
from meshlm.training.initial_weights import initial_weights_source
from meshlm.training.recompute import apply_recompute


@dataclass
class BuiltModel:
    model: torch.nn.Module
    """This rank's share: tensor/expert-parallel slices of its pipeline stages, on the run's device."""
    pipeline: PipelinedModel | None
    """The pipeline schedule's view of the model (pp > 1), else None."""
    num_parameters: int
    """Parameters of the whole single-process model."""
    num_trainable: int
    """Of those, the ones that train (all but the frozen weights under LoRA: ``model.lora_rank``)."""
    num_muon: int
    """Of those, the ones Muon would step (``meshlm.optim.muon.muon_parameter``; the start line's
    count under optim.optimizer=muon)."""
    sum_over_dp_cp: object
    """Sums a tensor over the DP x CP group (the MoE balancing's token counts; identity in one process)."""


def build_model(config, context, device: torch.device, init_from: str | None = None) -> BuiltModel:
    """This rank's model for the run ``config`` (a RunConfig) on ``context``; ``init_from``: a
    model folder or training checkpoint whose weights replace the initial values."""
    train = config.train
    with torch.device("meta"):
        model = LanguageModel(config.model, seed=train.seed)
    num_parameters = model.num_parameters()
    num_trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    num_muon = sum(parameter.numel() for name, parameter in model.named_parameters() if muon_parameter(name, parameter))
    model = parallelize_model(model, context, config.parallel.vocab_pad_multiple)
    apply_context_parallel(model, context)  # ring attention, Mamba state hand-off (cp > 1)
    apply_recompute(model, train.recompute, train.recompute_every)
    sum_over_dp_cp = summing_over(context.dp_cp_group)  # the MoE balancing's token counts
    set_load_balancing_sum(model, sum_over_dp_cp)  # for moe_aux_loss_type 'global'
    pipeline = None  # pipeline parallelism: keep this rank's stages of the model (collective)
    if context.pp_size > 1:
        pipeline = PipelinedModel.build(model, context, train.seq_len)
    source = (InitialValues(config.model, train.seed) if init_from is None
              else initial_weights_source(init_from, config.model, seed=train.seed))
    materialize(model, context, source, device)
    return BuiltModel(model.train(), pipeline, num_parameters, num_trainable, num_muon, sum_over_dp_cp)


__all__ = ["BuiltModel", "build_model"]
