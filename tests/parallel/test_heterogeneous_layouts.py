"""A heterogeneous stack (``model.block_overrides``, linear and no-op blocks) under parallel layouts.

The stack has every block kind -- Mamba, attention, MLP, MoE, linear ``L``, no-op ``0`` -- and
per-block sizes: a Mamba block with fewer heads, an attention block with fewer query and KV heads
(one KV head: replicated under tp2), one with more KV heads (split), a narrower MLP, an MoE block
with fewer and narrower experts. Checked in spawned gloo worlds against one process, in fp32:

* one training step at tp2 x pp2 (world 4), with and without sequence parallelism: loss terms,
  per-expert counts, every gradient, the global norm and an evaluation equal the single process
  (the step and its comparison are ``tests/parallel/pipeline/test_pipelined_model.py``'s); the
  pipeline stages are cut by the blocks' own FLOPs;
* the trainer, configured from the command line, for 5 steps at cp2 x dp2 x ep2: losses, grad
  norms, validation losses and final parameters equal the single-process trainer's;
* a distributed checkpoint saved at tp2 holds the single-process tensors, and loads back at tp2
  into a model initialized differently, restoring every parameter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.pipeline.stages import stage_starts
from tests.helpers.distributed import import_test_file, run_distributed

pipeline = import_test_file(Path(__file__).parent / "pipeline" / "test_pipelined_model.py",
                            "meshlm_pipelined_model_tests")

HETEROGENEOUS = dict(
    vocab_size=64, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
    pattern="M*-EL0*-", mamba_head_dim=8, mamba_state_size=8, mamba_num_groups=2, mamba_chunk_size=8,
    moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
    block_overrides={0: {"mamba_num_heads": 4}, 1: {"num_attention_heads": 2, "num_kv_heads": 1},
                     2: {"ffn_hidden_size": 32}, 3: {"moe_num_experts": 2, "moe_ffn_hidden_size": 16},
                     6: {"num_kv_heads": 4}})


def test_heterogeneous_stack_trains_at_tp2_pp2_like_one_process():
    runs = [("tp2 pp2 sp", HETEROGENEOUS, dict(tp=2, pp=2, sp=True)),
            ("tp2 pp2", HETEROGENEOUS, dict(tp=2, pp=2))]
    results = run_distributed(pipeline.pipelined_steps, 4, runs, timeout_s=180)
    expected = pipeline.single_process_step(HETEROGENEOUS)
    assert {"lm", "moe_aux", "moe_z"} <= set(expected["terms"])
    assert [len(counts) for counts in expected["counts"]] == [2]  # the MoE block's own expert count
    for name, _, _ in runs:
        for rank, by_run in enumerate(results):
            pipeline.assert_same_step(by_run[name], expected, f"{name} rank {rank}")
    # the stages are cut by FLOPs: blocks 0-3 (Mamba, narrow attention, MLP, MoE) vs the rest
    assert stage_starts(ModelConfig(**HETEROGENEOUS), 2, pipeline.SEQ_LEN) == [0, 4]


def as_overrides(model_kwargs: dict) -> list[str]:
    """The model as command-line overrides (``model.block_overrides='{0: {...}}'`` included)."""
    return [f"model.{key}={value}" for key, value in model_kwargs.items()]


def test_heterogeneous_stack_trains_with_the_trainer_under_cp_and_ep_like_one_process(tmp_path):
    """The trainer itself (5 steps), set from the command line, at cp2 x dp2 with ep2 (the experts
    over the folded dp x cp ranks) against the single-process trainer."""
    training = import_test_file(Path(__file__).parents[1] / "training" / "test_parallel_training.py",
                                "meshlm_parallel_training_helpers")
    blend = training.write_tiny_corpus(tmp_path / "corpus")
    model = as_overrides(HETEROGENEOUS)
    runs = [("cp2 ep2", model + ["parallel.cp=2", "parallel.dp=2", "parallel.ep=2"])]
    results = run_distributed(training.train_runs, 4, str(blend), str(tmp_path), runs, timeout_s=240)
    expected = training.train_once(blend, tmp_path / "single", model)
    for rank, by_run in enumerate(results):
        training.assert_same_run(by_run["cp2 ep2"], expected, f"cp2 ep2 rank {rank}")


def save_and_reload_at_tp2(model_kwargs: dict, run_dir: str) -> dict:
    """In each rank: save a tp2 checkpoint of the seed-0 model, load it into a seed-1 model; return
    the reloaded model's full state (gathered over TP) and the checkpoint's path."""
    from meshlm.checkpoint.distributed import Checkpointer, save_checkpoint
    from meshlm.checkpoint.global_state import TrainingParts
    from meshlm.checkpoint.training_checkpoint import TrainerState
    from meshlm.config import build_run_config
    from meshlm.parallel.data.data_parallel import build_data_parallel
    from meshlm.parallel.mesh import build_parallel_context
    from meshlm.parallel.parallelize import parallelize_model
    from meshlm.parallel.tensor.sharding import gather_full_state_dict
    from meshlm.precision.mixed_precision import MixedPrecision

    torch.set_num_threads(1)
    run_config = build_run_config({"model": model_kwargs, "parallel": {"tp": 2, "sp": True},
                                   "train": {"seq_len": 16, "micro_batch_size": 2, "global_batch_size": 2}})
    context = build_parallel_context(run_config.parallel, run_config.model, torch.device("cpu"), 16, 1)

    def parts(seed: int) -> TrainingParts:
        model = parallelize_model(LanguageModel(run_config.model, seed=seed), context)
        precision = MixedPrecision(model, run_config.precision)
        _, optimizer = build_data_parallel(precision, run_config.optim, run_config.parallel, context)
        return TrainingParts(model, optimizer, precision, context)

    saved = parts(seed=0)
    path = save_checkpoint(run_dir, TrainerState(step=1), saved.model, saved.optimizer, saved.precision,
                           run_config, keep=1, context=context)
    loaded = parts(seed=1)
    Checkpointer(run_dir, run_config, context).load(path, loaded)
    state = {name: tensor.clone() for name, tensor in gather_full_state_dict(loaded.model, context).items()}
    return {"state": state, "path": str(path)}


def test_heterogeneous_checkpoint_saves_and_loads_at_tp2(tmp_path):
    results = run_distributed(save_and_reload_at_tp2, 2, HETEROGENEOUS, str(tmp_path), timeout_s=120)
    expected = LanguageModel(ModelConfig(**HETEROGENEOUS), seed=0).state_dict()
    stored = read_global_tensors(results[0]["path"], keys=[f"model/{name}" for name in expected])
    for name, tensor in expected.items():
        assert torch.equal(stored[f"model/{name}"], tensor), name  # the single-process tensors, per block
        for rank, result in enumerate(results):
            assert torch.equal(result["state"][name][:tensor.shape[0]], tensor), (rank, name)
