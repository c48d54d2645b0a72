"""bench/constrained_decoding.py at a toy size: its document fits the schema under a freshly trained
BPE, remembered masks cost less than walked ones, and every constrained reply that ends is JSON."""

from bench.constrained_decoding import decoding, mask_costs, train_tokenizer


def test_the_bench_measures_masks_and_decoding_at_a_toy_size(tmp_path):
    tokenizer = train_tokenizer(512, tmp_path / "tokenizer", text_bytes=200_000)
    masks = mask_costs(tokenizer)
    assert masks["vocab_size"] == 512 and masks["document_tokens"] > 20
    assert 0 < masks["distinct_states"] <= masks["document_tokens"]
    assert masks["warm_mask_ms_median"] < masks["cold_mask_ms_median"]
    result = decoding(tokenizer, requests=2, new_tokens=24, repeats=1, device="cpu")
    assert result["free"]["tokens"] == 48 and result["free"]["ended_replies_valid_json"] is None
    for name in ("json_object", "schema"):
        assert result[name]["ended_replies_valid_json"] is True
        assert 0 < result[name]["constraint_ms_per_token_last_round"] < result[name]["ms_per_token"]
