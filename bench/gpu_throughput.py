"""Tokens/s, MFU and peak memory of ``meshlm train`` on one GPU at about 1B parameters, seq 4096.

    python -m bench.gpu_throughput [--models dense,hybrid,moe] [--compile off,on] [--recompute none,selective]
                                   [--steps 5] [--warmup 2] [--repeats 3] [--out FILE]
    python -m bench.gpu_throughput --tiny        # the same script on tiny shapes, on CPU, in seconds

Three shapes, each about 1B (active) parameters, bf16 (bf16 weights and activations, fp32 master
weights and AdamW states: ``meshlm/precision/mixed_precision.py``), vocab 32000, untied head:

- ``dense``: Llama-style, 20 layers (pattern ``*-`` x 20) of hidden 2048, 16 query heads of 128
  and 4 KV heads (GQA as Llama 3), SwiGLU MLP of 5632 (TinyLlama's width), RoPE: 1.03B.
- ``hybrid``: Nemotron-H-style (NVIDIA 2025): 26 blocks, 12 Mamba-2 (64 heads of 64, state 128,
  8 B/C groups, chunk 128), 2 attention (7.7% of the blocks, no positional encoding) and 12
  squared-ReLU MLPs of 5.25 x hidden = 10752 (Nemotron-H's ratio): 1.03B.
- ``moe``: 18 layers of attention + MoE (pattern ``*E`` x 18), 8 experts of width 2816, top-2
  (Mixtral's routing), aux loss 0.01: 2.81B total, 0.94B active. (64 fine-grained experts of
  704, top-8, would do the same work per token with 5.3B parameters: at 18 bytes each with fp32
  masters and AdamW that is more than one 80 GB GPU holds.)

The bench prints every count itself (``shapes`` in the JSON; ``active`` counts top_k of the
experts) and ``tests/bench/test_gpu_throughput.py`` holds them to 0.8-1.3B.

What is timed is the real trainer's step (``Trainer.train_step``: batch read from a token store
of random tokens, forward, backward, gradients to the fp32 masters, clipping, fused AdamW), one
micro-batch per step, for every combination of ``train.compile`` (each block under
torch.compile, ``meshlm/training/compile.py``) and ``train.recompute`` (``none`` or ``selective``,
``meshlm/training/recompute.py``). One trainer per model serves all its variants: the eager ones
first, then its blocks are compiled; recompute is switched with the trainer's own
``apply_recompute``. Each variant runs ``--warmup`` steps (the first pays for compiling), and up to
5 more while a step still compiles a new graph (``warmup_steps``), then ``--repeats`` x ``--steps``
timed steps; the median is reported, with ``graphs_compiled_while_timed`` (0 when no compiling
was timed).

MFU = model FLOPs per token (``meshlm.models.flops``: matmuls only, training = 3 x forward,
recomputation not counted, attention's full s x s square as PaLM counts it) x tokens/s / peak.
The peak is the data sheet's dense bf16 figure for the GPU (989.4 TFLOP/s for H100 SXM and H200,
``meshlm.training.metrics.GPU_PEAK_TFLOPS``) unless ``--peak-tflops`` says otherwise; the best
8192^3 bf16 matmul measured at start-up is reported beside it. Peak memory is
``torch.cuda.max_memory_allocated`` of each variant (static state included; null on CPU).

The baseline, on the dense shape in the same run: ``bench/reference_gpt.py``, the same model
written in plain PyTorch -- SDPA (flash) attention with GQA, bf16 ``torch.autocast`` over fp32
weights, fused AdamW, global-norm clipping -- eager and with each layer under ``torch.compile``,
on a fresh batch of random tokens each step (drawn on the device), as meshlm's trainer reads its
random-token store (until 2026-11-29 it repeated one batch, whose loss it memorized to ~0.0005:
the same kernels and time, a misleading loss).
torchtitan's Llama trainer would be the stronger baseline, but it cannot be installed on a
machine without network access; the JSON says whether it was importable.

The micro-batch is the largest of 8, 4, 2, 1 whose start-up memory estimate
(``meshlm/training/memory_estimate.py``) fits 85% of the GPU (``--micro-batch`` fixes it); a
variant that still runs out of memory is retried with half the micro-batch, and an error of any
other kind is recorded as ``{"error": ...}`` and the bench goes on. Each finished variant is one
line on stderr and is written at once to ``--out`` (so a killed run keeps what it measured; an
existing file from the same GPU and sequence length is merged into, so a run split into several
commands ends in one file). The JSON on stdout ends with ``summary`` (best MFU per model, the
meshlm/baseline ratios) and ``targets`` (issue 14's: dense >= 50% MFU and >= 1.1x the baseline,
hybrid >= 40%, MoE >= 35%; computed from the numbers, null where not measured). With the dense
shape, ``attention_kernels`` times each SDPA kernel forced on that shape's attention
(``bench/attention_kernels.py``) and names the one meshlm's ``model.attention_kernel=auto`` runs;
the baseline then runs PyTorch's own choice, as a plain loop would (the trainer sets meshlm's
preference process-wide). ``--profile TOP`` adds to each variant one more step under ``torch.profiler`` and its TOP operators by their own
device time (``profile``), to see where meshlm's step and the plain loop's part.
``--inductor-code FILE`` writes the modules Inductor generated for the compiled variants (each
kernel's source and the buffers it is called with: ``bench.profiling.save_inductor_code``) to one
gzip file, rewritten after every compiled variant, so that a compiled profile's kernel names can
be read against what each kernel reads and writes, afterwards and on any machine.

Time: the whole run is printed as an estimate first (about 9 minutes on an H100, most of it
Inductor compiling each block kind once, and the attention blocks again for selective
recompute). Where a command may run at most 10 minutes, split it; the three parts merge into
one ``--out`` file:

    python -m bench.gpu_throughput --compile off --out runs/gpu_throughput.json                 # ~2.5 min
    python -m bench.gpu_throughput --models dense --compile on --out runs/gpu_throughput.json   # ~3.5 min
    python -m bench.gpu_throughput --models hybrid,moe --compile on --out runs/gpu_throughput.json  # ~5 min
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.attention

from bench.attention_kernels import measure as measure_attention_kernels
from bench.compile import graphs_compiled
from bench.profiling import profile_step, save_inductor_code
from bench.timing import synchronize
from bench.reference_gpt import ReferenceGPT, ReferenceTrainer
from bench.train_throughput import write_random_corpus
from meshlm.checkpoint.files import write_json_atomic
from meshlm.config import load_run_config
from meshlm.models.attention_kernels import PRIORITY_SUPPORTED, settled_priority_order
from meshlm.models.config import ModelConfig
from meshlm.models.flops import model_flops_per_token
from meshlm.models.language_model import LanguageModel
from meshlm.precision.device_defaults import configure_tf32
from meshlm.training.compile import compile_blocks
from meshlm.training.memory_estimate import estimate_training_memory
from meshlm.training.metrics import measured_peak_flops, table_peak_flops
from meshlm.training.recompute import apply_recompute
from meshlm.training.trainer import Trainer

MFU_TARGETS = {"dense": 0.50, "hybrid": 0.40, "moe": 0.35}
"""Issue 14's MFU targets per shape; ``BASELINE_TARGET``: dense tokens/s over the baseline's."""
BASELINE_TARGET = 1.1
MICRO_BATCHES = (8, 4, 2, 1)
MEMORY_FRACTION = 0.85
"""Share of the GPU's memory the start-up estimate may fill when the micro-batch is chosen."""
COMPILE_SECONDS_PER_GRAPH, INIT_PARAMETERS_PER_SECOND, ASSUMED_MFU = 30.0, 1e8, 0.35
"""Rough constants of the time estimate printed up front: compiling one block kind's forward and
backward (selective recompute recompiles only the attention blocks; the baseline's one layer
kind counts as two), drawing initial values on the CPU, and the speed of a step."""

