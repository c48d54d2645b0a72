"""Sharded construction (meshlm/training/build.py): every rank builds on ``meta`` and fills only its
shards, with the single-process model's values, and never allocates the whole model.

* Equality: on 4 spawned gloo ranks, at TP+SP with vocabulary padding, PP with tied embeddings
  (the last stage's copy), EP with expert tensor parallelism, CP and an MTP depth, every element
  of every rank's local parameters and buffers equals the same element of ``LanguageModel(config,
  seed)`` built whole in one process, and together the ranks cover every element of it.
* ``train.init_from``: at TP x EP x CP on 4 ranks, every element of every rank's tensors equals
  the same element of the folder it starts from -- a model folder (``model.safetensors``, read by
  slice) and a single-process training run's checkpoint (DCP shards, read by chunk) -- read whole
  and independently (safetensors' ``load_file``, ``read_global_tensors``); and the ranks cover it.
* Peak memory: the bytes torch allocates on each rank while ``build_model`` runs (the profiler's
  allocation timeline) stay within the rank's own shards plus one full tensor of the model (the
  initial value being sliced), and -- the check can fail -- building the whole model in the same
  process under the same measurement exceeds that bound.
"""
from __future__ import annotations

from pathlib import Path

import torch
import pytest
from safetensors.torch import load_file

from meshlm.checkpoint.model_files import save_model
from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.checkpoint.sharding import box_slices, tensor_chunks
from meshlm.config import load_run_config
from meshlm.models.init import state_tensors
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.mesh import build_parallel_context
from meshlm.training.build import build_model
from meshlm.training.trainer import Trainer
from tests.helpers.distributed import run_distributed
from tests.helpers.memory import peak_allocated_bytes

BASE = ["model.vocab_size=97", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=64", "model.mamba_head_dim=8", "model.mamba_state_size=8", "model.mamba_num_groups=2",
        "model.mamba_chunk_size=8", "model.moe_num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32",
        "model.moe_shared_expert_ffn_hidden_size=32", "train.seq_len=16", "train.micro_batch_size=1",
        "train.global_batch_size=4", "train.device=cpu", "train.seed=11"]
