"""The optimizer's update rule: AdamW with decay / no-decay parameter groups (``adamw.py``).

It sits below ``parallel/`` and ``training/``: the trainer builds it for a single process, and
the ZeRO-1 distributed optimizer (``meshlm/parallel/data/distributed_optimizer.py``) builds the
same one as its single-process reference, so both step identically.
"""
