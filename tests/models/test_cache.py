"""The inference cache (meshlm/models/cache.py): preallocated KV buffers and positions.

Keys and values appended a few tokens at a time equal their concatenation; the buffers are
reallocated only when full, doubling (100 single-token appends: at most 8 allocations), and
exactly once when the cache knows its final length. Positions returned for each piece equal
the cumulative count of real tokens over everything seen (the old whole-mask cumsum), with
left padding; dropping sequences keeps the others' keys, mask and counts. Truncating (the
rollback of speculative decoding) leaves a cache equal to one that never saw the dropped
tokens: attention keys, positions, and -- tested directly -- Mamba conv windows and SSM states.
"""

import pytest
import torch

from meshlm.models.cache import AttentionCache, InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel


def pieces(total: int, sizes=(3, 1, 1, 4, 1, 2)):
    start, index = 0, 0
    while start < total:
        size = min(sizes[index % len(sizes)], total - start)
        yield start, start + size
        start, index = start + size, index + 1


def test_appends_equal_concatenation_and_buffers_grow_by_doubling():
    torch.manual_seed(0)
    keys, values = torch.randn(2, 3, 100, 4), torch.randn(2, 3, 100, 4)
    cache, allocations = AttentionCache(), set()
    for start in range(100):
        held_keys, held_values = cache.append(keys[:, :, start:start + 1], values[:, :, start:start + 1])
        allocations.add(cache.key_buffer.data_ptr())
        assert torch.equal(held_keys, keys[:, :, :start + 1]) and torch.equal(held_values, values[:, :, :start + 1])
    assert len(allocations) <= 8, len(allocations)  # 1, 2, 4, ..., 128
    assert cache.nbytes == 2 * cache.key_buffer.numel() * 4

    hinted, first = AttentionCache(capacity_hint=100), None
    for start, end in pieces(100):
        hinted.append(keys[:, :, start:end], values[:, :, start:end])
        first = first or hinted.key_buffer.data_ptr()
        assert hinted.key_buffer.data_ptr() == first  # allocated once, at the first append
    assert torch.equal(hinted.keys, keys) and hinted.key_buffer.shape[2] == 100


def test_positions_count_real_tokens_across_pieces_and_survive_select():
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[0, :4] = False  # left padding of a shorter prompt
    mask[1, :1] = False
    mask[2, 7] = False  # a masked token in the middle
    cache = InferenceCache()
    for start, end in pieces(12):
        positions = cache.append_token_mask(mask[:, start:end], 3, end - start, torch.device("cpu"))
        expected = (mask[:, :end].long().cumsum(-1) - 1).clamp(min=0)[:, start:]
        assert torch.equal(positions, expected), (start, end)
    assert torch.equal(cache.token_mask, mask) and cache.num_seen_tokens == 12

    cache.select(torch.tensor([0, 2]))
    positions = cache.append_token_mask(None, 2, 1, torch.device("cpu"))
    assert positions[:, 0].tolist() == [int(mask[0].sum()), int(mask[2].sum())]
    assert torch.equal(cache.token_mask[:, :12], mask[[0, 2]])


def test_cache_knowing_its_length_allocates_the_mask_once():
    cache = InferenceCache(max_tokens=20)
    cache.append_token_mask(None, 2, 5, torch.device("cpu"))
    first = cache.mask_buffer.data_ptr()
    for _ in range(15):
        cache.append_token_mask(None, 2, 1, torch.device("cpu"))
    assert cache.mask_buffer.data_ptr() == first and cache.mask_buffer.shape == (2, 20)
    assert cache.state_for(0, AttentionCache).capacity_hint == 20


def test_attention_truncate_forgets_the_latest_tokens_and_positions():
    keys = torch.randn(1, 2, 10, 4)
    cache = InferenceCache(max_tokens=16)
    cache.append_token_mask(None, 1, 6, torch.device("cpu"))
    cache.state_for(0, AttentionCache).append(keys[:, :, :6], keys[:, :, :6])
    cache.append_token_mask(None, 1, 4, torch.device("cpu"))
    cache.state_for(0, AttentionCache).append(keys[:, :, 6:], keys[:, :, 6:])
    cache.truncate(7)
    assert cache.num_seen_tokens == 7 and cache.real_tokens.tolist() == [7]
    assert torch.equal(cache.state_for(0, AttentionCache).keys, keys[:, :, :7])
    positions = cache.append_token_mask(None, 1, 2, torch.device("cpu"))
    assert positions.tolist() == [[7, 8]]  # the next tokens take the forgotten ones' places
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(10)


def test_padding_is_tracked_without_looking_at_the_whole_mask():
    cache = InferenceCache()
    cache.append_token_mask(torch.ones(2, 3, dtype=torch.bool), 2, 3, torch.device("cpu"))
    assert not cache.has_padding  # an all-true mask needs no key mask in attention
    cache.append_token_mask(torch.tensor([[False, True], [True, True]]), 2, 2, torch.device("cpu"))
    assert cache.has_padding
    cache.append_token_mask(None, 2, 1, torch.device("cpu"))  # a decode step: no mask, no look
    assert cache.has_padding and cache.num_seen_tokens == 6


