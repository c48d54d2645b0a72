"""lm-evaluation-harness on a meshlm model: the ``meshlm`` model type of ``lm_eval``.

    pip install 'meshlm[eval]'
    python -m meshlm.evaluation.lm_eval_adapter --model_args path=runs/x --tasks hellaswag,arc_easy
    torchrun --nproc_per_node 2 -m meshlm.evaluation.lm_eval_adapter --model_args path=runs/x,tp=2 --tasks mmlu

The harness (Gao et al., EleutherAI) turns each task into three kinds of requests, which a model
type answers; ``MeshLM`` answers them with the same scoring ``meshlm eval`` uses (``scoring.py``):

    loglikelihood          (context, continuation) -> (summed log-probability, is it the greedy
                           continuation); the harness's own tokenization split (``TemplateLM``)
    loglikelihood_rolling  a whole text's log-probability, cut into the harness's rolling windows
                           of ``max_length`` tokens (every token predicted once)
    generate_until         text continued by ``meshlm.inference.generate`` (greedy unless the
                           task asks for sampling), cut at the first stop string

Model arguments (``--model_args k=v,...``): ``path`` (a model folder, checkpoint or run, as for
``meshlm eval``), ``tokenizer``, ``max_length`` (default: the training seq_len), ``tp``; the
harness's ``--batch_size N`` and ``--device`` apply. ``--batch_size auto`` is not supported.

Why a module to run rather than ``lm_eval --model meshlm``: lm-evaluation-harness 0.4.13 knows
the model types it ships (``lm_eval.models.MODEL_MAPPING``) and those registered by code that
was imported before the run; it reads no plugin entry points for models, and ``--include_path``
adds tasks, not models. ``python -m meshlm.evaluation.lm_eval_adapter ARGS`` imports this
module (registering ``meshlm``) and then runs the harness's own command line with ARGS
(``--model meshlm`` is added when absent), so every ``lm_eval`` option works. From Python,
``import meshlm.evaluation.lm_eval_adapter`` then ``lm_eval.simple_evaluate(model="meshlm", ...)``.

Under torchrun the harness splits the requests over the data-parallel ranks itself (``rank``,
``world_size`` and the gathers below); the ranks of one tensor-parallel group all report the
data-parallel rank, answer the same requests in step, and only local rank 0 prints.
"""

from __future__ import annotations

import json
import sys

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from meshlm.errors import ConfigError, DataError
from meshlm.evaluation.loading import load_for_evaluation
from meshlm.evaluation.scoring import prefix_token, score_continuations
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.parallel.plain_collectives import all_gather_objects, barrier, gather_objects

DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256
"""New tokens of a generation request that names no ``max_gen_toks`` (the harness's default)."""


