"""``meshlm prune`` end to end: calibration from a blend file or token-store prefixes, an atomic
folder with the tokenizer, a pruned model that generates, converts to Hugging Face and back, and
trains with ``train.init_model_config=true`` (the YAML's model ignored, with a note); the printed
distillation command; ``--per-block`` writes per-block sizes that total the averages and
generates; refusals that name the flag and leave nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.model_files import load_model, read_model_config, save_model
from meshlm.cli import main
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from tests.helpers.counting_corpus import write_corpus

LLAMA = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2, head_dim=8,
             ffn_hidden_size=64)



@pytest.fixture
def source(tmp_path) -> Path:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**LLAMA))
    blend = write_corpus(tmp_path / "data", num_documents=40, max_length=60)
    return save_model(model, tmp_path / "big", tokenizer_dir=blend.parent)


def logits(directory: Path) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        return load_model(directory).eval()(ids).logits


def test_prune_writes_a_model_that_generates_and_converts_to_hf_and_back(tmp_path, source, capsys):
    out = tmp_path / "small"
    code = main(["prune", str(source), str(out), "--calibration", str(tmp_path / "data" / "blend.json"),
                 "--samples", "8", "--seq-len", "16", "--batch-size", "4", "--hidden", "24", "--ffn", "32",
                 "--kv-heads", "1", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["big", "data", "small"]  # no temporary folder left
    assert (out / "tokenizer.json").is_file()
    config = read_model_config(out)
    assert (config.hidden_size, config.ffn_hidden_size, config.num_attention_heads, config.num_kv_heads,
            config.head_dim) == (24, 32, 2, 1, 8)
    assert json.loads((out / "config.json").read_text())["pruning"]["samples"] == 8
    assert (f"meshlm train CONFIG train.init_from={out} train.init_model_config=true train.distill_from={source} "
            "train.distill_loss=kl train.distill_temperature=1.0 train.distill_weight=1.0") in printed

    assert main(["generate", str(out), "--prompt", "t1 t4 t7", "--max-new-tokens", "4", "--greedy",
                 "--device", "cpu"]) == 0
    assert main(["convert", "meshlm-to-hf", str(out), str(tmp_path / "hf")]) == 0
    assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    assert torch.allclose(logits(tmp_path / "back"), logits(out), atol=1e-5)


def test_prefixes_and_a_budget_with_depth_pruning(tmp_path, source, capsys):
    out = tmp_path / "small"
    budget = LanguageModel(ModelConfig(**LLAMA)).num_parameters() // 2
    assert main(["prune", str(source), str(out), "--calibration", str(tmp_path / "data" / "corpus"),
                 "--samples", "6", "--seq-len", "16", "--target-params", str(budget), "--drop-blocks", "1",
                 "--device", "cpu"]) == 0
    pruned = load_model(out)
    assert pruned.config.num_blocks == 3 and pruned.num_parameters() <= budget
    assert f"budget {budget:,}" in capsys.readouterr().out


def test_per_block_writes_block_overrides_that_total_the_averages_and_generates(tmp_path, source, capsys):
    out = tmp_path / "small"
    assert main(["prune", str(source), str(out), "--calibration", str(tmp_path / "data" / "blend.json"),
                 "--samples", "8", "--seq-len", "16", "--ffn", "32", "--kv-heads", "1", "--per-block",
                 "--device", "cpu"]) == 0
    config = read_model_config(out)
    assert (config.ffn_hidden_size, config.num_kv_heads, config.num_attention_heads) == (32, 1, 2)
    assert sum(config.for_block(index).resolved_ffn_hidden_size for index in (1, 3)) == 2 * 32
    assert sum(config.for_block(index).resolved_num_kv_heads for index in (0, 2)) == 2 * 1
    assert json.loads((out / "config.json").read_text())["pruning"]["per_block"] is True
    model = load_model(out)
    for index in (1, 3):
        assert model.blocks[index].mixer.up_proj.weight.shape[0] == config.for_block(index).resolved_ffn_hidden_size
    assert main(["generate", str(out), "--prompt", "t1 t4 t7", "--max-new-tokens", "4", "--greedy",
                 "--device", "cpu"]) == 0


def test_per_block_with_a_budget_spreads_the_searched_averages_at_the_same_parameter_count(tmp_path, source, capsys):
    budget = LanguageModel(ModelConfig(**LLAMA)).num_parameters() * 6 // 10
    arguments = ["--calibration", str(tmp_path / "data" / "blend.json"), "--samples", "8", "--seq-len", "16",
                 "--target-params", str(budget), "--device", "cpu"]
    assert main(["prune", str(source), str(tmp_path / "uniform"), *arguments]) == 0
    assert main(["prune", str(source), str(tmp_path / "spread"), *arguments, "--per-block"]) == 0
    uniform, spread = read_model_config(tmp_path / "uniform"), read_model_config(tmp_path / "spread")
    assert spread.block_overrides, "the calibration scores differ between blocks, so their sizes should too"
    assert (spread.ffn_hidden_size, spread.num_kv_heads) == (uniform.ffn_hidden_size, uniform.num_kv_heads)
    assert load_model(tmp_path / "spread").num_parameters() == load_model(tmp_path / "uniform").num_parameters()
    assert load_model(tmp_path / "spread").num_parameters() <= budget


def test_init_model_config_trains_the_pruned_model_and_notes_the_ignored_model(tmp_path, source, capsys):
    out = tmp_path / "small"
    blend = tmp_path / "data" / "blend.json"
    assert main(["prune", str(source), str(out), "--calibration", str(blend), "--samples", "4", "--seq-len", "16",
                 "--ffn", "32", "--device", "cpu"]) == 0
    run = ["model.vocab_size=64", "model.hidden_size=48", "model.pattern=*-", "model.num_attention_heads=4",
           "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=2", "train.steps=2",
           "train.eval_every=0", "train.save_every=2", "train.progress=false", "train.tensorboard=false",
           "train.plot=false", "train.device=cpu", f"train.run_dir={tmp_path / 'run'}", f"data.blend={blend}",
           f"train.init_from={out}", "train.init_model_config=true"]
    assert main(["train", *run]) == 0
    notes = capsys.readouterr().err
    assert "train.init_model_config=true" in notes and "model.hidden_size" in notes and "model.pattern" in notes
    trained = load_model(tmp_path / "run" / "checkpoints" / "step_2")
    assert trained.config.to_dict() == read_model_config(out).to_dict()


def test_init_model_config_without_init_from_is_refused(tmp_path, capsys):
    assert main(["train", "train.init_model_config=true", "train.device=cpu", f"train.run_dir={tmp_path}"]) == 2
    assert "train.init_model_config=true takes the model from train.init_from" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, words", [
    (["--heads", "3"], "--heads 3 must be a multiple of --kv-heads 2"),
    (["--ffn", "128"], "--ffn 128 must lie in [1, 64]"),
    (["--drop-blocks", "4"], "--drop-blocks 4 must lie in [0, 3]"),
    (["--mamba-heads", "2"], "the model has no 'M' blocks"),
    ([], "say how to prune"),
    (["--per-block", "--target-params", "1000"], "--target-params 1000 is below the smallest model"),
    (["--per-block", "--ffn", "4"], "give --ffn at least 8"),
    (["--ffn", "32", "--ep", "2"], "--ep 2 does not divide the 1 processes started"),
    (["--ffn", "32", "--ep", "0"], "--ep 0 must be a positive integer"),
])
def test_refusals_name_the_flag_and_write_nothing(tmp_path, source, capsys, arguments, words):
    code = main(["prune", str(source), str(tmp_path / "small"), "--calibration", str(tmp_path / "data" / "blend.json"),
                 "--device", "cpu", *arguments])
    assert code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "small").exists()


def test_an_existing_out_is_refused(tmp_path, source, capsys):
    (tmp_path / "small").mkdir()
    assert main(["prune", str(source), str(tmp_path / "small"), "--calibration", "x.json", "--ffn", "8"]) == 2
    assert "already exists" in capsys.readouterr().err


# --- under torchrun: tensor- and data-parallel calibration -----------------------------------------------

HYBRID = dict(vocab_size=64, hidden_size=32, pattern="M*-E", num_attention_heads=4, num_kv_heads=2, head_dim=8,
              ffn_hidden_size=64, mamba_head_dim=8, mamba_state_size=8, mamba_num_groups=2, mamba_chunk_size=8,
              moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16)
"""Every kind of unit: Mamba heads, attention heads, MLP neurons, experts."""
PRUNE_HYBRID = ["--samples", "6", "--seq-len", "16", "--batch-size", "2", "--hidden", "24", "--ffn", "32",
                "--kv-heads", "1", "--mamba-heads", "4", "--experts", "2", "--drop-blocks", "1", "--device", "cpu"]


def prune_and_score(source: str, blend: str, out: str, tp: int, ep: int = 1, pp: int = 1, cp: int = 1) -> dict:
    """On every rank (or in one process): ``meshlm prune --tp tp`` into ``out``, then the importance
    scores of the same layout and samples (the CLI's own pieces), as plain tensors."""
    from meshlm.adapt.importance import collect_importance
    from meshlm.adapt.prune_cli import (calibration_batches, calibration_context, calibration_dataset,
                                        calibration_model, gathered_over, pipeline_stages, sequence_shards,
                                        summed_over)

    torch.set_num_threads(1)
    assert main(["prune", source, out, "--calibration", blend, *PRUNE_HYBRID, "--tp", str(tp), "--ep", str(ep),
                 "--pp", str(pp), "--cp", str(cp)]) == 0
    config = read_model_config(Path(source))
    context = calibration_context(config, torch.device("cpu"), tp, ep, pp, 16, cp)
    dataset = calibration_dataset([blend], 16, 6, 1234, config.vocab_size)
    model = calibration_model(Path(source), context, 16)
    if pp == 1:
        assert model.blocks[3].mixer.experts.up_weight.shape[0] == HYBRID["moe_num_experts"] // ep  # this rank's
    else:
        assert 0 < len(model.blocks) < 4  # this stage's blocks only
    batches = list(calibration_batches(dataset, 2, context.dp_rank, context.dp_size, torch.device("cpu"), context))
    assert batches[0]["input_ids"].shape[1] == 16 // cp  # this rank's chunks of each sequence
    importance = collect_importance(
        model, batches,
        depth_metric="loss", reduce=summed_over(context.dp_group) if context.dp_size > 1 else None,
        gather=gathered_over(context.tp_group) if context.tp_size > 1 else None,
        stages=pipeline_stages(context, Path(source)), sequence=sequence_shards(context))
    scores = {"hidden": importance.hidden, "blocks": importance.blocks}
    for kind in ("heads", "neurons", "mamba_heads", "experts"):
        scores.update({f"{kind} {block}": value for block, value in getattr(importance, kind).items()})
    return scores


def test_tp2_dp2_ep2_pp2_and_cp2_calibration_prunes_exactly_as_one_process(tmp_path):
    from safetensors.torch import load_file

    from tests.helpers.distributed import run_distributed

    torch.manual_seed(0)
    blend = write_corpus(tmp_path / "data", num_documents=40, max_length=60)
    source = save_model(LanguageModel(ModelConfig(**HYBRID)), tmp_path / "big", tokenizer_dir=blend.parent)
    single = prune_and_score(str(source), str(blend), str(tmp_path / "single"), 1)
    layouts = (("tp2", 2, 1, 1, 1), ("dp2", 1, 1, 1, 1), ("ep2", 1, 2, 1, 1), ("pp2", 1, 1, 2, 1), ("cp2", 1, 1, 1, 2))
    for layout, tp, ep, pp, cp in layouts:
        by_rank = run_distributed(prune_and_score, 2, str(source), str(blend), str(tmp_path / layout), tp, ep, pp, cp,
                                  timeout_s=120)
        for rank, scores in enumerate(by_rank):
            assert set(scores) == set(single), (layout, rank)
            for name, value in single.items():  # float sums in another order: equal to fp32 rounding
                atol = 2e-6 if name == "blocks" else 1e-7  # loss increases: differences of two losses of ~4
                assert torch.allclose(scores[name], value, rtol=1e-5, atol=atol), (layout, rank, name)
        expected, actual = load_file(tmp_path / "single" / "model.safetensors"), load_file(
            tmp_path / layout / "model.safetensors")
        assert set(actual) == set(expected), layout
        for name, value in expected.items():  # the same units kept: the same values, bit for bit
            assert torch.equal(actual[name], value), (layout, name)
        assert read_model_config(tmp_path / layout).to_dict() == read_model_config(tmp_path / "single").to_dict()
