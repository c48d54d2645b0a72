import pytest

from meshlm.config import OptimConfig
from meshlm.training.schedules import learning_rate


def config(**overrides) -> OptimConfig:
    values = dict(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine", decay_fraction=0.2)
    values.update(overrides)
    return OptimConfig(**values)


def test_warmup_is_linear_and_reaches_peak_on_its_last_step():
    cosine = config()
    assert learning_rate(0, cosine, 110) == pytest.approx(0.1)  # 1 * (0 + 1) / 10
    assert learning_rate(4, cosine, 110) == pytest.approx(0.5)
    assert learning_rate(9, cosine, 110) == pytest.approx(1.0)


def test_cosine_points():
    # 110 steps, warmup 10: the decay spans steps 10..109, 99 intervals.
    cosine = config()
    assert learning_rate(10, cosine, 110) == pytest.approx(1.0)
    # step 43: progress 33/99 = 1/3, cos(pi/3) = 1/2, so 0.1 + 0.9 * (1 + 1/2) / 2 = 0.775
    assert learning_rate(43, cosine, 110) == pytest.approx(0.775)
    assert learning_rate(109, cosine, 110) == pytest.approx(0.1)
    assert learning_rate(500, cosine, 110) == pytest.approx(0.1)  # past the end: the floor


def test_cosine_middle_step_gives_the_mean_of_peak_and_floor():
    cosine = config(warmup_steps=0)
    assert learning_rate(50, cosine, 101) == pytest.approx(0.55)  # progress 50/100 = 1/2


def test_wsd_plateau_then_linear_decay_to_floor():
    wsd = config(schedule="wsd", warmup_steps=5, decay_fraction=0.2, lr=1.0, min_lr=0.0)
    # 100 steps: decay phase = last 20 steps = 80..99.
    assert learning_rate(4, wsd, 100) == pytest.approx(1.0)
    assert learning_rate(5, wsd, 100) == 1.0
    assert learning_rate(79, wsd, 100) == 1.0
    assert learning_rate(80, wsd, 100) == pytest.approx(0.95)  # first decay step: 1 - 1/20
    assert learning_rate(89, wsd, 100) == pytest.approx(0.5)
    assert learning_rate(99, wsd, 100) == pytest.approx(0.0)


def test_wsd_without_decay_stays_at_peak():
    assert learning_rate(99, config(schedule="wsd", decay_fraction=0.0), 100) == 1.0


def test_constant_after_warmup():
    constant = config(schedule="constant", warmup_steps=4)
    assert [learning_rate(step, constant, 8) for step in range(8)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_no_warmup_starts_at_peak_and_single_post_warmup_step_is_the_floor():
    assert learning_rate(0, config(warmup_steps=0), 10) == 1.0
    assert learning_rate(10, config(), 11) == pytest.approx(0.1)  # the last step always uses min_lr


def test_every_schedule_stays_between_zero_and_peak():
    for schedule in ("cosine", "wsd", "constant"):
        rates = [learning_rate(step, config(schedule=schedule), 57) for step in range(57)]
        assert all(0 < rate <= 1.0 for rate in rates)
        assert rates[9] == max(rates)
