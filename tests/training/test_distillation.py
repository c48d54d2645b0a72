"""``train.distill_from``: knowledge distillation from a teacher, through the real trainer.

- The loss of one micro-batch equals a hand computation from both models' full logits, for each
  ``train.distill_loss`` (``F.kl_div`` on temperature log-softmaxes times T^2, or
  ``F.cosine_similarity``), mixed with the LM loss as (1 - w) * LM + w * distill.
- ``train.distill_blocks``: each block's term is ``F.mse_loss`` of the student block on the
  teacher block's input (captured by forward hooks on the teacher's plain forward) against the
  teacher block's output.
- Layout independence: tp2 (with SP, and with a padded vocabulary), dp2 with the distributed
  optimizer, and an MoE student and teacher at ep2, on 2 spawned gloo ranks, equal one process:
  every step's loss, gradient norm, logged 'lm' and 'distill' terms, the validation loss and
  the final parameters within 1e-5 (the helpers of test_parallel_training.py). Block-wise
  distillation likewise at tp2 + SP and dp2.
- Training: a pruned student's KL to a trained teacher (given as a run directory) falls, and
  block-wise distillation brings each student block towards the teacher's.
- Bad inputs are refused with one sentence naming the key and the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshlm.checkpoint.model_files import save_model
from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.training.metrics import read_metrics
from meshlm.training.trainer import Trainer
from tests.helpers.distributed import import_test_file, run_distributed
from tests.helpers.tiny_training import relative_error

HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""

TEACHER = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, ffn_hidden_size=128)
"""The dense teacher: as many blocks as the student, twice its FFN width (a student pruned in width)."""
MOE_TEACHER = dict(vocab_size=64, hidden_size=32, pattern="*E*-", num_attention_heads=4, moe_num_experts=4,
                   moe_top_k=2, moe_ffn_hidden_size=48, ffn_hidden_size=96)
STUDENT = HELPERS.MODELS["dense"]  # *-*-, 2 KV heads, FFN 64 (run_config's)


def save_teacher(directory: Path, seed: int, **config) -> Path:
    """A randomly initialized teacher, its blocks' matrices 4x and its final norm gain 8x their
    initial size: a freshly initialized pair's KL is ~1e-2 and its blocks' outputs differ by
    ~1e-5 (close to what fp32 resolves); this teacher's distributions are far from uniform and
    its blocks change the residual stream, as a trained model's do."""
    torch.manual_seed(seed)
    model = LanguageModel(ModelConfig(**config))
    with torch.no_grad():
        model.final_norm.weight.mul_(8.0)
        for param in model.blocks.parameters():
            if param.ndim >= 2:
                param.mul_(4.0)
    return save_model(model, directory)


def distilled(teacher: Path, *overrides: str) -> list[str]:
    return [f"train.distill_from={teacher}", *overrides]


# --- one micro-batch by hand ------------------------------------------------------------------------

def hand_distillation(student_logits, teacher_logits, labels, kind: str, temperature: float) -> torch.Tensor:
    """The per-token mean of the plain torch formulas, in float64 (the reference)."""
    student, teacher = student_logits.flatten(0, 1).double(), teacher_logits.flatten(0, 1).double()
    keep = labels.flatten() != -100
    student, teacher = student[keep], teacher[keep]
    if kind == "cosine":
        return (1 - F.cosine_similarity(student, teacher, dim=-1)).mean()
    log_q, log_p = F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1)
    if kind in ("kl", "forward_kl"):  # KL(p || q): F.kl_div(input=log q, target=log p)
        return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * temperature ** 2
    return F.kl_div(log_p, log_q, log_target=True, reduction="batchmean") * temperature ** 2


