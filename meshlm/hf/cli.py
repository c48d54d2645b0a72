"""``meshlm convert``: Hugging Face folders <-> meshlm models.

    meshlm convert hf-to-meshlm HF_DIR OUT                 [--overwrite]
    meshlm convert meshlm-to-hf CKPT HF_DIR [--architecture NAME] [--quantize fp8] [--overwrite]
                                            [--adapter-only [--base-model NAME] | --base-only]

HF_DIR holds config.json and model.safetensors (or a sharded index); CKPT is a meshlm model
folder, a training checkpoint or a run directory (its newest checkpoint;
``meshlm/checkpoint/locate.py``). Both directions go one tensor at a time,
so a model larger than the host's memory converts. Tokenizer files are copied across. An
existing, non-empty output folder is refused unless --overwrite is given. ``--quantize fp8``
writes the decoder blocks' linear weights in block-wise FP8 with 128 x 128 block scales, the
layout of DeepSeek-V3's checkpoints that transformers' fine-grained FP8 loader reads
(``meshlm/hf/fp8_export.py``).

A LoRA model (``model.lora_rank`` > 0) is written with its adapters folded into the weights; with
``--base-only`` the frozen base model alone, with ``--adapter-only`` the adapters alone as a PEFT
adapter folder that ``peft.PeftModel.from_pretrained`` loads onto that base
(``meshlm/hf/peft_export.py``).
"""

from __future__ import annotations

import argparse
import json

import torch

from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.hf.convert import EXPORTABLE, hf_to_meshlm, meshlm_to_hf
from meshlm.hf.quantized_export import QUANTIZE_CHOICES, describe_quantized_export
from meshlm.models.language_model import LanguageModel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", metavar="DIRECTION")
    directions.required = True
    to_meshlm = directions.add_parser("hf-to-meshlm", help="Hugging Face folder -> meshlm model",
                                      description="Convert a Hugging Face model folder into a meshlm model.")
    to_meshlm.add_argument("hf_dir", metavar="HF_DIR", help="folder with config.json and model.safetensors")
    to_meshlm.add_argument("out", metavar="OUT", help="meshlm model folder to write")
    to_hf = directions.add_parser("meshlm-to-hf", help="meshlm model or checkpoint -> Hugging Face folder",
                                  description="Convert a meshlm model or checkpoint into a Hugging Face folder.")
    to_hf.add_argument("checkpoint", metavar="CKPT", help="meshlm model folder, training checkpoint or run directory")
    to_hf.add_argument("out", metavar="HF_DIR", help="Hugging Face folder to write")
    to_hf.add_argument("--architecture", choices=sorted(EXPORTABLE), metavar="NAME",
                       help="HF architecture to write (default: chosen from the model's shape); one of "
                            + ", ".join(sorted(EXPORTABLE)))
    to_hf.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                       help="fp8: store the decoder blocks' linear weights as FP8 E4M3 with one fp32 scale per "
                            "128x128 block (DeepSeek-V3 layout, transformers' fine-grained FP8); mxfp4: a gpt-oss "
                            "model's MoE experts in MXFP4, as gpt-oss was released; the rest keeps its stored dtype")
    lora = to_hf.add_mutually_exclusive_group()
    lora.add_argument("--adapter-only", action="store_true",
                      help="of a LoRA model: its adapters alone, as a PEFT adapter folder (adapter_config.json, "
                           "adapter_model.safetensors) for the base model --base-only writes")
    lora.add_argument("--base-only", action="store_true",
                      help="of a LoRA model: the frozen base model alone, without its adapters")
    to_hf.add_argument("--base-model", metavar="NAME",
                       help="with --adapter-only: the base model's name or path, recorded in adapter_config.json "
                            "(base_model_name_or_path)")
    for sub in (to_meshlm, to_hf):
        sub.add_argument("--overwrite", action="store_true",
                         help="write into OUT even if it is not empty (files of the same names are replaced)")


def run(args: argparse.Namespace) -> int:
    if args.direction == "hf-to-meshlm":
        out, config, extra = hf_to_meshlm(args.hf_dir, args.out, overwrite=args.overwrite)
        with torch.device("meta"):  # shapes only, to count the parameters
            model = LanguageModel(config)
        print(f"wrote meshlm model {out} from {extra['architecture']} {args.hf_dir}: pattern "
              f"{config.pattern!r}, {model.num_parameters():,} parameters")
    else:
        source = resolve_model_dir(args.checkpoint)  # a run directory: its newest checkpoint
        part = "adapter" if args.adapter_only else "base" if args.base_only else "merged"
        out, architecture = meshlm_to_hf(source, args.out, args.architecture, overwrite=args.overwrite,
                                         quantize=args.quantize, part=part, base_model=args.base_model)
        what = {"adapter": "PEFT LoRA adapter", "base": f"{architecture.name} base model"}.get(
            part, f"{architecture.name}")
        print(f"wrote {what} folder {out} from {source}")
        if args.quantize:
            print(describe_quantized_export(json.loads((out / "config.json").read_text())))
    return 0
