"""Planning a parallel layout before running it: ``meshlm plan``.

    layouts.py    the layouts that divide (the trainer's own rules), ``--layout`` parsing
    memory.py     memory per GPU, itemized (exact parameter state, estimated activations)
    step_time.py  compute, communication (alpha-beta) and the pipeline bubble of one step
    hardware.py   the editable per-GPU rates and bandwidths (and the CPU's calibration)
    predict.py    one prediction per layout, and the ranking
    cli.py        the command

The planner reads models, config, the parallel layout rules and the training memory estimate; it
never imports the trainer (``tests/test_layout.py``).
"""
