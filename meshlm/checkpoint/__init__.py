"""Models and training checkpoints on disk, readable at any parallel layout.

    files.py                the file names every format shares; atomic writes, CRC-32 checksums
    folders.py              a run's step_N folders: the newest complete one, pruning, verification
    model_files.py          a single-file model: config.json + model.safetensors (+ tokenizer)
    safetensors_stream.py   safetensors read by slice and written one tensor at a time
    materialize.py          a meta model's (sharded) tensors filled from initial values or files
    sharding.py             a parameter's shards as chunks of the single-process tensor
    global_state.py         everything a run saves (weights, fp32 masters, Adam moments) in global chunks
    planners.py             the chunks handed to torch.distributed.checkpoint (DCP) to save and load
    distributed.py          ``Checkpointer``: every rank writes its chunks, atomic commit, async save
    loading.py              check, read and derive: a checkpoint into a run at any layout
    training_checkpoint.py  ``TrainerState``, RNG states, the older single-process format
    whole_tensors.py        every tensor of a distributed checkpoint read whole (to compare checkpoints)
    consolidate.py          ``meshlm checkpoint consolidate`` / ``inspect`` (``cli.py``)
"""
