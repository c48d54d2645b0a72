"""The inference cache (meshlm/models/cache.py): preallocated KV buffers and positions.

Keys and values appended a few tokens at a time equal their concatenation; the buffers are
reallocated only when full, doubling (100 single-token appends: at most 8 allocations), and
exactly once when the cache knows its final length. Positions returned for each piece equal
the cumulative count of real tokens over everything seen (the old whole-mask cumsum), with
left padding; dropping sequences keeps the others' keys, mask and counts.
"""

import torch

from meshlm.models.cache import AttentionCache, InferenceCache


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