LLAMA = dict(vocab_size=32000, hidden_size=2048, num_attention_heads=16, num_kv_heads=4, tie_embeddings=False)
SHAPES = {
    "dense": dict(LLAMA, pattern="*-" * 20, mlp_activation="swiglu", ffn_hidden_size=5632),
    "hybrid": dict(LLAMA, pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-", position_embedding="none",
                   mlp_activation="squared_relu", ffn_hidden_size=10752, mamba_head_dim=64, mamba_state_size=128,
                   mamba_num_groups=8, mamba_chunk_size=128),
    "moe": dict(LLAMA, pattern="*E" * 18, mlp_activation="swiglu", moe_num_experts=8, moe_top_k=2,
                moe_ffn_hidden_size=2816, moe_aux_loss_coeff=0.01),
}
TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_kv_heads=2, tie_embeddings=False)
TINY_SHAPES = {
    "dense": dict(TINY, pattern="*-*-", mlp_activation="swiglu", ffn_hidden_size=128),
    "hybrid": dict(TINY, pattern="M-*-", position_embedding="none", mlp_activation="squared_relu",
                   ffn_hidden_size=256, mamba_head_dim=16, mamba_state_size=16, mamba_num_groups=2,
                   mamba_chunk_size=16),
    "moe": dict(TINY, pattern="*E*E", mlp_activation="swiglu", moe_num_experts=4, moe_top_k=2,
                moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.01),
}

