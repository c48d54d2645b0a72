"""``meshlm prune``: a trained model -> a smaller model of its most important units (Minitron).

    meshlm prune CKPT OUT --calibration DATA [--samples 512] [--seq-len N]
                 (--target-params N | --hidden H --ffn F --heads A --kv-heads K --mamba-heads M --experts E)
                 [--per-block] [--drop-blocks K] [--depth-metric loss|cosine]
    meshlm prune runs/big models/small --calibration data/demo/blend.json --target-params 60M
    meshlm prune models/8b models/6b --calibration data/web_text_document --ffn 9216 --heads 24 --drop-blocks 4
    meshlm prune models/8b models/6b-puzzle --calibration data/web_text_document --ffn 9216 --kv-heads 4 --per-block

CKPT is a model folder, a training checkpoint's step folder or a run directory (its newest
checkpoint). ``--calibration`` takes what training takes: one blend file (``.json``/``.yaml``)
or token-store prefixes (weighted by size); ``--samples`` sequences of ``--seq-len`` tokens
(default: the run's ``train.seq_len`` when CKPT records it) are drawn from all of their
documents. The activations on them rank every embedding channel, attention head, MLP neuron,
Mamba head, expert and block (``meshlm/adapt/importance.py``); the top units of every block are
kept, uniformly (``meshlm/adapt/prune.py``), or with ``--per-block`` in numbers that differ
from block to block (``meshlm/adapt/prune_blocks.py``).

Sizes: any of ``--hidden --ffn --heads --kv-heads --mamba-heads --experts`` (each at most the
model's; the rest stay), or ``--target-params N`` (``60M``, ``1.5B`` work), which searches the
widths not given for the one that keeps most importance within N parameters. ``--drop-blocks K``
removes the K blocks whose skipping costs least (``--depth-metric``: the loss increase, default,
or the cosine distance between a block's input and output). Query heads follow their KV head: ``--kv-heads K``
alone keeps K whole GQA groups; ``--heads A`` alone keeps the KV heads (with plain multi-head
attention the KV heads follow).

``--per-block``: the sizes given are averages. ``--ffn F`` keeps F x (number of MLP blocks)
neurons in all, the best over all MLP blocks by their score relative to their block's mean score,
so each block gets its own width (at least 1/8 of it); ``--kv-heads`` spreads GQA groups (at
least one per block, each with ``--heads / --kv-heads`` query heads), ``--mamba-heads`` Mamba
heads (whole rows over the B/C groups) and ``--experts`` experts (at least ``moe_top_k``) the same
way. ``--hidden`` stays uniform (every block shares it). The blocks whose sizes differ from the
averages are written as ``model.block_overrides`` (such a model does not export to Hugging Face).
With ``--target-params`` the budget search picks the averages (as for a uniform model), which are
then spread: a block's parameters grow linearly with its neurons, GQA groups, Mamba heads and
experts, so the spread model has exactly the uniform model's parameter count. A CKPT that already has ``block_overrides`` is pruned uniformly only
on the axes they leave alone; with ``--per-block`` on any.

OUT gets ``config.json`` (the pruned model; a ``pruning`` section records what was done) +
``model.safetensors`` + the tokenizer, written to a temporary sibling and renamed. The command
prints the ``meshlm train`` command that distills the pruned model from CKPT.

Under ``torchrun`` the calibration forward runs in the layout of ``meshlm eval``: ``--tp N``
groups of N adjacent processes each hold one tensor-parallel copy of the model (built on meta,
each rank reading only its slices, as training does), and the copies split the calibration
samples (data parallelism). Each rank scores the heads and neurons of its slice; the scores are
concatenated over the TP group and summed over the copies (``meshlm/adapt/importance.py``), so
every layout selects the same units as one process. The pruned tensors are then cut from the
source's files one tensor at a time, and rank 0 writes OUT. An MoE model's experts can also be
split: ``--ep N`` gives each rank 1/N of every MoE block's experts (folded onto the copies, as
training folds expert parallelism); the router is whole on every rank, so the routing counts
each rank records are those of its own samples and sum over the copies as before. Under ``--ep``
every rank must run as many forwards (the experts' all-to-alls), so ``--samples`` is a multiple
of the number of copies. ``--pp N`` cuts each copy into N pipeline stages as training cuts them
(blocks balanced by FLOPs); the forward passes from stage to stage and each stage scores its own
blocks (``meshlm/adapt/importance_pipeline.py``). ``--cp N`` splits each calibration sequence over N
ranks as training does (ring attention, Mamba's state hand-off), and the per-sample means are
taken over the whole sequence before they are squared (``meshlm/adapt/importance_sequence.py``).

    torchrun --nproc_per_node 4 -m meshlm prune runs/big models/small --calibration data/blend.json --ffn 2048 --tp 2
    torchrun --nproc_per_node 4 -m meshlm prune runs/moe models/moe-small --calibration data/blend.json --experts 32 --ep 4
    torchrun --nproc_per_node 8 -m meshlm prune runs/big models/small --calibration data/blend.json --ffn 2048 --tp 4 --pp 2
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch

from meshlm.errors import CheckpointError, ConfigError, DataError

SIZE_FLAGS = {"hidden": "hidden_size", "ffn": "ffn_hidden_size", "heads": "num_attention_heads",
              "kv_heads": "num_kv_heads", "mamba_heads": "mamba_num_heads", "experts": "moe_num_experts"}
"""argparse destination -> ModelConfig width field."""
SUFFIXES = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "G": 10 ** 9}


def parameter_budget(text: str) -> int:
    """``60M`` / ``1.5B`` / ``123456`` -> a parameter count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBG]?)\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count such as 60M, 1.5B or 123456")
    return int(float(match.group(1)) * SUFFIXES[match.group(2)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="meshlm model folder, training checkpoint or run directory")
    parser.add_argument("out", metavar="OUT", help="pruned model folder to write (must not exist)")
    parser.add_argument("--calibration", nargs="+", required=True, metavar="DATA",
                        help="a blend file (.json/.yaml) or token-store prefixes, as training reads them")
    parser.add_argument("--samples", type=int, default=512, help="calibration sequences (default 512)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per calibration sequence (default: the run's train.seq_len, else 1024)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the calibration sample order")
    parser.add_argument("--target-params", type=parameter_budget, metavar="N",
                        help="parameter budget (e.g. 60M): search the widths not given to meet it")
    for flag, field in SIZE_FLAGS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, metavar="N",
                            help=f"new model.{field} (at most the model's)")
    parser.add_argument("--per-block", action="store_true",
                        help="the sizes are averages: spread the units over the blocks by importance "
                             "(model.block_overrides)")
    parser.add_argument("--drop-blocks", type=int, default=0, metavar="K", help="remove the K least important blocks")
    parser.add_argument("--depth-metric", choices=("loss", "cosine"), default="loss",
                        help="block importance: loss increase when skipped (default) or input/output cosine distance")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="under torchrun: tensor-parallel ranks per copy of the model (default 1)")
    parser.add_argument("--pp", type=int, default=1, metavar="N",
                        help="under torchrun: pipeline stages each copy of the model is cut into (default 1)")
    parser.add_argument("--cp", type=int, default=1, metavar="N",
                        help="under torchrun: context-parallel ranks each calibration sequence is split over "
                             "(default 1)")
    parser.add_argument("--ep", type=int, default=1, metavar="N",
                        help="under torchrun: expert-parallel ranks each MoE block's experts are split over "
                             "(default 1)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    requested = {field: getattr(args, flag) for flag, field in SIZE_FLAGS.items()}
    check_arguments(args, out, requested)
    import torch.distributed as dist

    joined_here = not dist.is_initialized()  # under torchrun: calibration_context joins it
    try:
        prune(args, out, requested, process_device(args.device))
    finally:
        if joined_here and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def prune(args, out: Path, requested: dict, device: torch.device) -> None:
    from meshlm.adapt.importance import collect_importance
    from meshlm.adapt.prune import (check_drop_blocks, check_prunable, kept_blocks, prune_plan, resolve_widths,
                                    search_widths)
    from meshlm.adapt.prune_blocks import check_per_block, per_block_sizes
    from meshlm.checkpoint.locate import resolve_model_dir
    from meshlm.checkpoint.materialize import read_tensor
    from meshlm.checkpoint.model_files import read_model_config, trained_seq_len, weights_source
    from meshlm.models.lora import require_no_adapters

    source_dir = resolve_model_dir(args.checkpoint)
    config = read_model_config(source_dir)
    require_no_adapters(config, source_dir, "prune")
    check_prunable(config)  # the sizes are refused before the model is read or any forward runs
    check_drop_blocks(config.num_blocks, args.drop_blocks)
    widths = resolve_widths(config, requested, args.per_block) if args.target_params is None else None
    if args.per_block and widths is not None:  # a budget's averages are checked once searched
        check_per_block(config, widths)
    seq_len = args.seq_len or trained_seq_len(source_dir)
    context = calibration_context(config, device, args.tp, args.ep, args.pp, seq_len, args.cp)  # joins torchrun's
    if args.samples < context.dp_size:
        raise ConfigError(f"--samples {args.samples} is fewer than the {context.dp_size} copies of the model; give "
                          "each at least one.")
    if args.ep > 1 and args.samples % context.dp_size:  # the experts' all-to-alls need equal forwards everywhere
        raise ConfigError(f"--samples {args.samples} with --ep {args.ep} must be a multiple of the "
                          f"{context.dp_size} copies of the model, so that every rank runs as many forwards.")
    model = calibration_model(source_dir, context, seq_len)  # this rank's slices (and stage)
    dataset = calibration_dataset(args.calibration, seq_len, args.samples, args.seed, config.vocab_size)
    batches = calibration_batches(dataset, args.batch_size, context.dp_rank, context.dp_size, device, context)
    importance = collect_importance(model, batches, depth_metric=args.depth_metric if args.drop_blocks else "cosine",
                                    reduce=summed_over(context.dp_group) if context.dp_size > 1 else None,
                                    gather=gathered_over(context.tp_group) if context.tp_size > 1 else None,
                                    stages=pipeline_stages(context, source_dir), sequence=sequence_shards(context))
    del model
    if args.target_params is not None:
        widths, _ = search_widths(config, importance, args.target_params, requested, args.drop_blocks)
        if args.per_block:  # the searched averages, spread over the blocks (the same parameter count)
            check_per_block(config, widths)
    blocks = kept_blocks(importance, config.num_blocks, args.drop_blocks)
    sizes = per_block_sizes(config, importance, widths, blocks) if args.per_block else None
    source = weights_source(source_dir)  # the kept rows and columns, cut from the files one tensor at a time
    new_config, plan = prune_plan(config, dict(source.layout), lambda name: read_tensor(source, name), importance,
                                  widths, args.drop_blocks, sizes)
    if context.rank == 0:
        dropped = sorted(set(range(config.num_blocks)) - set(blocks))
        record = {"pruning": {"source": str(source_dir), "samples": importance.samples, "seq_len": seq_len,
                              "dropped_blocks": dropped, "depth_metric": args.depth_metric if dropped else None,
                              "per_block": args.per_block}}
        from meshlm.checkpoint.files import folder_written_atomically
        from meshlm.checkpoint.model_files import write_model_folder

        with folder_written_atomically(out) as temporary:  # with the source's tokenizer
            write_model_folder(temporary, new_config, plan, extra_config=record, tokenizer_dir=source_dir)
        report(args, config, new_config, dropped, importance, out, source_dir)



def check_arguments(args, out: Path, requested: dict) -> None:
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new OUT folder or remove it.")
    if args.target_params is None and args.drop_blocks == 0 and all(value is None for value in requested.values()):
        raise ConfigError("say how to prune: --target-params N, or at least one of --hidden --ffn --heads --kv-heads "
                          "--mamba-heads --experts --drop-blocks.")
    for flag in ("samples", "batch_size", "seq_len", "target_params", "tp", "pp", "cp", "ep"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value} must be a positive integer.")



def calibration_dataset(specs: list[str], seq_len: int, samples: int, seed: int, vocab_size: int):
    """``samples`` sequences of ``seq_len`` tokens from a blend file or token-store prefixes (weighted
    by size, as ``data.prefixes`` without ``data.weights``), from all their documents, in the
    blended, shuffled order training uses."""
    from meshlm.data.blend import Blend, BlendedDataset, load_blend
    from meshlm.data.indexed import TokenStore

    is_blend = len(specs) == 1 and specs[0].endswith((".json", ".yaml", ".yml"))
    if is_blend and not Path(specs[0]).is_file():
        raise DataError(f"--calibration {specs[0]}: no such blend file; give a blend file or token-store prefixes.")
    if is_blend:
        blend = load_blend(specs[0])
    else:
        blend = Blend(prefixes=list(specs), weights=[max(TokenStore(prefix).num_tokens, 1) for prefix in specs])
    for prefix in blend.prefixes:
        store = TokenStore(prefix)
        if store.vocab_size > vocab_size:
            raise DataError(f"--calibration: {store.idx_path} holds token ids up to {store.vocab_size - 1}, beyond the "
                            f"model's vocabulary of {vocab_size}; calibrate on data made with the model's tokenizer.")
    return BlendedDataset(blend, seq_len, samples, seed=seed, split="1", split_name="train")


def read_batch(dataset, start: int, size: int, device: torch.device) -> dict[str, torch.Tensor]:
    samples = [dataset[index] for index in range(start, start + size)]
    return {key: torch.stack([sample[key] for sample in samples]).to(device) for key in ("input_ids", "labels")}


def calibration_batches(dataset, batch_size: int, rank: int, world: int, device: torch.device, context=None):
    """This process's share of the samples (contiguous), ``batch_size`` at a time, on ``device``;
    under context parallelism (``context.cp_size > 1``) this rank's chunks of them, with their
    ``position_ids``."""
    from meshlm.parallel.context.context_parallel import split_batch

    share = -(-len(dataset) // world)
    start, stop = rank * share, min(len(dataset), (rank + 1) * share)
    for first in range(start, stop, batch_size):
        batch = read_batch(dataset, first, min(batch_size, stop - first), device)
        yield split_batch(batch, context) if context is not None else batch


def process_device(device_name: str | None) -> torch.device:
    """``--device``, else cuda if available, else cpu; a bare 'cuda' is this process's GPU (LOCAL_RANK)."""
    if device_name is None:
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def calibration_context(config, device: torch.device, tp: int, ep: int = 1, pp: int = 1, seq_len: int | None = None,
                        cp: int = 1):
    """One process: no groups. Under torchrun: data-parallel copies of ``pp`` pipeline stages of
    ``cp`` x ``tp`` ranks (the sequences split over cp, the weights over tp: the layout of
    ``meshlm eval --tp``), each MoE block's experts split over ``ep`` of the ranks (folded onto
    the copies, as training folds them), the process group joined here."""
    import torch.distributed as dist

    from meshlm.config import ParallelConfig
    from meshlm.parallel.mesh import ParallelContext, build_parallel_context

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    for flag, size in (("--tp", tp), ("--ep", ep), ("--pp", pp), ("--cp", cp), ("--tp x --pp x --cp", tp * pp * cp)):
        if world % size:
            raise ConfigError(f"{flag} {size} does not divide the {world} processes started; launch a multiple of "
                              f"{size} processes with torchrun (--nproc_per_node), or lower {flag}.")
    if ep > 1 and "E" not in config.block_kinds:
        raise ConfigError(f"--ep {ep}: the model has no MoE blocks (model.pattern={config.pattern!r}); leave --ep out.")
    if world == 1:
        return ParallelContext(device=device)
    try:
        return build_parallel_context(ParallelConfig(tp=tp, ep=ep, pp=pp, cp=cp), config, device, seq_len)
    except ConfigError as error:
        raise ConfigError(f"--tp {tp} --pp {pp} --cp {cp} --ep {ep} on {world} processes (--seq-len {seq_len}): "
                          f"{error}") from error


def calibration_model(source_dir: Path, context, seq_len: int = 1024):
    """This rank's tensor-parallel slices of the model in ``source_dir`` (all of it in one process),
    of its pipeline stage's blocks under pp > 1 (cut as training cuts them, by FLOPs at
    ``seq_len``): built on meta, cut by ``parallelize_model``, then filled from the files one
    tensor at a time in their stored dtypes (as training and ``meshlm eval`` build theirs), in
    eval mode."""
    from meshlm.checkpoint.materialize import materialize
    from meshlm.checkpoint.model_files import check_stored_tensors, read_model_config, source_file, weights_source
    from meshlm.models.language_model import LanguageModel
    from meshlm.parallel.context.context_parallel import apply_context_parallel
    from meshlm.parallel.parallelize import parallelize_model
    from meshlm.parallel.pipeline.stages import keep_stage_modules, rank_chunks

    config, source = read_model_config(source_dir), weights_source(source_dir)
    check_stored_tensors(config, source.layout, str(source_file(source_dir)))
    with torch.device("meta"):
        model = parallelize_model(LanguageModel(config), context)
    apply_context_parallel(model, context)  # ring attention, Mamba state hand-off (cp > 1)
    if context.pp_size > 1:
        chunks = rank_chunks(config, context.pp_size, 1, context.pp_rank, seq_len)
        keep_stage_modules(model, chunks, context.pp_rank, context.pp_size)
    dtypes = {name: dtype for name, (_, dtype) in source.layout.items()}
    return materialize(model, context, source, context.device, dtype=dtypes).eval()


def pipeline_stages(context, source_dir: Path):
    """The forward-only pipeline of a pp > 1 calibration (``importance_pipeline.py``; the hidden
    state travels in the stored embedding's dtype), else None."""
    if context.pp_size == 1:
        return None
    from meshlm.adapt.importance_pipeline import PipelineStages
    from meshlm.checkpoint.model_files import weights_source

    return PipelineStages(context, dict(weights_source(source_dir).layout)["embedding.weight"][1])


def sequence_shards(context):
    """How a cp > 1 calibration combines each sequence's chunks (``importance_sequence.py``), else None."""
    if context.cp_size == 1:
        return None
    from meshlm.adapt.importance_sequence import SequenceShards

    return SequenceShards(context)


def summed_over(group):
    """Sum a CPU score tensor in place over ``group``'s ranks (the model's copies)."""
    from meshlm.parallel.collectives import all_reduce_

    def reduce(tensor: torch.Tensor) -> None:
        on_device = tensor.to(group.device)
        all_reduce_(on_device, group)
        tensor.copy_(on_device.cpu())
    return reduce


def gathered_over(group):
    """A CPU score tensor -> every rank's of ``group`` concatenated in rank order (a TP group's slices)."""
    from meshlm.parallel.collectives import all_gather_into_

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        on_device = tensor.to(group.device)
        gathered = on_device.new_empty((group.size * on_device.shape[0], *on_device.shape[1:]))
        all_gather_into_(gathered, on_device, group)
        return gathered.cpu()
    return gather


def report(args, config, new_config, dropped, importance, out: Path, source_dir: Path) -> None:
    from meshlm.adapt.cli import parameter_count

    shape = (f"hidden {new_config.hidden_size}, pattern {new_config.pattern!r}"
             + (f", heads {new_config.num_attention_heads}/{new_config.resolved_num_kv_heads} kv"
                if "*" in new_config.block_kinds else "")
             + (f", ffn {new_config.resolved_ffn_hidden_size}" if "-" in new_config.block_kinds else "")
             + (f", mamba heads {new_config.resolved_mamba_num_heads}" if "M" in new_config.block_kinds else "")
             + (f", experts {new_config.moe_num_experts}" if "E" in new_config.block_kinds else "")
             + (f", own sizes in blocks {sorted(new_config.block_overrides)}" if new_config.block_overrides else ""))
    print(f"wrote {out}: {shape}; {parameter_count(new_config):,} parameters (from {parameter_count(config):,}"
          + (f", budget {args.target_params:,}" if args.target_params else "") + f"); importance from "
          f"{importance.samples} calibration samples" + (f"; dropped blocks {dropped}" if dropped else ""))
    print(f"distill it with: meshlm train CONFIG train.init_from={out} train.init_model_config=true "
          f"train.distill_from={source_dir} train.distill_loss=kl train.distill_temperature=1.0 "
          "train.distill_weight=1.0")


__all__ = ["add_arguments", "calibration_dataset", "parameter_budget", "run"]
