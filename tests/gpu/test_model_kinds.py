"""Each model kind trains in bf16 on the GPU like it trains in fp32 on the CPU, and generates the same
tokens with caches as with full forwards.

**Training.** For the dense, hybrid (Mamba-2 + attention, shapes the Triton SSD kernels take),
MoE and MTP models (tests/gpu/support.py ``MODEL_KINDS``, hidden 64, 4 blocks, sequences of 32),
the trainer runs 20 steps of 4 micro-batches (lr 3e-3) on the tiny counting corpus twice from
the same seed and data: ``precision.dtype=bf16`` on the GPU, and ``fp32`` on the CPU. The bf16 run keeps
fp32 master weights and Adam moments (meshlm/precision/mixed_precision.py), so the two runs do
the same updates up to bf16 rounding of the forward and backward.

*The tolerance.* bf16 keeps 8 significant bits: each rounding is off by at most 2^-9 ~ 2e-3 of
its value, and a loss of cross-entropies over ~64 tokens averages the rounding of thousands of
products, so one forward's loss moves by ~1e-3 relative; over 20 steps the weights drift apart
by the accumulated rounding of the updates, and the losses with them. A relative gap of at most
``LOSS_TOLERANCE`` = 2e-2 per step (training and validation losses) allows that drift with room
to spare; the first step, which
depends only on the initial weights and one forward, must agree within ``FIRST_STEP_TOLERANCE``
= 5e-3. So that a broken run cannot pass by not learning at all, both curves must also fall: the
last step's loss at most ``MIN_FALL`` = 0.6 of the first's (it reaches ~0.5), a fall of 20
tolerance bands. Measured on the CPU, the dense model: bf16 stays within 1.3e-3 of fp32, while a
bf16 run whose updates are 20% too small (lr x 0.8) parts from it by 12%.

**Generation.** Random models of each kind (logits spread by init_std 0.2, so argmax is not
decided by rounding) decode greedily on the GPU with their caches (``meshlm.inference.generate``),
against the reference of tests/inference/test_generate.py: a full forward over the whole
sequence for every new token. In fp32 (TF32 off) the tokens must be equal. In bf16 the cached and
full paths round differently, so a near-tie may flip: each cached token must be the full
forward's argmax or within ``BF16_LOGIT_GAP`` (relative) of its top logit, on the cached sequence. The MTP
model also decodes speculatively (its depth drafts, the model verifies): the tokens of plain
greedy decoding.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.training.metrics import read_metrics
from tests.gpu.support import (FIRST_STEP_TOLERANCE, HELPERS, LOSS_TOLERANCE, MODEL_KINDS, SIZE, losses_in_order,
                               on_device, relative_gaps)
from tests.helpers.allocation_failure import cpu_allocator_refusal
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import import_test_file

STEPS = 20
MIN_FALL = 0.6
"""The last step's loss must be at most this fraction of the first step's (the corpus is learnable)."""
BF16_LOGIT_GAP = 2e-2
"""A cached bf16 token may fall this far below the full forward's top logit, relative to the row's
largest |logit|: about five bf16 roundings (2^-9 each) of that logit."""
GREEDY = SamplingConfig(greedy=True)
PROMPTS = [[5, 17, 3, 42, 8, 1, 60, 22, 9], [11, 2], [33, 4, 40, 12, 50, 51, 7, 7, 30, 21, 19, 18, 2, 1, 9, 28, 6]]
"""Prompts of 9, 2 and 17 tokens: the last crosses a Mamba chunk of 16 in the prefill."""
NEW_TOKENS = 14


def run_overrides(kind: str) -> list[str]:
    return [*MODEL_KINDS[kind], *SIZE, f"train.steps={STEPS}", "train.eval_every=10", "train.save_every=0",
            "optim.lr=3e-3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("gpu-corpus"))


@pytest.mark.parametrize("kind", list(MODEL_KINDS))
def test_bf16_on_gpu_follows_fp32_on_cpu(kind, corpus, gpu_device, tmp_path):
    reference = HELPERS.train_once(corpus, tmp_path / "fp32 cpu", [*run_overrides(kind), *on_device("cpu", "fp32")])
    # a bare "cuda", as users write it (cuda:0 elsewhere in the tier)
    bf16 = HELPERS.train_once(corpus, tmp_path / "bf16 gpu", [*run_overrides(kind), *on_device(gpu_device.type, "bf16")])
    for key in ("losses", "val_losses"):
        expected, actual = losses_in_order(reference, key), losses_in_order(bf16, key)
        assert sorted(bf16[key]) == sorted(reference[key]), key
        assert all(torch.isfinite(torch.tensor(actual))), (key, actual)
        gaps = relative_gaps(bf16, reference, key)
        assert max(gaps) <= LOSS_TOLERANCE, (kind, key, max(gaps), actual, expected)
        assert gaps[0] <= FIRST_STEP_TOLERANCE, (kind, key, gaps[0])
    for run in (reference, bf16):
        losses = losses_in_order(run)
        assert losses[-1] <= MIN_FALL * losses[0], (kind, losses)
    largest = max(bf16["params"].values(), key=lambda value: value.numel())
    assert largest.dtype == torch.bfloat16  # the weights really were bf16 (the state also holds fp32 buffers)
    # metrics.jsonl's memory on the device: the allocator's peaks, allocated within reserved (memory_usage.py)
    records = [record for record in read_metrics(tmp_path / "bf16 gpu" / "metrics.jsonl") if "loss" in record]
    peaks = [record["memory_peak_bytes"] for record in records]
    assert records and peaks == sorted(peaks) and peaks[0] > 0, peaks
    if gpu_device.type == "cuda":
        assert all(record["memory_peak_bytes"] <= record["memory_reserved_peak_bytes"] for record in records)


# --- generation ----------------------------------------------------------------------------------------

def tiny_model(kind: str, device: torch.device, dtype: torch.dtype) -> LanguageModel:
    """A random model of ``kind`` (the training kinds' shapes), on ``device`` in ``dtype``."""
    fields = {"vocab_size": 97, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 128, "init_std": 0.2, "pattern": "*-*-"}
    for override in MODEL_KINDS[kind]:
        name, value = override.removeprefix("model.").split("=")
        fields[name] = value if name == "pattern" else float(value) if "." in value or "e-" in value else int(value)
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(**fields)).to(device=device, dtype=dtype).eval()


