"""``meshlm train --list-keys``: each key with its default and the first sentence of its docstring,
whole: "Su et al. 2021", "e.g. the experts" and "0.5" do not end a sentence."""

from __future__ import annotations

import pytest

from meshlm.training.cli import first_sentence, key_descriptions


@pytest.mark.parametrize("docstring, sentence", [
    ("'rope' (rotary, Su et al. 2021, rotate-half layout) or 'none'. More.", "'rope' (rotary, Su et al. 2021, "
                                                                             "rotate-half layout) or 'none'."),
    ("Groups (e.g. the experts of one device), i.e. fewer. Then.", "Groups (e.g. the experts of one device), i.e. "
                                                                   "fewer."),
    ("Capacity 1.25 by default,\n    per expert. Tokens beyond it drop.", "Capacity 1.25 by default, per expert."),
    ("SSM heads H. None means derived.", "SSM heads H."),
    ("Std of the init (Megatron's).", "Std of the init (Megatron's)."),
    ("No period at all", "No period at all"),
    ("", ""),
])
def test_first_sentence(docstring, sentence):
    assert first_sentence(docstring) == sentence


def test_list_keys_prints_whole_first_sentences():
    lines = {line.split(" = ")[0]: line for line in key_descriptions()}
    assert lines["model.position_embedding"].endswith("(rotary, Su et al. 2021, rotate-half layout as in Llama), "
                                                       "'learned' (a trained table of max_position_embeddings "
                                                       "vectors added to the token embeddings, as GPT-2 and BERT "
                                                       "do; meshlm/models/position_embedding.py) or 'none' "
                                                       "(Nemotron-H's attention blocks use no positional signal; "
                                                       "the Mamba blocks carry order).")
    assert lines["parallel.tp"].startswith("parallel.tp = 1  # Tensor-parallel size (Shoeybi et al. 2019): ")
    assert not [line for line in lines.values() if line.endswith((" al.", " e.g.", " i.e."))]
