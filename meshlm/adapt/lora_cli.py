"""``meshlm merge-lora``: a LoRA fine-tuned model -> a model folder with its adapters folded in.

    meshlm train configs/sft.yaml train.init_from=runs/base model.lora_rank=16 train.run_dir=runs/sft-lora
    meshlm merge-lora runs/sft-lora models/sft            # W' = W + (lora_alpha / lora_rank) b a
    meshlm generate models/sft --prompt "..."             # no adapters left: the base model's speed

CKPT is a model folder, a training checkpoint's step folder or a run directory (its newest
checkpoint; ``meshlm/checkpoint/locate.py``; ``RUN/best`` for the best validation step). OUT gets
the merged weights (``meshlm/models/lora.py``: ``merged_weights``), a ``config.json`` whose model
has no adapters (``model.lora_rank: 0``; the other sections of CKPT's config.json, such as the
run's sequence length and the imported Hugging Face settings, carried over) and CKPT's tokenizer.
It is written one tensor at a time into a temporary folder beside OUT and renamed into place, so
OUT is either complete or absent. ``meshlm convert meshlm-to-hf`` merges the same way by itself.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from meshlm.checkpoint.files import CONFIG_FILE, folder_written_atomically
from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.materialize import read_tensor
from meshlm.checkpoint.model_files import (check_stored_tensors, read_model_config, source_file, weights_source,
                                           write_model_folder)
from meshlm.checkpoint.safetensors_stream import PlannedTensor
from meshlm.errors import CheckpointError
from meshlm.models.lora import adapted_layer_names, merged_weights

FOLDER_KEYS = ("format", "version", "model")
"""The config.json keys ``write_model_folder`` writes itself; every other key of CKPT's is kept."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="a LoRA model: model folder, training checkpoint or run directory")
    parser.add_argument("out", metavar="OUT", help="model folder to write (must not exist)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new OUT folder or remove it.")
    source_dir = resolve_model_dir(args.checkpoint)
    config = read_model_config(source_dir)
    if not config.lora_rank:
        raise CheckpointError(f"{source_dir} has no LoRA adapters (its model.lora_rank is 0): there is nothing to "
                              "merge; use it as it is.")
    source = weights_source(source_dir)
    check_stored_tensors(config, source.layout, str(source_file(source_dir)))
    merged, stored, read = merged_weights(config, source.layout, partial(read_tensor, source))
    plan = {name: PlannedTensor(tuple(shape), dtype, partial(read, name)) for name, (shape, dtype) in stored.items()}
    extra = {key: value for key, value in json.loads((source_dir / CONFIG_FILE).read_text()).items()
             if key not in FOLDER_KEYS}
    with folder_written_atomically(out) as temporary:
        write_model_folder(temporary, merged, plan, extra_config=extra, tokenizer_dir=source_dir)
    adapters = len(adapted_layer_names(source.layout))
    print(f"wrote {out}: {adapters} LoRA adapters of rank {config.lora_rank} folded into their weights "
          f"(scale {config.lora_scale:g}); the model has no adapters left and runs at the base model's speed")
    return 0


__all__ = ["add_arguments", "run"]
