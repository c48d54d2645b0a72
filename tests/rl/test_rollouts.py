"""meshlm/rl/rollouts.py: seeded groups, packing, and log-probabilities against a plain forward."""

from __future__ import annotations

import torch

from meshlm.checkpoint.model_files import load_model
from meshlm.config import RLConfig
from meshlm.models.losses import IGNORE_INDEX
from meshlm.rl.rollouts import group_seed, pack, sample_groups, token_log_probs


def test_pack_right_pads_and_labels_the_completion_one_position_early():
    input_ids, labels = pack([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_token_id=0, device=torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    ignore = IGNORE_INDEX
    assert labels.tolist() == [[ignore, ignore, 1, 2, ignore], [3, 4, 9, ignore, ignore]]


def test_token_log_probs_are_the_tempered_log_softmax_at_the_labels(policy_folder):
    model = load_model(policy_folder).float().eval()
    input_ids, labels = pack([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], 0, torch.device("cpu"))
    with torch.no_grad():
        got = token_log_probs(model, input_ids, labels, temperature=0.7, valid_vocab_size=50)
        logits = model(input_ids).logits
    for row, (prompt_length, completion) in enumerate([(3, [6, 7]), (2, [8, 9, 10])]):
        for offset, token in enumerate(completion):
            position = prompt_length - 1 + offset
            expected = torch.log_softmax(logits[row, position, :50] / 0.7, dim=-1)[token]
            assert torch.allclose(got[row, position], expected, atol=1e-6)
    assert got[labels == IGNORE_INDEX].abs().max() == 0


def test_a_group_is_the_same_whichever_rank_samples_it(policy_folder):
    """Group seeds depend on (seed, step, index in the step) only: sampling prompts 1 and 2 alone
    gives what sampling all three together gave them."""
    model = load_model(policy_folder).float()
    records = [{"prompt": p} for p in ("a", "b", "c")]
    encode = lambda record: [1, 2, 3 + ord(record["prompt"]) % 5]  # noqa: E731
    rl = RLConfig(group_size=4, max_new_tokens=5, temperature=1.0)
    together = sample_groups(model, records, 0, step=3, seed=11, encode_prompt=encode, rl=rl, stop_ids=[40],
                             valid_vocab_size=50, pad_token_id=0)
    alone = sample_groups(model, records[1:], 1, step=3, seed=11, encode_prompt=encode, rl=rl, stop_ids=[40],
                          valid_vocab_size=50, pad_token_id=0)
    assert together.completion_ids[4:] == alone.completion_ids
    assert len(set(map(tuple, together.completion_ids))) > 1  # temperature sampling, not one repeated reply
    assert group_seed(11, 3, 1) == group_seed(11, 3, 1) != group_seed(11, 4, 1)
