"""Whole-model conversion between Hugging Face folders and meshlm models.

Import (``hf_to_meshlm``): read config.json, pick the adapter by its ``architectures`` entry
(or ``model_type``), translate the config, map the tensors (checked against the shapes the
config implies, from the files' headers alone) and write the meshlm model folder one tensor at
a time, each read from the HF shards when it is written. No model is built and no process holds
more than one output tensor and what it is read from, so a model larger than the host's memory
converts. The HF settings meshlm
does not model but generation needs (bos/eos/pad token ids, the context length) travel in the
meshlm config.json under ``"hf"``, together with the source architecture, so that export can
restore them and ``meshlm generate`` can find the eos id.

Export (``meshlm_to_hf``): the architecture is, in order, the one asked for, the one the model was
imported from (if it can still express the model), or the first that fits of Llama (dense '*-' with
RoPE), Qwen2 (Llama with biases on q/k/v only), Qwen3 (dense '*-' with QK-norm), Qwen3-MoE
(softmax-routed '*E' with QK-norm), Mistral (a subset of Llama: written only when asked for or
imported from; or a window in every layer), Ministral 3 (Mistral with a query scale by position),
Mixtral (softmax-routed '*E'), OLMoE (softmax-routed '*E' with QK-norm over all heads), Qwen2-MoE
(Qwen3-MoE's routing without QK-norm, a gated shared expert), DeepSeek-V3 (multi-head latent
attention -- the one class here with it, every other refuses it --, dense '*-' layers, then
sigmoid-routed '*E' with a shared expert), Phi-3 (Llama's layer with fused projections: written only
when asked for or imported from), Gemma (GeGLU, zero-centered norms, scaled embeddings), Gemma 2 and
3 (sandwich norms, soft-capping; Gemma 3 with QK-norm), OLMo 2 and 3 (norms after the sublayers,
QK-norm over all heads; OLMo 3 sliding), EXAONE 4.0 (OLMo 2's layer with a QK-norm per head, sliding
layers with RoPE and full ones without), GPT-2 (learned positions, LayerNorm, biases, transposed
Conv1D weights), GPTBigCode (StarCoder: GPT-2's layer with multi-query attention and plain linear
weights), StarCoder2 (RoPE with LayerNorm, biases and a non-gated MLP), GPT-NeoX (StarCoder2's layer
with one head per key/value head, partial rotary and attention beside the MLP, a parallel residual;
q/k/v rows grouped per head), StableLM (Llama's layer with LayerNorm and partial rotary), Falcon
(parallel layers with one norm or two, sequential ones; MQA or grouped KV heads in a fused tensor),
Phi (phi-1 to Phi-2: a parallel layer with one norm, partial rotary, a bias on the output head),
GPT-J (Phi's layer without attention biases, its rotary pairs interleaved), Command R (the parallel
layer with a bias-free LayerNorm, SwiGLU and interleaved rotary pairs, scaled logits), Cohere2
(Command R's layer, three sliding layers with RoPE to one full without), SmolLM3 (Llama's layer,
some layers without RoPE), Granite (Llama with muP-style multipliers), Arcee (Llama's attention, a
non-gated MLP), Granite MoE, MoE-shared and 4.0-H (top-k-then-softmax routing; the hybrid with
Mamba-2 layers), GLM and GLM-4-0414 (Llama's layer rotating half of each head in interleaved pairs,
biases on q/k/v, a fused gate_up_proj; GLM-4-0414 with norms after the sublayers), Seed-OSS (Llama
with q/k/v, o and MLP biases each on or off), Hunyuan (QK-norm after RoPE), dots.llm1 (Qwen3's
attention then DeepSeek-V3's MoE), GLM-4.5 (GQA then DeepSeek-V3's MoE: after the dense classes,
since it holds their stacks too), Mamba2 ('MMM...'), Bamba (Mamba-2 and attention layers with MLPs)
and Nemotron-H (everything hybrid). When none fits, the error lists, per architecture, the fields
that block it. The same streaming applies: each meshlm tensor is read whole (by slice from
model.safetensors, by chunk from a training checkpoint) when the first HF tensor cut from it is
written. With ``quantize="fp8"`` the decoder blocks' linear weights are written as block-wise FP8,
each quantized as it is written (``fp8_export.py``); with ``quantize="mxfp4"`` a gpt-oss model's
experts in MXFP4, as gpt-oss was released (``mxfp4_export.py``).
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import torch

from meshlm.checkpoint.files import CONFIG_FILE
from meshlm.checkpoint.materialize import read_tensor
from meshlm.checkpoint.model_files import (check_stored_tensors, load_state_checked, read_model_config, source_file,
                                           weights_source, write_model_folder)
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import CheckpointError, ConfigError, DataError
from meshlm.hf import (arcee, bamba, cohere, cohere2, deepseek_v3, dots1, ernie4_5, ernie4_5_moe, exaone4, falcon,
                       falcon_h1, gemma, gemma2, gemma3, glm, glm4_moe, glm4_moe_lite, gpt2, gpt_bigcode, gpt_neox,
                       gpt_oss, gptj, granite, granite_moe, hunyuan, llama, mamba2, minimax_m2, ministral3, mistral,
                       mistral3, mixtral, nemotron_h, olmo2, olmoe, phi, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe,
                       qwen_vl, seed_oss, smollm3, stablelm, starcoder2)
from meshlm.hf.common import Architecture, produce_all
from meshlm.hf.files import check_output_dir, open_hf_tensors, read_hf_config, write_hf_folder
from meshlm.hf.quantized_export import quantize_hf_export
from meshlm.hf.fp8_import import dequantized_dtype, dequantized_tensors, fp8_blocks
from meshlm.hf.peft_export import peft_adapter_plan, write_adapter_folder
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.lora import is_adapter_tensor, merged_weights, without_adapters

EXPORT_ORDER: tuple[Architecture, ...] = (llama.ARCHITECTURE, qwen2.ARCHITECTURE, qwen3.ARCHITECTURE,
                                          qwen3_moe.ARCHITECTURE, mistral.ARCHITECTURE, ministral3.ARCHITECTURE,
                                          mixtral.ARCHITECTURE,
                                          olmoe.ARCHITECTURE, qwen2_moe.ARCHITECTURE,
                                          deepseek_v3.ARCHITECTURE, phi3.ARCHITECTURE, gemma.ARCHITECTURE,
                                          gemma2.ARCHITECTURE,
                                          gemma3.ARCHITECTURE, olmo2.OLMO2_ARCHITECTURE, olmo2.OLMO3_ARCHITECTURE,
                                          exaone4.ARCHITECTURE,
                                          gpt2.ARCHITECTURE, gpt_bigcode.ARCHITECTURE, starcoder2.ARCHITECTURE,
                                          gpt_neox.ARCHITECTURE,
                                          stablelm.ARCHITECTURE, falcon.ARCHITECTURE, falcon_h1.ARCHITECTURE,
                                          phi.ARCHITECTURE,
                                          gptj.ARCHITECTURE, cohere.ARCHITECTURE, cohere2.ARCHITECTURE,
                                          smollm3.ARCHITECTURE,
                                          granite.ARCHITECTURE, arcee.ARCHITECTURE, granite_moe.MOE, granite_moe.SHARED,
                                          granite_moe.HYBRID,
                                          glm.GLM_ARCHITECTURE, glm.GLM4_ARCHITECTURE,
                                          seed_oss.ARCHITECTURE, hunyuan.ARCHITECTURE, ernie4_5.ARCHITECTURE,
                                          dots1.ARCHITECTURE, glm4_moe.ARCHITECTURE,  # after the dense classes:
                                          # they hold '*-' stacks too
                                          gpt_oss.ARCHITECTURE, minimax_m2.ARCHITECTURE, ernie4_5_moe.ARCHITECTURE,
                                          glm4_moe_lite.ARCHITECTURE,  # DeepSeek-V3's layer: chosen when asked
                                          mamba2.ARCHITECTURE, bamba.ARCHITECTURE,
                                          nemotron_h.ARCHITECTURE)
EXPORTABLE: dict[str, Architecture] = {architecture.name: architecture for architecture in EXPORT_ORDER}
IMPORT_ONLY: tuple[Architecture, ...] = (gemma3.MULTIMODAL, mistral3.ARCHITECTURE, *qwen_vl.ARCHITECTURES)
"""Folders meshlm reads part of (Gemma 3's, Mistral 3's and Qwen-VL's multimodal ones: the language
model) and never writes."""
ARCHITECTURES: dict[str, Architecture] = {architecture.name: architecture
                                          for architecture in EXPORT_ORDER + IMPORT_ONLY}
HF_EXTRA_KEY = "hf"
KEPT_HF_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def architecture_of(hf_config: dict, source: str = "config.json") -> Architecture:
    """The adapter for an HF config, by its ``architectures`` entry, else its ``model_type``."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names:
        by_type = {architecture.model_type: architecture for architecture in EXPORT_ORDER}
        if hf_config.get("model_type") in by_type:
            return by_type[hf_config["model_type"]]
    found = ", ".join(names) or f"model_type {hf_config.get('model_type')!r}"
    raise CheckpointError(f"{source}: architecture {found} is not supported; meshlm converts "
                          f"{', '.join(ARCHITECTURES)}.")


