"""The Mamba-2 mixer: cached generation, left padding, gradients, dtypes, and a hybrid model."""

import math

import pytest
import torch

from meshlm.models.cache import InferenceCache, MambaCache
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.models.mamba2 import Mamba2Mixer

HIDDEN = 32


def make_config(**overrides):
    values = dict(hidden_size=HIDDEN, pattern="M", mamba_head_dim=8, mamba_state_size=8,
                  mamba_num_groups=2, mamba_chunk_size=8, vocab_size=64)
    values.update(overrides)
    return ModelConfig(**values)


def make_mixer(seed=0, **overrides):
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(make_config(**overrides), layer_index=0)
    with torch.no_grad():  # non-trivial values everywhere, so every path is exercised
        mixer.norm.weight.uniform_(0.5, 1.5)
        mixer.D.uniform_(0.5, 1.5)
    return mixer


def run(mixer, hidden, token_mask=None, cache=None):
    batch, seq_len, _ = hidden.shape
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    return mixer(hidden, SequenceContext.for_tokens(ids, token_mask, cache))


def relative_error(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_parameter_names_and_shapes_follow_the_hf_layout():
    config = make_config(mamba_proj_bias=True)
    mixer = Mamba2Mixer(config, layer_index=0)
    heads, inner, bc = 8, 64, 2 * 8  # H = 2*32/8, d_inner = H*P, G*N
    shapes = {name: tuple(p.shape) for name, p in mixer.named_parameters()}
    assert shapes == {
        "in_proj.weight": (2 * inner + 2 * bc + heads, HIDDEN), "in_proj.bias": (2 * inner + 2 * bc + heads,),
        "conv1d.weight": (inner + 2 * bc, 1, 4), "conv1d.bias": (inner + 2 * bc,),
        "dt_bias": (heads,), "A_log": (heads,), "D": (heads,), "norm.weight": (inner,),
        "out_proj.weight": (HIDDEN, inner), "out_proj.bias": (HIDDEN,),
    }


def test_init_draws_A_and_dt_in_their_ranges():
    config = make_config(mamba_num_heads=64)
    mixer = Mamba2Mixer(config, layer_index=0)
    A = torch.exp(mixer.A_log)
    assert A.min() >= 1.0 and A.max() <= 16.0 and A.std() > 1.0
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert dt.min() >= config.mamba_dt_min * (1 - 1e-4) and dt.max() <= config.mamba_dt_max * (1 + 1e-4)
    assert dt.max() / dt.min() > 10  # log-uniform over two decades, not a constant
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))


@pytest.mark.parametrize("prefix", [1, 5, 11])
def test_forward_equals_prefill_then_token_by_token_steps(prefix):
    mixer = make_mixer()
    hidden = torch.randn(2, 19, HIDDEN)
    with torch.no_grad():
        full = run(mixer, hidden)
        cache = InferenceCache()
        pieces = [run(mixer, hidden[:, :prefix], cache=cache)]
        state = cache.state_for(0, MambaCache)
        assert state.conv_state.shape == (2, mixer.conv_dim, 3)
        assert state.ssm_state.shape == (2, 8, 8, 8) and state.ssm_state.dtype == torch.float32
        for t in range(prefix, hidden.shape[1]):
            pieces.append(run(mixer, hidden[:, t:t + 1], cache=cache))
    assert relative_error(torch.cat(pieces, dim=1), full) <= 1e-5


def test_prefill_continuation_equals_one_prefill():
    mixer = make_mixer(seed=1)
    hidden = torch.randn(2, 23, HIDDEN)
    with torch.no_grad():
        full = run(mixer, hidden)
        cache = InferenceCache()
        first = run(mixer, hidden[:, :10], cache=cache)
        second = run(mixer, hidden[:, 10:], cache=cache)  # a multi-token continuation: chunked path
    assert relative_error(torch.cat((first, second), dim=1), full) <= 1e-5


def test_left_padding_gives_the_unpadded_result():
    mixer = make_mixer(seed=2)
    short, long = torch.randn(1, 9, HIDDEN), torch.randn(1, 14, HIDDEN)
    padded = torch.cat((torch.randn(1, 5, HIDDEN) * 10, short), dim=1)  # garbage in the pad slots
    token_mask = torch.ones(2, 14, dtype=torch.bool)
    token_mask[0, :5] = False
    with torch.no_grad():
        batched = run(mixer, torch.cat((padded, long)), token_mask=token_mask)
        alone = run(mixer, short)
        # and with a cache: the states left by the padded prompt continue the real sequence
        cache = InferenceCache()
        run(mixer, torch.cat((padded, long)), token_mask=token_mask, cache=cache)
        next_token = torch.randn(2, 1, HIDDEN)
        stepped = run(mixer, next_token, cache=cache)
        reference = run(mixer, torch.cat((short, next_token[:1]), dim=1))
    assert relative_error(batched[:1, 5:], alone) <= 1e-5
    assert relative_error(batched[1:], run(mixer, long).detach()) <= 1e-5
    assert relative_error(stepped[0, 0], reference[0, -1]) <= 1e-5


