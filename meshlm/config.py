"""A training run's configuration: typed sections, YAML files, dotted command-line overrides.

    meshlm train configs/tiny.yaml train.steps=200 optim.lr=1e-3 model.pattern='M*-E'

A run is one ``RunConfig`` with a section per concern (``model``, ``train``, ``optim``,
``data``, ``precision``); every field is a typed dataclass field with a docstring. Loading
goes YAML -> dict -> overrides applied -> dataclasses built -> validated once, and every
mistake gets one sentence naming the dotted key, the value and the fix (unknown keys get
the closest known names).
"""

from __future__ import annotations

import dataclasses
import difflib
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from meshlm.errors import ConfigError, check_choice
from meshlm.models.config import ModelConfig
from meshlm.models.losses import DISTILL_LOSSES
from meshlm.models.position_embedding import check_positions_fit

SCHEDULES = ("cosine", "wsd", "constant")
DTYPES = ("auto", "fp32", "bf16", "fp16")
FP8_GEMMS = ("auto", "emulated", "hardware")
FP8_FAST_ACCUMULATION = ("fprop", "none", "all")
RECOMPUTE = ("none", "selective", "full")
ON_NONFINITE = ("rollback", "stop")
OBJECTIVES = ("lm", "reward", "dpo")
REWARD_LOSSES = ("bradley_terry", "mse")
DPO_VARIANTS = ("dpo", "length_normalized", "rpo")


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps to run (the run ends at this step; resuming continues up to it)."""
    run_dir: str = "runs/default"
    """Where checkpoints, metrics.jsonl, TensorBoard events and loss.png go. Re-running with the
    same run_dir resumes from its latest checkpoint."""
    micro_batch_size: int = 4
    """Sequences per forward/backward pass."""
    global_batch_size: int = 8
    """Sequences per optimizer step; micro-batches are accumulated to reach it (must be a
    multiple of micro_batch_size times the data-parallel size)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    seed: int = 1234
    """Seeds model init, data order and dropout; the same seed gives the same run."""
    log_every: int = 10
    """Write a metrics.jsonl line (and TensorBoard scalars) every this many steps."""
    eval_every: int = 50
    """Run validation every this many steps (0 = never; when > 0 also once before the first
    step and once at the end)."""
    eval_batches: int = 8
    """Validation micro-batches per evaluation."""
    eval_per_dataset: bool = False
    """Also the validation loss of each corpus of the blend alone, eval_batches micro-batches of its
    own validation split each: metrics val_loss_<name> (the store's file name), beside val_loss --
    which data helps which domain, in a data-mixing study. Each corpus adds an evaluation's cost."""
    save_every: int = 100
    """Save a checkpoint every this many steps (0 = only at the end)."""
    keep_checkpoints: int = 3
    """Keep the most recent K checkpoints; older ones are deleted after a new one is complete. 0 keeps
    every checkpoint (e.g. to score each one later: meshlm eval RUN --every-checkpoint)."""
    keep_best: bool = False
    """Also keep the checkpoint of the lowest validation loss: an evaluation that improves on the
    best saves a checkpoint at its step (unless one is saved there anyway), pruning never deletes
    it, and RUN_DIR/best_checkpoint.json names it (step, validation loss, folder)."""
    early_stop_evals: int = 0
    """Stop when this many evaluations in a row have not lowered the best validation loss (0:
    never). The run saves, logs a stopped event ('early stop') and exits 0; rerunning it says it
    stopped early and trains nothing, unless this is raised (or set to 0)."""
    async_save: bool = False
    """Save checkpoints in a background thread: the step waits only while this rank's shards are
    copied to CPU buffers, and training goes on while they are written."""
    time_limit_minutes: float = 0.0
    """The job's wall-clock limit in minutes, counted from the start of the trainer (0 = none): the
    run saves a checkpoint and stops at the end of the first step where the elapsed time plus the
    longest step so far (evaluations and saves included: a margin for one more step and a save)
    would exceed it; the same command resumes. SIGTERM and SIGINT stop it the same way. See
    meshlm/training/stop_requests.py."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = no clipping)."""
    recompute: str = "none"
    """Activation recomputation: 'none', 'selective' (attention core only, Korthikanti et al.
    2022) or 'full' (whole blocks, every recompute_every-th block)."""
    recompute_every: int = 1
    """With recompute='full': recompute every k-th block (1 = all blocks)."""
    tensorboard: bool = True
    """Write TensorBoard event files when the tensorboard package is installed."""
    wandb: bool = False
    """Mirror the run to Weights & Biases (``pip install meshlm[tracking]``): the resolved config,
    every metrics.jsonl scalar under TensorBoard's names, and loss.png at the end; from global
    rank 0 only. A resumed run continues the same W&B run (its id is kept in RUN_DIR/wandb_id).
    WANDB_MODE=offline writes it under RUN_DIR/wandb for `wandb sync`. See meshlm/training/tracking.py."""
    wandb_project: str = "meshlm"
    """With wandb=true: the W&B project the run is logged to."""
    wandb_run_name: str | None = None
    """With wandb=true: the run's name in W&B (null: the run directory's name)."""
    profile_steps: str | None = None
    """Profile steps A to B (``"A:B"``, 1-based, inclusive, within train.steps) with torch.profiler:
    each rank writes a Chrome trace to RUN_DIR/profile/rank{R}.json (open it in Perfetto or
    chrome://tracing) and rank 0 prints the top operators by self time. See meshlm/training/profiling.py."""
    memory_snapshot: bool = False
    """CUDA only: record the caching allocator's history (every allocation with its stack) and write
    it to RUN_DIR/memory_snapshot/rank{R}_step1.pickle after the first step and rank{R}_oom.pickle
    when a step runs out of memory; open them at https://pytorch.org/memory_viz. Costs a stack walk
    per allocation. See meshlm/training/memory_snapshot.py."""
    compile: bool = False
    """Run each block under torch.compile (inductor; on CPU it needs a C++ compiler). Compiled after
    the model is parallelized, block by block, so parameter names and parallel hooks are unchanged.
    Falls back to eager with a one-line notice where compiling fails. See meshlm/training/compile.py."""
    plot: bool = True
    """Write RUN_DIR/loss.png (train and validation curves) at the end, when matplotlib is installed."""
    progress: bool = True
    """Show a live progress line on the terminal."""
    device: str = "auto"
    """Device to train on: 'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'."""
    init_from: str | None = None
    """A model folder (config.json + model.safetensors, e.g. from `meshlm upcycle` or a training
    checkpoint's step_N folder) whose weights start the run; the optimizer, step and data position
    start fresh. Its model config must equal the run's. Ignored when run_dir has a checkpoint."""
    init_model_config: bool = False
    """Take the model's shape from train.init_from's config.json instead of the `model` section
    (which is then ignored, with a note naming the fields that differ), so a pruned, upcycled or
    imported model trains without copying its shape into the YAML."""
    distill_from: str | None = None
    """Knowledge distillation (meshlm/training/distillation.py): a teacher -- a meshlm model folder, a
    training checkpoint's step_N folder or a run directory (its newest checkpoint) -- that runs
    forward-only (eval mode, no gradient, the run's dtype and layout) on every training batch; the
    student (this run's model) learns to match it. Its vocabulary must equal the run's. Works at
    every layout (tp, sp, dp, ep, ZeRO, pp with vp, cp); under pp the teacher has stages of its own."""
    distill_loss: str = "kl"
    """With distill_from: 'kl' (= 'forward_kl', KL(teacher || student) of the token distributions,
    Minitron's choice), 'reverse_kl' (KL(student || teacher)) or 'cosine' (1 - cosine similarity
    of the two logit vectors), per token, averaged over the tokens the LM loss counts."""
    distill_temperature: float = 1.0
    """With distill_from: softmax temperature T of both models for the KL losses; the KL is
    multiplied by T^2 (Hinton et al. 2015) so its gradient's scale does not depend on T."""
    distill_weight: float = 1.0
    """With distill_from: w in loss = (1 - w) * LM loss + w * distillation loss + the model's other
    terms (MoE aux/z, MTP) at their coefficients; 1.0 (the default, as Minitron) is pure distillation."""
    distill_blocks: bool = False
    """With distill_from: block-wise local distillation (Puzzle) instead of the logits: student
    block i gets the teacher's (detached) input to its block i and is trained to reproduce the
    teacher block's output (mean squared error), all blocks independently in one step; the
    distillation loss is the sum over blocks. Needs as many blocks and the same hidden size."""
    objective: str = "lm"
    """What the run trains (meshlm/training/preference.py): 'lm' (next-token prediction, pretraining
    and SFT), 'reward' (a reward model: model.head=reward on a preference store of pairs (loss
    train.reward_loss=bradley_terry) or of rated replies (mse); `meshlm preprocess --preference`), or
    'dpo' (Direct Preference Optimization of an LM on a store of pairs against a frozen reference
    model, train.reference_from). train.micro_batch_size and global_batch_size then count examples
    (a pair is two rows). Layouts: tp (+sp), dp, ZeRO; pp, cp and ep are refused."""
    reward_loss: str = "bradley_terry"
    """With objective=reward: 'bradley_terry' (pairs: -log sigmoid(r_chosen - r_rejected) of the one
    score a model with a single reward attribute gives) or 'mse' (rated replies: mean squared error of
    each attribute's score against its rating, skipping missing ratings)."""
    dpo_beta: float = 0.1
    """With objective=dpo: beta of DPO (Rafailov et al. 2023), the strength of the implicit KL
    penalty to the reference: loss = -log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r)))."""
    dpo_variant: str = "dpo"
    """With objective=dpo: 'dpo' (log-probabilities summed over the reply's tokens), 'length_normalized'
    (averaged over them: SimPO's/ORPO's length normalization, with the reference kept) or 'rpo'
    (DPO plus rpo_alpha times the chosen reply's mean token NLL; Pang et al. 2024, Nemotron-4 340B)."""
    rpo_alpha: float = 1.0
    """With dpo_variant=rpo: the weight of the chosen reply's NLL term."""
    reference_from: str | None = None
    """With objective=dpo: the frozen reference model (a model folder, step_N folder or run
    directory), run forward-only in the run's layout and dtype; null means train.init_from (the
    usual choice: the SFT model DPO starts from)."""
    prefetch_batches: bool = True
    """Read the next step's micro-batches in a background thread while the current step computes
    (into pinned memory on CUDA, copied with non_blocking=True). The batches are the same either
    way; see meshlm/training/data_loading.py."""
    keep_freed_cpu_memory: bool = True
    """On CPU, let glibc reuse freed heap memory instead of returning it to the kernel (faster
    steps; the process keeps its peak memory). See meshlm/training/cpu_allocator.py."""
    max_consecutive_skips: int = 20
    """After this many skipped steps in a row (a non-finite loss or gradient, in any precision;
    fp16 overflows count too, and a loss-scale search from 65536 down to 1 needs at most 17) act
    as on_nonfinite says; 0 = never (keep skipping). See meshlm/training/fault_tolerance.py."""
    on_nonfinite: str = "rollback"
    """What max_consecutive_skips skips in a row do: 'rollback' (reload the newest complete
    checkpoint's weights, optimizer and loss scaler in this process and go on with the next
    unseen batch: the batches since that checkpoint are not replayed, the step count and the LR
    schedule are not rewound) or 'stop' (end the run with an error naming the step and the
    checkpoint to resume from)."""
    max_rollbacks: int = 3
    """With on_nonfinite='rollback': stop instead once this many rollbacks happened in one process."""
    record_phases: bool = True
    """Global rank 0 appends each step's phase timestamps (its waits on communication and on the
    pipeline, the optimizer, checkpoint saves, evaluations, power-floor filler bursts) to
    RUN_DIR/power_timeline.jsonl, which `meshlm power RUN_DIR` turns into the job's power trace.
    A few microseconds per collective and a line per step. See meshlm/training/phase_timeline.py."""
    power_floor: float = 0.0
    """Hold the estimated power of each GPU at or above this fraction of its compute power
    (0 = off; 0 < F < 1): while the host waits on a collective or the pipeline, a filler thread
    runs GEMMs on spare tensors (a secondary CUDA stream on GPU, a thread on CPU), as many as the
    floor needs; the model's numbers are unchanged. Costs energy; shrinks the job's power swing
    to about (1 - F) of its peak. See meshlm/training/power_floor.py."""
    power_ramp_seconds: float = 0.0
    """With power_floor: ramp the filler's floor linearly over this many seconds at the start of
    the run (0 -> F before the first step), at its end (F -> 0 after the last step) and around
    checkpoint saves (held at F, fading to 0 over this time if the save lasts, back up before
    training resumes), so the job's power never jumps by more than F of its peak at those moments."""
    reward_fn: str | None = None
    """`meshlm rl`: the reward as 'module:function' (the module importable, e.g. from the working
    directory), called as ``fn(prompt: str, completion: str, **fields) -> float`` with the
    environment record's fields (the arithmetic environment's: ``answer``); null: the environment's
    own reward (arithmetic: 1.0 when the reply's last number is the answer, else 0.0). See meshlm/rl/."""