def choose_architecture(config: ModelConfig, requested: str | None = None, original: str | None = None
                        ) -> Architecture:
    """The HF architecture to export ``config`` as (see the module docstring for the order)."""
    if config.head == "reward":
        raise ConfigError("this model has model.head=reward (a reward model), which no supported Hugging Face "
                          "causal-LM architecture can hold; read it with `meshlm score` instead of exporting it.")
    if requested is not None:
        if requested not in EXPORTABLE:
            raise ConfigError(f"--architecture {requested!r} is not one of {', '.join(EXPORTABLE)}.")
        EXPORTABLE[requested].check_expressible(config)
        return EXPORTABLE[requested]
    if original in ARCHITECTURES and not ARCHITECTURES[original].unsupported(config):
        return ARCHITECTURES[original]
    reasons = {}
    for architecture in EXPORT_ORDER:
        reasons[architecture.name] = architecture.unsupported(config)
        if not reasons[architecture.name]:
            return architecture
    detail = " | ".join(f"{name}: {'; '.join(why)}" for name, why in reasons.items())
    raise ConfigError(f"this model (pattern {config.pattern!r}) cannot be written as any supported Hugging Face "
                      f"architecture: {detail}.")


# --- import -------------------------------------------------------------------------------------
def read_hf_model_config(hf_dir: Path) -> tuple[dict, Architecture, ModelConfig]:
    """(HF config.json, its adapter, the meshlm config it translates to)."""
    hf_config = read_hf_config(hf_dir)
    architecture = architecture_of(hf_config, str(hf_dir / CONFIG_FILE))
    try:
        return hf_config, architecture, architecture.config_from_hf(hf_config)
    except ConfigError as error:
        raise ConfigError(f"{hf_dir / CONFIG_FILE}: {error}") from error