TINY_ATTENTION = dict(batch=1, heads=4, kv_heads=2, seq=64, head_dim=16, warmup=1, repeats=2)
"""``attention_kernels``' shape under ``--tiny``."""


# --- shapes and their sizes --------------------------------------------------------------------------------
def parameter_counts(model: dict) -> dict[str, int]:
    """Total and active parameters of a shape, built on the meta device (no memory): active counts
    ``moe_top_k`` of each MoE block's ``moe_num_experts`` routed experts, everything else whole."""
    config = ModelConfig(**model)
    with torch.device("meta"):
        built = LanguageModel(config)
    total = built.num_parameters()
    experts = sum(p.numel() for name, p in built.named_parameters() if ".experts." in name)
    return {"total": total, "active": round(total - experts * (1 - config.moe_top_k / config.moe_num_experts))}


def describe_shapes(shapes: dict[str, dict], seq_len: int) -> dict[str, dict]:
    described = {}
    for name, model in shapes.items():
        config = ModelConfig(**model)
        kinds = {kind: config.block_kinds.count(kind) for kind in sorted(set(config.block_kinds))}
        described[name] = {"parameters": parameter_counts(model), "blocks": kinds, "model": model,
                           "flops_per_token": model_flops_per_token(config, seq_len)}
    return described


# --- what runs: meshlm's trainer and the plain-PyTorch baseline --------------------------------------------
def run_config(model: dict, seq_len: int, micro_batch: int, dtype: str, extra: tuple[str, ...] = ()):
    """A validated RunConfig of one shape: one micro-batch per step, no evaluation, no checkpoints."""
    config = load_run_config(None, [f"train.seq_len={seq_len}", f"train.micro_batch_size={micro_batch}",
                                    f"train.global_batch_size={micro_batch}", f"precision.dtype={dtype}",
                                    "data.blend=null", *extra])
    config = dataclasses.replace(config, model=ModelConfig(**model))
    config.validate()
    return config


class MeshlmSubject:
    """The real trainer on one shape; ``prepare`` switches compile (once, eager variants first) and recompute."""

    impl = "meshlm"

    def __init__(self, micro_batch: int, model: dict, args, data_prefix: Path, run_dir: Path, steps: int):
        self.trainer = Trainer(run_config(model, args.seq_len, micro_batch, args.dtype, (
            f"train.steps={steps}", "optim.warmup_steps=1", "train.eval_every=0", "train.save_every=0",
            "train.tensorboard=false", "train.progress=false", f"train.run_dir={run_dir}",
            f"train.device={args.device}", f"data.prefixes=[{data_prefix}]", "data.split=100,0,0")))
        self.compiled_blocks, self.notices = None, []

    def prepare(self, compile: bool, recompute: str) -> dict:
        if not compile and self.compiled_blocks is not None:
            raise RuntimeError("eager variants must run before the blocks are compiled")
        if compile and self.compiled_blocks is None:
            self.compiled_blocks = compile_blocks(self.trainer.model, self.trainer.device, self.notices.append)
        apply_recompute(self.trainer.model, recompute)
        return {"parameters": self.trainer.num_parameters, "compiled_blocks": self.compiled_blocks,
                "compile_fallback": self.notices[0] if self.notices else None,
                "scan_kernels_note": self.trainer.scan_kernels_note}  # None: the Triton scan passed its check

    def step(self) -> float:
        return self.trainer.train_step().loss

    def close(self) -> None:
        self.trainer.batches.close()


