"""Data parallelism (DP): every rank holds a replica and runs its own samples; gradients are summed.

Gradients are accumulated in fp32 buckets and summed over DP by collectives that start during
the last micro-batch's backward (PyTorch DDP's bucketing, Li et al. 2020). ZeRO stage 1
(Rajbhandari et al. 2020) shards the optimizer state instead: gradients are reduce-scattered,
each rank updates its 1/dp of the fp32 values and Adam moments, and an all-gather returns them.
Stages 2 and 3 (``parallel.zero_stage``) shard the gradients and then the parameters as well.

    data_parallel.py          the one call that builds a run's reducer and optimizer; finishing a step
    grad_reducer.py           fp32 gradient buckets and their (overlapped) reduction
    distributed_optimizer.py  ZeRO-1: the sharded AdamW (and the stage-3 parameter shards)
    units.py                  ZeRO-2/3 units: a block, the embedding, the tail; one bucket each
    sharded_gradients.py      ZeRO-2/3: gradients reduce-scattered unit by unit, a shard kept
    fully_sharded.py          ZeRO-2/3: hooks that gather, reduce and free each unit in a fixed order
    grad_norm.py              the global gradient norm and clipping, every element counted once
    expert_data_parallel.py   experts reduced over the expert-data-parallel group, dense weights over dp_cp
"""