def hf_plan(architecture: Architecture, tensors: dict, config: ModelConfig, hf_dir: Path, hf_config: dict) -> dict:
    """The meshlm tensors of an HF folder's tensors, as a plan (errors name the folder); block-wise FP8
    weights are dequantized as they are read (``fp8_import.py``)."""
    block = fp8_blocks(hf_config, architecture.quantizations, str(hf_dir / CONFIG_FILE))
    if block is not None:
        tensors = dequantized_tensors(tensors, block, dequantized_dtype(hf_config), hf_dir)
    try:
        return architecture.plan_from_hf(tensors, config, hf_config)
    except CheckpointError as error:
        raise CheckpointError(f"{hf_dir}: {error}") from error


def kept_hf_fields(hf_config: dict, architecture: Architecture) -> dict:
    return {"architecture": architecture.name,
            **{name: hf_config[name] for name in KEPT_HF_FIELDS if hf_config.get(name) is not None}}


def load_hf_model(hf_dir: str | os.PathLike) -> tuple[LanguageModel, dict]:
    """The meshlm model held by an HF folder (in memory), and the ``"hf"`` extra config to keep with it."""
    hf_dir = Path(hf_dir)
    hf_config, architecture, config = read_hf_model_config(hf_dir)
    with open_hf_tensors(hf_dir) as files:
        config = architecture.fit_config(config, set(files.tensors))
        state = produce_all(hf_plan(architecture, files.tensors, config, hf_dir, hf_config))
    with torch.device("meta"):
        model = LanguageModel(config)
    load_state_checked(model, state, str(hf_dir))
    return model, kept_hf_fields(hf_config, architecture)