class BaselineSubject:
    """``bench/reference_gpt.py`` on the dense shape: autocast bf16 over fp32 weights, SDPA, fused AdamW."""

    impl = "baseline"

    def __init__(self, micro_batch: int, model: dict, args):
        config = ModelConfig(**model)
        if set(config.block_kinds) != {"*", "-"} or config.mlp_activation != "swiglu":
            raise ValueError("the plain-PyTorch baseline is a Llama-style stack: pattern '*-' repeated, SwiGLU")
        device = torch.device(args.device)
        torch.manual_seed(0)
        with device:
            gpt = ReferenceGPT(config.vocab_size, config.hidden_size, config.block_kinds.count("*"),
                               config.num_attention_heads, config.resolved_ffn_hidden_size, config.rope_theta,
                               kv_heads=config.resolved_num_kv_heads, tie_embeddings=config.tie_embeddings)
        self.reference = ReferenceTrainer(gpt, args.dtype)
        self.parameters = sum(p.numel() for p in gpt.parameters())
        # A fresh batch of random tokens each step, as meshlm's trainer reads from its random-token store
        # (the same batch over and over is memorized: the loss falls to ~0 within the timed steps).
        self.batch_shape, self.vocab_size, self.device = (micro_batch, args.seq_len + 1), config.vocab_size, device
        self.generator = torch.Generator(device).manual_seed(0)
        self.compiled = False

    def prepare(self, compile: bool, recompute: str) -> dict:
        if recompute != "none":
            raise ValueError("the plain-PyTorch baseline has no recomputation")
        if compile and not self.compiled:  # per layer, as meshlm compiles per block (and torchtitan per layer)
            for layer in self.reference.model.layers:
                layer.compile()
            self.compiled = True
        return {"parameters": self.parameters}

    def step(self) -> float:
        batch = torch.randint(0, self.vocab_size, self.batch_shape, device=self.device, generator=self.generator)
        return self.reference.train_step(batch[:, :-1], batch[:, 1:])

    def close(self) -> None:
        pass


# --- measuring ---------------------------------------------------------------------------------------------
def timed(step, count: int, device: torch.device) -> tuple[float, object]:
    """Seconds per step over ``count`` steps (the device synchronized at both ends) and the last result."""
    synchronize(device)
    started = time.perf_counter()
    for _ in range(count):
        result = step()
    synchronize(device)
    return (time.perf_counter() - started) / count, result


MAX_EXTRA_WARMUP = 5
"""Warm-up steps beyond ``--warmup`` while Dynamo is still compiling new graphs."""


def measure_variant(subject, compile: bool, recompute: str, args, device: torch.device) -> dict:
    """Warm up (``--warmup`` steps, then more while a step still compiled a new graph, up to
    ``MAX_EXTRA_WARMUP``: a graph first met on the second or third step, such as the optimizer's
    first real update or a recompile for a changed shape, must not be timed), then the repeats.
    ``graphs_compiled_while_timed`` says whether compiling leaked into the timed steps anyway."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    details = subject.prepare(compile, recompute)
    warmup, still_compiling = [], False
    while len(warmup) < args.warmup or (still_compiling and len(warmup) < args.warmup + MAX_EXTRA_WARMUP):
        before = graphs_compiled()
        warmup.append(timed(subject.step, 1, device)[0])  # the first one compiles
        still_compiling = graphs_compiled() != before
    before_timing = graphs_compiled()
    runs = [timed(subject.step, args.steps, device) for _ in range(args.repeats)]
    step_s = statistics.median(seconds for seconds, _ in runs)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if args.profile:
        details = {**details, "profile": profile_step(subject.step, device, args.profile)}
    return {**details, "step_s": step_s, "step_s_repeats": [round(s, 5) for s, _ in runs],
            "first_step_s": round(warmup[0], 3) if warmup else None, "warmup_steps": len(warmup),
            "graphs_compiled_while_timed": graphs_compiled() - before_timing, "loss": runs[-1][1],
            "peak_memory_gib": None if peak is None else round(peak, 2)}


def where(error: BaseException, frames: int = 3) -> list[str]:
    """The innermost ``frames`` of ``error``'s traceback as ``file:line in function``."""
    return [f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
            for frame in traceback.extract_tb(error.__traceback__)[-frames:]]


