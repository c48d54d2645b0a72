"""``meshlm upcycle``: a dense model or checkpoint -> an MoE model folder with the same outputs.

    meshlm upcycle CKPT OUT --experts E --top-k K [--granularity G] [--set moe_key=VALUE ...]
    meshlm upcycle runs/dense/checkpoints/step_2000 models/moe-8x2 --experts 8 --top-k 2
    meshlm upcycle models/dense models/moe-fine --experts 16 --top-k 4 --granularity 2 \
        --set moe_aux_loss_coeff=0.01 moe_bias_update_rate=0.001

CKPT is a model folder (``save_model``, ``meshlm convert``) or a training checkpoint's step
folder; OUT gets ``config.json`` + ``model.safetensors`` (and the tokenizer files), written to a
temporary folder beside it and renamed into place, so OUT is either complete or absent.
``--set moe_*=VALUE`` pairs set other MoE fields (router, balancing; see ``meshlm train --list-keys``).
The command prints the ``meshlm train`` overrides that describe the new model, for a run
started with ``train.init_from=OUT``. See meshlm/adapt/upcycle.py for the construction.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
from pathlib import Path

from meshlm.checkpoint.files import copy_tokenizer_files
from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.config import parse_override
from meshlm.errors import CheckpointError
from meshlm.models.config import ModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="dense meshlm model folder or training checkpoint")
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
    from meshlm.adapt.upcycle import changed_fields, down_projection_scale, is_exact, upcycle_model

    out = Path(args.out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new OUT folder or remove it.")
    overrides = model_overrides(args.overrides)
    dense = load_model(args.checkpoint)
    moe = upcycle_model(dense, args.experts, args.top_k, args.granularity, args.router_init_std, args.seed,
                        **overrides)
    write_atomically(moe, out, Path(args.checkpoint))
    exactness = "equal to the dense model's" if is_exact(moe.config) else "close to the dense model's"
    print(f"wrote {out}: pattern {moe.config.pattern!r}, {moe.config.moe_num_experts} experts of width "
          f"{moe.config.moe_ffn_hidden_size}, top-{moe.config.moe_top_k}, down projections x"
          f"{down_projection_scale(moe.config, args.granularity):g}; {moe.num_parameters():,} parameters "
          f"(dense {dense.num_parameters():,}); outputs {exactness} at step 0")
    settings = " ".join(f"model.{key}={value!r}" if isinstance(value, str) else f"model.{key}={value}"
                        for key, value in changed_fields(dense.config, moe.config).items())
    print(f"train it with: meshlm train CONFIG train.init_from={out} {settings}")
    return 0


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


def write_atomically(model, out: Path, source: Path) -> None:
    """save_model into a temporary sibling of ``out`` (with the source's tokenizer), then rename."""
    temporary = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    try:
        save_model(model, temporary)
        copy_tokenizer_files(source, temporary)
        os.replace(temporary, out)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


__all__ = ["add_arguments", "model_overrides", "run", "write_atomically"]