@dataclass
class OptimConfig:
    optimizer: str = "adamw"
    """'adamw' (AdamW on every parameter) or 'muon' (Muon, Jordan et al. 2024, with Moonlight's
    update scaling: the blocks' weight matrices step along their momentum orthogonalized by
    Newton-Schulz, everything else -- embedding, head, norms, biases, routers, Mamba's
    convolution and time-scale parameters -- with AdamW; one lr, weight_decay and schedule
    for both). Muon keeps one fp32 momentum per matrix element instead of Adam's two, needs whole
    matrices (TP shards are gathered for its step; under ZeRO each matrix's pieces are gathered
    over DP: Distributed Muon) and no LoRA. See
    meshlm/optim/muon.py."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    schedule: str = "cosine"
    """'cosine' (warmup then cosine decay to min_lr), 'wsd' (warmup-stable-decay: constant after
    warmup, then a linear decay over the last decay_fraction of steps) or 'constant' (after warmup)."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over this many steps."""
    decay_fraction: float = 0.2
    """With schedule='wsd': the fraction of steps spent decaying at the end."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW, Loshchilov & Hutter 2019) on matrices."""
    decay_embeddings_norms_biases: bool = False
    """Also apply weight decay to embeddings, norm weights and biases (off by default)."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.95
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    muon_momentum: float = 0.95
    """optimizer=muon: the momentum mu of M <- mu M + G."""
    muon_nesterov: bool = True
    """optimizer=muon: orthogonalize G + mu M (Nesterov) instead of M."""
    muon_ns_steps: int = 5
    """optimizer=muon: Newton-Schulz iterations per matrix and step (5 suffices with its quintic
    coefficients)."""
    muon_update_rms: float = 0.2
    """optimizer=muon: the RMS of every matrix's update before the learning rate, set by scaling the
    orthogonalized momentum by muon_update_rms * sqrt(max(rows, columns)) (Liu et al. 2025: 0.2
    matches AdamW's typical update RMS, so AdamW's lr and weight_decay carry over)."""


@dataclass
class DataConfig:
    blend: str | None = "data/demo/blend.json"
    """A blend file written by `meshlm data demo` (prefixes, weights, tokenizer). Used when
    `prefixes` is empty; when both are set, `prefixes` wins with a warning (data.blend=null
    silences it)."""
    prefixes: list[str] = field(default_factory=list)
    """Token-store prefixes written by `meshlm preprocess` (PREFIX.bin / PREFIX.idx)."""
    weights: list[float] | None = None
    """Blend weights, one per prefix (None = proportional to size)."""
    tokenizer: str | None = None
    """The tokenizer file used to build the data (copied into checkpoints for generation). None:
    the blend file's, else the one the token stores' PREFIX.meta.json names (`meshlm preprocess`
    records it)."""
    split: str = "98,1,1"
    """Train/valid/test split of each dataset's documents, as relative weights."""
    cache_dir: str | None = None
    """Where index caches go (default: beside the data)."""
    document_boundaries: bool = False
    """Keep the documents packed into one sample apart: attention only within a document, RoPE
    positions and Mamba-2's conv and SSM state restarting at each boundary, and no label that
    predicts a document's first token from the previous one's last (``meshlm/data/gpt_dataset.py``).
    Off for pretraining (documents separated by EOS only, as GPT-2/3); a chat store (`meshlm
    preprocess --chat`) turns it on, with a note (meshlm/training/data_loading.py)."""


