"""Evaluation: how well a trained model predicts text, and how often it picks the right answer.

    meshlm eval runs/x --data data/valid notes.txt       perplexity and bits per byte
    meshlm eval runs/x --task hellaswag.jsonl              multiple-choice accuracy
    python -m meshlm.evaluation.lm_eval_adapter --model_args path=runs/x --tasks arc_easy

Both measures come from one quantity, the log-probability the model gives a token after the
tokens before it (``scoring.py``). Perplexity sums it over every token of a held-out text, cut
into windows of the training length (``perplexity.py``); a multiple-choice task sums it over
the tokens of each answer after its question and picks the most likely one (``multiple_choice.py``).
``lm_eval_adapter.py`` lets lm-evaluation-harness ask the same questions of a meshlm model.

Under torchrun the windows, answers or requests are split over the data-parallel ranks and the
sums are added up over them; with ``--tp N`` each group of N ranks holds one tensor-parallel
copy of the model (``loading.py``). The numbers equal those of one process, up to rounding.
"""
