"""meshlm: train dense, hybrid Mamba-2/Transformer and MoE language models at any scale.

The Python API, for notebooks and scripts (docs/api.md; ``examples/notebook.py`` runs it end to
end). Each function is the library call behind one ``meshlm`` command:

    import meshlm

    config = meshlm.load_config("configs/tiny.yaml", overrides=["train.steps=20"])  # meshlm train's config
    result = meshlm.train(config)                          # the trainer, in this process
    model = meshlm.load_model(result.run_dir)              # model folder, checkpoint or run directory
    meshlm.generate(model, "ROMEO:", max_new_tokens=32, tokenizer=result.run_dir)   # -> the new text
    meshlm.convert(result.run_dir, "hf/tiny", to="hf")     # meshlm convert meshlm-to-hf

``import meshlm`` imports neither torch nor any model code: the functions import what they need
when called, and the classes (``ModelConfig``, ``LanguageModel``, ``RunConfig``, ...) are loaded
on first access (PEP 562's module ``__getattr__``), so ``import meshlm`` stays cheap for tools
that only read a config.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from meshlm.errors import CheckpointError, ConfigError, DataError

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": "meshlm.models.config",
    "LanguageModel": "meshlm.models.language_model",
    "LMOutput": "meshlm.models.language_model",
    "RunConfig": "meshlm.config",
    "TrainResult": "meshlm.training.trainer",
    "Tokenizer": "meshlm.data.tokenizer",
}
"""Public classes, by the module that defines them (imported on first access)."""


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access is an ordinary attribute
        return value
    raise AttributeError(f"module 'meshlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()):
    """A validated ``RunConfig`` from a YAML file (or the defaults when ``path`` is None) plus
    ``section.key=value`` overrides, exactly as ``meshlm train CONFIG OVERRIDES...`` reads them.
    A mistake raises ``ConfigError`` with one sentence naming the key and the fix."""
    from meshlm.config import load_run_config

    if isinstance(overrides, str):
        raise ConfigError(f"overrides={overrides!r} must be a list of section.key=value strings, "
                          f"e.g. overrides=[{overrides!r}].")
    return load_run_config(path, list(overrides))


def train(config, overrides: list[str] | tuple[str, ...] = ()):
    """Train (or resume) a run in this process and return its ``TrainResult`` (``run_dir``, ``step``,
    ``losses`` and ``val_losses`` by step, ``stopped_by``).

    ``config`` is a ``RunConfig`` or a YAML path (read with ``overrides``). A run directory that
    holds a checkpoint is resumed, as by ``meshlm train``. Launched by ``torchrun``, every process
    calls ``train`` with the same config; the process group is joined from torchrun's environment
    and left open for the caller. Errors are raised, not turned into exit codes."""
    from meshlm.config import RunConfig
    from meshlm.training.trainer import train as run_trainer

    if not isinstance(config, RunConfig):
        config = load_config(config, overrides)
    elif overrides:
        raise ConfigError("overrides apply to a YAML path; with a RunConfig, pass them to "
                          "meshlm.load_config(path, overrides) instead.")
    return run_trainer(config)


def load_model(path: str | os.PathLike, device: str = "cpu", merge_lora: bool = False):
    """The ``LanguageModel`` stored at ``path`` -- a model folder (config.json + model.safetensors),
    a training checkpoint (``RUN_DIR/checkpoints/step_N``) or a run directory (its newest
    complete checkpoint) -- on ``device``, in eval mode, each tensor in the dtype it was saved in.
    ``merge_lora``: a LoRA model's adapters folded into its weights (``meshlm merge-lora``)."""
    from meshlm.checkpoint.locate import resolve_model_dir
    from meshlm.checkpoint.model_files import load_model as load_model_folder

    model = load_model_folder(resolve_model_dir(path), map_location=device, merge_lora=merge_lora)
    return model.eval()


def load_tokenizer(path: str | os.PathLike):
    """A tokenizer file (tokenizer.json, SentencePiece .model, tiktoken), or the one saved in a
    model folder, checkpoint or run directory."""
    from meshlm.data.tokenizer import find_tokenizer_file, load_tokenizer as load_tokenizer_file

    path = Path(path)
    if path.is_dir():
        for directory in _model_dirs(path):
            try:
                return load_tokenizer_file(find_tokenizer_file(directory))
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"{path}: no tokenizer file here or in its newest checkpoint; pass the "
                                "tokenizer.json the data was built with.")
    return load_tokenizer_file(path)


def _model_dirs(path: Path) -> list[Path]:
    """``path`` and, for a run directory, the checkpoint folder a model would be loaded from."""
    from meshlm.checkpoint.locate import resolve_model_dir

    try:
        return list(dict.fromkeys([path, resolve_model_dir(path)]))
    except CheckpointError:
        return [path]