def measure_subject(subject_class, subject_args: dict, variants, micro_batch: int, name: str,
                    flops_per_token: float, peak: float, args, device: torch.device, record) -> None:
    """Every (compile, recompute) variant on one ``subject_class(micro_batch, **subject_args)`` while it
    lasts. Out of memory: a new subject with half the micro-batch runs the same variant again; any
    other error is recorded (and the next variant gets a new subject)."""
    subject, pending, halved_from = None, list(variants), []
    while pending:
        compile, recompute = pending[0]
        retry = False
        try:
            subject = subject or subject_class(micro_batch, **subject_args)
            result = measure_variant(subject, compile, recompute, args, device)
        except torch.OutOfMemoryError as error:
            retry, result = micro_batch > 1, {"error": f"OutOfMemoryError: {first_line(error)}"}
        except Exception as error:  # recorded; the bench goes on with the next variant
            result = {"error": f"{type(error).__name__}: {first_line(error)}", "where": where(error)}
            traceback.print_exc()  # the whole story in the log; the JSON keeps the innermost frames
        if "error" in result:  # outside the except block: the traceback no longer pins the step's tensors
            subject = closed(subject)
            free_memory(device)
            if retry:
                halved_from.append(micro_batch)
                micro_batch //= 2
                continue
        pending.pop(0)
        entry = {"impl": subject_class.impl, "model": name, "compile": compile, "recompute": recompute,
                 "micro_batch": micro_batch, "seq_len": args.seq_len, **result}
        if halved_from:
            entry["out_of_memory_at_micro_batch"] = list(halved_from)
        if name == "hybrid" and device.type == "cuda":  # which tile and warps the SSD kernels' autotuner chose
            from meshlm.kernels.ssd_diagonal import tuned_choices  # {} without Triton
            entry["ssd_kernel_choices"] = tuned_choices()
        if "error" not in result:
            tokens, step_s = micro_batch * args.seq_len, result["step_s"]
            entry.update(step_s=round(step_s, 7), tokens_per_step=tokens, tokens_per_s=round(tokens / step_s, 1),
                         mfu=round(flops_per_token * tokens / step_s / peak, 4))
        record(entry)
    subject = closed(subject)
    free_memory(device)


def closed(subject) -> None:
    """Close ``subject`` (its background threads); None, for the caller to drop its reference with."""
    if subject is not None:
        subject.close()


