"""One generated token per sequence through the whole model, as one graph ``torch.compile`` can fuse.

**Why.** A decode step of a small model on a CPU is mostly fixed cost: a few dozen matmuls of
4-row inputs and, around them, hundreds of tiny eager ops (norms, activations, the Mamba
recurrence, casts), each paying a dispatch and a pass over memory. Under ``torch.compile``
(TorchDynamo + Inductor) the elementwise ops fuse into a few C++ loops, and the matmuls become
kernels over weights pre-packed once (``DecodeStep.compile_settings``). On the 2-core CPU of
``bench/hybrid_vs_transformer.py`` (hidden 256, 24 blocks, batch 4, fp32) this takes the
hybrid's step at 2k context from about 18.5 ms to 5.5 ms and the Transformer's from 24 to 14 ms;
what is left is mostly reading the weights, and at long context the KV caches (at 32k the
Transformer's twelve attention blocks read 3.2 GB per step, the hybrid's one block 270 MB).

**What stops ``torch.compile(model)``.** The cache is Python bookkeeping -- token counts, a dict
of per-block states, buffers that grow -- and Dynamo specializes on such values: a new graph
every step. So a step is split in two:

- eager bookkeeping, a few ops whatever the context: the new token's mask and position
  (``InferenceCache.append_token_mask``), one more slot in each KV buffer
  (``AttentionCache.reserve``; a sliding-window block's cache drops its old keys there, in place);
- the compiled body, with fixed shapes: embedding, blocks, final norm, head. A KV buffer enters
  whole (its capacity is fixed for the generation, ``InferenceCache(max_tokens)``) with the
  number of tokens it held as a 0-d tensor; the one op whose work depends on that number,
  writing the new key/value and attending over the held ones, is the custom op
  ``meshlm::cached_attention``, opaque to the compiler, which declares the buffers it writes.
  Mamba blocks take the recurrent step (``models/mamba_decode.py``) and hand back their new conv
  window and SSM state, which the cache keeps. Nothing in the graph grows with the context, so
  it compiles once (again only if the batch shrinks, when rows finish).

The eager body (``compile=False``) is the same code without the compiler; the tokens are those of
the model's ordinary cached forward, up to float rounding (``tests/inference/test_decode_step.py``).
Supported: attention (``*``), Mamba-2 (``M``), MLP (``-``), linear (``L``) and removed (``0``)
blocks, in eval mode (dropout off), after a prefill; anything else -- MoE blocks, a cache that
can roll back (speculative decoding), a replaced attention core -- takes the ordinary forward
(``DecodeStep.supports``). With ``freezing`` the compiled step keeps the weights it saw: build a
new ``DecodeStep`` after changing them.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from meshlm.models.attention import attention_core
from meshlm.models.cache import AttentionCache, InferenceCache, MambaCache
from meshlm.models.mamba_decode import mamba_decode_step

SUPPORTED_KINDS = frozenset("*M-L0")
"""Block kinds the decode step runs (pattern symbols, ``models/pattern.py``)."""


@torch.library.custom_op("meshlm::cached_attention", mutates_args=("key_buffer", "value_buffer"))
def cached_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_buffer: torch.Tensor,
                     value_buffer: torch.Tensor, held: torch.Tensor, mask_buffer: Optional[torch.Tensor],
                     window: Optional[int] = None, first_slot: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write key/value [b, kv_heads, t, d] into the buffers after their ``held`` tokens (a 0-d
    tensor), then attend with query [b, heads, t, d] over all held tokens (``attention_core``;
    ``mask_buffer`` [b, tokens], False on padding, or None: no padding; ``window``: the block's
    sliding window, None for full attention -- only the last ``window`` keys are read;
    ``first_slot``: the mask slot of the buffers' first key, a 0-d tensor, when a sliding-window
    cache has dropped older ones; ``scale``: the factor on q k^T, None for 1/sqrt(d); ``softcap``: the
    scores' soft cap, None for none; ``sinks``: the heads' attention sinks, None for none)."""
    end = int(held) + key.shape[2]
    key_buffer[:, :, end - key.shape[2]:end] = key
    value_buffer[:, :, end - key.shape[2]:end] = value
    first = 0 if first_slot is None else int(first_slot)
    key_mask = None if mask_buffer is None else mask_buffer[:, first:first + end]
    return attention_core(query, key_buffer[:, :, :end], value_buffer[:, :, :end], key_mask,
                          window=window, scale=scale, softcap=softcap, sinks=sinks).contiguous()


@cached_attention.register_fake
def _(query, key, value, key_buffer, value_buffer, held, mask_buffer, window=None, first_slot=None, scale=None,
      softcap=None, sinks=None):
    return query.new_empty(query.shape)


