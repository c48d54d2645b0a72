"""Self-speculative decoding: the model's multi-token-prediction depths draft, the model verifies.

An MTP depth k (``meshlm/models/mtp.py``) is trained to predict token t+k+1 from the hidden
state at t and the tokens up to t+k, so at generation time the depths are a draft model that
comes with the model (DeepSeek-V3 §5.4.3: 85-90% acceptance of the second token, 1.8x tokens/s;
Nemotron 3). One step, for K drafts (``draft_tokens``: the first K depths, by default all
``model.mtp_depth``) and committed tokens x_0..x_c (x_c drawn but not yet run through the model):

1. **Draft.** Depth 1 reads the main model's last hidden state at c-1 and x_c and proposes d_1
   for x_{c+1}; depth k reads depth k-1's hidden state at c-1 and d_{k-1}, proposing d_k.
2. **Verify.** One forward of the main model over [x_c, d_1, ..., d_K] with the cache gives its
   greedy choice g_0..g_K after each of them: K+1 decode steps in one forward.
3. **Accept** the longest prefix of drafts with d_i = g_{i-1}; the token after it is g_n, the
   main model's own (a correction, or a bonus when all K were accepted). Every step emits n + 1
   tokens, and exactly those greedy decoding would (Leviathan et al. 2023, "Fast Inference from
   Transformers via Speculative Decoding"; Chen et al. 2023): drafts only decide how many
   forwards it takes. Up to rounding: K+1 queries in one forward may round differently from one
   query per forward, so a near-tie of the two best logits could break the other way.
   **Sampling** (temperature, top-k, top-p): each depth *draws* its draft from its own distribution
   q_i under the same settings, and the verification keeps drafts by the speculative-sampling rule
   (``speculative_sampling.py``: accept d_i with probability min(1, p(d_i)/q_i(d_i)), else draw
   the token from max(0, p - q_i)), so every emitted token is distributed as plain sampling's.
4. **Roll back** the main cache past the accepted tokens with ``InferenceCache.truncate``: a count
   for attention; for Mamba the SSM state kept after each verified token and a wider conv window
   (``enable_rollback(K + 1)`` after the prefill; see ``meshlm/models/cache.py``).

**The depths' caches.** Depth k's blocks (attention, Mamba, MLP per ``model.mtp_pattern``) see a
sequence of their own: at position j they read h^{k-1}_j (the main model's last hidden state
for k = 1, else depth k-1's output) and the token x_{j+k}. With x_0..x_c committed, that input
is *true* for j <= c-k; drafting at the last position c-1 feeds the deeper depths draft tokens
and draft hidden states at the k-1 positions after their true ones. Each depth keeps its own
``InferenceCache`` holding exactly its true positions -- what a training forward over the
committed sequence would put there -- so nothing a rejected draft touched outlives the step:

- ``MTPDrafter.draft`` (after the prefill and after every verification) runs each depth once,
  over the positions that became true since the last step -- for depth 1 the n + 1 just
  verified, for depth k those from its first uncached position on -- followed by its k-1
  speculative positions, and then truncates its cache back to the true ones (so depth k's
  cache rolls back k-1 tokens a step: attention by a count, Mamba from its kept states). Its
  outputs are the next depth's inputs; the true input at c-k+1 that depth k could not use yet
  (its x_{c+1} is still a draft) waits in ``pending`` for the next step.
- A depth whose cache is empty runs its true positions first (a Mamba state can roll back only
  after a first forward) and, with no true position at all yet, drafts on a scratch cache.

Prompts are decoded one at a time (batch 1): the rows of a batch would accept different numbers
of drafts. With sampling the tokens follow the model's distribution but are not the ones plain
sampling with the same seed draws (the drafts and acceptances take their own random numbers).
"""

from __future__ import annotations

import torch

from meshlm.errors import ConfigError
from meshlm.inference.prefill import column_slices, hidden_states, prefill
from meshlm.inference.sampling import SamplingConfig, restrict_vocab, sample_next, token_probs
from meshlm.inference.speculative_sampling import accept_or_resample
from meshlm.inference.stats import GenerationStats
from meshlm.models.cache import InferenceCache
from meshlm.models.context import SequenceContext

SPECULATIVE_METHODS = ("mtp",)


def check_speculative(model, method: str, sampling: SamplingConfig, draft_tokens: int | None = None) -> None:
    """Raise ConfigError unless ``model`` can decode speculatively with ``method``, ``sampling`` and
    ``draft_tokens`` drafts a step."""
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"speculative={method!r} is not a speculative decoding method; the only one is 'mtp' "
                          "(drafts from the model's multi-token-prediction depths).")
    if not model.config.mtp_depth:
        raise ConfigError("speculative decoding 'mtp' drafts with the model's multi-token-prediction depths, "
                          "but this model has model.mtp_depth=0; use a model trained with model.mtp_depth >= 1 "
                          "(e.g. configs/demo-mtp.yaml), or drop --speculative.")
    depths = model.config.mtp_depth
    if draft_tokens is not None and (isinstance(draft_tokens, bool) or not 1 <= draft_tokens <= depths):
        raise ConfigError(f"draft_tokens={draft_tokens!r}: the model's {depths} MTP depths (model.mtp_depth) draft "
                          f"1 to {depths} tokens a step; pick one in that range, or leave it out for {depths}.")


