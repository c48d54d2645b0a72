"""Multi-head latent attention in generation: the latent KV cache against the expanded one.

    python -m bench.latent_attention [--contexts 1024 4096] [--steps 8] [--repeats 5] [--threads 2]
                                     [--device cpu] [--out bench/results/latent_attention_cpu.json]

One latent attention layer of DeepSeek-V2-Lite's shapes (hidden 2048, 16 heads, queries projected
directly, a key/value latent of 512, 128 unrotated + 64 rotary query/key channels, values of 128;
``meshlm/models/latent_attention.py``), batch 1, fp32 on a CPU (bf16 on a GPU), two ways in the same
run, interleaved so machine noise hits each alike (``bench/timing.py``; medians of ``repeats``):

* ``expanded``: the cache holds every head's key (192) and value (128), as a multi-head
  attention layer of these widths would -- the baseline;
* ``latent``: the cache holds the normalized latent and the rotary key (W_kvb absorbed into the
  queries and the output), meshlm's default.

Per context length (the prompt, prefilled once per way) it prints the cache's bytes per token, the
seconds of ``steps`` one-token decode steps (eager forwards with the cache; the cache is rolled back
after each round, so every round decodes at the same length), the latent way's time over the
expanded one's, and the largest difference between their logits (the same function, rounded apart).

Then training's attention core at ``--train-seqs`` tokens, forward and backward, the same heads
(16 query/key heads of 192, values of 128), two ways interleaved:

* ``unpadded_sdpa``: ``F.scaled_dot_product_attention`` of the heads as they are -- on a CPU SDPA's
  math path, as the fused kernels want one width for q, k and v -- the baseline;
* ``padded``: meshlm's core (``attention.scaled_dot_product``: values zero-padded to 192, the fused
  kernel, the output's padding cut off).

with the bytes each keeps for backward and the largest tensor it makes.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.attention_runs import add_run_options, emit, run_setting
from bench.timing import interleaved_medians, synchronize
from meshlm.models.attention import attention_core
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

SHAPES = dict(vocab_size=256, hidden_size=2048, pattern="*", num_attention_heads=16, attention_type="mla",
              mla_q_lora_rank=None, mla_kv_lora_rank=512, mla_qk_nope_head_dim=128, mla_qk_rope_head_dim=64,
              mla_v_head_dim=128)


def prefilled(model, prompt: torch.Tensor, latent: bool, steps: int):
    """The cache after ``prompt``, with room for ``steps`` more tokens, and the way it was made."""
    model.blocks[0].mixer.latent_cache = latent
    cache = InferenceCache(max_tokens=prompt.shape[1] + steps)
    with torch.no_grad():
        model(prompt, cache=cache)
    return cache


def decode_round(model, cache, latent: bool, tokens: torch.Tensor, device):
    def run() -> float:
        model.blocks[0].mixer.latent_cache = latent
        synchronize(device)
        started = time.perf_counter()
        with torch.no_grad():
            for token in tokens:
                model(token.view(1, 1), cache=cache)
        synchronize(device)
        seconds = time.perf_counter() - started
        cache.truncate(cache.num_seen_tokens - len(tokens))  # back to the prompt
        return seconds
    return run


def measure(model, context: int, steps: int, repeats: int, device) -> dict:
    generator = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, 256, (1, context), generator=generator).to(device)
    tokens = torch.randint(0, 256, (steps,), generator=generator).to(device)
    caches = {"expanded": prefilled(model, prompt, False, steps), "latent": prefilled(model, prompt, True, steps)}
    seconds = interleaved_medians({name: decode_round(model, cache, name == "latent", tokens, device)
                                   for name, cache in caches.items()}, repeats)
    logits = {}
    for name, cache in caches.items():
        model.blocks[0].mixer.latent_cache = name == "latent"
        with torch.no_grad():
            logits[name] = model(tokens[:1].view(1, 1), cache=cache).logits.float()
        cache.truncate(cache.num_seen_tokens - 1)
    per_token = {name: cache.nbytes / (context + steps) for name, cache in caches.items()}
    return {"context": context, "steps": steps, "seconds": seconds,
            "latent_over_expanded_time": seconds["latent"] / seconds["expanded"],
            "cache_bytes_per_token": per_token,
            "expanded_over_latent_bytes": per_token["expanded"] / per_token["latent"],
            "max_logit_difference": float((logits["latent"] - logits["expanded"]).abs().max())}


def training_core(seq: int, repeats: int, dtype, device) -> dict:
    """The attention core's forward and backward at ``seq`` tokens, padded and not (module docstring)."""
    from tests.helpers.saved_tensors import LargestTensor, SavedStorages

    heads, key_width, value_width = SHAPES["num_attention_heads"], 192, SHAPES["mla_v_head_dim"]
    generator = torch.Generator().manual_seed(seq)
    tensors = [torch.randn(1, heads, seq, width, generator=generator).to(device, dtype).requires_grad_()
               for width in (key_width, key_width, value_width)]
    grad_out = torch.randn(1, heads, seq, value_width, generator=generator).to(device, dtype)
    cores = {"unpadded_sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "padded": lambda q, k, v: attention_core(q, k, v)}

    def timed(core):
        def run() -> float:
            synchronize(device)
            started = time.perf_counter()
            torch.autograd.grad(core(*tensors), tensors, grad_out)
            synchronize(device)
            return time.perf_counter() - started
        return run

    seconds = interleaved_medians({name: timed(core) for name, core in cores.items()}, repeats)
    memory = {}
    for name, core in cores.items():
        with SavedStorages(excluded={tensor.untyped_storage().data_ptr() for tensor in tensors}) as saved, \
                LargestTensor() as largest:
            out = core(*tensors)
            saved_bytes = sum(saved.storages.values())
            torch.autograd.grad(out, tensors, grad_out)
        memory[name] = {"saved_bytes": saved_bytes, "largest_tensor_bytes": largest.bytes}
    with torch.no_grad():
        difference = float((cores["padded"](*tensors) - cores["unpadded_sdpa"](*tensors)).abs().max())
    return {"seq": seq, "seconds": seconds, "padded_over_unpadded_time": seconds["padded"] / seconds["unpadded_sdpa"],
            "memory": memory, "max_difference": difference}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--train-seqs", type=int, nargs="*", default=[2048, 4096])
    add_run_options(parser)
    args = parser.parse_args(argv)
    device, dtype, header = run_setting(args)
    model = LanguageModel(ModelConfig(**SHAPES), seed=0).to(device, dtype).eval()
    results = {**header, "shapes": SHAPES, "repeats": args.repeats,
               "runs": [measure(model, context, args.steps, args.repeats, device) for context in args.contexts],
               "training_core": [training_core(seq, args.repeats, dtype, device) for seq in args.train_seqs]}
    return emit(results, args.out)


if __name__ == "__main__":
    main()
