"""One model's evaluation: the perplexity of each data source and the accuracy of each task, and
the lines ``meshlm eval`` prints for them (shared by one model and a run's checkpoint series)."""

from __future__ import annotations

from functools import reduce

from meshlm.evaluation.multiple_choice import TaskResult, evaluate_task
from meshlm.evaluation.perplexity import PerplexityResult, evaluate_perplexity


def evaluate_model(evaluation, sources, tasks: list[tuple[str, list]], seq_len: int,
                   batch_size: int) -> tuple[list[PerplexityResult], list[TaskResult]]:
    """Perplexity of each source (and their total when there are several) and each task's accuracy."""
    perplexities = evaluate_perplexity(evaluation, sources, seq_len, batch_size) if sources else []
    if len(perplexities) > 1:
        perplexities.append(reduce(PerplexityResult.__add__, perplexities))
    scored = [evaluate_task(evaluation, questions, seq_len, batch_size, name=name) for name, questions in tasks]
    return perplexities, scored


def perplexity_line(result: PerplexityResult) -> str:
    bits = "n/a (a token store needs --tokenizer)" if result.bits_per_byte is None else f"{result.bits_per_byte:.4f}"
    return (f"{result.name}: {result.tokens} tokens  loss {result.loss:.4f}  perplexity {result.perplexity:.4f}  "
            f"bits/byte {bits}")


def task_line(result: TaskResult) -> str:
    def with_error(value: float, error: float | None) -> str:
        return f"{value:.4f}" + ("" if error is None else f" ± {error:.4f}")
    return (f"{result.name}: {result.questions} questions  acc {with_error(result.acc, result.acc_stderr)}  "
            f"acc_norm {with_error(result.acc_norm, result.acc_norm_stderr)}")


__all__ = ["evaluate_model", "perplexity_line", "task_line"]
