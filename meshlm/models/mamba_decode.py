"""One new token through a Mamba-2 mixer: the recurrent form, in as few tensor ops as it takes.

While generating, every step feeds each sequence a single token. The chunked scan that trains
the layer (``ssd.py``) would treat that token as a sequence of one chunk -- dozens of small
ops for a [1 x 1] "attention" -- when the state-space model is, token by token, just the
recurrence it was derived from (Dao & Gu 2024, "Transformers are SSMs", §3 and §7):

    z, xBC, dt = in_proj(u)                               one matmul for all five branches
    window = [window[1:], xBC];  xBC = silu(bias + sum_k w_k window_k)   the K-tap causal conv
    dt = max(softplus(dt + dt_bias), dt_clamp_min),  A = -exp(A_log)
    h = exp(dt A) h + dt x B^T                            per head: a [P x N] state
    y = h C + D x
    out = out_proj(GatedRMSNorm(y, z))

The conv window is the cache's [b, channels, K-1] tail of past inputs (newest last); appending
the new input gives exactly the K inputs the conv reads, and dropping its oldest column is the
next window. Eagerly this saves only a little -- about 30 compute ops and as many views per
layer against 36 and 48 on the sequence path (padding masks, the conv's window bookkeeping, the
recurrent step's einsums), some 30% of the layer's eager time -- but every op here has fixed
shapes and no Python state, so ``torch.compile`` fuses the elementwise ones into a few loops
(``meshlm/inference/decode_step.py``), which is where a decode step's time goes down.

The result equals the mixer's sequence forward on that token up to float rounding (the conv
taps are summed in another order); ``tests/models/test_mamba_decode.py`` checks it against the
reference recurrence (``ssd.ssd_recurrent_step``) and the chunked scan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshlm.models.ssd import expand_groups


def decodes_one_token(hidden: torch.Tensor, token_mask: torch.Tensor | None, state) -> bool:
    """Whether a cached forward can take ``mamba_decode_step``: one token per sequence, no padding
    mask, a state to continue (``MambaCache``) that keeps no rollback history (speculative
    decoding's caches step through ``Mamba2Mixer.scan_keeping_states`` instead)."""
    return (hidden.shape[1] == 1 and token_mask is None and state.ssm_state is not None
            and state.conv_state is not None and not state.rollback_window)


def conv_step(mixer, xBC: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(causal conv) of one new input xBC [b, channels] after ``window`` [b, channels, W >= K-1]
    (past inputs, newest last); returns the output [b, channels] and the next window (as wide)."""
    extended = torch.cat((window.to(xBC.dtype), xBC[:, :, None]), dim=-1)  # [b, ch, W + 1]
    taps = extended[:, :, extended.shape[-1] - mixer.conv_kernel:]  # the K inputs the conv reads
    pre = (taps * mixer.conv1d.weight[:, 0]).sum(-1)
    if mixer.conv1d.bias is not None:
        pre = pre + mixer.conv1d.bias
    return F.silu(pre), extended[:, :, 1:]


def ssm_step(mixer, state: torch.Tensor, x: torch.Tensor, dt_raw: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = exp(dt A) h + dt x B^T``, ``y = h C + D x`` for one token, fp32.

    state [b, H, P, N]; x [b, H, P]; dt_raw [b, H] (before softplus); B, C [b, G, N]. Returns y
    [b, H, P] (with the D skip) and the new state."""
    num_heads = x.shape[1]
    x = x.float()
    dt = F.softplus(dt_raw.float() + mixer.dt_bias.float()).clamp(min=mixer.dt_clamp_min)  # [b, H]
    decay = torch.exp(dt * -torch.exp(mixer.A_log.float()))
    B = expand_groups(B.float(), num_heads, group_dim=1)  # [b, H, N]
    C = expand_groups(C.float(), num_heads, group_dim=1)
    new_state = state.float() * decay[:, :, None, None] + (x * dt[:, :, None])[..., None] * B[:, :, None, :]
    y = (new_state @ C[..., None]).squeeze(-1) + mixer.D.float()[:, None] * x
    return y, new_state


def mamba_decode_step(mixer, hidden: torch.Tensor, conv_window: torch.Tensor,
                      ssm_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mixer`` (a ``Mamba2Mixer``) on one token per sequence, hidden [b, hidden_size], from the
    cached conv window [b, conv_dim, W] and SSM state [b, H, P, N]. Returns the output [b,
    hidden_size], the next conv window and the next SSM state (new tensors: the old ones are
    left as they were)."""
    batch = hidden.shape[0]
    z, xBC, dt_raw = mixer.split_projection(mixer.in_proj(hidden))
    xBC, next_window = conv_step(mixer, xBC, conv_window)
    x, B, C = xBC.split([mixer.inner_size, mixer.bc_size, mixer.bc_size], dim=-1)
    y, next_state = ssm_step(mixer, ssm_state, x.view(batch, mixer.num_heads, mixer.head_dim), dt_raw,
                             B.view(batch, mixer.num_groups, mixer.state_size),
                             C.view(batch, mixer.num_groups, mixer.state_size))
    out = mixer.norm(y.flatten(1), z)
    return mixer.out_proj(out.to(hidden.dtype)), next_window, next_state


__all__ = ["conv_step", "decodes_one_token", "mamba_decode_step", "ssm_step"]
