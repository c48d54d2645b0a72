import pytest
import torch

from meshlm.config import OptimConfig, PrecisionConfig
from meshlm.errors import CheckpointError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.optim.adamw import build_adamw
from meshlm.precision.mixed_precision import MixedPrecision

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1)


def tiny(pattern: str = "*-") -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=64, hidden_size=32, pattern=pattern, num_attention_heads=4))


def batch(seed: int = 1):
    torch.manual_seed(seed)
    tokens = torch.randint(0, 16, (4, 16))  # a small alphabet, so a few steps visibly lower the loss
    return tokens, tokens.roll(-1, 1)


def train_step(model, precision, optimizer, microbatches) -> tuple[float, bool]:
    """The trainer's step: scaled backward per micro-batch, unscale/check, step or skip, copy back."""
    losses = []
    for tokens, labels in microbatches:
        loss = model(tokens, labels).loss
        precision.scale_loss(loss / len(microbatches)).backward()
        losses.append(loss.item())
    found_nonfinite = precision.gradients_to_master()
    if not found_nonfinite:
        optimizer.step()
        precision.master_to_model()
    precision.update_scale(found_nonfinite)
    optimizer.zero_grad(set_to_none=True)
    return sum(losses) / len(losses), found_nonfinite


def test_fp32_is_bitwise_a_plain_adamw_loop():
    model, plain = tiny(), tiny()
    precision = MixedPrecision(model, PrecisionConfig(dtype="fp32"))
    assert [p for _, p in precision.master_parameters()] == list(model.parameters())
    optimizer = build_adamw(precision.master_parameters(), OPTIM)
    plain_optimizer = build_adamw(list(plain.named_parameters()), OPTIM)
    for step in range(3):
        train_step(model, precision, optimizer, [batch(step)])
        tokens, labels = batch(step)
        plain(tokens, labels).loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    assert precision.loss_scale == 1.0 and precision.scale_loss(torch.tensor(3.0)).item() == 3.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_bf16_training_lowers_the_loss_with_fp32_masters_and_bf16_model():
    model = tiny("M*-")
    precision = MixedPrecision(model, PrecisionConfig(dtype="bf16"))
    optimizer = build_adamw(precision.master_parameters(), OPTIM)
    losses = [train_step(model, precision, optimizer, [batch(0)])[0] for _ in range(20)]
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for (name, master), (_, param) in zip(precision.master_parameters(), model.named_parameters()):
        assert master.dtype == torch.float32 and master is not param
        assert torch.equal(param, master.to(torch.bfloat16)), name


def test_micro_batches_accumulate_in_fp32_masters_and_free_model_grads():
    model = tiny()
    precision = MixedPrecision(model, PrecisionConfig(dtype="bf16"))
    single = []
    for seed in (1, 2):
        model(*batch(seed)).loss.backward()
        assert all(p.grad is None for p in model.parameters())  # moved into the masters at once
        single.append([m.grad.clone() for _, m in precision.master_parameters()])
        for _, master in precision.master_parameters():
            master.grad = None
    for seed in (1, 2):
        model(*batch(seed)).loss.backward()
    assert precision.gradients_to_master() is False
    for (_, master), first, second in zip(precision.master_parameters(), *single):
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, first + second)


def test_fp16_loss_scaling_rescues_gradients_that_would_underflow_and_is_undone():
    # Shrink the loss by 2^-20 so that most fp16 gradients fall below fp16's smallest subnormal;
    # a loss scale of 2^20 lifts them back into range and the unscaled fp32 masters recover them.
    tiny_factor = 2.0 ** -20
    reference_model = tiny()
    reference_model(*batch()).loss.backward()
    reference = torch.cat([p.grad.flatten() for p in reference_model.parameters()])

    def relative_error(scale: float) -> float:
        model = tiny()
        precision = MixedPrecision(model, PrecisionConfig(dtype="fp16", initial_loss_scale=scale))
        precision.scale_loss(model(*batch()).loss * tiny_factor).backward()
        assert precision.gradients_to_master() is False
        grads = torch.cat([m.grad.flatten() for _, m in precision.master_parameters()]) / tiny_factor
        return ((grads - reference).norm() / reference.norm()).item()

    assert relative_error(2.0 ** 20) < 5e-3
    assert relative_error(1.0) > 0.5


def test_fp16_overflow_is_detected_and_skipped_and_the_scale_backs_off():
    model = tiny()
    precision = MixedPrecision(model, PrecisionConfig(dtype="fp16", initial_loss_scale=2.0 ** 100, hysteresis=1))
    optimizer = build_adamw(precision.master_parameters(), OPTIM)
    masters_before = [m.detach().clone() for _, m in precision.master_parameters()]
    model_before = [p.detach().clone() for p in model.parameters()]
    _, found_nonfinite = train_step(model, precision, optimizer, [batch()])
    assert found_nonfinite
    assert precision.loss_scale == 2.0 ** 99
    assert all(torch.equal(a, m) for a, (_, m) in zip(masters_before, precision.master_parameters()))
    assert all(torch.equal(a, p) for a, p in zip(model_before, model.parameters()))
    assert not optimizer.state  # AdamW never stepped, so its moments were not polluted


def test_nan_gradients_are_reported_in_fp32_too():
    model = tiny()
    precision = MixedPrecision(model, PrecisionConfig(dtype="fp32"))
    model(*batch()).loss.backward()
    assert precision.gradients_to_master() is False
    model.blocks[0].norm.weight.grad[3] = float("nan")
    assert precision.gradients_to_master() is True
    # the trainer leaves the check to the global norm it takes next: no second pass, no second sync
    assert precision.gradients_to_master(check_nonfinite=False) is False
    grads = [master.grad for _, master in precision.master_parameters() if master.grad is not None]
    assert not torch.isfinite(torch.nn.utils.get_total_norm(grads))


def test_state_dict_restores_master_weights_and_scale_exactly():
    config = PrecisionConfig(dtype="fp16", initial_loss_scale=256.0, growth_interval=2)
    model = tiny()
    precision = MixedPrecision(model, config)
    optimizer = build_adamw(precision.master_parameters(), OPTIM)
    for step in range(3):
        train_step(model, precision, optimizer, [batch(step)])
    state = precision.state_dict()
    assert state["loss_scaler"]["scale"] == 512.0

    restored_model = tiny()
    restored = MixedPrecision(restored_model, config)
    restored_model.load_state_dict(model.state_dict())
    restored.load_state_dict(state)
    assert restored.loss_scale == 512.0
    for (_, a), (_, b) in zip(precision.master_parameters(), restored.master_parameters()):
        assert torch.equal(a, b) and b.dtype == torch.float32
    with pytest.raises(CheckpointError, match="master weight"):
        restored.load_state_dict({"master_weights": {"embedding.weight": state["master_weights"]["embedding.weight"]}})