@pytest.mark.parametrize("kind", ["kl", "forward_kl", "reverse_kl", "cosine"])
def test_the_loss_of_a_micro_batch_equals_the_hand_computation(make_config, tmp_path, kind):
    teacher_dir = save_teacher(tmp_path / "teacher", 3, vocab_size=64, hidden_size=48, pattern="*-*",
                               num_attention_heads=4)
    weight, temperature = 0.3, 2.0
    trainer = Trainer(make_config(*distilled(teacher_dir, f"train.distill_loss={kind}",
                                             f"train.distill_temperature={temperature}",
                                             f"train.distill_weight={weight}")))
    batch = trainer.next_micro_batches()[0]
    batch["labels"][0, :3] = -100  # ignored positions count in neither term
    output = trainer.distillation.forward(trainer.model, batch)
    with torch.no_grad():
        student_logits = trainer.model(batch["input_ids"]).logits
        teacher_logits = trainer.distillation.teacher(batch["input_ids"]).logits
    expected = hand_distillation(student_logits, teacher_logits, batch["labels"], kind, temperature)
    lm = F.cross_entropy(student_logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert expected > 0.05
    assert relative_error(output.losses["distill"], expected) <= 1e-5
    assert relative_error(output.losses["lm"], lm) <= 1e-5
    assert relative_error(output.loss, (1 - weight) * lm + weight * expected) <= 1e-5
    assert not trainer.distillation.teacher.training
    assert not any(param.requires_grad for param in trainer.distillation.teacher.parameters())


def test_block_wise_terms_equal_the_mean_squared_error_of_each_block(make_config, tmp_path):
    teacher_dir = save_teacher(tmp_path / "teacher", 3, vocab_size=64, hidden_size=32, pattern="*-",
                               num_attention_heads=4, ffn_hidden_size=96)
    trainer = Trainer(make_config(*distilled(teacher_dir, "train.distill_blocks=true", "train.distill_weight=0.5")))
    batch = trainer.next_micro_batches()[0]
    output = trainer.distillation.forward(trainer.model, batch)
    teacher, captured = trainer.distillation.teacher, []
    hooks = [block.register_forward_hook(lambda module, inputs, out: captured.append((inputs[0], out)))
             for block in teacher.blocks]
    with torch.no_grad():
        teacher(batch["input_ids"])
        student_lm = trainer.model(batch["input_ids"], batch["labels"]).losses["lm"]
        expected = [F.mse_loss(trainer.model.blocks[index](block_input, teacher_context(batch)), block_output)
                    for index, (block_input, block_output) in enumerate(captured)]
    for hook in hooks:
        hook.remove()
    assert len(expected) == 2 and all(error > 1e-3 for error in expected)
    for index, error in enumerate(expected):
        assert relative_error(output.losses[f"distill_block_{index}"], error) <= 1e-5, index
    assert relative_error(output.losses["distill"], sum(expected)) <= 1e-5
    assert relative_error(output.loss, 0.5 * student_lm + 0.5 * sum(expected)) <= 1e-5


def teacher_context(batch):
    return SequenceContext.for_tokens(batch["input_ids"])


# --- layouts -----------------------------------------------------------------------------------------

def configurations(teacher: Path, moe_teacher: Path) -> dict[str, list[str]]:
    """name -> the overrides of a distillation run, without the layout."""
    return {
        "kl": [*STUDENT, *distilled(teacher)],
        "reverse T2 w.5": [*STUDENT, *distilled(teacher, "train.distill_loss=reverse_kl",
                                                "train.distill_temperature=2", "train.distill_weight=0.5")],
        "cosine": [*STUDENT, *distilled(teacher, "train.distill_loss=cosine")],
        "moe": [*HELPERS.MODELS["moe"], *distilled(moe_teacher, "train.distill_weight=0.7")],
        "blocks": [*STUDENT, *distilled(teacher, "train.distill_blocks=true", "train.distill_weight=0.8")],
    }


LAYOUTS = [("kl", "tp2", ["parallel.tp=2"]),
           ("kl", "dp2 dist-opt", ["parallel.dp=2", "parallel.distributed_optimizer=true"]),
           ("reverse T2 w.5", "tp2 sp", ["parallel.tp=2", "parallel.sp=true"]),
           ("cosine", "tp2 padded vocab", ["parallel.tp=2", "parallel.vocab_pad_multiple=48"]),
           ("moe", "dp2 ep2", ["parallel.ep=2"]),
           ("blocks", "tp2 sp", ["parallel.tp=2", "parallel.sp=true"]),
           ("blocks", "dp2", ["parallel.dp=2"])]


def logged_terms(run_dir: Path) -> dict[str, list[float]]:
    records = [record for record in read_metrics(run_dir / "metrics.jsonl") if "loss_distill" in record]
    return {name: [record[name] for record in records] for name in ("loss_lm", "loss_distill")}


def test_distillation_at_tp_dp_and_ep_equals_one_process(tmp_path):
    blend = HELPERS.write_tiny_corpus(tmp_path / "corpus")
    teacher = save_teacher(tmp_path / "teacher", 11, **TEACHER)
    moe_teacher = save_teacher(tmp_path / "moe teacher", 12, **MOE_TEACHER)
    configs = configurations(teacher, moe_teacher)
    single = {name: HELPERS.train_once(blend, tmp_path / f"single {name}", overrides)
              for name, overrides in configs.items()}
    runs = [(f"{name} {layout}", [*configs[name], *overrides]) for name, layout, overrides in LAYOUTS]
    by_rank = run_distributed(HELPERS.train_runs, 2, str(blend), str(tmp_path), runs, timeout_s=300)
    for name, layout, _ in LAYOUTS:
        for rank, results in enumerate(by_rank):
            HELPERS.assert_same_run(results[f"{name} {layout}"], single[name], f"{name} {layout} rank {rank}")
        expected, actual = logged_terms(tmp_path / f"single {name}"), logged_terms(tmp_path / f"{name} {layout}")
        for term in ("loss_lm", "loss_distill"):
            assert len(actual[term]) == 5 and relative_error(actual[term], expected[term]) <= 1e-5, (name, layout)
    assert all(loss > 0 for loss in logged_terms(tmp_path / "single moe")["loss_distill"])


# --- training ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_teacher(tmp_path_factory) -> Path:
    """A run directory whose model (the TEACHER shape) learned the corpus for 40 steps."""
    root = tmp_path_factory.mktemp("teacher")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    overrides = ["model.pattern=*-*-", "model.ffn_hidden_size=128", "train.steps=40", "train.eval_every=0",
                 "optim.lr=3e-3", "train.global_batch_size=4"]
    HELPERS.train_once(blend, root / "run", overrides)
    return root


def test_a_pruned_student_s_kl_to_the_teacher_falls(trained_teacher, tmp_path):
    run_dir = tmp_path / "student"
    overrides = [*STUDENT, f"train.distill_from={trained_teacher / 'run'}", "train.steps=30", "train.eval_every=0",
                 "optim.lr=3e-3", "train.global_batch_size=4"]
    HELPERS.train_once(trained_teacher / "corpus" / "blend.json", run_dir, overrides)
    distill = logged_terms(run_dir)["loss_distill"]
    assert len(distill) == 30
    assert sum(distill[-5:]) / 5 < 0.3 * distill[0], distill


def test_block_wise_distillation_brings_each_block_to_the_teacher_s(trained_teacher, tmp_path):
    run_dir = tmp_path / "student"
    overrides = [*STUDENT, f"train.distill_from={trained_teacher / 'run'}", "train.distill_blocks=true",
                 "train.steps=40", "train.eval_every=0", "optim.lr=1e-2", "train.global_batch_size=4",
                 "optim.eps=1e-6"]  # as tuned: block errors of ~1e-4 have gradients near the helpers' eps 1e-5
    HELPERS.train_once(trained_teacher / "corpus" / "blend.json", run_dir, overrides)
    records = [record for record in read_metrics(run_dir / "metrics.jsonl") if "loss_distill" in record]
    for index in range(4):
        errors = [record[f"loss_distill_block_{index}"] for record in records]
        assert sum(errors[-5:]) / 5 < 0.3 * errors[0], (index, errors)


# --- refusals ----------------------------------------------------------------------------------------

def test_bad_distillation_settings_are_refused_in_one_sentence(make_config, tmp_path):
    teacher = save_teacher(tmp_path / "teacher", 3, vocab_size=64, hidden_size=32, pattern="*-*",
                           num_attention_heads=4)
    other_vocab = save_teacher(tmp_path / "other vocab", 3, vocab_size=48, hidden_size=32, pattern="*-",
                               num_attention_heads=4)
    refusals = {
        "train.distill_from=/no/such/teacher does not exist": [f"train.distill_from={tmp_path / 'missing'}"],
        "has a vocabulary of 48 tokens but the run's model has 64": [f"train.distill_from={other_vocab}"],
        "teacher has 3 blocks of width 32 and the student 2 of width 32": [f"train.distill_from={teacher}",
                                                                           "train.distill_blocks=true"],
    }
    for message, overrides in refusals.items():
        message = message.replace("/no/such/teacher", str(tmp_path / "missing"))
        with pytest.raises(ConfigError) as refused:
            Trainer(make_config(*overrides))
        assert message in str(refused.value) and str(refused.value).count(". ") <= 1, str(refused.value)
    config_refusals = {
        "train.distill_loss='kld' is not one of kl, forward_kl, reverse_kl, cosine.": ["train.distill_loss=kld"],
        "train.distill_temperature=0.0 must be > 0": ["train.distill_temperature=0"],
        "train.distill_weight=1.5 must lie in [0, 1]": ["train.distill_weight=1.5"],
    }
    for message, overrides in config_refusals.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
            load_run_config(None, [f"train.distill_from={teacher}", *overrides])
    with pytest.raises(ConfigError, match="train.distill_blocks=true needs a teacher"):
        load_run_config(None, ["train.distill_blocks=true"])
