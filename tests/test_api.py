"""The Python API of ``meshlm/__init__.py``: load_config, train, load_model, load_tokenizer, generate, convert.

One tiny model is trained through the API on the counting corpus of tests/training/conftest.py
(every document counts up in steps of 3, mod 63), long enough to learn the rule, so the checks
are on real results: the trained model continues "t0 t3 t6 t9" with "t12 t15 ...", whatever the
form of the prompt; a run resumed through ``meshlm.train`` continues at the saved step; a model
converted to Hugging Face and back gives the same logits as the trained one. And ``import
meshlm`` stays free of torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import meshlm
from meshlm.config import save_run_config
from meshlm.data.tokenizer import Tokenizer
from meshlm.inference.generate import generate as generate_ids
from meshlm.inference.sampling import SamplingConfig
from meshlm.training.metrics import read_metrics
from tests.helpers.counting_corpus import write_corpus

TESTS = Path(__file__).resolve().parent
STEPS = 40
COUNTING = [0, 3, 6, 9]
NEXT = [12, 15, 18, 21, 24]



def tiny_overrides(blend: Path, run_dir: Path, steps: int = STEPS) -> list[str]:
    return ["model.vocab_size=64", "model.hidden_size=32", "model.pattern=*-", "model.num_attention_heads=4",
            "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={steps}",
            "train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.progress=false",
            "train.tensorboard=false", "train.plot=false", "train.device=cpu", f"train.run_dir={run_dir}",
            f"data.blend={blend}", "data.split=90,10,0", "optim.lr=1e-2", "optim.warmup_steps=5"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(blend, run directory, TrainResult) of a tiny run trained through ``meshlm.train``."""
    root = tmp_path_factory.mktemp("api")
    blend = write_corpus(root / "corpus")
    config = meshlm.load_config(None, overrides=tiny_overrides(blend, root / "run"))
    return blend, root / "run", meshlm.train(config)