def free_memory(device: torch.device) -> None:
    """Give the memory of dropped subjects back, compiled graphs included (they hold traced tensors)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


# --- the run -----------------------------------------------------------------------------------------------
def fitting_micro_batch(model: dict, seq_len: int, dtype: str, budget_bytes: float) -> tuple[int, dict]:
    """The largest of MICRO_BATCHES whose start-up memory estimate (one process) fits ``budget_bytes``
    (1 when none does), and the estimate of each size tried, in GiB."""
    estimates = {}
    for micro_batch in MICRO_BATCHES:
        estimates[micro_batch] = estimate_training_memory(run_config(model, seq_len, micro_batch, dtype)).total
        if estimates[micro_batch] <= budget_bytes:
            break
    fits = [size for size, total in estimates.items() if total <= budget_bytes]
    return (fits[0] if fits else 1), {size: round(total / 2**30, 1) for size, total in estimates.items()}


def peak_flops(args, device: torch.device) -> dict:
    """The MFU denominator (``--peak-tflops``, else the data sheet, else the measured matmul) and the
    best measured matmul beside it."""
    if device.type == "cuda":
        configure_tf32(device, args.dtype, True)  # TF32 for fp32 matmuls, as the trainer sets it (precision.tf32)
        size, dtype = 8192, {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        seconds = [timed(lambda: a @ b, 10, device)[0] for _ in range(3)]
        measured, how = 2 * size ** 3 / min(seconds), f"measured: best of 3 x 10 {args.dtype} {size}^3 matmuls"
        name = torch.cuda.get_device_name(device)
        sheet = table_peak_flops(name, args.dtype, torch.backends.cuda.matmul.allow_tf32)
    else:
        (measured, how), sheet = measured_peak_flops("cpu", args.dtype), None
    if args.peak_tflops:
        peak, source = args.peak_tflops * 1e12, "--peak-tflops"
    else:
        peak, source = sheet if sheet is not None else (measured, how)
    return {"peak_flops": peak, "peak_source": source, "measured_matmul_flops": round(measured), "measured": how}


def environment(device: torch.device) -> dict:
    """What the numbers depend on besides meshlm: versions, and which fast paths the GPU takes."""
    triton = importlib.util.find_spec("triton")
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": __import__("triton").__version__ if triton else None,
            "grouped_mm_available": hasattr(torch.nn.functional, "grouped_mm"),
            "torchtitan_installed": importlib.util.find_spec("torchtitan") is not None,
            "device": str(device), "cpu_threads": torch.get_num_threads(),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if device.type == "cuda":
        info.update(device_name=torch.cuda.get_device_name(device),
                    capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                    memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1),
                    flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
                    cudnn_sdp_enabled=torch.backends.cuda.cudnn_sdp_enabled(),
                    cudnn_version=torch.backends.cudnn.version(),
                    sdp_priority_order=sdp_priority_order(device))
    return info


def sdp_priority_order(device: torch.device) -> list[str] | None:
    """The order in which SDPA tries its attention kernels on this GPU (torch puts cuDNN first on
    some GPUs and cuDNN versions), or None where this torch does not say."""
    if not PRIORITY_SUPPORTED:
        return None
    names = {int(backend): name for name, backend in torch.nn.attention.SDPBackend.__members__.items()}
    return [names.get(int(code), str(code)) for code in settled_priority_order(device)]


def estimate_seconds(described: dict, args, peak: float) -> tuple[float, str]:
    """A rough wall-clock estimate of the run, and the assumptions it rests on."""
    compiled, steps_per_variant = "on" in args.compile, args.warmup + args.repeats * args.steps
    tokens, total = (args.micro_batch or 4) * args.seq_len, 0.0
    step_s = {name: shape["flops_per_token"] * tokens / (ASSUMED_MFU * peak) for name, shape in described.items()}
    for name, shape in described.items():
        total += 10 + shape["parameters"]["total"] / INIT_PARAMETERS_PER_SECOND
        total += len(args.compile) * len(args.recompute) * steps_per_variant * step_s[name]
        graphs = len(shape["blocks"]) + ("*" in shape["blocks"] and "selective" in args.recompute)
        total += graphs * COMPILE_SECONDS_PER_GRAPH * compiled
    if "dense" in described and args.baseline:
        total += 20 + len(args.compile) * steps_per_variant * step_s["dense"] + 2 * COMPILE_SECONDS_PER_GRAPH * compiled
    return total, (f"{COMPILE_SECONDS_PER_GRAPH:.0f} s to compile each block kind's graphs, "
                   f"{ASSUMED_MFU:.0%} MFU, initial values drawn at {INIT_PARAMETERS_PER_SECOND:.0e}/s")


class Report:
    """The JSON document, rewritten to ``--out`` after every variant; merged into a previous file of the
    same device and sequence length (its variants kept unless measured again)."""

    def __init__(self, out: Path | None, header: dict, fresh: bool):
        self.out, self.document = out, {**header, "results": []}
        if out is not None and out.exists() and not fresh:
            previous = json.loads(out.read_text())
            same = all(previous.get(key) == header[key] for key in ("bench", "seq_len", "dtype", "tiny"))
            if same and previous.get("environment", {}).get("device_name") == header["environment"].get("device_name"):
                self.document["results"] = previous.get("results", [])
                for name, shape in previous.get("shapes", {}).items():
                    self.document["shapes"].setdefault(name, shape)
        self.document.update(summarize(self.document["results"]))

    def record(self, entry: dict) -> None:
        key = lambda e: (e["impl"], e["model"], e["compile"], e["recompute"])  # noqa: E731
        self.document["results"] = [e for e in self.document["results"] if key(e) != key(entry)] + [entry]
        self.document.update(summarize(self.document["results"]))
        line = (f"error {entry['error']}" if "error" in entry else
                f"{entry['tokens_per_s']:,.0f} tok/s, step {entry['step_s']:.3f} s, MFU {entry['mfu']:.1%}, "
                f"peak memory {entry['peak_memory_gib'] or '-'} GiB, loss {entry['loss']:.3f}")
        print(f"{entry['impl']} {entry['model']} compile={'on' if entry['compile'] else 'off'} "
              f"recompute={entry['recompute']} micro-batch {entry['micro_batch']}: {line}", file=sys.stderr, flush=True)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.out, self.document)


def summarize(results: list[dict]) -> dict:
    """Per model its fastest variant; the dense/baseline ratios (meshlm's faster recompute setting over
    the baseline at each compile setting, and fastest over fastest); issue 14's targets from them."""
    good = [r for r in results if "error" not in r]
    best = {}
    for result in good:
        name = result["model"] if result["impl"] == "meshlm" else "baseline"
        if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
            best[name] = result
    summary = {name: {"mfu": r["mfu"], "tokens_per_s": r["tokens_per_s"], "compile": r["compile"],
                      "recompute": r["recompute"], "micro_batch": r["micro_batch"]} for name, r in best.items()}
    ratios = {}
    for compile in (False, True):
        ours = [r for r in good if r["impl"] == "meshlm" and r["model"] == "dense" and r["compile"] == compile]
        theirs = [r for r in good if r["impl"] == "baseline" and r["compile"] == compile]
        if ours and theirs:
            ratios[f"compile_{'on' if compile else 'off'}"] = round(
                max(r["tokens_per_s"] for r in ours) / theirs[0]["tokens_per_s"], 3)
    if "dense" in best and "baseline" in best:
        ratios["best_vs_best"] = round(best["dense"]["tokens_per_s"] / best["baseline"]["tokens_per_s"], 3)
    summary["dense_over_baseline"] = ratios
    targets = {f"{name}_mfu_at_least_{target:g}": (best[name]["mfu"] >= target if name in best else None)
               for name, target in MFU_TARGETS.items()}
    targets[f"dense_over_baseline_at_least_{BASELINE_TARGET:g}"] = (
        ratios["best_vs_best"] >= BASELINE_TARGET if "best_vs_best" in ratios else None)
    return {"summary": summary, "targets": targets}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = {"models": ("dense", "hybrid", "moe"), "compile": ("off", "on"), "recompute": ("none", "selective")}
    for flag, allowed in choices.items():
        parser.add_argument(f"--{flag}", default=",".join(allowed), help=f"comma-separated subset of {allowed}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (the first compiles)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per variant (the median is reported)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (4096; --tiny: 32)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default: the largest "
                        "of 8, 4, 2, 1 whose memory estimate fits; --tiny: 2)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator (default: the data "
                        "sheet's dense figure for this GPU, e.g. 989.4 for H100 SXM; else the measured matmul)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after every variant")
    parser.add_argument("--fresh", action="store_true", help="start --out over instead of merging into it")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the plain-PyTorch loop")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run of the script, on CPU)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP", help="after timing each variant, profile "
                        "one more step and keep its TOP operators by device time in the JSON (default 0: none)")
    parser.add_argument("--inductor-code", type=Path, default=None, metavar="FILE", help="write the code Inductor "
                        "generated for the compiled variants to this gzip file (give the run a fresh "
                        "TORCHINDUCTOR_CACHE_DIR: modules taken from an old cache are not included)")
    args = parser.parse_args(argv)
    for flag, allowed in choices.items():
        picked = [item.strip() for item in getattr(args, flag).split(",") if item.strip()]
        unknown = [item for item in picked if item not in allowed]
        if unknown or not picked:
            parser.error(f"--{flag} {getattr(args, flag)!r}: use a comma-separated subset of {', '.join(allowed)}.")
        setattr(args, flag, [item for item in allowed if item in picked])  # eager before compiled
    for flag in ("steps", "repeats", "micro_batch", "seq_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive integer.")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more.")
    if args.profile < 0:
        parser.error(f"--profile {args.profile}: give how many operators to list (0, the default, profiles nothing).")
    if torch.device(args.device).type != "cuda" and not args.tiny:
        parser.error(f"--device {args.device}: the ~1B shapes need a CUDA GPU; use --tiny for a dry run on CPU.")
    args.seq_len = args.seq_len or (32 if args.tiny else 4096)
    if args.tiny and args.micro_batch is None:
        args.micro_batch = 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    shapes = {name: (TINY_SHAPES if args.tiny else SHAPES)[name] for name in args.models}
    described = describe_shapes(shapes, args.seq_len)
    header = {"bench": "gpu_throughput", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "environment": environment(device), "dtype": args.dtype, "seq_len": args.seq_len, "tiny": args.tiny,
              "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "shapes": described,
              "baseline": "bench/reference_gpt.py: plain PyTorch, SDPA, bf16 autocast over fp32 weights, fused AdamW",
              **({"note": "--tiny: a dry run of the script on toy shapes; its numbers say nothing about a GPU"}
                 if args.tiny else {})}
    header.update(peak_flops(args, device))
    torch_order = torch._C._get_sdp_priority_order() if PRIORITY_SUPPORTED else None  # settled by environment()
    if "dense" in shapes:  # each SDPA kernel on the dense shape, and the one meshlm's auto runs
        dense = shapes["dense"]
        attention = TINY_ATTENTION if args.tiny else dict(
            batch=args.micro_batch or MICRO_BATCHES[0], heads=dense["num_attention_heads"],
            kv_heads=dense["num_kv_heads"], seq=args.seq_len, head_dim=dense["hidden_size"] // dense["num_attention_heads"])
        header["attention_kernels"] = measure_attention_kernels(
            device, **attention, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    seconds, how = estimate_seconds(described, args, header["peak_flops"])
    estimate = "a dry run on tiny shapes" if args.tiny else f"estimated {seconds / 60:.1f} min ({how})"
    print(f"gpu_throughput: {', '.join(args.models)} x compile {'/'.join(args.compile)} x recompute "
          f"{'/'.join(args.recompute)} at seq {args.seq_len}; {estimate}; peak {header['peak_flops'] / 1e12:.1f} "
          f"TFLOP/s ({header['peak_source']})", file=sys.stderr, flush=True)
    report, recorded = Report(args.out, header, args.fresh), []

    started = time.time()

    def record(entry: dict) -> None:
        recorded.append(entry)
        report.record(entry)
        if args.inductor_code and entry.get("compile"):
            modules = save_inductor_code(args.inductor_code, started)
            print(f"gpu_throughput: {modules} generated module(s) in {args.inductor_code}", file=sys.stderr, flush=True)
    variants = [(compile == "on", recompute) for compile in args.compile for recompute in args.recompute]
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        for name, model in shapes.items():
            micro_batch = args.micro_batch
            if micro_batch is None:  # only without --tiny, so on a GPU
                budget = MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
                micro_batch, estimates = fitting_micro_batch(model, args.seq_len, args.dtype, budget)
                described[name]["memory_estimate_gib"] = estimates
            count = len(variants) * (args.warmup + args.repeats * args.steps) + 8
            prefix = workdir / f"{name}-tokens"
            write_random_corpus(prefix, min(count * micro_batch * (args.seq_len + 1), 2 ** 24),
                                vocab_size=model["vocab_size"], document_lengths=(1000, 20000), tokens_per_document=10000)
            flops = described[name]["flops_per_token"]
            subject_args = dict(model=model, args=args, data_prefix=prefix, run_dir=workdir / f"run-{name}",
                                steps=count)
            measure_subject(MeshlmSubject, subject_args, variants, micro_batch, name, flops, header["peak_flops"],
                            args, device, record)
            if name == "dense" and args.baseline:
                if torch_order is not None:  # the plain loop gets PyTorch's own attention kernel, not meshlm's choice
                    torch._C._set_sdp_priority_order(torch_order)
                compiles = [(compile == "on", "none") for compile in args.compile]
                measure_subject(BaselineSubject, dict(model=model, args=args), compiles, micro_batch, name, flops,
                                header["peak_flops"], args, device, record)
    print(json.dumps(report.document))
    failed = [f"{entry['impl']} {entry['model']} compile={entry['compile']}" for entry in recorded if "error" in entry]
    if failed:  # recorded and the bench went on; the exit status still says so (bench/gpu_session.py)
        print(f"gpu_throughput: {len(failed)} variant(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
