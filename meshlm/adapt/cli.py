"""``meshlm upcycle``: a dense model or checkpoint -> an MoE model folder with the same outputs.

    meshlm upcycle CKPT OUT --experts E --top-k K [--granularity G] [--set moe_key=VALUE ...]
    meshlm upcycle runs/dense/checkpoints/step_2000 models/moe-8x2 --experts 8 --top-k 2
    meshlm upcycle models/dense models/moe-fine --experts 16 --top-k 4 --granularity 2 \
        --set moe_aux_loss_coeff=0.01 moe_bias_update_rate=0.001

CKPT is a model folder (``save_model``, ``meshlm convert``), a training checkpoint's step
folder or a run directory (its newest checkpoint; ``meshlm/checkpoint/locate.py``). OUT gets
``config.json`` + ``model.safetensors`` (and the tokenizer files), written to a temporary folder
beside it and renamed into place, so OUT is either complete or absent. The dense weights are
read one tensor at a time (by slice from model.safetensors, by chunk from a checkpoint) and each
MoE tensor is written as soon as it is made: neither model is ever held.

``--set moe_*=VALUE`` pairs set other MoE fields (router, balancing; see ``meshlm train
--list-keys``). Unless they choose the balancing, the new model trains with a load-balancing
loss and a router z-loss (``BALANCING_DEFAULTS`` in meshlm/adapt/upcycle.py), without which the
router of the copied experts collapses onto a few of them. The command prints the ``meshlm
train`` overrides that describe the new model, for a run started with ``train.init_from=OUT``.
See meshlm/adapt/upcycle.py for the construction.
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial
from pathlib import Path

import torch

from meshlm.checkpoint.files import copy_tokenizer_files, folder_written_atomically
from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.materialize import read_tensor
from meshlm.checkpoint.model_files import (check_stored_tensors, read_model_config, source_file, weights_source,
                                           write_model_folder)
from meshlm.config import format_override, parse_override
from meshlm.errors import CheckpointError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.lora import require_no_adapters

BALANCING_FIELDS = ("moe_aux_loss_coeff", "moe_bias_update_rate", "moe_z_loss_coeff")
"""The router-balancing settings the command reports."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="dense meshlm model folder, training checkpoint or run directory")
    parser.add_argument("out", metavar="OUT", help="MoE model folder to write (must not exist)")
    parser.add_argument("--experts", type=int, required=True, help="routed experts per MoE block (E)")
    parser.add_argument("--top-k", type=int, required=True, help="experts per token (K)")
    parser.add_argument("--granularity", type=int, default=1,
                        help="G: experts of width ffn/G; E and K must be multiples of G (default 1)")
    parser.add_argument("--router-init-std", type=float, default=None,
                        help="std of the random router rows (default: the model's init_std)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the router initialization")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="moe_key=VALUE",
                        help="other MoE fields of the new model, e.g. --set moe_aux_loss_coeff=0.01")


def run(args: argparse.Namespace) -> int:
    from meshlm.adapt.upcycle import changed_fields, down_projection_scale, is_exact, upcycle_plan

    out = Path(args.out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new OUT folder or remove it.")
    source_dir = resolve_model_dir(args.checkpoint)
    overrides = model_overrides(args.overrides)
    dense = read_model_config(source_dir)
    require_no_adapters(dense, source_dir, "upcycle")
    source = weights_source(source_dir)
    check_stored_tensors(dense, source.layout, str(source_file(source_dir)))
    config, plan = upcycle_plan(dense, source.layout, partial(read_tensor, source), args.experts, args.top_k,
                                args.granularity, args.router_init_std, args.seed, **overrides)
    with folder_written_atomically(out) as temporary:  # tensor by tensor, with the source's tokenizer
        write_model_folder(temporary, config, plan)
        copy_tokenizer_files(source_dir, temporary)
    exactness = "equal to the dense model's" if is_exact(config) else "close to the dense model's"
    print(f"wrote {out}: pattern {config.pattern!r}, {config.moe_num_experts} experts of width "
          f"{config.moe_ffn_hidden_size}, top-{config.moe_top_k}, down projections x"
          f"{down_projection_scale(config, args.granularity):g}; {parameter_count(config):,} parameters "
          f"(dense {parameter_count(dense):,}); outputs {exactness} at step 0")
    balancing = ", ".join(f"{name}={getattr(config, name):g}" for name in BALANCING_FIELDS if getattr(config, name))
    print(f"router balancing: {balancing or 'none'} (choose with --set moe_aux_loss_coeff=... moe_z_loss_coeff=...; "
          "without balancing the router collapses onto a few experts)")
    settings = " ".join(format_override(f"model.{key}", value)
                        for key, value in changed_fields(dense, config).items())
    print(f"train it with: meshlm train CONFIG train.init_from={out} {settings}")
    return 0


def parameter_count(config: ModelConfig) -> int:
    with torch.device("meta"):  # shapes only
        return LanguageModel(config).num_parameters()


def model_overrides(texts: list[str]) -> dict:
    """``moe_top_k=2`` (or ``model.moe_top_k=2``) pairs, typed like the ModelConfig fields."""
    from meshlm.config import _coerce, _unknown_key_error

    fields = {field.name: field for field in dataclasses.fields(ModelConfig) if field.init}
    values = {}
    for text in texts:
        key, value = parse_override(text)
        name = key.removeprefix("model.")
        if name not in fields:
            raise _unknown_key_error(f"model.{name}")
        values[name] = _coerce(f"model.{name}", value, fields[name].type)
    return values



__all__ = ["add_arguments", "model_overrides", "parameter_count", "run"]
