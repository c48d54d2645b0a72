"""Tensor parallelism (TP) and sequence parallelism (SP): each matrix multiply split over tp ranks.

Megatron-LM's intra-layer model parallelism (Shoeybi et al. 2019): a column-parallel layer
splits its output features, a row-parallel one its input features, so a column-then-row pair
(q/k/v then o; up then down) costs one all-reduce forward and one backward. Sequence
parallelism (Korthikanti et al. 2022) keeps the residual stream sharded along the sequence
between those regions: the all-reduce becomes a reduce-scatter plus an all-gather, and norms run
on 1/tp of the tokens.

    layers.py          column/row-parallel linears, entering and leaving a parallel region
    sharding.py        which parameters are shards; full tensor <-> shard; partial-gradient sums
    vocab_parallel.py  embedding and cross-entropy over vocabulary shards (logits never gathered)
    attention.py       attention split by heads (KV heads split or replicated under GQA)
    mlp.py             the MLP split on its FFN width
    mamba.py           Mamba-2 split by heads and groups
    moe.py             MoE experts split on their FFN width (ep = 1, etp = tp)
    language_model.py  the model with a vocabulary-parallel head and loss
    orthogonal_updates.py  Muon's Newton-Schulz on TP-cut matrices, each whole on one rank
"""
