"""RunConfig: YAML loading, dotted overrides, type checks, validation errors, and the shipped configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshlm.config import RunConfig, build_run_config, known_keys, load_run_config, parse_override, save_run_config
from meshlm.data.demo_corpus import DemoSettings
from meshlm.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_then_overrides(tmp_path):
    path = write(tmp_path, "model:\n  hidden_size: 48\n  pattern: 'M*-'\ntrain:\n  steps: 10\noptim:\n  lr: 1e-3\n")
    config = load_run_config(path, ["train.steps=20", "optim.schedule=wsd", "data.prefixes=[a, b]",
                                    "data.weights=[1, 3]", "train.tensorboard=false"])
    assert config.model.hidden_size == 48 and config.model.block_kinds == ("M", "*", "-")
    assert config.train.steps == 20  # the override wins over the file
    assert config.optim.lr == 1e-3 and isinstance(config.optim.lr, float)  # YAML reads '1e-3' as a string
    assert config.optim.schedule == "wsd" and config.train.tensorboard is False
    assert config.data.prefixes == ["a", "b"] and config.data.weights == [1, 3]
    assert config.train.micro_batch_size == RunConfig().train.micro_batch_size  # untouched default


def test_defaults_without_a_file():
    config = load_run_config(None, ["model.vocab_size=128"])
    assert config.model.vocab_size == 128 and config.train.device == "auto"
    assert config.precision.dtype == "auto"  # bf16 on CUDA, fp32 on CPU, resolved by the trainer


def test_round_trip_through_yaml(tmp_path):
    config = load_run_config(None, ["model.pattern=*E", "model.moe_num_experts=4", "train.seq_len=64",
                                    "precision.dtype=bf16", "data.tokenizer=tok.json"])
    save_run_config(config, tmp_path / "saved.yaml")
    assert load_run_config(tmp_path / "saved.yaml").to_dict() == config.to_dict()


@pytest.mark.parametrize("overrides, message", [
    (["train.stpes=3"], r"unknown config key 'train.stpes'. Did you mean train.steps"),
    (["optim.learning_rate=1"], r"unknown config key 'optim.learning_rate'"),
    (["trian.steps=3"], r"unknown config key 'trian.steps'"),
    (["model.hiden_size=3"], r"Did you mean model.hidden_size"),
    (["train.steps=ten"], r"train.steps='ten' has the wrong type; expected int"),
    (["train.steps=2.5"], r"train.steps=2.5 has the wrong type"),
    (["train.steps=true"], r"train.steps=True has the wrong type"),
    (["train.plot=maybe"], r"train.plot='maybe' has the wrong type; expected bool"),
    (["train.seq_len=null"], r"train.seq_len cannot be null"),
    (["train.steps"], r"must look like section.key=value"),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], r"multiple of train.micro_batch_size=4"),
    (["train.steps=0"], r"train.steps=0 must be a positive integer"),
    (["train.time_limit_minutes=-1"], r"train.time_limit_minutes=-1.0 must be >= 0; give the job's wall-clock"),
    (["train.time_limit_minutes=.nan"], r"train.time_limit_minutes=nan must be >= 0"),
    (["optim.schedule=linear"], r"optim.schedule='linear' is not one of cosine, wsd, constant"),
    (["precision.dtype=fp8"], r"precision.dtype='fp8' is not one of auto, fp32, bf16, fp16"),
    (["optim.min_lr=1", "optim.lr=0.1"], r"optim.min_lr"),
    (["data.prefixes=[a]", "data.weights=[1, 2]"], r"data.weights has 2 entries but data.prefixes has 1"),
    (["model.pattern=*X"], r"model.pattern"),
    (["parallel.zero_stage=4"], r"parallel.zero_stage=4 must be 0, 1, 2 or 3"),
    (["parallel.reduce_grads_in_fp32=false", "parallel.distributed_optimizer=true"],
     r"parallel.reduce_grads_in_fp32=false needs parallel.zero_stage=2 or 3"),
])
def test_override_errors_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, overrides)


def test_unknown_key_in_the_file_gets_close_matches(tmp_path):
    with pytest.raises(ConfigError, match=r"'train.save_evry'. Did you mean train.save_every"):
        load_run_config(write(tmp_path, "train:\n  save_evry: 5\n"))


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_run_config(write(tmp_path, "train: [steps: 3\n"))
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_run_config(write(tmp_path, "- just a list\n"))
    with pytest.raises(ConfigError, match="config section 'train' must be a mapping"):
        load_run_config(write(tmp_path, "train: 5\n"))


def test_parse_override_reads_yaml_values():
    assert parse_override("train.steps=200") == ("train.steps", 200)
    assert parse_override("model.pattern=M*-E") == ("model.pattern", "M*-E")
    assert parse_override("data.tokenizer=") == ("data.tokenizer", "")
    assert parse_override("data.weights=[0.5, 0.5]") == ("data.weights", [0.5, 0.5])


def test_known_keys_cover_every_section():
    keys = known_keys()
    for key in ("model.pattern", "train.run_dir", "train.device", "optim.lr", "data.blend", "precision.dtype"):
        assert key in keys
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("name, kinds", [("tiny", {"*", "-"}), ("hybrid-tiny", {"M", "*", "-"}),
                                         ("moe-tiny", {"*", "E"}), ("demo-mtp", {"M", "*", "-", "E"}),
                                         ("gemma2-tiny", {"*", "-"}), ("gemma3-tiny", {"*", "-"}),
                                         ("gpt2-tiny", {"*", "-"}), ("pythia-tiny", {"*", "-"}),
                                         ("olmo2-tiny", {"*", "-"}), ("deepseek-v3-tiny", {"*", "-", "E"}),
                                         ("gpt-oss-tiny", {"*", "E"})])
def test_shipped_configs_load_and_match_the_demo_data(name, kinds):
    config = load_run_config(CONFIGS / f"{name}.yaml")
    assert set(config.model.block_kinds) == kinds
    if name == "demo-mtp":  # the demo model plus MTP depths to draft with (meshlm generate --speculative mtp)
        demo = dataclasses.asdict(load_run_config(CONFIGS / "demo.yaml").model)
        with_mtp = dataclasses.asdict(config.model)
        assert config.model.mtp_depth == 2
        assert {key for key in demo if demo[key] != with_mtp[key]} <= {"mtp_depth", "mtp_pattern", "mtp_loss_coeff"}
    assert config.model.vocab_size == DemoSettings().vocab_size  # the demo tokenizer's vocabulary
    assert config.data.blend == "data/demo/blend.json"
    assert config.train.run_dir == f"runs/{name}"
    if "E" in kinds:
        assert config.model.moe_aux_loss_coeff > 0 and config.model.moe_z_loss_coeff > 0
    if name == "gemma3-tiny":  # the layer the Gemma 3 conversion writes, so it exports as one
        from meshlm.hf import choose_architecture
        assert config.model.embedding_multiplier == config.model.hidden_size ** 0.5
        assert choose_architecture(config.model).name == "Gemma3ForCausalLM"
    if name == "gpt-oss-tiny":  # the layer the gpt-oss conversion writes, sinks and biased experts included
        from meshlm.hf import choose_architecture
        assert config.model.attention_sinks and config.model.moe_expert_linear_bias
        assert choose_architecture(config.model).name == "GptOssForCausalLM"
    if name == "gemma2-tiny":  # the layer the Gemma 2 conversion writes, soft caps included
        from meshlm.hf import choose_architecture
        assert (config.model.attention_softcap, config.model.final_logit_softcap) == (50.0, 30.0)
        assert choose_architecture(config.model).name == "Gemma2ForCausalLM"
    if name == "gpt2-tiny":  # the layer the GPT-2 conversion writes, its table as long as the samples
        from meshlm.hf import choose_architecture
        assert config.model.max_position_embeddings == config.train.seq_len
        assert choose_architecture(config.model).name == "GPT2LMHeadModel"
    if name == "pythia-tiny":  # the layer the GPT-NeoX conversion writes
        from meshlm.hf import choose_architecture
        assert config.model.parallel_residual and config.model.rotary_dim == 6
        assert choose_architecture(config.model).name == "GPTNeoXForCausalLM"
    if name == "olmo2-tiny":
        from meshlm.hf import choose_architecture
        assert choose_architecture(config.model).name == "Olmo2ForCausalLM"


def test_build_run_config_from_a_dict():
    config = build_run_config({"train": {"steps": 7}, "optim": {"warmup_steps": 0}})
    assert config.train.steps == 7 and config.optim.warmup_steps == 0
