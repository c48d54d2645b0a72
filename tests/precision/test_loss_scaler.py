import pytest

from meshlm.config import PrecisionConfig
from meshlm.errors import ConfigError
from meshlm.precision.loss_scaler import DynamicLossScaler


def scaler(**overrides) -> DynamicLossScaler:
    values = dict(initial_loss_scale=1024.0, growth_interval=3, growth_factor=2.0, backoff_factor=0.5,
                  hysteresis=2, min_loss_scale=1.0)
    values.update(overrides)
    return DynamicLossScaler.from_config(PrecisionConfig(dtype="fp16", **values))


def test_grows_after_growth_interval_consecutive_clean_steps():
    loss_scaler = scaler()
    loss_scaler.update(False)
    loss_scaler.update(False)
    assert loss_scaler.scale == 1024.0
    loss_scaler.update(False)
    assert loss_scaler.scale == 2048.0
    for _ in range(3):
        loss_scaler.update(False)
    assert loss_scaler.scale == 4096.0


def test_an_overflow_restarts_the_clean_count():
    loss_scaler = scaler(hysteresis=5)
    loss_scaler.update(False)
    loss_scaler.update(False)
    loss_scaler.update(True)
    loss_scaler.update(False)
    loss_scaler.update(False)
    assert loss_scaler.scale == 1024.0
    loss_scaler.update(False)
    assert loss_scaler.scale == 2048.0


def test_hysteresis_first_overflow_keeps_the_scale_then_every_further_one_lowers_it():
    loss_scaler = scaler(hysteresis=2)
    loss_scaler.update(True)
    assert loss_scaler.scale == 1024.0
    loss_scaler.update(True)
    assert loss_scaler.scale == 512.0
    loss_scaler.update(True)  # counter exhausted: each overflow backs off until a growth resets it
    assert loss_scaler.scale == 256.0


def test_growth_resets_the_hysteresis_counter():
    loss_scaler = scaler(hysteresis=2)
    loss_scaler.update(True)  # one overflow tolerated, one left
    for _ in range(3):
        loss_scaler.update(False)
    assert loss_scaler.scale == 2048.0
    loss_scaler.update(True)  # the counter is back at 2, so this one is tolerated again
    assert loss_scaler.scale == 2048.0


def test_hysteresis_one_backs_off_on_every_overflow_down_to_the_minimum():
    loss_scaler = scaler(hysteresis=1, initial_loss_scale=8.0, min_loss_scale=2.0, backoff_factor=0.25)
    loss_scaler.update(True)
    assert loss_scaler.scale == 2.0
    loss_scaler.update(True)
    assert loss_scaler.scale == 2.0


def test_state_round_trip():
    loss_scaler = scaler()
    for found in (True, False, False):
        loss_scaler.update(found)
    restored = scaler(initial_loss_scale=7.0)
    restored.load_state_dict(loss_scaler.state_dict())
    assert restored.state_dict() == loss_scaler.state_dict() == {"scale": 1024.0, "clean_steps": 2,
                                                                 "hysteresis_left": 1}
    loss_scaler.update(False)
    restored.update(False)
    assert restored.scale == loss_scaler.scale == 2048.0


@pytest.mark.parametrize("field,value", [("backoff_factor", 1.5), ("growth_factor", 0.5), ("hysteresis", 0),
                                         ("growth_interval", 0), ("min_loss_scale", 1e9)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"precision.{field}"):
        scaler(**{field: value})
