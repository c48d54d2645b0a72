"""Context parallelism (CP): every sequence split over cp ranks, balanced for causal attention.

The sequence is cut into 2*cp chunks and rank i keeps chunks i and 2cp-1-i (Megatron-LM; Llama 3,
Dubey et al. 2024, §3.3.2), so every rank does the same causal work. Layers that mix tokens
exchange what they need: attention passes keys and values around a ring (Liu et al. 2023, Ring
Attention), Mamba-2 hands its convolution window and SSM state over in sequence order. One chunk
pair's attention, through the fused kernel that returns the log-sum-exp, is
``meshlm/models/block_attention.py`` (attention sinks use it outside CP too).

    chunks.py            which chunks a rank holds; rows of a neighbouring chunk
    context_parallel.py  a micro-batch split into the rank's chunks, loss shares, applying CP to a model
    ring_attention.py    exact causal attention with K/V travelling the ring (online-softmax merge)
    mamba.py             exact Mamba-2: conv windows from the previous chunk, SSM start states by one all-gather
"""