@dataclass
class PrecisionConfig:
    dtype: str = "auto"
    """'auto' (bf16 when the run's device is a GPU, fp32 on CPU; resolved once at start-up and
    logged); 'fp32'; 'bf16' (bf16 parameters, forward and backward; fp32 master weights, gradient
    accumulation and optimizer states); or 'fp16' (the same with fp16, plus a dynamic loss
    scaler; Micikevicius et al. 2017)."""
    tf32: bool = True
    """CUDA: let fp32 matmuls and convolutions use TF32 tensor cores (fp32 range, 10-bit mantissa
    products, fp32 sums; several times faster): every matmul of an fp32 run, and in a bf16/fp16 run
    those kept in fp32 on purpose (the Mamba-2 SSD scan's state products, the MoE router's logits).
    Set at the trainer's start for the process; false forces full-fp32 products. No effect on CPU."""
    initial_loss_scale: float = 65536.0
    """fp16: the loss scale to start from."""
    growth_interval: int = 1000
    """fp16: multiply the scale by growth_factor after this many steps without overflow."""
    growth_factor: float = 2.0
    """fp16: scale growth factor."""
    backoff_factor: float = 0.5
    """fp16: scale multiplier after an overflow."""
    hysteresis: int = 2
    """fp16: overflows tolerated (steps still skipped) before the scale is lowered."""
    min_loss_scale: float = 1.0
    """fp16: the scale never drops below this."""
    recipe: str = "none"
    """Low-precision training on top of bf16 (meshlm/precision/recipes.py): 'none'; 'fp8_tensorwise'
    (per-tensor current scaling, E4M3 / E5M2); 'fp8_delayed' (per-tensor scales from an amax history
    of past steps, as Transformer Engine's delayed scaling); 'fp8_blockwise' (DeepSeek-V3: 1x128 tiles, 128x128
    weight blocks); 'mxfp8' (1x32 blocks, power-of-two scales); 'nvfp4' (E2M1 in 16-element blocks,
    E4M3 block scales, fp32 tensor scale, stochastic rounding of gradients, random Hadamard
    transform for the weight gradient). Every GEMM of the blocks' linear layers is quantized
    (emulated: exact format values, bf16 matmuls); needs precision.dtype=bf16."""
    fp8_format: str = "hybrid"
    """fp8_tensorwise: 'hybrid' (E4M3 activations and weights, E5M2 gradients) or 'e4m3' (E4M3 for all)."""
    high_precision_layers: int = 0
    """Keep the first and last this many blocks (and, when > 0, the MTP depths) out of the recipe, in bf16."""
    amax_history: int = 16
    """fp8_delayed: how many past steps' amaxes a scale is taken from (the window's max)."""
    nvfp4_hadamard: bool = True
    """nvfp4: apply the 16x16 random Hadamard transform to both weight-gradient operands (false: the ablation)."""
    nvfp4_stochastic_rounding: bool = True
    """nvfp4: round gradients stochastically (false: round-to-nearest-even, the ablation)."""
    fp8_gemm: str = "auto"
    """FP8 recipes: 'emulated' (dequantize, matmul in bf16), 'hardware' (torch._scaled_mm on the FP8
    codes; CUDA with compute capability >= 8.9, or the CPU), or 'auto' (hardware on such a GPU where
    the installed torch supports the recipe's scales, else emulated). NVFP4 is always emulated."""
    fp8_fast_accumulation: str = "fprop"
    """Hardware FP8 GEMMs with one scale per tensor or row: which of them may keep their running sums
    in the tensor cores' own accumulator (about 14 bits; cuBLAS's fast accumulation) instead of
    moving them into fp32 at intervals (the split accumulator), for speed: 'fprop' (the forward
    GEMM only; Transformer Engine's default: its gradients' GEMMs split), 'none' or 'all'. Block
    scales (fp8_blockwise) always split: their scales are applied per 128-wide slice of the sum.
    No effect on emulated GEMMs or on a CPU."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size (Shoeybi et al. 2019): each block's heads / FFN width / Mamba heads
    are split across this many ranks. TP groups are adjacent ranks (inside a node)."""
    dp: int | None = None
    """Data-parallel size. None means whatever is left of the world: world / (tp * pp * cp)."""
    sp: bool = False
    """Sequence parallelism (Korthikanti et al. 2022, needs tp > 1): norms and the residual stream
    are sharded along the sequence between blocks; all-gather before column-parallel layers and
    reduce-scatter after row-parallel ones."""
    pp: int = 1
    """Pipeline-parallel size: the blocks are split into this many stages (Narayanan et al. 2021)."""
    vp: int = 1
    """Virtual pipeline stages (model chunks) per rank; > 1 selects the interleaved 1F1B schedule."""
    cp: int = 1
    """Context-parallel size: each sequence is split over this many ranks (ring attention)."""
    ep: int = 1
    """Expert-parallel size: each rank of an EP group holds moe_num_experts / ep routed experts."""
    etp: int | None = None
    """Expert tensor-parallel size (each expert's FFN width split over etp ranks); null means tp.
    Expert groups (etp x ep x expert-dp) fold onto the same ranks as tp x cp x dp."""
    moe_dispatcher: str = "all_to_all"
    """How MoE blocks send tokens to the ranks of their experts when ep > 1 or etp != tp
    (meshlm/parallel/expert/dispatchers.py): 'all_to_all' (permute by destination, exchange counts, then
    exactly the routed rows) or 'all_gather' (every EP rank gathers all the group's tokens and
    keeps those for its experts; a reduce-scatter brings the outputs back)."""
    distributed_optimizer: bool = False
    """ZeRO stage 1: shard fp32 master weights and optimizer states over the DP group;
    gradients are reduce-scattered and parameters all-gathered. The same as zero_stage=1."""
    zero_stage: int = 0
    """How much of the training state is sharded over the DP (x CP) ranks (meshlm/parallel/data/
    fully_sharded.py): 0 none (unless distributed_optimizer), 1 the optimizer state (ZeRO-1),
    2 also the gradients (reduce-scattered block by block in every backward, only a shard kept),
    3 also the parameters (each block all-gathered just before its forward and again for its
    backward, then freed; the next block's gather is prefetched)."""
    reduce_grads_in_fp32: bool = True
    """ZeRO-2/3 in bf16/fp16: reduce-scatter and accumulate the gradients in fp32 (4 bytes per
    parameter / dp; Megatron-LM's default). false: in the model's dtype (2 bytes / dp, the ZeRO
    paper's count; DeepSpeed's default), at the price of low-precision sums over ranks and
    micro-batches. Stages 0 and 1 always accumulate in their fp32 gradient buffer."""
    bucket_size_mb: float = 25.0
    """Gradients are reduced across DP in buckets of about this many MB, launched during backward
    as soon as a bucket's gradients are ready."""
    overlap_grad_reduce: bool = True
    """Launch each bucket's DP reduction asynchronously during backward (else after it)."""
    overlap_param_gather: bool = True
    """With distributed_optimizer: leave the all-gather of the updated parameters running after each
    step, bucket by bucket in forward order; the next forward waits for each bucket just before the
    first module that uses it (else the step waits for all of them)."""
    vocab_pad_multiple: int = 1
    """The vocabulary is padded to a multiple of tp * vocab_pad_multiple for the vocab-parallel
    embedding and loss; padded ids are masked out of the loss and generation."""
    backend: str = "auto"
    """torch.distributed backend: 'auto' (nccl with CUDA, gloo without), 'nccl' or 'gloo'."""
    timeout_s: float = 600.0
    """Collective timeout: a rank that dies makes the others fail after this long, not hang."""
    check_collectives: bool = False
    """Record every rank's collectives and point-to-point messages (group, operation, shapes,
    dtypes) and compare them across ranks after every step, evaluation and at the end of the run:
    a group whose members issued different sequences, or two ranks that used two shared groups in
    opposite orders (either can hang NCCL), stops the run with one message naming the step, the
    two ranks and the first diverging call (meshlm/parallel/collective_checks.py). Costs one
    small all-gather per step; meant for tests and for debugging a new layout."""
    dp_sync: str = "every_step"
    """How DP replicas stay together (meshlm/parallel/data/low_communication.py): 'every_step'
    (gradients summed over DP every step), or -- across slow links -- each replica (a whole
    TP x PP x CP model group) takes inner steps on its own data with no DP communication and
    they are reconciled every sync_every steps: 'local_sgd' (parameters averaged), 'diloco'
    (outer optimizer on the averaged parameter change; Douillard et al. 2023) or 'palsgd'
    (DiLoCo plus random communication-free pulls toward the last global copy)."""
    sync_every: int = 32
    """H: the replicas are reconciled every H optimizer steps (dp_sync other than every_step)."""
    outer_optimizer: str = "nesterov"
    """DiLoCo/PALSGD outer optimizer on the global copy: 'nesterov' (SGD with Nesterov momentum,
    as published) or 'sgd' (heavy-ball momentum)."""
    outer_lr: float = 0.7
    """Outer learning rate (DiLoCo's 0.7; PALSGD's authors use 0.1). 1.0 with outer_momentum=0 is local SGD."""
    outer_momentum: float = 0.9
    """Outer momentum (DiLoCo's 0.9); 0 for none."""
    outer_sync_dtype: str = "fp32"
    """dtype of the outer step's messages (the replicas' parameter changes and the updates):
    'fp32' or 'bf16' (half the bytes). local_sgd averages the parameters themselves, in fp32."""
    outer_overlap: bool = False
    """Overlap the outer step's communication with the next inner step (Streaming DiLoCo's
    one-step-stale sync): the replicas' changes are all-reduced in the background while step
    H+1 runs, and after it each replica loads the new global copy plus its own progress since
    the sync. Costs two more fp32 copies of the parameters (and an unsharded outer momentum)."""
    palsgd_p: float = 0.2
    """PALSGD: probability that an inner step is a pseudo-synchronization (the authors' 0.2)."""
    palsgd_eta: float = 1.0
    """PALSGD: strength eta of the pull theta <- theta - (lr / p) eta (theta - theta_global)."""
    palsgd_warmup: int = 32
    """PALSGD: the first steps are ordinary DDP steps (the authors' 32)."""
    local_warmup: int = 0
    """local_sgd and diloco: the first steps are ordinary DDP steps, the replicas training alone
    only after them (post-local SGD, Lin et al. 2020); PALSGD's is palsgd_warmup. 0: none."""
    simulate_link: str | None = None
    """Testing aid: 'BANDWIDTH,LATENCY' (e.g. '1Gbps,5ms') delays every DP collective by its
    bytes / bandwidth + latency (meshlm/parallel/simulated_link.py), so the wall-clock effect
    of dp_sync is measurable on one machine. null: no delay."""

    @property
    def sharding_stage(self) -> int:
        """The ZeRO stage in effect: zero_stage, or 1 for distributed_optimizer=true."""
        return max(self.zero_stage, int(self.distributed_optimizer))


