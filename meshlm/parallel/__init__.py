"""Parallelism: one folder per way of splitting the work, over one mesh and one set of collectives.

Every rank runs the same program on its share; each parallelism inserts a few collectives into
the forward (Megatron-LM's explicit style), and with a world of one process every layer is an
ordinary PyTorch layer. The pieces, bottom up:

    mesh.py          ``ParallelContext``: the process groups of one grid (pp, dp, cp, tp), TP
                     innermost, and the folded expert grid (pp, edp, ep, etp); layouts are
                     refused before any collective.
    groups.py        ``Group``: a process group with its name ("tp", "dp_cp", ...), the run's
                     device and the run's collective record; what every collective takes.
    collectives.py   every collective with a custom backward, defined once with its adjoint;
                     the one import for all communication (plain ones re-exported).
    plain_collectives.py  the only calls of torch.distributed's communication functions: each
                     refuses a tensor off the run's device and is recorded when checked.
    collective_log.py, collective_checks.py  ``parallel.check_collectives``: what a rank records,
                     and the comparison of the ranks' records after every step.
    comm_log.py      counts collectives and their bytes per group (for benchmarks and tests).
    tensor/          tensor + sequence parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022).
    data/            data parallelism: bucketed gradient reduction, ZeRO-1 (Rajbhandari et al. 2020).
    context/         context parallelism: ring attention (Liu et al. 2023), exact CP Mamba-2.
    expert/          expert parallelism with parallel folding (Lepikhin et al. 2020; Liu et al. 2025).
    pipeline/        pipeline parallelism: 1F1B and interleaved 1F1B (Narayanan et al. 2021).
    parallelize.py   a full single-process model -> this rank's share (TP/SP per block kind, MoE
                     blocks over TP or the expert grid); CP and PP are applied by the trainer
                     (``context/context_parallel.apply_context_parallel``, ``pipeline/``).
"""