def mamba_model() -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=50, hidden_size=32, pattern="M-M", mamba_head_dim=8,
                                     mamba_chunk_size=4, init_std=0.1)).eval()


def run(model: LanguageModel, ids: list[int], cache: InferenceCache) -> torch.Tensor:
    return model(torch.tensor([ids]), cache=cache).logits


@pytest.mark.parametrize("calls, keep", [([[4, 9, 12, 3]], 2), ([[4, 9], [12, 3]], 1), ([[4, 9, 12, 3, 30]], 0),
                                         ([[4, 9, 12, 3]], 4), ([[4, 9, 12, 3, 30, 11, 19]], 3)])
def test_mamba_rollback_equals_a_cache_that_saw_only_the_kept_tokens(calls, keep):
    """Undo the latest tokens (within the rollback window, across forwards too): the conv window and
    SSM state equal those of a cache that only ever saw the kept tokens, and so do later outputs."""
    model, prompt = mamba_model(), [7, 1, 22, 5, 40, 13, 8, 2, 17, 33]  # longer than a scan chunk
    fed = [token for call in calls for token in call]
    with torch.no_grad():
        rolled_back = InferenceCache()
        run(model, prompt, rolled_back)
        rolled_back.enable_rollback(5)
        for call in calls:
            run(model, call, rolled_back)
        rolled_back.truncate(len(prompt) + keep)

        reference = InferenceCache()
        run(model, prompt + fed[:keep], reference)

        for index in (0, 2):
            state, expected = rolled_back.layers[index], reference.layers[index]
            kernel_inputs = expected.conv_state.shape[-1]
            # equal up to rounding: the reference ran the kept tokens in another forward shape
            torch.testing.assert_close(state.conv_state[..., -kernel_inputs:], expected.conv_state,
                                       atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(state.ssm_state, expected.ssm_state, atol=1e-5, rtol=1e-4)
        assert rolled_back.num_seen_tokens == reference.num_seen_tokens
        assert torch.equal(rolled_back.real_tokens, reference.real_tokens)
        torch.testing.assert_close(run(model, [21, 6], rolled_back), run(model, [21, 6], reference),
                                   atol=1e-5, rtol=1e-4)


def test_mamba_rollback_refuses_more_than_its_window():
    model = mamba_model()
    with torch.no_grad():
        cache = InferenceCache()
        run(model, [7, 1, 22], cache)
        cache.enable_rollback(2)
        run(model, [4, 9, 12], cache)
        with pytest.raises(RuntimeError, match="at most 2 tokens"):
            cache.truncate(3)
        fresh = InferenceCache()
        run(model, [7, 1], fresh)
        with pytest.raises(RuntimeError, match="at most 0 tokens"):
            fresh.truncate(1)  # no rollback window: nothing kept to undo with


def test_reserve_counts_tokens_written_by_the_caller_and_grows_like_append():
    cache = AttentionCache(capacity_hint=3)
    cache.append(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    assert cache.reserve(1) == 2 and cache.length == 3 and cache.key_buffer.shape[2] == 3
    cache.key_buffer[:, :, 2] = 1.0  # the caller writes the reserved slot (the compiled decode step does)
    assert cache.reserve(2) == 3 and cache.key_buffer.shape[2] == 6  # doubled, the held keys kept
    assert cache.keys.shape[2] == 5 and torch.equal(cache.key_buffer[:, :, 2], torch.ones(1, 2, 4))


# --- sliding-window caches ---------------------------------------------------------------------------------

def test_a_sliding_window_cache_keeps_the_window_and_stays_twice_its_size():
    cache = AttentionCache(window=4)
    cache.append(torch.arange(30.0).view(1, 1, 30, 1), torch.arange(30.0).view(1, 1, 30, 1))  # a long prompt
    assert cache.length == 30 and cache.start == 0
    for token in range(30, 100):  # decoding: one token at a time
        keys, _ = cache.append(torch.full((1, 1, 1, 1), float(token)), torch.full((1, 1, 1, 1), float(token)))
        assert cache.start + cache.length == token + 1  # slots of the keys held end at the newest token
        assert keys[0, 0, -4:, 0].tolist() == [float(t) for t in range(token - 3, token + 1)]  # its window
        assert keys.shape[2] >= 4 and cache.key_buffer.shape[2] <= 2 * 3 + 1
    assert cache.start > 0


def test_a_sliding_window_cache_undoes_only_its_rollback_window_once_keys_are_dropped():
    cache = AttentionCache(window=3, rollback_window=2)
    for token in range(20):
        cache.append(torch.full((1, 1, 1, 1), float(token)), torch.zeros(1, 1, 1, 1))
    assert cache.start > 0 and cache.length >= 2 + 2
    cache.forget_latest(2)
    assert cache.keys[0, 0, -2:, 0].tolist() == [16.0, 17.0]  # the window before token 18 is still there
    with pytest.raises(RuntimeError, match="can undo at most 2 tokens"):
        cache.forget_latest(3)


def test_inference_cache_gives_sliding_blocks_their_window_and_rollback():
    cache = InferenceCache(max_tokens=1000)
    cache.enable_rollback(3)
    full, sliding = cache.state_for(0, AttentionCache), cache.state_for(1, AttentionCache, window=8)
    assert (full.window, full.capacity_hint) == (None, 1000)
    assert (sliding.window, sliding.rollback_window, sliding.capacity_hint) == (8, 3, 16)


# --- joining and trimming batches (continuous batching) -----------------------------------------------------

JOIN_MODELS = {"dense": {"pattern": "*-*-"}, "hybrid": {"pattern": "M*-M-"},
               "sliding": {"pattern": "*-*-", "sliding_window": 3, "sliding_window_pattern": "SF"}}


def join_model(name: str) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=97, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                                     init_std=0.1, mamba_head_dim=8, mamba_chunk_size=8, **JOIN_MODELS[name])).eval()


