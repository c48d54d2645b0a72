"""A multi-node launch, two "nodes" on one host: the way examples/slurm/train.sbatch and
examples/multinode.sh start meshlm.

Two torchrun agents, one per node (``--nnodes 2 --nproc-per-node 1``), meet through torchrun's
c10d rendezvous at 127.0.0.1:PORT; the agent of node 0 hosts the rendezvous store
(``--rdzv-conf is_host=true``; on real nodes torchrun finds the host by its address), the other
only connects. Each starts one ``meshlm train`` worker, and the two workers train with dp=2 over
gloo. The run must be the single-process run of the same config and global batch: every step's
loss in RUN_DIR/metrics.jsonl within 1e-6 (fp32; only the order of the data-parallel sum
differs), and both ranks' shards in the final checkpoint.

Every process runs under a deadline and is killed by its process group when a test ends, however
it ends: a rendezvous that never completes fails the test instead of blocking it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import meshlm
from meshlm.config import load_run_config
from meshlm.training.metrics import read_metrics
from meshlm.training.trainer import train

PACKAGE_ROOT = Path(meshlm.__file__).resolve().parents[1]
STEPS = 3
DEADLINE_S = 180


def overrides(blend: Path, run_dir: Path) -> list[str]:
    """A tiny fp32 CPU run: global batch 4 = 2 micro-batches of 2, one per rank at dp=2."""
    return ["model.vocab_size=64", "model.hidden_size=32", "model.pattern=*-", "model.num_attention_heads=4",
            "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={STEPS}",
            "train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.progress=false",
            "train.tensorboard=false", "train.plot=false", "train.device=cpu", "precision.dtype=fp32",
            f"train.run_dir={run_dir}", f"data.blend={blend}", "data.split=90,10,0", "optim.lr=3e-3",
            "optim.warmup_steps=2", "parallel.backend=gloo", "parallel.timeout_s=60"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_node(node_rank: int, port: int, train_args: list[str], log: Path) -> subprocess.Popen:
    """One torchrun agent as node ``node_rank`` of 2, in a session of its own (so that killing its
    process group takes its worker too)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "meshlm-multinode-test",
               "--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'},join_timeout=60",
               "--max-restarts", "0", "--monitor-interval", "0.1", "-m", "meshlm", "train", *train_args]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def run_two_nodes(train_args: list[str], folder: Path) -> list[tuple[int, str]]:
    """Start node 0 and node 1, wait for both (at most DEADLINE_S), return (exit status, output) of each."""
    port, logs, nodes = free_port(), [folder / f"node{rank}.log" for rank in range(2)], []
    try:
        for rank in range(2):
            nodes.append(start_node(rank, port, train_args, logs[rank]))
        codes = [node.wait(timeout=DEADLINE_S) for node in nodes]
    except subprocess.TimeoutExpired:
        codes = [node.poll() for node in nodes]
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)  # its worker too; nothing left behind either way
            except ProcessLookupError:
                pass
            node.wait()
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in read_metrics(run_dir / "metrics.jsonl")
            if "loss" in record and "event" not in record}


def test_two_nodes_under_c10d_rendezvous_train_as_one_process(tmp_path, corpus_blend):
    single_dir, nodes_dir = tmp_path / "single", tmp_path / "two-nodes"
    train(load_run_config(None, overrides(corpus_blend, single_dir)))
    expected = step_losses(single_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))

    results = run_two_nodes(overrides(corpus_blend, nodes_dir), tmp_path)
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"node {rank} exited with {code}:\n{output[-3000:]}"
    output = "".join(text for _, text in results)
    assert f"meshlm train: done: step {STEPS}/{STEPS}" in output  # global rank 0 (on either node) reports
    start = read_metrics(nodes_dir / "metrics.jsonl")[0]
    assert (start["event"], start["world_size"], start["dp"], start["tp"]) == ("start", 2, 2, 1)
    losses = step_losses(nodes_dir)
    assert sorted(losses) == sorted(expected)
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), f"step {step}"
    checkpoint = nodes_dir / "checkpoints" / f"step_{STEPS}"
    assert {path.name.split("_")[2] for path in checkpoint.glob("__*_*.distcp")} == {"0", "1"}  # both ranks' shards