class DecodeStep:
    """``step(input_ids [b], cache) -> logits [b, vocab]`` (fp32) for one new token per sequence,
    compiled with ``compile=True`` (the first call then pays for compiling: ``compile_seconds``;
    ``backend``: torch.compile's, e.g. "aot_eager" to check the graph without generating code).
    ``report`` is told when compiling is not possible here (the step then runs eagerly)."""

    def __init__(self, model, compile: bool = False, report: Callable[[str], None] = print,
                 backend: str | Callable = "inductor"):
        self.model, self.report = model, report
        self.compile_seconds = 0.0
        self.body, self.compiled, self.calls = self.run_body, False, 0
        if compile:
            import torch._dynamo  # only here: importing it takes seconds

            if torch._dynamo.is_dynamo_supported():
                self.body, self.compiled = torch.compile(self.run_body, backend=backend), True
            else:
                self.fall_back(f"TorchDynamo does not support this platform (torch {torch.__version__})")

    def fall_back(self, reason: str) -> None:
        """Decode eagerly from now on, saying why once."""
        self.body, self.compiled = self.run_body, False
        self.report(f"compiling the decode step was asked for, but {reason}; decoding eagerly.")

    def compile_settings(self):
        """Inductor's settings while the step runs (they matter when it compiles, at the first call
        and after a recompile): ``freezing`` turns the weights into constants; ``max_autotune`` with
        the C++ GEMM template lets Inductor time its own matmul kernel (split over the cores) against
        ATen's for each weight shape and keep the faster. For 4-row inputs it wins: ATen's GEMM reads
        each weight on one core and repacks it every call, the template streams pre-packed weights on
        all cores (the bench's hybrid at 2k context: about 9 ms per step with ATen's GEMM, 5.5 with this)."""
        import torch._inductor.config

        return torch._inductor.config.patch(freezing=True, max_autotune=True,
                                            max_autotune_gemm_backends="CPP,ATEN")

    def supports(self, cache: InferenceCache) -> bool:
        """Whether this model and cache can take the step (else use the ordinary forward)."""
        for block in self.model.blocks:
            if block.kind not in SUPPORTED_KINDS or block.training:
                return False
            state = cache.layers.get(block.layer_index)
            if block.kind == "*" and (block.mixer.core is not attention_core or state is None
                                      or state.key_buffer is None):
                return False
            if block.kind == "M" and (state is None or state.ssm_state is None or state.rollback_window):
                return False
        return True

    def __call__(self, input_ids: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        input_ids, batch = input_ids.contiguous(), input_ids.shape[0]  # an expanded row would be another graph
        positions = cache.append_token_mask(None, batch, 1, input_ids.device)
        kv_buffers, mamba_states, held = [], [], []
        for block in self.model.blocks:
            state = cache.layers.get(block.layer_index)
            if isinstance(state, AttentionCache):
                # a sliding-window cache may drop old keys here, so each block has its own count and first slot
                held.append(torch.tensor([state.reserve(1), state.start]))
                kv_buffers += [state.key_buffer, state.value_buffer]
            elif isinstance(state, MambaCache):
                mamba_states += [state.conv_state.contiguous(), state.ssm_state.contiguous()]
        mask_buffer = cache.mask_buffer if cache.has_padding else None
        started, inputs = time.perf_counter(), (input_ids, positions, held, kv_buffers, mamba_states, mask_buffer)
        logits, new_states = self.run_compiled(*inputs) if self.compiled else self.run_body(*inputs)
        if self.calls == 0 and self.compiled:
            self.compile_seconds = time.perf_counter() - started
        self.calls += 1
        states = iter(new_states)
        for block in self.model.blocks:
            state = cache.layers.get(block.layer_index)
            if isinstance(state, MambaCache):
                state.conv_state, state.ssm_state = next(states), next(states)
        return logits

    def run_compiled(self, *inputs):
        """The compiled body; if the backend fails to compile it (e.g. no C++ compiler for Inductor's
        CPU code -- raised before the graph ran), the eager body from now on."""
        try:
            with self.compile_settings():
                return self.body(*inputs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            self.fall_back(f"{error.backend_name} failed to compile it ({type(error.inner_exception).__name__})")
            return self.run_body(*inputs)

    def run_body(self, input_ids, positions, held, kv_buffers, mamba_states, mask_buffer):
        """Embedding -> blocks -> head for one token per sequence; the new Mamba states, in block order."""
        model = self.model
        hidden = model.embed(input_ids[:, None], positions=positions)  # (learned positions read them)
        kv, counts, states, new_states = iter(kv_buffers), iter(held), iter(mamba_states), []
        pair_input = None  # model.parallel_residual: the input the attention block shares with its partner
        for block in model.blocks:
            if block.mixer is None:
                continue
            mixer_input = hidden
            if block.parallel_residual_role == "first":
                pair_input = hidden
            elif block.parallel_residual_role == "second":
                mixer_input = pair_input
            norm = block.input_norm
            normed = mixer_input if norm is None else norm(mixer_input)
            if block.kind == "*":
                query, key, value = block.mixer.cached_projection(normed, positions)
                held_and_first = next(counts)
                attended = cached_attention(query, key, value, next(kv), next(kv), held_and_first[0], mask_buffer,
                                            block.mixer.window, held_and_first[1], block.mixer.cached_scale,
                                            block.mixer.softcap, block.mixer.sinks)
                attended = block.mixer.from_cached_output(attended)
                mixed = block.mixer.o_proj(attended.transpose(1, 2).flatten(2))
            elif block.kind == "M":
                out, conv_state, ssm_state = mamba_decode_step(block.mixer, normed[:, 0], next(states), next(states))
                new_states += [conv_state, ssm_state]
                mixed = out[:, None]
            else:
                mixed = block.mixer(normed)
            if block.output_norm is not None:
                mixed = block.output_norm(mixed)
            hidden = hidden + (mixed if block.residual_multiplier == 1.0 else mixed * block.residual_multiplier)
        return model.head_logits(hidden)[:, -1], new_states


__all__ = ["DecodeStep", "cached_attention"]
