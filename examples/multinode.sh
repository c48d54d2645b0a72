#!/bin/bash
# Train with meshlm on several machines without a scheduler: run this script on every node,
# with the same MASTER_ADDR and NNODES and each node's own NODE_RANK.
#
#   node0$ MASTER_ADDR=node0 NNODES=2 NODE_RANK=0 examples/multinode.sh configs/tiny.yaml train.run_dir=/shared/runs/tiny
#   node1$ MASTER_ADDR=node0 NNODES=2 NODE_RANK=1 examples/multinode.sh configs/tiny.yaml train.run_dir=/shared/runs/tiny
#
# Node 0 (MASTER_ADDR) hosts the c10d rendezvous store; the others connect to it, so they may be
# started in any order within the rendezvous timeout. Global ranks are assigned by the
# rendezvous, so rank 0 (the one that logs) may land on any node. Everything after the script
# name goes to `meshlm train`; the run directory and the data must be visible from every node.
# Environment: MASTER_PORT (default 29500), NPROC_PER_NODE (default: the GPUs on this node, else
# 1 CPU process), OMP_NUM_THREADS and NCCL_* as explained in examples/slurm/train.sbatch.

set -euo pipefail

: "${MASTER_ADDR:?set MASTER_ADDR to the host name or address of node 0}"
: "${NODE_RANK:?set NODE_RANK: 0 on node MASTER_ADDR, 1 ... NNODES-1 on the others}"
NNODES=${NNODES:-2}
MASTER_PORT=${MASTER_PORT:-29500}
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
    [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=1
fi
CONFIG=${1:?usage: examples/multinode.sh CONFIG.yaml [SECTION.KEY=VALUE ...]}
shift

IS_HOST=false
[ "$NODE_RANK" = 0 ] && IS_HOST=true

# SIGTERM or Ctrl-C here reaches torchrun, which forwards it to its workers: they save the
# current step and exit 0; running the same command on every node resumes.
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-meshlm}" \
    --rdzv-conf "is_host=$IS_HOST" \
    -m meshlm train "$CONFIG" "$@"