def test_import_meshlm_loads_no_torch_and_the_classes_load_on_first_use():
    code = ("import sys, meshlm; assert 'torch' not in sys.modules, 'torch imported'; "
            "from meshlm import ModelConfig, LanguageModel, LMOutput, RunConfig, ConfigError; "
            "assert 'torch' in sys.modules; print(LanguageModel.__module__, RunConfig.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["meshlm.models.language_model", "meshlm.config"]
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        meshlm.Trainer  # noqa: B018
    assert set(meshlm.__all__) <= set(dir(meshlm))


def test_load_config_reads_yaml_and_overrides_like_the_command_line(tmp_path):
    config = meshlm.load_config(TESTS.parent / "configs" / "tiny.yaml", overrides=["train.steps=7", "optim.lr=1e-3"])
    assert isinstance(config, meshlm.RunConfig)
    assert (config.train.steps, config.optim.lr, config.model.pattern) == (7, 1e-3, "*-*-*-*-")
    assert meshlm.load_config().train.steps == meshlm.RunConfig().train.steps  # no file: the defaults
    with pytest.raises(meshlm.ConfigError, match="unknown config key 'train.step'. Did you mean train.steps"):
        meshlm.load_config(None, overrides=["train.step=3"])
    with pytest.raises(meshlm.ConfigError, match="must be a list of section.key=value strings"):
        meshlm.load_config(None, overrides="train.steps=3")


def test_train_runs_the_trainer_in_process_and_logs_every_step(trained):
    _, run_dir, result = trained
    assert result.run_dir == run_dir and result.step == STEPS and result.stopped_by is None
    assert sorted(result.losses) == list(range(1, STEPS + 1))
    logged = {record["step"]: record["loss"] for record in read_metrics(run_dir / "metrics.jsonl")
              if "loss" in record and "event" not in record}
    assert logged == result.losses
    assert result.losses[STEPS] < 0.5 * result.losses[1]  # it learned
    assert (run_dir / "checkpoints" / f"step_{STEPS}" / "config.json").is_file()


@pytest.mark.filterwarnings("ignore:resuming")  # the longer run's schedule is recomputed: expected here
def test_train_from_a_yaml_path_resumes_the_run_directory(trained, tmp_path):
    blend, run_dir, first = trained
    copy = tmp_path / "run"
    config = meshlm.load_config(None, [*tiny_overrides(blend, copy, steps=2), "optim.warmup_steps=1"])
    meshlm.train(config)
    yaml_file = tmp_path / "run.yaml"
    save_run_config(config, yaml_file)
    resumed = meshlm.train(yaml_file, overrides=["train.steps=4"])
    assert resumed.step == 4 and sorted(resumed.losses) == [3, 4]  # steps 1-2 came from the checkpoint
    with pytest.raises(meshlm.ConfigError, match="overrides apply to a YAML path"):
        meshlm.train(config, overrides=["train.steps=5"])


def test_load_model_takes_a_run_directory_a_checkpoint_or_a_model_folder(trained):
    _, run_dir, _ = trained
    from_run = meshlm.load_model(run_dir)
    from_checkpoint = meshlm.load_model(run_dir / "checkpoints" / f"step_{STEPS}")
    assert isinstance(from_run, meshlm.LanguageModel) and not from_run.training
    assert from_run.config.pattern == "*-" and from_run.config.vocab_size == 64
    for (name, a), (other, b) in zip(from_run.state_dict().items(), from_checkpoint.state_dict().items()):
        assert name == other and torch.equal(a, b), name
    with pytest.raises(meshlm.CheckpointError, match="missing: no such model"):
        meshlm.load_model(run_dir / "missing")


def test_generate_text_in_text_out_ids_in_ids_out(trained):
    _, run_dir, _ = trained
    model = meshlm.load_model(run_dir)
    tokenizer = meshlm.load_tokenizer(run_dir)
    assert isinstance(tokenizer, Tokenizer)
    text = meshlm.generate(model, "t0 t3 t6 t9", max_new_tokens=5, tokenizer=run_dir, greedy=True)
    assert text == " ".join(f"t{token}" for token in NEXT)
    ids = meshlm.generate(model, COUNTING, max_new_tokens=5, greedy=True)
    assert ids == NEXT
    reference = generate_ids(model, [COUNTING], 5, SamplingConfig(greedy=True))[0]
    assert ids == reference  # the library's own generation, nothing added
    batch = meshlm.generate(run_dir, ["t0 t3 t6 t9", "t10 t13"], max_new_tokens=3, greedy=True)  # a path: own tokenizer
    assert batch == ["t12 t15 t18", "t16 t19 t22"]
    assert meshlm.generate(model, [COUNTING, [10, 13]], max_new_tokens=3, greedy=True) == [NEXT[:3], [16, 19, 22]]
    with pytest.raises(meshlm.ConfigError, match="a text prompt needs a tokenizer"):
        meshlm.generate(model, "t0 t3", max_new_tokens=2)


def test_generate_holds_replies_to_a_json_schema(trained, tmp_path):
    """``json_schema=``: the replies (sampled from a random model with a byte-level BPE) are documents
    of the schema; a vocabulary that cannot spell JSON, or no tokenizer, is refused in one sentence."""
    import json

    from meshlm.checkpoint.model_files import save_model
    from tests.helpers.generation_model import tiny_model, write_sentence_tokenizer

    folder = save_model(tiny_model(), tmp_path / "model", tokenizer_dir=write_sentence_tokenizer(tmp_path / "tok"))
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}
    replies = meshlm.generate(folder, ["the cat", "a dog"], max_new_tokens=80, seed=1, json_schema=schema)
    assert all(1 <= len(json.loads(reply)) <= 2 for reply in replies), replies
    _, run_dir, _ = trained
    with pytest.raises(meshlm.ConfigError, match="no token of this vocabulary can begin a document"):
        meshlm.generate(run_dir, "t0 t3", max_new_tokens=3, json_schema={"type": "object"})
    with pytest.raises(meshlm.ConfigError, match="json_schema holds replies to a schema, which needs the tokenizer"):
        meshlm.generate(meshlm.load_model(run_dir), [1, 2], max_new_tokens=3, json_schema={"type": "object"})


def test_generate_samples_reproducibly_by_seed(trained):
    _, run_dir, _ = trained
    model = meshlm.load_model(run_dir)
    first = meshlm.generate(model, [5, 8], max_new_tokens=8, temperature=2.0, top_k=10, seed=3)
    assert first == meshlm.generate(model, [5, 8], max_new_tokens=8, temperature=2.0, top_k=10, seed=3)
    assert len(first) == 8 and all(0 <= token < 64 for token in first)


def test_convert_to_hugging_face_and_back_keeps_the_logits(trained, tmp_path):
    _, run_dir, _ = trained
    hf_dir = meshlm.convert(run_dir, tmp_path / "hf", to="hf")
    assert sorted(path.name for path in hf_dir.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    back = meshlm.convert(hf_dir, tmp_path / "back", to="meshlm")
    tokens = torch.tensor([COUNTING + [12, 15]])
    expected = meshlm.load_model(run_dir)(tokens).logits
    torch.testing.assert_close(meshlm.load_model(back)(tokens).logits, expected, rtol=0, atol=0)
    with pytest.raises(meshlm.ConfigError, match="to='gguf' must be 'hf'"):
        meshlm.convert(run_dir, tmp_path / "x", to="gguf")
    with pytest.raises(meshlm.CheckpointError):  # refused: not empty
        meshlm.convert(run_dir, hf_dir, to="hf")
    with pytest.raises(meshlm.CheckpointError, match="has no LoRA adapters"):
        meshlm.convert(run_dir, tmp_path / "adapter", to="hf", lora="adapter")
    with pytest.raises(meshlm.ConfigError, match="lora='both' must be one of merged, base, adapter"):
        meshlm.convert(run_dir, tmp_path / "adapter", to="hf", lora="both")