def greedy_tokens(model, hidden: torch.Tensor, valid_vocab_size: int | None, normed: bool = False) -> torch.Tensor:
    """The most likely next token [b, t] after each position of ``hidden`` [b, t, hidden_size]."""
    return restrict_vocab(model.head_logits(hidden, normed=normed), valid_vocab_size).argmax(-1)


def accepted_drafts(drafts: torch.Tensor, verified: torch.Tensor) -> int:
    """How many leading ``drafts`` [1, K] equal the main model's choices ``verified`` [1, K] before them."""
    return int((drafts == verified).long().cumprod(dim=-1).sum())


class MTPDrafter:
    """The model's MTP depths as a draft model, each depth with a cache of its true positions."""

    def __init__(self, model, num_drafts: int, valid_vocab_size: int | None, chunk_size: int | None,
                 max_tokens: int, sampling: SamplingConfig | None = None, generator: torch.Generator | None = None):
        self.model = model
        self.sampling = SamplingConfig(greedy=True) if sampling is None else sampling
        self.generator = generator
        """Draws the drafts when sampling (``sampling`` not greedy)."""
        self.draft_probs: list[torch.Tensor] = []
        """With sampling: each draft's distribution [1, vocab] in the last ``draft``."""
        self.depths = list(model.mtp.depths)[:num_drafts]
        self.caches = [InferenceCache(max_tokens) for _ in self.depths]
        self.pending: list[torch.Tensor | None] = [None for _ in self.depths]
        """Per depth: true input hidden states [1, n, hidden] from its first uncached position on
        that the previous depth (or the main model) will not hand over again."""
        self.recent_tokens = torch.zeros(1, 0, dtype=torch.long, device=model.output_weight().device)
        self.recent_start = 0
        """``recent_tokens`` are the committed tokens from this position on: those a depth still
        needs (a few), so that no step handles every token generated so far."""
        self.valid_vocab_size, self.chunk_size = valid_vocab_size, chunk_size

    def draft(self, new_tokens: torch.Tensor, main_hidden: torch.Tensor) -> torch.Tensor:
        """Bring every depth's cache up to its true positions and draft K tokens [1, K].

        ``new_tokens`` [1, m]: the tokens committed since the last call (first the prompt and
        the first token, then the accepted drafts and the main model's token); ``main_hidden``:
        the main model's last hidden states at the positions it just ran (through c-1)."""
        self.recent_tokens = torch.cat((self.recent_tokens, new_tokens), dim=1)
        last_committed = self.recent_start + self.recent_tokens.shape[1] - 1  # c
        inputs, drafts = main_hidden, []
        self.draft_probs = []
        for k, (depth, cache) in enumerate(zip(self.depths, self.caches), start=1):
            # h^{k-1} at positions start .. c-1: true up to c-1 (k = 1) or c-k+1, then speculative
            hidden = inputs if self.pending[k - 1] is None else torch.cat((self.pending[k - 1], inputs), dim=1)
            start = cache.num_seen_tokens
            future = torch.cat((self.recent_tokens, *drafts), dim=1)  # x_j for j >= recent_start
            ids = future[:, start + k - self.recent_start:][:, :hidden.shape[1]]  # position j reads x_{j+k}
            true_count = max(last_committed - k + 1 - start, 0)
            outputs = self.run_and_keep(depth, hidden, ids, cache, true_count)
            last_true_input = min(last_committed - 1, last_committed - k + 1) - start
            self.pending[k - 1] = hidden[:, true_count:last_true_input + 1]
            drafts.append(self.choose(depth.final_norm(outputs[:, -1:])))
            inputs = outputs
        still_needed = min(cache.num_seen_tokens + k for k, cache in enumerate(self.caches, start=1))
        self.recent_tokens = self.recent_tokens[:, still_needed - self.recent_start:]
        self.recent_start = still_needed
        return torch.cat(drafts, dim=1)

    def choose(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """A depth's draft [1, 1] after its last position: its most likely token, or with sampling one
        drawn from its distribution (kept in ``draft_probs`` for the verification)."""
        if self.sampling.greedy:
            return greedy_tokens(self.model, normed_hidden, self.valid_vocab_size, normed=True)
        logits = restrict_vocab(self.model.head_logits(normed_hidden, normed=True), self.valid_vocab_size)
        probs = token_probs(logits[:, -1], self.sampling)
        self.draft_probs.append(probs)
        return torch.multinomial(probs, 1, generator=self.generator)

    def run(self, depth, hidden: torch.Tensor, ids: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """Depth outputs [1, t, hidden] for inputs ``hidden`` and future tokens ``ids`` [1, t], after
        what ``cache`` holds (in chunks of the prefill's size)."""
        outputs = []
        for columns in column_slices(ids.shape[1], self.chunk_size):
            context = SequenceContext.for_tokens(ids[:, columns], None, cache)
            outputs.append(depth(hidden[:, columns], self.model.embed(ids[:, columns]), context))
        return torch.cat(outputs, dim=1)

    def run_and_keep(self, depth, hidden: torch.Tensor, ids: torch.Tensor, cache: InferenceCache,
                     keep: int) -> torch.Tensor:
        """``run`` over all positions given, of which ``cache`` keeps only the first ``keep``."""
        if cache.num_seen_tokens == 0 and keep < hidden.shape[1]:
            # a Mamba state can roll back only tokens after its first forward: the true ones go first
            if keep == 0:
                return self.run(depth, hidden, ids, InferenceCache())  # nothing to keep: a scratch cache
            first = self.run(depth, hidden[:, :keep], ids[:, :keep], cache)
            return torch.cat((first, self.run_and_keep(depth, hidden[:, keep:], ids[:, keep:], cache, 0)), dim=1)
        seen = cache.num_seen_tokens
        cache.enable_rollback(hidden.shape[1] - keep)
        outputs = self.run(depth, hidden, ids, cache)
        cache.truncate(seen + keep)
        return outputs

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches)


def speculative_generate(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | list[int] | None,
                         valid_vocab_size: int | None, prefill_chunk: int | None, stats: GenerationStats,
                         draft_tokens: int | None = None, sampling: SamplingConfig | None = None) -> list[int]:
    """New tokens for one prompt (as ``generate``; greedy unless ``sampling`` samples),
    ``draft_tokens`` (default: every MTP depth) drafted by the first MTP depths each step and verified."""
    device = next(model.parameters()).device
    sampling = SamplingConfig(greedy=True) if sampling is None else sampling
    generator = sampling.make_generator(device)
    num_drafts = draft_tokens or model.config.mtp_depth
    eos_ids = set(torch.tensor(eos_token_id).reshape(-1).tolist()) if eos_token_id is not None else set()
    max_tokens = len(prompt) + max_new_tokens + num_drafts
    cache = InferenceCache(max_tokens)
    drafter = MTPDrafter(model, num_drafts, valid_vocab_size, prefill_chunk, max_tokens, sampling, generator)
    prompt_ids = torch.tensor([prompt], device=device)

    with stats.timing("prefill", device):  # the main model's and the depths' (in the first draft)
        hidden = prefill(model, prompt_ids, None, cache, prefill_chunk, keep_all=True)
        logits = restrict_vocab(model.head_logits(hidden[:, -1]), valid_vocab_size)
        next_token = sample_next(logits, sampling, generator).view(1, 1)
        generated = next_token[0].tolist()
        finished = max_new_tokens == 1 or generated[0] in eos_ids
        if not finished:
            drafts = drafter.draft(torch.cat((prompt_ids, next_token), dim=1), hidden)
    stats.prefill_tokens += len(prompt)
    cache.enable_rollback(num_drafts + 1)

    with stats.timing("decode", device):
        while not finished:
            hidden = hidden_states(model, torch.cat((next_token, drafts), dim=1), cache)
            if sampling.greedy:
                verified = greedy_tokens(model, hidden, valid_vocab_size)
                accepted = accepted_drafts(drafts, verified[:, :-1])
                next_token = verified[:, accepted:accepted + 1]
            else:  # the speculative-sampling rule (speculative_sampling.py)
                target = token_probs(restrict_vocab(model.head_logits(hidden), valid_vocab_size)[0], sampling)
                accepted, token = accept_or_resample(drafts[0], torch.cat(drafter.draft_probs), target, generator)
                next_token = token.view(1, 1)
            cache.truncate(cache.num_seen_tokens - (num_drafts - accepted))
            new_tokens = torch.cat((drafts[:, :accepted], next_token), dim=1)
            generated += new_tokens[0].tolist()
            stats.verify_forwards += 1
            stats.drafted_tokens += num_drafts
            stats.accepted_tokens += accepted
            finished = len(generated) >= max_new_tokens or not eos_ids.isdisjoint(generated[-accepted - 1:])
            if not finished:
                drafts = drafter.draft(new_tokens, hidden[:, :accepted + 1])
    stats.saw_cache_bytes(cache.nbytes + drafter.nbytes)
    generated = generated[:max_new_tokens]
    ends = [index for index, token in enumerate(generated) if token in eos_ids]
    generated = generated[:ends[0] + 1] if ends else generated
    stats.decode_tokens += len(generated)
    return generated