@dataclass
class RLConfig:
    """`meshlm rl`: reinforcement learning with verifiable rewards (GRPO; meshlm/rl/)."""

    env: str = "arithmetic"
    """Where prompts come from: 'arithmetic' (built-in: seeded questions such as "What is 17 + 25?",
    scored by the final number of the reply) or 'prompts' (the records of the file rl.prompts,
    scored by their final answer or by train.reward_fn: meshlm/rl/prompt_file.py)."""
    prompts: str | None = None
    """rl.env=prompts: a JSON-lines file (or .json array, compressed or not) of {"prompt": "...",
    "answer": ...} records; every field but the prompt goes to the reward function, and
    rl.eval_prompts of them, drawn by train.seed, are held out for the accuracy."""
    system: str | None = None
    """A system turn put before every prompt (a prompt-file record's own 'system' or 'messages' win),
    e.g. one ending with '/think' or '/no_think' for the reasoning toggle; null: none."""
    group_size: int = 8
    """G: completions sampled per prompt; advantages are normalized within each group (>= 2)."""
    prompts_per_step: int = 4
    """Prompts per step over all data-parallel ranks (a multiple of the DP size); the step trains on
    prompts_per_step * group_size completions (`meshlm rl` sets train.global_batch_size to that count;
    train.micro_batch_size completions go through each forward/backward)."""
    max_new_tokens: int = 16
    """Longest completion, in tokens (the end-of-turn token included); prompt plus completion must fit train.seq_len."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts; the log-probabilities of the loss use the same temperature."""
    clip_epsilon: float = 0.2
    """PPO/GRPO clip: the ratio pi/pi_old is clipped to [1 - clip_epsilon, 1 + clip_epsilon]."""
    kl_coeff: float = 0.04
    """beta of the k3 KL penalty to the frozen reference model (GRPO's 0.04); 0 builds no reference."""
    epochs: int = 1
    """mu: optimizer steps on each step's rollouts (1: the ratio is 1 and the clip inactive)."""
    loss_averaging: str = "sequence"
    """'sequence' (each completion's mean over its tokens, then the mean over completions: GRPO) or
    'token' (the mean over all completion tokens of the step: DAPO, Yu et al. 2025)."""
    reference_from: str | None = None
    """The frozen reference model of the KL term (a model folder, checkpoint or run directory); null: train.init_from."""
    eval_prompts: int = 64
    """Held-out prompts (never trained on) answered greedily for the accuracy of each evaluation
    (every train.eval_every steps, and `meshlm rl --eval-only`)."""
    digits: int = 2
    """Arithmetic environment: operands have 1 to this many digits."""
    operations: str = "+-"
    """Arithmetic environment: the operators drawn from, some of '+', '-', '*'."""