def test_gradients_reach_every_parameter():
    mixer = make_mixer(seed=3, mamba_proj_bias=True)
    hidden = torch.randn(2, 13, HIDDEN, requires_grad=True)
    run(mixer, hidden).square().sum().backward()
    for name, parameter in mixer.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().sum() > 0, name
    assert hidden.grad.abs().sum() > 0


def test_dt_clamp_applies_in_both_paths():
    mixer = make_mixer(seed=4, mamba_dt_clamp_min=0.5)
    dt = mixer.time_step(torch.full((1, 1, mixer.num_heads), -20.0))
    assert torch.allclose(dt, torch.full_like(dt, 0.5))
    hidden = torch.randn(1, 6, HIDDEN)
    with torch.no_grad():
        full = run(mixer, hidden)
        cache = InferenceCache()
        pieces = [run(mixer, hidden[:, :3], cache=cache)]
        pieces += [run(mixer, hidden[:, t:t + 1], cache=cache) for t in range(3, 6)]
    assert relative_error(torch.cat(pieces, dim=1), full) <= 1e-5


def test_bf16_input_returns_bf16():
    mixer = make_mixer(seed=5).to(torch.bfloat16)
    hidden = torch.randn(2, 11, HIDDEN)
    with torch.no_grad():
        out = run(mixer, hidden.bfloat16())
        cache = InferenceCache()
        run(mixer, hidden[:, :10].bfloat16(), cache=cache)
        step = run(mixer, hidden[:, 10:].bfloat16(), cache=cache)
        reference = run(make_mixer(seed=5), hidden)
    assert out.dtype == torch.bfloat16 and step.dtype == torch.bfloat16
    assert cache.state_for(0, MambaCache).ssm_state.dtype == torch.float32
    assert relative_error(out.float(), reference) < 0.1  # close to fp32, up to bf16 rounding
    assert relative_error(step.float(), reference[:, 10:]) < 0.1


def test_hybrid_language_model_trains():
    torch.manual_seed(0)
    config = make_config(pattern="M-M*", num_attention_heads=4)
    model = LanguageModel(config)
    input_ids = torch.randint(0, config.vocab_size, (2, 17))
    output = model(input_ids, labels=torch.roll(input_ids, -1, dims=1))
    assert output.logits.shape == (2, 17, config.vocab_size)
    assert abs(output.loss.item() - math.log(config.vocab_size)) < 0.5
    output.loss.backward()
    mixer = model.blocks[0].mixer
    assert isinstance(mixer, Mamba2Mixer)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mixer.parameters())
    # init.py's generic pass ran, then the mixer's own init: out_proj is the scaled output init
    assert abs(mixer.out_proj.weight.std().item() - config.output_init_std) < 0.3 * config.output_init_std
    assert torch.exp(mixer.A_log).min() >= 1.0


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_fast_and_reference_scans_give_the_same_mixer(dtype, tolerance):
    """model.mamba_scan="pytorch" (the default's path) equals "reference": output and every gradient
    (fp32 within 1e-5 relative; a bf16 mixer -- projections, conv and scan matmuls in bf16, 8-bit
    mantissa -- within 5e-2 of the fp32 reference)."""
    hidden = torch.randn(2, 29, HIDDEN, generator=torch.Generator().manual_seed(4))
    results = {}
    for scan, run_dtype in (("reference", torch.float32), ("pytorch", dtype)):
        mixer = make_mixer(mamba_scan=scan).to(run_dtype)
        inputs = hidden.to(run_dtype).detach().requires_grad_()
        out = run(mixer, inputs)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results[scan] = [out, inputs.grad] + [param.grad for _, param in sorted(mixer.named_parameters())]
    for index, (actual, expected) in enumerate(zip(results["pytorch"], results["reference"])):
        assert actual.dtype == dtype
        assert relative_error(actual.float(), expected) <= tolerance, index


def test_mamba_scan_choice_is_validated(monkeypatch):
    from meshlm.errors import ConfigError
    with pytest.raises(ConfigError, match="model.mamba_scan='triton2' is not one of auto, pytorch, triton, reference"):
        make_config(mamba_scan="triton2")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # as if Triton were not installed
    with pytest.raises(ConfigError, match="model.mamba_scan='triton' needs Triton"):
        make_config(mamba_scan="triton")


def test_triton_scan_refuses_shapes_the_kernels_do_not_take():
    pytest.importorskip("triton")
    from meshlm.errors import ConfigError
    mixer = make_mixer(mamba_scan="triton")  # head dim 8, state 8: below tl.dot's 16
    with pytest.raises(ConfigError, match="model.mamba_head_dim and model.mamba_state_size powers of two"):
        run(mixer, torch.randn(1, 8, HIDDEN))
