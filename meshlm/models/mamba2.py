"""The Mamba-2 mixer: a gated, selective state-space layer (Dao & Gu 2024, §7).

One projection of the (normed) residual stream feeds five things at once:

    z, x, B, C, dt = in_proj(u)                  widths d_inner, d_inner, G*N, G*N, H
    x, B, C = silu(causal_depthwise_conv(x, B, C))   a short (K-tap) convolution over time
    dt = max(softplus(dt + dt_bias), dt_clamp_min),  A = -exp(A_log)
    y = SSM(x, dt, A, B, C) + D * x              the selective scan, per head (see ssd.py)
    out = out_proj(GatedRMSNorm(y, z))           = out_proj(rmsnorm_per_group(y * silu(z)))

What each piece is for:

- **Selective SSM.** Each of the H heads keeps a [P x N] state that decays by exp(dt A) per
  token and absorbs dt * x B^T. Because dt, B and C are computed from the token (Gu & Dao 2023,
  "Mamba"), the layer chooses what to remember (large dt: reset towards the new input) and what
  to read out (C). A is a learned scalar per head, so the state's decay is "scalar times
  identity", the restriction that gives Mamba-2 its state-space duality: the whole layer is a
  masked linear attention whose mask is a product of decays, computable with matmuls in chunks
  (``ssd_chunked_scan``) or one token at a time (``ssd_recurrent_step``) with the same result.
- **Groups.** B and C are produced once per group of heads (G groups, like KV heads in GQA),
  which cuts projection width; head h uses group h // (H / G).
- **Causal convolution.** A depthwise conv of K taps over x, B and C gives each token a little
  local context before the scan, cheap short-range mixing the SSM does not do as well.
- **D skip.** A per-head residual D * x around the scan.
- **Gate and grouped norm.** The z branch gates the output as in gated MLPs; the product is
  RMS-normalized per group of d_inner / G channels (not over all of d_inner) so that a tensor-
  parallel rank holding whole groups can normalize without communicating (Dao & Gu 2024, §8).
  ``model.mamba_gated_norm=false`` keeps the gate and drops the norm (Falcon-H1's mixers).

Parameter names and layouts follow Hugging Face's Mamba2 / Nemotron-H mixers one to one (in_proj
output order z, x, B, C, dt; conv channels x, B, C), so checkpoints convert by renaming only.

The scan over a sequence is ``model.mamba_scan``'s: ``ssd_fast.ssd_chunked_scan_fast`` (run-dtype
matmuls, a hand-written backward that recomputes instead of saving) or the reference
``ssd.ssd_chunked_scan``; both compute the same function.

Generation keeps a ``MambaCache``: the last K-1 conv inputs and the fp32 SSM state. A single
new token takes the recurrent step (``mamba_decode.py``: fixed shapes, few ops, compilable); a
prompt (or a continuation of one) takes the chunked scan starting from the stored state, with
the conv fed by the stored window. Left padding
(``context.token_mask`` False) is zeroed before in_proj and after the conv, so padded
positions add nothing to the conv window or the SSM state. For speculative decoding a cache can
also roll back (``MambaCache.enable_rollback``): it then keeps the SSM state after each of its
last few tokens and a conv window that many columns wider, and the mixer steps those tokens one
at a time (``scan_keeping_states``), so that undoing rejected draft tokens restores a state and
slices the window.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.cache import MambaCache
from meshlm.models.causal_conv import causal_conv_silu
from meshlm.models.init import constant, initialize_own_tensors
from meshlm.models.lora import adapted, lora_coordinates
from meshlm.models.mamba_decode import decodes_one_token, mamba_decode_step
from meshlm.models.norms import GatedRMSNorm, SiluGate
from meshlm.models.ssd import ssd_chunked_scan, ssd_recurrent_step
from meshlm.models.ssd_fast import ssd_chunked_scan_fast

CHUNKED_SCANS = {"auto": partial(ssd_chunked_scan_fast, use_triton=None),
                 "pytorch": partial(ssd_chunked_scan_fast, use_triton=False),
                 "triton": partial(ssd_chunked_scan_fast, use_triton=True),
                 "reference": ssd_chunked_scan}
"""``model.mamba_scan`` -> the function computing the SSD scan over a sequence (same call and results)."""


def zero_padding(hidden: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the positions where ``token_mask`` [b, t] is False; hidden is [b, t, channels]."""
    if token_mask is None:
        return hidden
    return hidden * token_mask[:, :, None].to(hidden.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.lora_dropout = config.lora_dropout
        """``model.lora_dropout``: whether in_proj's and out_proj's adapters need the tokens' coordinates."""
        self.hidden_size = config.hidden_size
        self.num_heads = config.resolved_mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.state_size = config.mamba_state_size
        self.num_groups = config.mamba_num_groups
        self.conv_kernel = config.mamba_conv_kernel
        self.chunk_size = config.mamba_chunk_size
        self.dt_clamp_min = config.mamba_dt_clamp_min
        self.chunked_scan = CHUNKED_SCANS[config.mamba_scan]
        self.inner_size = self.num_heads * self.head_dim
        self.bc_size = self.num_groups * self.state_size  # width of B (and of C)
        self.conv_dim = self.inner_size + 2 * self.bc_size

        projection_size = 2 * self.inner_size + 2 * self.bc_size + self.num_heads
        self.in_proj = nn.Linear(self.hidden_size, projection_size, bias=config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim,
                                bias=config.mamba_conv_bias, padding=self.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(self.inner_size, group_size=self.inner_size // self.num_groups,
                                 eps=config.norm_eps) if config.mamba_gated_norm else SiluGate()
        self.out_proj = nn.Linear(self.inner_size, self.hidden_size, bias=config.mamba_proj_bias)
        initialize_own_tensors(self, config)

    def init_rules(self, config) -> dict:
        """Mamba-2's own init (as mamba_ssm): A in U[1, 16], dt log-uniform, D = 1 (meshlm/models/init.py)."""
        log_dt_min, log_dt_max = math.log(config.mamba_dt_min), math.log(config.mamba_dt_max)

        def a_log(tensor, generator):
            tensor.uniform_(1.0, 16.0, generator=generator).log_()

        def dt_bias(tensor, generator):
            dt = torch.exp(torch.rand(tensor.shape, generator=generator) * (log_dt_max - log_dt_min) + log_dt_min)
            dt = dt.clamp(min=config.mamba_dt_init_floor)
            # Inverse softplus, so that softplus(dt_bias) == dt at a zero projection.
            tensor.copy_(dt + torch.log(-torch.expm1(-dt)))

        return {"A_log": a_log, "dt_bias": dt_bias, "D": constant(1.0)}

    # --- pieces ------------------------------------------------------------------------------
    def split_projection(self, projected: torch.Tensor):
        """in_proj output -> (z, xBC, dt_raw), by the named widths of this (partition of the) layer."""
        return projected.split([self.inner_size, self.conv_dim, self.num_heads], dim=-1)

    def causal_conv(self, xBC: torch.Tensor, window: torch.Tensor | None):
        """silu(depthwise causal conv) of xBC [b, t, conv_dim], continuing from ``window``.

        ``window`` [b, conv_dim, W] holds the previous inputs, newest last (None: K-1 zeros, the
        start of a sequence); the conv reads the last K-1, and W > K-1 when the cache keeps older
        inputs to roll back over (``MambaCache.enable_rollback``). Returns the activated outputs
        [b, t, conv_dim] and the new window, as wide as the old one and a copy (a view would keep
        this call's whole input alive in the cache).
        """
        channels_first = xBC.transpose(1, 2)
        if window is None:
            window = channels_first.new_zeros(xBC.shape[0], self.conv_dim, self.conv_kernel - 1)
        window = window.to(xBC.dtype)
        read = window[:, :, window.shape[-1] - (self.conv_kernel - 1):].transpose(1, 2)  # [b, K-1, ch]
        out = causal_conv_silu(xBC, self.conv1d.weight, self.conv1d.bias, read)
        new_window = torch.cat((window, channels_first), dim=-1)[:, :, -window.shape[-1]:].clone()
        return out, new_window

    def conv_from_start(self, xBC: torch.Tensor, document_positions: torch.Tensor | None = None) -> torch.Tensor:
        """silu(depthwise causal conv) of a whole sequence xBC [b, t, conv_dim] from a zero window
        (``causal_conv.causal_conv_silu``); context parallelism continues from the previous chunk instead.
        With packed documents (``document_positions``) the window restarts at each document."""
        return causal_conv_silu(xBC, self.conv1d.weight, self.conv1d.bias, document_positions=document_positions)

    def time_step(self, dt_raw: torch.Tensor) -> torch.Tensor:
        """dt = softplus(dt_raw + dt_bias), clamped below; fp32 [b, t, heads]."""
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        return dt.clamp(min=self.dt_clamp_min)

    def scan(self, x, dt, B, C, state: MambaCache | None, document_ids: torch.Tensor | None = None,
             document_positions: torch.Tensor | None = None) -> torch.Tensor:
        """The SSM over x [b, t, H, P] (in x's dtype from ``ssd_fast``, fp32 from the reference scan
        and the recurrent step; the norm adds the D skip in fp32), updating the cached state when there is one.
        With packed documents (``document_ids``, training only) the state restarts at each one
        (``document_positions``, the tokens' positions in them, serve context parallelism's scan)."""
        A = -torch.exp(self.A_log.float())
        if document_ids is not None:
            return self.chunked_scan(x, dt, A, B, C, self.chunk_size, document_ids=document_ids)[0]
        initial_state = None if state is None else state.ssm_state
        if state is not None and state.rollback_window:
            y, final_state = self.scan_keeping_states(x, dt, A, B, C, state)
        elif initial_state is not None and x.shape[1] == 1:
            y, final_state = ssd_recurrent_step(initial_state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
            y = y[:, None]
        else:
            y, final_state = self.chunked_scan(x, dt, A, B, C, self.chunk_size, initial_state)
        if state is not None:
            state.ssm_state = final_state
        return y

    def scan_keeping_states(self, x, dt, A, B, C, state: MambaCache):
        """The cached scan of a cache that can roll back (speculative decoding): the chunked scan up
        to the last ``state.rollback_window`` tokens, then one recurrent step per token, handing the
        state after each to the cache (``MambaCache.remember_states``)."""
        stepped_from = max(x.shape[1] - state.rollback_window, 0)
        outputs, current, start, states = [], state.ssm_state, None, []
        if stepped_from:
            head = slice(0, stepped_from)
            y_head, current = self.chunked_scan(x[:, head], dt[:, head], A, B[:, head], C[:, head],
                                                self.chunk_size, current)
            outputs, start = [y_head], current
        for t in range(stepped_from, x.shape[1]):
            y_t, current = ssd_recurrent_step(current, x[:, t], dt[:, t], A, B[:, t], C[:, t])
            outputs.append(y_t[:, None])
            states.append(current)
        state.remember_states(states, start)
        return torch.cat(outputs, dim=1), current

    # --- forward -----------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, context) -> torch.Tensor:
        token_mask = context.token_mask
        state = None if context.cache is None else context.cache.state_for(self.layer_index, MambaCache)
        if state is not None and decodes_one_token(hidden, token_mask, state):  # generation's hot path
            out, state.conv_state, state.ssm_state = mamba_decode_step(self, hidden[:, 0], state.conv_state,
                                                                       state.ssm_state)
            return out[:, None]

        coordinates = lora_coordinates(self, context)
        z, xBC, dt_raw = self.split_projection(adapted(self.in_proj, zero_padding(hidden, token_mask), coordinates))
        # xBC holds the whole sequence, also when in_proj gathers a sequence-parallel slice
        # packed documents: passed only when present, so a subclass's conv/scan without them still fits
        documents, positions = {}, {}
        if context.document_ids is not None:
            positions = {"document_positions": context.document_positions}
            documents = {"document_ids": context.document_ids, **positions}
        if state is None:  # training: no window to continue
            xBC = self.conv_from_start(xBC, **positions)
        else:
            xBC, state.conv_state = self.causal_conv(xBC, state.conv_state)
        xBC = zero_padding(xBC, token_mask)
        x, B, C = xBC.split([self.inner_size, self.bc_size, self.bc_size], dim=-1)

        x = x.unflatten(-1, (self.num_heads, self.head_dim))
        y = self.scan(x, self.time_step(dt_raw),
                      B.unflatten(-1, (self.num_groups, self.state_size)),
                      C.unflatten(-1, (self.num_groups, self.state_size)), state, **documents)
        # y + D x, gated and normalized in fp32 from the tensors as they are (norms._SkipGatedRMSNorm)
        out = self.norm(y.flatten(-2), z, skip=x.flatten(-2), skip_scale=self.D.repeat_interleave(self.head_dim),
                        out_dtype=hidden.dtype)
        return adapted(self.out_proj, out, coordinates)


__all__ = ["Mamba2Mixer", "zero_padding"]