def validate_rl(rl: RLConfig, train: TrainConfig) -> None:
    """The rl section's values (the environment, reward function and layout are checked by `meshlm rl`)."""
    for name in ("group_size", "prompts_per_step", "max_new_tokens", "epochs", "eval_prompts", "digits"):
        value = getattr(rl, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"rl.{name}={value!r} must be a positive integer.")
    if rl.group_size < 2:
        raise ConfigError(f"rl.group_size={rl.group_size} must be >= 2: advantages compare the completions of a "
                          "prompt with each other.")
    if not rl.temperature > 0:
        raise ConfigError(f"rl.temperature={rl.temperature} must be > 0 (rollouts are sampled).")
    if not 0 < rl.clip_epsilon < 1:
        raise ConfigError(f"rl.clip_epsilon={rl.clip_epsilon} must lie in (0, 1) (0.2 is usual).")
    if not rl.kl_coeff >= 0:
        raise ConfigError(f"rl.kl_coeff={rl.kl_coeff} must be >= 0 (0: no KL penalty and no reference model).")
    check_choice("rl.loss_averaging", rl.loss_averaging, ("sequence", "token"))
    if rl.env not in ("arithmetic", "prompts"):
        raise ConfigError(f"rl.env={rl.env!r} is not a built-in environment (arithmetic, prompts); use "
                          "rl.env=arithmetic, or rl.env=prompts with rl.prompts=FILE for prompts of your own.")
    if rl.env == "prompts" and not rl.prompts:
        raise ConfigError("rl.env=prompts reads its prompts from a file: set rl.prompts=FILE.jsonl "
                          "(or pass meshlm rl --prompts FILE.jsonl).")
    if rl.prompts and rl.env != "prompts":
        raise ConfigError(f"rl.prompts={rl.prompts} is read only by rl.env=prompts, and rl.env={rl.env}; set "
                          "rl.env=prompts to train on the file, or drop rl.prompts.")
    if not rl.operations or set(rl.operations) - set("+-*"):
        raise ConfigError(f"rl.operations={rl.operations!r} must be some of '+', '-', '*' (e.g. rl.operations='+-').")
    if train.reward_fn is not None and (train.reward_fn.count(":") != 1 or not all(train.reward_fn.split(":"))):
        raise ConfigError(f"train.reward_fn={train.reward_fn!r} must look like module:function "
                          "(e.g. train.reward_fn=my_rewards:exact_answer).")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict:
        return {name: section_to_dict(getattr(self, name)) for name in SECTIONS}

    def validate(self) -> None:
        self.model.validate()
        train, optim = self.train, self.optim
        for name in ("steps", "micro_batch_size", "global_batch_size", "seq_len", "log_every",
                     "recompute_every", "eval_batches"):
            if getattr(train, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(train, name)} must be a positive integer.")
        if train.early_stop_evals < 0:
            raise ConfigError(f"train.early_stop_evals={train.early_stop_evals} must be >= 0 (0: no early stopping).")
        if train.eval_per_dataset and (train.objective != "lm" or train.eval_every <= 0):
            why = (f"train.objective={train.objective} reads preference rows, not a blend of corpora"
                   if train.objective != "lm" else "train.eval_every=0 computes no validation loss")
            raise ConfigError(f"train.eval_per_dataset: {why}; drop it" + ("." if train.objective != "lm" else
                                                                            ", or set train.eval_every."))
        if (train.keep_best or train.early_stop_evals) and train.eval_every <= 0:
            setting = "train.keep_best" if train.keep_best else f"train.early_stop_evals={train.early_stop_evals}"
            raise ConfigError(f"{setting} follows the validation loss, and train.eval_every=0 computes none; set "
                              "train.eval_every (e.g. 100).")
        if train.keep_checkpoints < 0:
            raise ConfigError(f"train.keep_checkpoints={train.keep_checkpoints} must be >= 0 (0 keeps every "
                              "checkpoint).")
        if train.global_batch_size % train.micro_batch_size:
            raise ConfigError(f"train.global_batch_size={train.global_batch_size} must be a multiple of "
                              f"train.micro_batch_size={train.micro_batch_size}.")
        check_choice("train.recompute", train.recompute, RECOMPUTE)
        validate_profile_steps(train.profile_steps, train.steps)
        check_choice("train.on_nonfinite", train.on_nonfinite, ON_NONFINITE)
        if train.max_consecutive_skips < 0 or train.max_rollbacks < 0:
            raise ConfigError(f"train.max_consecutive_skips={train.max_consecutive_skips} and train.max_rollbacks="
                              f"{train.max_rollbacks} must be >= 0 (0 skips: never roll back or stop).")
        if not train.time_limit_minutes >= 0:  # also refuses nan
            raise ConfigError(f"train.time_limit_minutes={train.time_limit_minutes} must be >= 0; give the job's "
                              "wall-clock limit in minutes (a little below the scheduler's), or 0 for none.")
        validate_distillation(train)
        validate_power_floor(train)
        validate_objective(self)
        check_choice("optim.schedule", optim.schedule, SCHEDULES)
        check_choice("precision.dtype", self.precision.dtype, DTYPES)
        check_choice("precision.fp8_gemm", self.precision.fp8_gemm, FP8_GEMMS)
        check_choice("precision.fp8_fast_accumulation", self.precision.fp8_fast_accumulation, FP8_FAST_ACCUMULATION)
        if not isinstance(self.precision.amax_history, int) or self.precision.amax_history < 1:
            raise ConfigError(f"precision.amax_history={self.precision.amax_history!r} must be an integer >= 1 "
                              "(the number of past steps whose amaxes set an fp8_delayed scale).")
        if not isinstance(self.precision.high_precision_layers, int) or self.precision.high_precision_layers < 0:
            raise ConfigError(f"precision.high_precision_layers={self.precision.high_precision_layers!r} must be "
                              "an integer >= 0 (blocks kept out of the recipe at each end).")
        if optim.lr <= 0 or optim.min_lr < 0 or optim.min_lr > optim.lr:
            raise ConfigError(f"need 0 <= optim.min_lr ({optim.min_lr}) <= optim.lr ({optim.lr}) and optim.lr > 0.")
        if not 0 <= optim.decay_fraction <= 1:
            raise ConfigError(f"optim.decay_fraction={optim.decay_fraction} must lie in [0, 1].")
        if optim.warmup_steps < 0 or train.eval_every < 0 or train.save_every < 0 or train.grad_clip < 0:
            raise ConfigError("optim.warmup_steps, train.eval_every, train.save_every and train.grad_clip "
                              "must be >= 0.")
        validate_optimizer(self)
        validate_parallel(self.parallel)
        if self.parallel.cp > 1 and self.model.attention_kernel != "auto":
            raise ConfigError(f"model.attention_kernel={self.model.attention_kernel!r} has no effect under context "
                              f"parallelism (parallel.cp={self.parallel.cp}: ring attention computes its blocks "
                              "itself); set model.attention_kernel=auto or parallel.cp=1.")
        check_positions_fit(self.model, train.seq_len, f"train.seq_len={train.seq_len}",
                            "set train.seq_len to at most that, or enlarge the table (a new model)")
        validate_rl(self.rl, train)
        if self.data.weights is not None and len(self.data.weights) != len(self.data.prefixes):
            raise ConfigError(f"data.weights has {len(self.data.weights)} entries but data.prefixes has "
                              f"{len(self.data.prefixes)}; give one weight per prefix (or null).")


