"""The lean single-token Mamba-2 step against the reference recurrence and the sequence forward."""

import torch

from meshlm.models.cache import InferenceCache, MambaCache
from meshlm.models.mamba_decode import decodes_one_token, mamba_decode_step
from meshlm.models.ssd import ssd_recurrent_step
from tests.models.test_mamba2 import HIDDEN, make_mixer, relative_error, run


def reference_step(mixer, hidden, window, state):
    """One token by the mixer's own pieces: its conv with the window, ``ssd_recurrent_step``, D, norm."""
    z, xBC, dt_raw = mixer.split_projection(mixer.in_proj(hidden[:, None]))
    xBC, next_window = mixer.causal_conv(xBC, window)
    x, B, C = xBC[:, 0].split([mixer.inner_size, mixer.bc_size, mixer.bc_size], dim=-1)
    x = x.unflatten(-1, (mixer.num_heads, mixer.head_dim))
    y, next_state = ssd_recurrent_step(state, x, mixer.time_step(dt_raw)[:, 0], -torch.exp(mixer.A_log),
                                       B.unflatten(-1, (mixer.num_groups, mixer.state_size)),
                                       C.unflatten(-1, (mixer.num_groups, mixer.state_size)))
    y = y + mixer.D[:, None] * x
    return mixer.out_proj(mixer.norm(y.flatten(1), z[:, 0])), next_window, next_state


@torch.no_grad()
def test_decode_step_equals_the_reference_recurrence():
    mixer = make_mixer(mamba_conv_bias=True)  # two B/C groups: heads share them
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, HIDDEN, generator=generator)
    window = torch.randn(3, mixer.conv_dim, mixer.conv_kernel - 1, generator=generator)
    state = torch.randn(3, mixer.num_heads, mixer.head_dim, mixer.state_size, generator=generator)
    out, next_window, next_state = mamba_decode_step(mixer, hidden, window, state)
    expected_out, expected_window, expected_state = reference_step(mixer, hidden, window, state)
    assert relative_error(out, expected_out) < 1e-5
    assert torch.equal(next_window, expected_window)
    assert relative_error(next_state, expected_state) < 1e-5


@torch.no_grad()
def test_cached_single_token_forwards_equal_the_whole_sequence():
    mixer = make_mixer()
    hidden = torch.randn(2, 11, HIDDEN, generator=torch.Generator().manual_seed(2))
    cache = InferenceCache()
    outputs = [run(mixer, hidden[:, :7], cache=cache)]  # the chunked scan leaves a state ...
    for t in range(7, 11):  # ... which each new token continues with the decode step
        assert decodes_one_token(hidden[:, t:t + 1], None, cache.layers[0])
        outputs.append(run(mixer, hidden[:, t:t + 1], cache=cache))
    assert relative_error(torch.cat(outputs, dim=1), run(mixer, hidden)) < 1e-5


def test_only_plain_cached_tokens_take_the_decode_step():
    state = MambaCache(conv_state=torch.zeros(1), ssm_state=torch.zeros(1))
    one, two = torch.zeros(1, 1, HIDDEN), torch.zeros(1, 2, HIDDEN)
    assert decodes_one_token(one, None, state)
    assert not decodes_one_token(two, None, state)  # a prompt: the chunked scan
    assert not decodes_one_token(one, torch.ones(1, 1, dtype=torch.bool), state)  # a padding mask
    assert not decodes_one_token(one, None, MambaCache())  # nothing to continue yet
    assert not decodes_one_token(one, None, MambaCache(conv_state=torch.zeros(1), ssm_state=torch.zeros(1),
                                                       rollback_window=2))  # speculative decoding
