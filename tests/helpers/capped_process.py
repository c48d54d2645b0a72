"""Run one model-file job in a fresh process whose memory is capped, and report its peak.

    python -m tests.helpers.capped_process JOB HEADROOM_MIB ARG...     (prints one JSON line)
    run_capped(JOB, HEADROOM_MIB, ARG...)                              (from a test: that line, parsed)

The cap is ``RLIMIT_DATA`` = the process's data size once torch and meshlm are imported, plus
HEADROOM_MIB. Why that limit: ``RLIMIT_DATA`` counts the memory a process writes -- the heap and
private anonymous mappings (every tensor torch allocates, thread stacks) -- but not read-only
file mappings or the shared libraries' code. ``RLIMIT_AS`` would count all address space: torch's
libraries alone reserve several GiB of it, and a read-only mapping of a file being read counts in
full although it costs no memory, so a cap on it measures the files' sizes, not what the process
holds. (safetensors' own ``safe_open`` maps a file copy-on-write, which ``RLIMIT_DATA`` does count
in full; meshlm reads through a read-only mapping instead: ``meshlm/checkpoint/safetensors_stream.py``.)

The process samples its own ``VmData`` (what the cap limits) and ``VmRSS`` every 2 ms in a
background thread and reports the peaks above the baseline; the ``VmHWM`` the kernel keeps is
reported too. The JSON line: {"ok", "error", "headroom", "data_peak", "rss_peak", "hwm"} (bytes
above the baseline). Jobs:

    hf-to-meshlm HF_DIR OUT        ``meshlm convert hf-to-meshlm`` (streams)
    meshlm-to-hf MODEL OUT         ``meshlm convert meshlm-to-hf`` (streams)
    hf-in-memory HF_DIR            the HF model built in memory (``load_hf_model``), as the
                                   conversion worked before it streamed
    consolidate CKPT OUT           ``meshlm checkpoint consolidate`` (streams)
    upcycle CKPT OUT ARG...        ``meshlm upcycle`` (streams)
    upcycle-in-memory CKPT E K     the dense model loaded and upcycled in memory (``upcycle_model``)
    dcp-in-memory CKPT             every model tensor of a checkpoint read whole at once
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def status(key: str) -> int:
    with open("/proc/self/status") as stream:
        return int(re.search(rf"{key}:\s+(\d+)", stream.read()).group(1)) * 1024


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peaks = {"VmData": 0, "VmRSS": 0}
        self.running = True

    def run(self) -> None:
        while self.running:
            for key in self.peaks:
                self.peaks[key] = max(self.peaks[key], status(key))
            time.sleep(0.002)


def cli_succeeds(cli, argv: list[str]) -> None:
    if cli(argv) != 0:
        raise RuntimeError(f"meshlm {' '.join(argv)} failed")


def job(name: str, arguments: list[str]):
    if name == "hf-to-meshlm":
        from meshlm.hf.convert import hf_to_meshlm
        return lambda: hf_to_meshlm(arguments[0], arguments[1])
    if name == "meshlm-to-hf":
        from meshlm.hf.convert import meshlm_to_hf
        return lambda: meshlm_to_hf(arguments[0], arguments[1])
    if name == "hf-in-memory":
        from meshlm.hf.convert import load_hf_model
        return lambda: load_hf_model(arguments[0])
    if name == "consolidate":
        from meshlm.checkpoint.consolidate import consolidate
        return lambda: consolidate(arguments[0], arguments[1])
    if name == "upcycle":
        from meshlm.cli import main as cli
        return lambda: cli_succeeds(cli, ["upcycle", *arguments])
    if name == "upcycle-in-memory":
        from meshlm.adapt.upcycle import upcycle_model
        from meshlm.checkpoint.model_files import load_model
        return lambda: upcycle_model(load_model(arguments[0]), int(arguments[1]), int(arguments[2]))
    if name == "dcp-in-memory":
        from meshlm.checkpoint.whole_tensors import read_global_tensors
        from meshlm.checkpoint.model_files import weights_source
        return lambda: read_global_tensors(arguments[0], [f"model/{key}" for key in weights_source(arguments[0]).layout])
    raise SystemExit(f"unknown job {name!r}")


def run_capped(job_name: str, headroom_mib: float, *arguments, timeout_s: float = 300, env: dict | None = None) -> dict:
    """Run ``job_name`` in a fresh capped process; its JSON report (raises if the process itself failed)."""
    completed = subprocess.run([sys.executable, "-m", "tests.helpers.capped_process", job_name, str(headroom_mib),
                                *map(str, arguments)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})
    if completed.returncode != 0:
        raise RuntimeError(f"the capped process exited with {completed.returncode}: {completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    import torch

    name, headroom, arguments = argv[0], int(float(argv[1]) * 2**20), argv[2:]
    run = job(name, arguments)  # imports what the job needs before the baseline
    torch.ones(4).sum()  # start torch's thread pool (its stacks) before the baseline, too
    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel
    with torch.device("meta"):  # the first model built imports ~200 modules lazily (~25 MiB): not the job's
        LanguageModel(ModelConfig(vocab_size=16, hidden_size=16, pattern="M*-E", num_attention_heads=2,
                                  mamba_head_dim=8, moe_num_experts=2, moe_top_k=1))
    sampler = Sampler()
    sampler.start()
    time.sleep(0.05)
    baseline_data, baseline_rss = status("VmData"), status("VmRSS")
    resource.setrlimit(resource.RLIMIT_DATA, (baseline_data + headroom, resource.RLIM_INFINITY))
    result = {"ok": True, "error": None, "headroom": headroom}
    try:
        run()
    except BaseException as error:  # MemoryError, or torch's RuntimeError "can't allocate memory"
        result.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
    sampler.running = False
    sampler.join()
    result.update(data_peak=sampler.peaks["VmData"] - baseline_data, rss_peak=sampler.peaks["VmRSS"] - baseline_rss,
                  hwm=status("VmHWM") - baseline_rss)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