def validate_power_floor(train) -> None:
    """train.power_floor in [0, 1), train.power_ramp_seconds >= 0 (meshlm/training/power_floor.py)."""
    if not 0 <= train.power_floor < 1:  # also refuses nan
        raise ConfigError(f"train.power_floor={train.power_floor} must lie in [0, 1): the fraction of a GPU's "
                          "compute power to hold during communication waits (0 = off, e.g. 0.6).")
    if not train.power_ramp_seconds >= 0:
        raise ConfigError(f"train.power_ramp_seconds={train.power_ramp_seconds} must be >= 0 (seconds over which "
                          "the power floor ramps at start, end and around checkpoints; 0 = no ramps).")
    if train.power_ramp_seconds > 0 and train.power_floor == 0:
        raise ConfigError(f"train.power_ramp_seconds={train.power_ramp_seconds} ramps the power floor, but "
                          "train.power_floor is 0 (off); set train.power_floor (e.g. 0.6) or drop the ramps.")


def parse_profile_steps(text: str) -> tuple[int, int]:
    """``"3:5"`` -> (3, 5); raises ValueError when the text is not two integers around a colon."""
    first, _, last = str(text).partition(":")
    return int(first), int(last)


def validate_profile_steps(text: str | None, steps: int) -> None:
    if text is None or text == "":
        return
    try:
        first, last = parse_profile_steps(text)
    except ValueError:
        raise ConfigError(f"train.profile_steps={text!r} must look like A:B (first and last step to profile, "
                          "e.g. train.profile_steps=5:7), or null for no profiling.") from None
    if not 1 <= first <= last <= steps:
        raise ConfigError(f"train.profile_steps={text!r} must satisfy 1 <= A <= B <= train.steps ({steps}); "
                          f"pick steps the run will take, e.g. train.profile_steps={min(2, steps)}:{min(3, steps)}.")