LAYOUTS = {
    "tp2 sp pp2 tied mtp": ["model.pattern=M*-E", "model.tie_embeddings=true", "model.mtp_depth=1",
                            "parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.vocab_pad_multiple=8"],
    "ep2 etp2": ["model.pattern=*E-E", "parallel.ep=2", "parallel.etp=2"],
    "tp2 ep2 etp1 cp2": ["model.pattern=M*E", "parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "parallel.cp=2"],
}


def run_config(overrides: list[str]):
    return load_run_config(None, [*BASE, *overrides])


def shards_equal_single_process(overrides: list[str], init_from: str | None = None) -> dict:
    """In each rank: build this rank's model; compare every chunk of it with the whole model --
    ``LanguageModel(config, seed)``, or the tensors of ``init_from`` read whole."""
    config = run_config(overrides)
    context = build_parallel_context(config.parallel, config.model, torch.device("cpu"), config.train.seq_len,
                                     config.train.global_batch_size // config.train.micro_batch_size)
    built = build_model(config, context, torch.device("cpu"), init_from=init_from)
    reference = whole_tensors(config, init_from)
    compared, mismatches, covered = 0, [], {}
    for name, tensor in state_tensors(built.model).items():
        assert not tensor.is_meta, name
        shape, chunks = tensor_chunks(tensor, tensor.data, context)
        assert shape == tuple(reference[name].shape), name
        for offsets, view in chunks:
            box = box_slices(offsets, view.shape)
            if not torch.equal(view, reference[name][box]):
                mismatches.append(f"{name} at {offsets}")
            compared += view.numel()
            covered.setdefault(name, set()).update(_elements(reference[name].shape, box))
    return {"compared": compared, "mismatches": mismatches, "covered": covered,
            "sizes": {name: value.numel() for name, value in reference.items()}}


def whole_tensors(config, init_from: str | None) -> dict[str, torch.Tensor]:
    if init_from is None:
        return state_tensors(LanguageModel(config.model, seed=config.train.seed))
    folder = Path(init_from)
    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    return {key.removeprefix("model/"): value for key, value in read_global_tensors(folder).items()
            if key.startswith("model/")}


def _elements(shape, box) -> set[int]:
    index = torch.arange(torch.Size(shape).numel()).view(tuple(shape))
    return set(index[box].flatten().tolist())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_holds_the_single_process_values_of_its_shards(layout):
    results = run_distributed(shards_equal_single_process, 4, LAYOUTS[layout], timeout_s=240)
    for rank, result in enumerate(results):
        assert result["compared"] > 0 and not result["mismatches"], (rank, result["mismatches"][:5])
    sizes = results[0]["sizes"]
    for name, size in sizes.items():  # every element of the model lives on some rank
        covered = set().union(*(result["covered"].get(name, set()) for result in results))
        assert len(covered) == size, f"{layout}: {name} covers {len(covered)} of {size} elements"


def test_init_from_a_model_folder_or_a_checkpoint_at_tp_ep_cp(make_config, tmp_path):
    layout = LAYOUTS["tp2 ep2 etp1 cp2"]
    model = run_config(layout).model
    save_model(LanguageModel(model, seed=5), tmp_path / "folder")  # other values than the run's seed 11 gives
    model_fields = [item for item in BASE if item.startswith("model.")] + [item for item in layout
                                                                          if item.startswith("model.")]
    Trainer(make_config(*model_fields, "train.steps=1", "train.eval_every=0", "train.save_every=1",
                        "train.seed=3", f"train.run_dir={tmp_path / 'run'}")).run()
    sources = {"model folder": tmp_path / "folder", "checkpoint": tmp_path / "run" / "checkpoints" / "step_1"}
    for kind, folder in sources.items():
        results = run_distributed(shards_equal_single_process, 4, layout, str(folder), timeout_s=240)
        for rank, result in enumerate(results):
            assert result["compared"] > 0 and not result["mismatches"], (kind, rank, result["mismatches"][:5])
        for name, size in results[0]["sizes"].items():
            covered = set().union(*(result["covered"].get(name, set()) for result in results))
            assert len(covered) == size, f"{kind}: {name} covers {len(covered)} of {size} elements"


def construction_peak(overrides: list[str]) -> dict:
    """In each rank: the peak bytes of build_model, the rank's own bytes, the largest full tensor
    and the peak of building the whole model."""
    torch.set_num_threads(1)
    config = run_config(overrides)
    context = build_parallel_context(config.parallel, config.model, torch.device("cpu"), config.train.seq_len,
                                     config.train.global_batch_size // config.train.micro_batch_size)
    holder = {}

    def build():
        holder["built"] = build_model(config, context, torch.device("cpu"))

    peak = peak_allocated_bytes(build)
    own = sum(tensor.numel() * tensor.element_size() for tensor in state_tensors(holder["built"].model).values())
    with torch.device("meta"):
        full = state_tensors(LanguageModel(config.model, seed=config.train.seed))
    largest = max(tensor.numel() * 4 for tensor in full.values())
    whole = sum(tensor.numel() * 4 for tensor in full.values())
    whole_peak = peak_allocated_bytes(lambda: LanguageModel(config.model, seed=config.train.seed))
    return {"peak": peak, "own": own, "largest": largest, "whole": whole, "whole_peak": whole_peak}


def test_no_rank_allocates_more_than_its_shards_and_one_tensor():
    # A model whose blocks dominate (vocabulary 97 x 256 is the largest single tensor) at tp2 x pp2.
    overrides = ["model.pattern=*-*-*-*-", "model.hidden_size=256", "model.ffn_hidden_size=1024",
                 "model.num_attention_heads=8", "parallel.tp=2", "parallel.pp=2"]
    results = run_distributed(construction_peak, 4, overrides, timeout_s=240)
    slack = 64 * 1024  # the allocator's own small tensors (generators, index arithmetic)
    for rank, result in enumerate(results):
        bound = result["own"] + result["largest"] + slack
        assert result["peak"] <= bound, (rank, result)
        assert result["own"] < result["whole"] / 3, (rank, result)
        assert result["whole_peak"] > bound, (rank, result)  # the measurement sees a whole build