def hf_to_meshlm(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False
                 ) -> tuple[Path, ModelConfig, dict]:
    """Convert an HF folder into a meshlm model folder, one tensor at a time (tokenizer files are
    copied along); returns (the folder, its model config, the ``"hf"`` extra config)."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_output_dir(out_dir, overwrite)
    hf_config, architecture, config = read_hf_model_config(hf_dir)
    extra = kept_hf_fields(hf_config, architecture)
    with open_hf_tensors(hf_dir) as files:
        config = architecture.fit_config(config, set(files.tensors))
        plan = hf_plan(architecture, files.tensors, config, hf_dir, hf_config)
        write_model_folder(out_dir, config, plan, extra_config={HF_EXTRA_KEY: extra}, tokenizer_dir=hf_dir)
    return out_dir, config, extra


# --- export -------------------------------------------------------------------------------------
def read_hf_extra(model_dir: Path) -> dict:
    """The ``"hf"`` section a meshlm config.json may carry (absent for models trained in meshlm)."""
    try:
        extra = json.loads((model_dir / CONFIG_FILE).read_text()).get(HF_EXTRA_KEY) or {}
    except (OSError, json.JSONDecodeError):
        return {}
    return extra if isinstance(extra, dict) else {}


def hf_export_plan(config: ModelConfig, stored: dict[str, tuple], read, extra: dict | None = None,
                   architecture: str | None = None) -> tuple[dict, dict, Architecture]:
    """(HF config.json, plan of the HF tensors, chosen architecture) for a meshlm model whose
    tensors are ``stored`` ({name: (shape, dtype)}) and read one at a time by ``read(name)``."""
    extra = extra or {}
    chosen = choose_architecture(config, architecture, extra.get("architecture"))
    hf_config = chosen.config_to_hf(config)
    hf_config.update({name: extra[name] for name in KEPT_HF_FIELDS if name in extra})
    hf_config["dtype"] = str(stored["embedding.weight"][1]).removeprefix("torch.")
    return hf_config, chosen.plan_to_hf(stored, read, config), chosen


def export_hf(model: LanguageModel, extra: dict | None = None, architecture: str | None = None
              ) -> tuple[dict, dict[str, torch.Tensor], Architecture]:
    """(HF config.json, HF tensors, chosen architecture) for a meshlm model, in memory."""
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    stored = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}
    config, stored, read = merged_weights(model.config, stored, state.__getitem__)  # LoRA folded in
    hf_config, plan, chosen = hf_export_plan(config, stored, read, extra, architecture)
    return hf_config, produce_all(plan), chosen


def tokenizer_token_ids(model_dir: Path, vocab_size: int) -> dict[str, int]:
    """``bos_token_id``/``eos_token_id``/``pad_token_id`` of the tokenizer stored with a model (those
    it has, within the vocabulary); {} without a readable tokenizer."""
    try:
        tokenizer = load_tokenizer(model_dir)
    except (FileNotFoundError, DataError):
        return {}
    ids = {f"{role}_token_id": getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "pad")}
    return {name: token_id for name, token_id in ids.items() if token_id is not None and 0 <= token_id < vocab_size}


LORA_PARTS = ("merged", "base", "adapter")
"""What ``meshlm_to_hf`` writes of a LoRA model: the adapters folded into the weights, the frozen
base model alone, or the adapters alone as a PEFT folder (``peft_export.py``)."""


def meshlm_to_hf(model_dir: str | os.PathLike, out_dir: str | os.PathLike, architecture: str | None = None,
                 overwrite: bool = False, quantize: str | None = None, part: str = "merged",
                 base_model: str | None = None) -> tuple[Path, Architecture]:
    """Convert a meshlm model folder (or training checkpoint) into an HF folder, one tensor at a time;
    ``quantize="fp8"`` writes the block linears in block-wise FP8 (``fp8_export.py``), ``"mxfp4"`` a
    gpt-oss model's experts in MXFP4 (``mxfp4_export.py``). Of a LoRA
    model, ``part`` (``LORA_PARTS``) says what: ``adapter`` writes a PEFT adapter folder whose
    ``base_model_name_or_path`` is ``base_model``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output_dir(out_dir, overwrite)
    config = read_model_config(model_dir)
    source = weights_source(model_dir)
    check_stored_tensors(config, source.layout, str(source_file(model_dir)))
    if part != "merged" and not config.lora_rank:
        raise CheckpointError(f"{model_dir} has no LoRA adapters (its model.lora_rank is 0), so it has no separate "
                              f"{part}; export it without --{part}-only.")
    stored, read = source.layout, partial(read_tensor, source)
    if part == "adapter":
        if quantize is not None:
            raise ConfigError("--quantize applies to the model's weights, not to an adapter folder: drop one of "
                              "--quantize and --adapter-only.")
        original = read_hf_extra(model_dir).get("architecture")
        chosen = choose_architecture(without_adapters(config), architecture, original)
        adapter_config, plan = peft_adapter_plan(config, stored, read, chosen, base_model)
        write_adapter_folder(out_dir, adapter_config, plan, tokenizer_dir=model_dir, overwrite=True)
        return out_dir, chosen
    if part == "base":  # the frozen weights as they are, the adapters left out
        config, stored = without_adapters(config), {name: entry for name, entry in stored.items()
                                                    if not is_adapter_tensor(name)}
    else:
        config, stored, read = merged_weights(config, stored, read)  # LoRA folded in
    hf_config, plan, chosen = hf_export_plan(config, stored, read, read_hf_extra(model_dir), architecture)
    for name, token_id in tokenizer_token_ids(model_dir, config.vocab_size).items():
        if hf_config.get(name) is None:  # a model trained in meshlm: its tokenizer's ids, so HF generation stops
            hf_config[name] = token_id
    if quantize is not None:
        hf_config, plan = quantize_hf_export(hf_config, plan, quantize)
    write_hf_folder(out_dir, hf_config, plan, tokenizer_dir=model_dir, overwrite=True)
    return out_dir, chosen