def validate_distillation(train: TrainConfig) -> None:
    """The train.distill_* settings (the teacher itself is checked when the trainer loads it)."""
    check_choice("train.distill_loss", train.distill_loss, DISTILL_LOSSES)
    if not train.distill_temperature > 0:
        raise ConfigError(f"train.distill_temperature={train.distill_temperature} must be > 0 "
                          "(1.0: the plain softmax).")
    if not 0 <= train.distill_weight <= 1:
        raise ConfigError(f"train.distill_weight={train.distill_weight} must lie in [0, 1] (1.0: pure distillation, "
                          "0.0: the LM loss alone).")
    if train.distill_from is None and train.distill_blocks:
        raise ConfigError("train.distill_blocks=true needs a teacher; set train.distill_from=TEACHER "
                          "(a model folder, checkpoint or run directory).")


def validate_objective(config: RunConfig) -> None:
    """train.objective and its settings against the model and layout (the data's kind and the
    reference model are checked when the trainer opens them: meshlm/training/preference.py)."""
    train, model, parallel = config.train, config.model, config.parallel
    check_choice("train.objective", train.objective, OBJECTIVES)
    check_choice("train.reward_loss", train.reward_loss, REWARD_LOSSES)
    check_choice("train.dpo_variant", train.dpo_variant, DPO_VARIANTS)
    if train.objective == "reward" and model.head != "reward":
        raise ConfigError("train.objective=reward trains a reward head; set model.head=reward.")
    if train.objective != "reward" and model.head == "reward":
        raise ConfigError(f"model.head=reward has no next-token logits to train with train.objective="
                          f"{train.objective}; set train.objective=reward.")
    if train.objective == "lm":
        return
    if train.objective == "reward" and train.reward_loss == "bradley_terry" and len(model.reward_attributes) > 1:
        raise ConfigError(f"train.reward_loss=bradley_terry compares one score per reply, but model.reward_attributes "
                          f"has {len(model.reward_attributes)}; give one name, or use train.reward_loss=mse on rated "
                          "replies.")
    if not train.dpo_beta > 0 or not train.rpo_alpha >= 0:
        raise ConfigError(f"train.dpo_beta={train.dpo_beta} must be > 0 and train.rpo_alpha={train.rpo_alpha} >= 0.")
    if train.objective == "dpo" and (train.reference_from or train.init_from) is None:
        raise ConfigError("train.objective=dpo needs a frozen reference model; set train.init_from (the SFT model, "
                          "also the reference by default) or train.reference_from.")
    unsupported = [(f"parallel.{name}={getattr(parallel, name)}", getattr(parallel, name) > 1)
                   for name in ("pp", "cp", "ep")]
    unsupported += [(f"model.mtp_depth={model.mtp_depth}", model.mtp_depth > 0),
                    (f"precision.recipe={config.precision.recipe}", config.precision.recipe != "none"),
                    (f"train.distill_from={train.distill_from}", train.distill_from is not None),
                    (f"parallel.dp_sync={parallel.dp_sync}", parallel.dp_sync != "every_step")]
    for setting, used in unsupported:
        if used:
            raise ConfigError(f"train.objective={train.objective} does not support {setting} yet; use tp (+sp), dp "
                              "and ZeRO, plain bf16/fp16/fp32, without MTP or distillation.")


