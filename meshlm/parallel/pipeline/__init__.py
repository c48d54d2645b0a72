"""Pipeline parallelism (PP): the blocks split into stages on pp ranks, micro-batches in flight.

1F1B and interleaved 1F1B with virtual stages (Narayanan et al. 2021) as per-rank action lists;
activations and gradients move by batched point-to-point messages.

    stages.py           stage boundaries (by ``|`` in the pattern or by equal FLOPs), tied embeddings
    schedules.py        1F1B and interleaved schedules, inspectable and replayable
    p2p.py              batched, tagged send/receive with shapes known ahead
    runtime.py          the executor that runs a rank's actions (with timestamps)
    pipelined_model.py  a model's stage: forward/backward of micro-batches, losses to rank 0
    state.py            the whole single-process state dict assembled from the stages
"""