def fed(model, prompts: list[list[int]], decoded: int) -> tuple[InferenceCache, list[list[int]]]:
    """A cache that has seen ``prompts`` (left-padded) and ``decoded`` tokens more per row, and the
    tokens each row was fed."""
    from meshlm.inference.generate import left_pad

    cache, input_ids = InferenceCache(), None
    input_ids, mask = left_pad(prompts, 0, torch.device("cpu"))
    model(input_ids, token_mask=mask, cache=cache)
    sequences = [list(prompt) for prompt in prompts]
    for step in range(decoded):
        tokens = [(7 * row + 11 * step + 5) % 97 for row in range(len(prompts))]
        model(torch.tensor(tokens)[:, None], cache=cache)
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
    return cache, sequences


@pytest.mark.parametrize("name", JOIN_MODELS)
@pytest.mark.parametrize("longer_first", [True, False])
@torch.inference_mode()
def test_joined_caches_decode_each_sequence_as_its_own_cache_does(name, longer_first):
    """A batch that has decoded past a sliding window joins one just prefilled (and the other way
    round): every row's logits from then on equal those of its own cache, and when the longest row
    leaves, the columns only it used are cut off and the others still decode the same."""
    model = join_model(name)
    running, running_sequences = fed(model, [[5, 17, 3, 42, 8, 1, 60], [11, 2]], decoded=6)
    joining, joining_sequences = fed(model, [[70, 4, 13], [33, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 90]], 0)
    if not longer_first:
        running, joining = joining, running
        running_sequences, joining_sequences = joining_sequences, running_sequences
    alone = [fed(model, [sequence], 0)[0] for sequence in running_sequences + joining_sequences]
    if name == "sliding":  # the decoded batch has dropped keys older than its window
        assert any(state.start for cache in (running, joining) for state in cache.layers.values())
    running.join(joining, capacity=40)
    assert running.batch_size == 4 and running.has_padding
    for step in range(8):
        tokens = torch.tensor([(13 * row + 3 * step + 1) % 97 for row in range(4)])
        joined = model(tokens[:, None], cache=running).logits[:, -1]
        for row, cache in enumerate(alone):
            torch.testing.assert_close(joined[row], model(tokens[row:row + 1, None], cache=cache).logits[0, -1],
                                       rtol=1e-5, atol=1e-5)
    longest = max(range(4), key=lambda row: len((running_sequences + joining_sequences)[row]))
    kept = [row for row in range(4) if row != longest]
    seen_before = running.num_seen_tokens
    running.select(torch.tensor(kept))
    assert running.drop_leading_padding() > 0 and running.num_seen_tokens < seen_before
    for step in range(4):
        tokens = torch.tensor([(5 * row + step) % 97 for row in kept])
        joined = model(tokens[:, None], cache=running).logits[:, -1]
        for index, row in enumerate(kept):
            torch.testing.assert_close(joined[index], model(tokens[index:index + 1, None], cache=alone[row]).logits[
                0, -1], rtol=1e-5, atol=1e-5)


def test_joining_refuses_caches_of_other_models_and_rolling_back_mamba_states():
    dense, hybrid = join_model("dense"), join_model("hybrid")
    with torch.inference_mode():
        with pytest.raises(ValueError, match="same model"):
            fed(dense, [[1, 2]], 0)[0].join(fed(hybrid, [[1, 2]], 0)[0])
        rolling = fed(hybrid, [[1, 2]], 0)[0]
        rolling.enable_rollback(2)
        with pytest.raises(RuntimeError, match="cannot be joined"):
            rolling.join(fed(hybrid, [[3]], 0)[0])