def validate_optimizer(config: RunConfig) -> None:
    """optim.optimizer and Muon's settings, and the layouts Muon cannot step (meshlm/optim/muon.py)."""
    optim = config.optim
    check_choice("optim.optimizer", optim.optimizer, ("adamw", "muon"))
    if optim.optimizer != "muon":
        return
    if not 0 <= optim.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum={optim.muon_momentum} must lie in [0, 1) (0.95 is usual).")
    if not isinstance(optim.muon_ns_steps, int) or optim.muon_ns_steps < 1:
        raise ConfigError(f"optim.muon_ns_steps={optim.muon_ns_steps!r} must be an integer >= 1 (5 is usual).")
    if not optim.muon_update_rms > 0:
        raise ConfigError(f"optim.muon_update_rms={optim.muon_update_rms} must be > 0 (0.2 matches AdamW's updates).")
    if config.model.lora_rank:
        raise ConfigError(f"optim.optimizer=muon orthogonalizes whole weight matrices, and with model.lora_rank="
                          f"{config.model.lora_rank} only low-rank adapters train; use optim.optimizer=adamw.")


def validate_parallel(parallel: ParallelConfig) -> None:
    """Checks that need no world size; the layout against the world and the model is checked by
    ``meshlm.parallel.mesh.check_layout`` before any collective runs."""
    for name in ("tp", "pp", "vp", "cp", "ep", "vocab_pad_multiple"):
        if not isinstance(getattr(parallel, name), int) or getattr(parallel, name) < 1:
            raise ConfigError(f"parallel.{name}={getattr(parallel, name)!r} must be a positive integer.")
    if parallel.dp is not None and parallel.dp < 1:
        raise ConfigError(f"parallel.dp={parallel.dp} must be a positive integer, or null for the rest of the world.")
    if parallel.etp is not None and (not isinstance(parallel.etp, int) or parallel.etp < 1):
        raise ConfigError(f"parallel.etp={parallel.etp!r} must be a positive integer, or null for parallel.tp.")
    if parallel.vp > 1 and parallel.pp == 1:
        raise ConfigError(f"parallel.vp={parallel.vp} needs parallel.pp > 1 (virtual stages interleave a pipeline); "
                          "set parallel.pp or parallel.vp=1.")
    if parallel.sp and parallel.tp == 1:
        raise ConfigError("parallel.sp=true needs parallel.tp > 1 (sequence parallelism shards along the "
                          "tensor-parallel group); set parallel.tp or parallel.sp=false.")
    check_choice("parallel.backend", parallel.backend, ("auto", "nccl", "gloo"))
    check_choice("parallel.moe_dispatcher", parallel.moe_dispatcher, ("all_to_all", "all_gather"))
    if parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={parallel.zero_stage!r} must be 0, 1, 2 or 3.")
    if not parallel.reduce_grads_in_fp32 and parallel.sharding_stage < 2:
        raise ConfigError("parallel.reduce_grads_in_fp32=false needs parallel.zero_stage=2 or 3 (stages 0 and 1 "
                          "accumulate in an fp32 gradient buffer); set parallel.zero_stage or drop the override.")
    if parallel.bucket_size_mb <= 0 or parallel.timeout_s <= 0:
        raise ConfigError("parallel.bucket_size_mb and parallel.timeout_s must be > 0.")


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "optim": OptimConfig,
            "data": DataConfig, "precision": PrecisionConfig, "parallel": ParallelConfig, "rl": RLConfig}


def section_to_dict(section) -> dict:
    if isinstance(section, ModelConfig):
        return section.to_dict()
    return dataclasses.asdict(section)


def known_keys() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.init]


def _unknown_key_error(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, known_keys(), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else " Run `meshlm train --list-keys` to see all keys."
    return ConfigError(f"unknown config key '{key}'.{hint}")


class ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``3:5`` as the base-60 integer 185; config values keep it as the text "3:5"
    (train.profile_steps=3:5). Everything else loads as with ``yaml.safe_load``."""

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        return text if ":" in text else super().construct_yaml_int(node)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)


def parse_override(text: str) -> tuple[str, object]:
    """``train.steps=200`` -> ("train.steps", 200); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. train.steps=200).")
    key, raw = text.split("=", 1)
    try:
        value = yaml.load(raw, Loader=ConfigLoader) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def format_override(key: str, value) -> str:
    """The inverse of ``parse_override``: ``model.pattern='*E'``, as a shell passes it on unchanged."""
    plain = isinstance(value, str) and parse_override(f"{key}={value}")[1] == value
    text = value if plain else yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
    return f"{key}={shlex.quote(text)}"


def _coerce(key: str, value, annotation):
    """Check ``value`` against a field's annotation (int/float/bool/str/list/Optional)."""
    hint = eval(annotation, vars(typing), {}) if isinstance(annotation, str) else annotation  # noqa: S307
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} cannot be null.")
    for option in options:
        origin = typing.get_origin(option) or option
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin in (bool, str) and isinstance(value, origin):
            return value
        if origin is list and isinstance(value, list):
            return value
        if origin is dict and isinstance(value, dict):  # e.g. model.block_overrides (checked by its section)
            return value
    names = " or ".join(getattr(typing.get_origin(o) or o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{key}={value!r} has the wrong type; expected {names}.")


def build_run_config(values: dict) -> RunConfig:
    """Dict (as from YAML) -> validated RunConfig."""
    if not isinstance(values, dict):
        raise ConfigError("the config file must be a mapping of sections (model:, train:, ...).")
    sections = {}
    for section_name, section_values in values.items():
        if section_name not in SECTIONS:
            raise _unknown_key_error(str(section_name))
        if not isinstance(section_values, dict):
            raise ConfigError(f"config section '{section_name}' must be a mapping, got {section_values!r}.")
        cls = SECTIONS[section_name]
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        checked = {}
        for key, value in section_values.items():
            if key not in fields:
                raise _unknown_key_error(f"{section_name}.{key}")
            checked[key] = _coerce(f"{section_name}.{key}", value, fields[key].type)
        sections[section_name] = cls(**checked)
    config = RunConfig(**sections)
    config.validate()
    return config


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config (or start from defaults when ``path`` is None) and apply overrides."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (configs/ has examples such as configs/tiny.yaml).")
        try:
            values = yaml.load(path.read_text(), Loader=ConfigLoader) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from error
    for text in overrides:
        key, value = parse_override(text)
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise _unknown_key_error(key)
        if not isinstance(values.get(section, {}), dict):
            raise ConfigError(f"config section '{section}' must be a mapping.")
        values.setdefault(section, {})[name] = value
    return build_run_config(values)


def save_run_config(config: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