class MeshLM(TemplateLM):
    """A meshlm model folder, checkpoint or run, answering lm-evaluation-harness requests."""

    def __init__(self, path: str, tokenizer: str | None = None, max_length: int | None = None, tp: int = 1,
                 batch_size: int | str | None = None, device: str | None = None, **_harness_options):
        super().__init__()
        self.evaluation = load_for_evaluation(path, tokenizer, harness_device(device), int(tp))
        if self.evaluation.tokenizer is None:
            raise DataError(f"{self.evaluation.directory}: no tokenizer found beside the model; add "
                            "tokenizer=PATH to --model_args.")
        self.model, self.tokenizer = self.evaluation.model, self.evaluation.tokenizer
        self.max_length = int(max_length or self.evaluation.default_seq_len)
        self.batch_size = parse_batch_size(batch_size)
        self._rank, self._world_size = self.evaluation.work_rank
        self._device = self.evaluation.device

    # --- tokens -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int | None:
        return prefix_token(self.tokenizer)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Without special tokens unless asked, as ``meshlm preprocess`` tokenizes training text."""
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tokenizer.decode(tokens)

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.source)

    # --- requests -----------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation), context tokens, continuation tokens) -> (log-likelihood, greedy)."""
        scores, greedy = score_continuations(self.model, [(context, continuation) for _, context, continuation
                                                          in requests], self.max_length, self.batch_size)
        answers = [(float(score), bool(is_greedy)) for score, is_greedy in zip(scores, greedy)]
        for (strings, _, _), answer in zip(requests, answers):
            self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability over rolling windows of ``max_length`` (the harness's windows)."""
        if self.prefix_token_id is None:
            raise DataError(f"{self.tokenizer.source}: rolling log-likelihood starts each text after the end-of-text "
                            "or begin token, and this tokenizer names neither.")
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            for window in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        scores, _ = score_continuations(self.model, windows, self.max_length, self.batch_size)
        totals = [0.0] * len(requests)
        for owner, score in zip(owners, scores):
            totals[owner] += float(score)
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context with ``meshlm.inference.generate``; cut at the first stop string."""
        outputs: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):  # requests sharing settings share batches
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        for indices in groups.values():
            settings = dict(requests[indices[0]].args[1])
            stops = settings.pop("until", None) or []
            stops = [stops] if isinstance(stops, str) else list(stops)
            max_new_tokens = int(settings.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            sampling = sampling_from_settings(settings)
            prompts = [self.prompt_tokens(requests[index].args[0], max_new_tokens) for index in indices]
            for start in range(0, len(indices), self.batch_size):
                new_tokens = generate(self.model, prompts[start:start + self.batch_size], max_new_tokens, sampling,
                                      eos_token_id=self.eot_token_id,
                                      valid_vocab_size=min(self.tokenizer.vocab_size, self.model.config.vocab_size))
                for index, tokens in zip(indices[start:start + self.batch_size], new_tokens):
                    outputs[index] = cut_at_stops(self.tok_decode(tokens), stops)
                    self.cache_hook.add_partial("generate_until", requests[index].args, outputs[index])
        return outputs

    def prompt_tokens(self, context: str, max_new_tokens: int) -> list[int]:
        """The context's last tokens that leave room for the new ones (at least one token)."""
        tokens = self.tok_encode(context) or [self.prefix_token_id]
        return tokens[-max(1, self.max_length - max_new_tokens):]

    # --- data parallelism: the harness splits the requests and gathers the results -------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        pieces = all_gather_objects(tensor.detach().cpu(), self.evaluation.work_group)
        return torch.cat([piece.reshape(-1) if piece.dim() == 0 else piece for piece in pieces])

    def gather_object(self, obj, dst: int = 0):
        return gather_objects(obj, self.evaluation.work_group, destination=dst)

    def barrier(self) -> None:
        barrier(self.evaluation.work_group)

    def get_model_info(self) -> dict:
        return {"model_path": str(self.evaluation.directory), "max_length": self.max_length,
                "model_num_parameters": self.model.num_parameters()}


def harness_device(device: str | None) -> str | None:
    """The harness passes ``--device`` (default "cuda") whether or not the user chose it: plain
    "cuda", or any CUDA device on a machine without one, means meshlm's default (this rank's GPU
    under torchrun, else the CPU)."""
    if device is None or str(device) == "cuda" or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        return None
    return str(device)


def parse_batch_size(batch_size: int | str | None) -> int:
    if batch_size is None:
        return DEFAULT_BATCH_SIZE
    try:
        value = int(batch_size)
    except ValueError:
        raise ConfigError(f"--batch_size {batch_size!r}: the meshlm model takes a number of sequences per forward "
                          f"(default {DEFAULT_BATCH_SIZE}); 'auto' is not supported.") from None
    if value < 1:
        raise ConfigError(f"--batch_size {value} must be at least 1.")
    return value


def sampling_from_settings(settings: dict) -> SamplingConfig:
    """Greedy unless the task asks for sampling (``do_sample`` or a temperature above 0)."""
    temperature = float(settings.get("temperature") or 0.0)
    if not settings.get("do_sample") and temperature == 0.0:
        return SamplingConfig(greedy=True)
    return SamplingConfig(temperature=temperature or 1.0, top_k=int(settings.get("top_k") or 0),
                          top_p=float(settings.get("top_p") or 1.0), seed=int(settings.get("seed") or 0))


def cut_at_stops(text: str, stops: list[str]) -> str:
    """``text`` up to (not including) the earliest stop string found in it."""
    ends = [text.find(stop) for stop in stops if stop and stop in text]
    return text[:min(ends)] if ends else text


def main(argv: list[str] | None = None) -> None:
    """lm-evaluation-harness's command line with the ``meshlm`` model registered (module docstring)."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        argv = argv[1:]
    if argv and argv[0] not in ("ls", "validate") and "--model" not in argv:
        argv = ["--model", "meshlm", *argv]
    sys.argv = ["lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    # Run as a script, this file is ``__main__``; the harness must get the importable module's
    # class (its registry refuses two classes under one name), which importing it registers.
    from meshlm.evaluation.lm_eval_adapter import main as run_harness

    run_harness()
else:
    register_model("meshlm")(MeshLM)