def full_forward_logits(model: LanguageModel, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one forward over the whole sequence, in fp32."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([tokens], device=device)).logits[0].float()


generate_without_cache = import_test_file(Path(__file__).parents[1] / "inference" / "test_generate.py",
                                          "generate_helpers").generate_without_cache
"""tests/inference/test_generate.py's reference: greedy decoding by a full forward every step."""


@pytest.mark.parametrize("kind", list(MODEL_KINDS))
def test_cached_greedy_equals_full_forward_greedy_in_fp32(kind, gpu_device, exact_fp32_cuda):
    model = tiny_model(kind, gpu_device, torch.float32)
    for prompt in PROMPTS:
        expected = generate_without_cache(model, prompt, NEW_TOKENS)
        assert generate(model, [prompt], NEW_TOKENS, GREEDY) == [expected], (kind, prompt)
        assert len(set(expected)) > 2  # the test would be weak if the model repeated one token
    batched = generate(model, PROMPTS, NEW_TOKENS, GREEDY)  # left-padded together
    assert batched == [generate_without_cache(model, prompt, NEW_TOKENS) for prompt in PROMPTS], kind


@pytest.mark.parametrize("kind", list(MODEL_KINDS))
def test_cached_greedy_in_bf16_picks_the_full_forward_top_token(kind, gpu_device):
    model = tiny_model(kind, gpu_device, torch.bfloat16)
    for prompt in PROMPTS:
        new = generate(model, [prompt], NEW_TOKENS, GREEDY)[0]
        assert len(new) == NEW_TOKENS and len(set(new)) > 2, (kind, new)
        logits = full_forward_logits(model, prompt + new)[len(prompt) - 1:-1]  # the logits each token was drawn from
        assert torch.isfinite(logits).all(), kind
        chosen = logits.gather(1, torch.tensor(new, device=logits.device)[:, None])[:, 0]
        shortfall = (logits.max(dim=1).values - chosen) / logits.abs().max(dim=1).values
        assert float(shortfall.max()) <= BF16_LOGIT_GAP, (kind, prompt, shortfall.tolist())


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_continuous_batching_gives_each_request_its_tokens_alone(kind, gpu_device, exact_fp32_cuda):
    """``meshlm serve``'s batcher on CUDA tensors: the requests, submitted together and joining the
    decoding batch from its thread, get what ``generate`` gives each alone."""
    from meshlm.inference.continuous_batching import ContinuousBatcher, GenerationRequest

    model = tiny_model(kind, gpu_device, torch.float32)
    alone = [generate(model, [prompt], NEW_TOKENS, GREEDY)[0] for prompt in PROMPTS]
    batcher = ContinuousBatcher(model, max_batch_size=len(PROMPTS))
    try:
        requests = [batcher.submit(GenerationRequest(prompt, NEW_TOKENS, GREEDY)) for prompt in PROMPTS]
        assert [request.wait() for request in requests] == alone, kind
    finally:
        batcher.close()


def test_mtp_speculative_decoding_equals_plain_greedy(gpu_device, exact_fp32_cuda):
    model = tiny_model("mtp", gpu_device, torch.float32)
    for prompt in PROMPTS:
        plain = generate(model, [prompt], NEW_TOKENS, GREEDY)
        assert generate(model, [prompt], NEW_TOKENS, GREEDY, speculative="mtp") == plain, prompt


def test_a_step_out_of_device_memory_stops_with_what_to_change(corpus, gpu_device, tmp_path, monkeypatch):
    """The caching allocator's own OutOfMemoryError (a 1 PiB request at step 3, after step 2's
    checkpoint) becomes meshlm's one sentence: the request, this process's peak, the settings that
    lower it, the checkpoint to resume from (meshlm/training/out_of_memory.py); with
    train.memory_snapshot the allocator's history after step 1 and at the failure, in the files
    https://pytorch.org/memory_viz reads (meshlm/training/memory_snapshot.py)."""
    from meshlm.training.out_of_memory import OutOfMemoryStop
    from meshlm.training.trainer import Trainer

    take_step = Trainer.train_step

    def step_that_runs_out(trainer):
        if trainer.state.step == 2:
            if gpu_device.type != "cuda":  # a dry run: the CPU allocator's message (tests/helpers/allocation_failure.py)
                raise RuntimeError(cpu_allocator_refusal())
            torch.empty(2 ** 50, dtype=torch.uint8, device=gpu_device)  # the caching allocator's own error
        return take_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", step_that_runs_out)
    cuda = gpu_device.type == "cuda"
    overrides = [*run_overrides("dense"), "train.save_every=2", *on_device(gpu_device, "bf16"),
                 *(["train.memory_snapshot=true"] if cuda else [])]  # the allocator's history: CUDA only
    with pytest.raises(OutOfMemoryStop) as stopped:
        HELPERS.train_once(corpus, tmp_path / "run", overrides)
    message = str(stopped.value)
    assert message.startswith(f"out of memory on {gpu_device} in step 3 (a request for "), message
    assert "train.recompute=full (now none)" in message and "step_2 is intact" in message, message
    if cuda:
        assert isinstance(stopped.value.__cause__, torch.OutOfMemoryError)
        # c10's format_size: "1048576.00 GiB"
        assert re.search(r"a request for [\d.]+ [KMG]iB failed; this process had allocated at most ", message), message
        snapshots = tmp_path / "run" / "memory_snapshot"
        assert sorted(path.name for path in snapshots.iterdir()) == ["rank0_oom.pickle", "rank0_step1.pickle"]
        assert message.endswith(f"The allocator's history is in {snapshots / 'rank0_oom.pickle'}: open it at "
                                "https://pytorch.org/memory_viz."), message
        for path in snapshots.iterdir():  # what memory_viz reads: the segments and each device's events
            history = pickle.loads(path.read_bytes())
            assert history["segments"] and history["device_traces"][gpu_device.index or 0], path