def generate(model, prompt, max_new_tokens: int = 64, tokenizer=None, *, greedy: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             eos_token_id: int | list[int] | None = None, prefill_chunk: int | None = None,
             speculative: str | None = None, draft_tokens: int | None = None, json_schema: dict | None = None):
    """Continue ``prompt`` by at most ``max_new_tokens`` tokens; returns only the new ones.

    ``prompt`` is a string (-> a string), a list of token ids (-> a list of ids), or a list of
    either (-> a list of results, batched with left padding). ``model`` is a ``LanguageModel`` or
    a path for ``load_model`` (then its own tokenizer is used unless one is given). ``tokenizer``
    is a ``Tokenizer`` or a path for ``load_tokenizer``; text prompts need one. Generation stops
    at ``eos_token_id`` (default: the tokenizer's). Sampling: ``greedy``, or ``temperature``,
    ``top_k`` (0 = all), ``top_p`` (1 = off) and ``seed``; ``repetition_penalty``, ``presence_penalty``
    and ``frequency_penalty`` lower the logits of tokens already seen (meshlm/inference/penalties.py),
    greedy or sampled; ``prefill_chunk``, ``speculative="mtp"``
    and ``draft_tokens`` as in ``meshlm generate`` (docs/generation.md). ``json_schema``: hold every
    reply to this JSON Schema by constrained decoding (``meshlm/inference/constrained/``; needs the
    tokenizer; ``{"type": "object"}`` for any JSON object)."""
    from meshlm.inference.generate import generate as generate_ids
    from meshlm.inference.sampling import SamplingConfig

    model_dir = None
    if isinstance(model, (str, os.PathLike)):
        model_dir = Path(model)
        model = load_model(model_dir, device="cuda" if _cuda_available() else "cpu", merge_lora=True)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    elif tokenizer is None and model_dir is not None:
        tokenizer = _tokenizer_or_none(model_dir)
    single = isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                         and all(isinstance(token, int) for token in prompt))
    prompts = [prompt] if single else list(prompt)
    if any(isinstance(item, str) for item in prompts) and tokenizer is None:
        raise ConfigError("a text prompt needs a tokenizer: pass tokenizer=PATH (tokenizer.json, or the model "
                          "or run directory holding one), or give the prompt as token ids.")
    ids = [tokenizer.encode(item) if isinstance(item, str) else list(item) for item in prompts]
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    sampling = SamplingConfig(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty)
    valid_vocab_size = min(tokenizer.vocab_size, model.config.vocab_size) if tokenizer is not None else None
    constraints = None
    if json_schema is not None:
        constraints = _schema_constraints(json_schema, tokenizer, valid_vocab_size, eos_token_id, len(ids))
    new_ids = generate_ids(model, ids, max_new_tokens, sampling, eos_token_id=eos_token_id,
                           valid_vocab_size=valid_vocab_size, prefill_chunk=prefill_chunk, speculative=speculative,
                           draft_tokens=draft_tokens, constraints=constraints)
    results = [tokenizer.decode(new) if isinstance(item, str) else new for item, new in zip(prompts, new_ids)]
    return results[0] if single else results


def _schema_constraints(json_schema, tokenizer, valid_vocab_size: int | None, eos_token_id, count: int) -> list:
    """One constraint per prompt holding its reply to ``json_schema`` (``generate``'s keyword)."""
    import json

    from meshlm.inference.constrained.grammar import GrammarCache
    from meshlm.inference.constrained.json_schema import read_schema
    from meshlm.inference.constrained.token_constraint import TokenConstraint

    if tokenizer is None:
        raise ConfigError("json_schema holds replies to a schema, which needs the tokenizer's token bytes: pass "
                          "tokenizer=PATH.")
    grammar = GrammarCache(tokenizer, valid_vocab_size).grammar(json.dumps(json_schema, sort_keys=True),
                                                               read_schema(json_schema, "json_schema"))
    ends = [] if eos_token_id is None else list(eos_token_id) if isinstance(eos_token_id, list) else [eos_token_id]
    return [TokenConstraint(grammar, ends) for _ in range(count)]


def _tokenizer_or_none(path: Path):
    try:
        return load_tokenizer(path)
    except FileNotFoundError:
        return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def convert(source: str | os.PathLike, out: str | os.PathLike, *, to: str, architecture: str | None = None,
            quantize: str | None = None, overwrite: bool = False, lora: str = "merged",
            base_model: str | None = None) -> Path:
    """Convert a model between Hugging Face and meshlm folders, one tensor at a time; returns ``out``.

    ``to="hf"``: ``source`` is a meshlm model folder, checkpoint or run directory; ``architecture``
    picks the HF class (default: chosen from the model's shape) and ``quantize="fp8"`` writes the
    block linears in block-wise FP8 (``meshlm convert meshlm-to-hf``). Of a LoRA model ``lora``
    says what: "merged" (the adapters folded into the weights), "base" (the frozen base alone) or
    "adapter" (the adapters alone, a PEFT folder naming ``base_model``). ``to="meshlm"``:
    ``source`` is a Hugging Face folder (``meshlm convert hf-to-meshlm``). Tokenizer files travel
    along; a non-empty ``out`` is refused unless ``overwrite``."""
    if to == "hf":
        from meshlm.checkpoint.locate import resolve_model_dir
        from meshlm.hf.convert import LORA_PARTS, meshlm_to_hf

        if lora not in LORA_PARTS:
            raise ConfigError(f"lora={lora!r} must be one of {', '.join(LORA_PARTS)}.")
        written, _ = meshlm_to_hf(resolve_model_dir(source), out, architecture, overwrite=overwrite,
                                  quantize=quantize, part=lora, base_model=base_model)
        return written
    if to == "meshlm":
        if architecture is not None or quantize is not None or lora != "merged" or base_model is not None:
            raise ConfigError("architecture=, quantize=, lora= and base_model= apply to to='hf' only; the HF "
                              "folder's config says what it holds.")
        from meshlm.hf.convert import hf_to_meshlm

        written, _, _ = hf_to_meshlm(source, out, overwrite=overwrite)
        return written
    raise ConfigError(f"to={to!r} must be 'hf' (meshlm -> Hugging Face) or 'meshlm' (Hugging Face -> meshlm).")


__all__ = ["CheckpointError", "ConfigError", "DataError", "LMOutput", "LanguageModel", "ModelConfig", "RunConfig",
           "Tokenizer", "TrainResult", "__version__", "convert", "generate", "load_config", "load_model",
           "load_tokenizer", "train"]
