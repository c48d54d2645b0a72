"""Expert parallelism (EP): whole experts per rank, each token sent to the ranks of its experts.

GShard (Lepikhin et al. 2020) places E/ep routed experts on each rank of an EP group and moves
tokens with an all-to-all; expert tensor parallelism (etp) may still split each expert's FFN
width, and experts are replicated over the remaining expert-data-parallel ranks (edp). MoE
Parallel Folding (Liu et al. 2025) lays that (edp, ep, etp) grid over the same ranks as
attention's (tp, cp, dp) (``meshlm/parallel/mesh.py``).

    expert_parallel.py  the MoE layer over the expert grid: entering/leaving it, routing gathered
                        for exact losses and capacity dropping, splitting a full layer
    dispatchers.py      token dispatchers: all-to-all (uneven, with its adjoint) and all-gather
"""
