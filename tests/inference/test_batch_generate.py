"""``meshlm generate --input/--output`` (meshlm/inference/batch_generate.py): a file of prompts in
batches, the same tokens as generating them directly, fields carried through, an interrupted file
continued without redoing or losing a line, and bad input refused in one sentence."""

from __future__ import annotations

import json
import re

import pytest

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.cli import main
from meshlm.data.tokenizer import load_tokenizer
from meshlm.inference.chat import chat_messages, conversation_prompt, stop_ids
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from tests.helpers.generation_model import tiny_model

PROMPTS = ["the cat", "a dog sat", "the cat and the", "friends", "on the mat"]


def write_records(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_file_of_prompts_gives_what_generate_gives_with_the_fields_kept(model_dir, tmp_path, capsys):
    records = [{"id": index, "prompt": prompt, "reference": "x"} for index, prompt in enumerate(PROMPTS)]
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(model_dir), "--input", str(write_records(tmp_path / "in.jsonl", records)),
                 "--output", str(out), "--batch-size", "2", "--greedy", "--max-new-tokens", "6"]) == 0
    tokenizer = load_tokenizer(model_dir)
    expected = generate(load_model(model_dir), [tokenizer.encode(p) for p in PROMPTS], 6, SamplingConfig(greedy=True),
                        eos_token_id=tokenizer.eos_token_id, valid_vocab_size=tokenizer.vocab_size)
    written = lines(out)
    assert [record["id"] for record in written] == list(range(5)) and all(r["reference"] == "x" for r in written)
    assert [record["generated"] for record in written] == [tokenizer.decode(ids) for ids in expected]
    assert [record["new_tokens"] for record in written] == [len(ids) for ids in expected]
    assert "wrote 5 completions" in capsys.readouterr().err


def test_an_interrupted_file_is_continued_without_redoing_or_losing_a_line(model_dir, tmp_path, capsys):
    source = write_records(tmp_path / "in.jsonl", [{"prompt": prompt} for prompt in PROMPTS])
    arguments = ["generate", str(model_dir), "--input", str(source), "--batch-size", "2", "--temperature", "0.9",
                 "--seed", "7", "--max-new-tokens", "5"]
    whole = tmp_path / "whole.jsonl"
    assert main([*arguments, "--output", str(whole)]) == 0
    complete = whole.read_text().splitlines(keepends=True)
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(complete[:2]) + complete[2][:10])  # two whole lines and a torn third
    capsys.readouterr()
    assert main([*arguments, "--output", str(partial)]) == 0
    assert partial.read_text() == whole.read_text()  # each batch seeded by its first record: the same samples
    assert "already holds 2 of 5 completions; continuing" in capsys.readouterr().err
    assert main([*arguments, "--output", str(partial)]) == 0  # complete: nothing to do, nothing changed
    assert partial.read_text() == whole.read_text()


def test_chat_records_render_their_system_turn_or_context(chat_tokenizer_dir, tmp_path):
    model_dir = save_model(tiny_model(), tmp_path / "chat_model", tokenizer_dir=chat_tokenizer_dir)
    context = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"},
               {"role": "user", "content": "the dog"}]
    records = [{"prompt": "the cat"}, {"prompt": "the dog", "system": "be brief"}, {"messages": context}]
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(model_dir), "--chat", "--system", "talk", "--input",
                 str(write_records(tmp_path / "in.jsonl", records)), "--output", str(out), "--greedy",
                 "--max-new-tokens", "4"]) == 0
    tokenizer = load_tokenizer(chat_tokenizer_dir)
    prompts = [conversation_prompt(tokenizer, messages) for messages in
               (chat_messages("the cat", "talk"), chat_messages("the dog", "be brief"), context)]
    stops = stop_ids(tokenizer)
    expected = generate(load_model(model_dir), prompts, 4, SamplingConfig(greedy=True), eos_token_id=stops,
                        valid_vocab_size=min(tokenizer.vocab_size, 320))
    written = lines(out)
    assert [r["new_tokens"] for r in written] == [len(ids) for ids in expected]
    assert [r["finished"] for r in written] == [bool(ids) and ids[-1] in stops for ids in expected]
    assert written[2]["messages"] == context


@pytest.mark.parametrize("records, extra, message", [
    ([{"text": "x"}], [], r"in\.jsonl, line 1: needs a string under 'prompt' \(keys here: 'text'\)"),
    ([{"messages": [{"role": "user", "content": "x"}]}], [], "'messages' is a chat context; add --chat"),
    ([{"prompt": "x", "generated": "old"}], [], "its records have a 'generated' field, which the output adds"),
    ([{"prompt": "x"}], ["--prompt", "y"], "--input reads the prompts from a file; drop --prompt"),
    ([{"prompt": "x"}], ["--batch-size", "0"], "--batch-size 0 must be at least 1"),
])
def test_bad_input_is_refused_in_one_sentence(model_dir, tmp_path, capsys, records, extra, message):
    source = write_records(tmp_path / "in.jsonl", records)
    assert main(["generate", str(model_dir), "--input", str(source), "--output", str(tmp_path / "o.jsonl"),
                 *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_an_output_of_another_input_is_never_touched(model_dir, tmp_path, capsys):
    source = write_records(tmp_path / "in.jsonl", [{"prompt": "the cat"}])
    other = tmp_path / "other.jsonl"
    other.write_text('{"generated": "a"}\n{"generated": "b"}\n')
    assert main(["generate", str(model_dir), "--input", str(source), "--output", str(other)]) == 2
    assert "already holds 2 completions, more than the 1 prompts of --input" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"generated": "a"}\nnot json\n{"generated": "b"}\n')
    assert main(["generate", str(model_dir), "--input", str(source), "--output", str(broken)]) == 2
    assert "line 2: not JSON, and not the last line" in capsys.readouterr().err
    assert other.read_text() == '{"generated": "a"}\n{"generated": "b"}\n'
    assert main(["generate", str(model_dir), "--prompt", "x", "--output", str(other)]) == 2
    assert "--output holds the completions of --input's prompts" in capsys.readouterr().err


def test_records_sample_as_alone_whatever_the_batch_size(model_dir, tmp_path):
    """Continuous batching: record i samples with seed + i, so its completion is what ``generate``
    samples for its prompt alone, with any --batch-size, in input order."""
    source = write_records(tmp_path / "in.jsonl", [{"prompt": prompt} for prompt in PROMPTS])
    outputs = []
    for batch_size in ("2", "3"):
        out = tmp_path / f"out{batch_size}.jsonl"
        assert main(["generate", str(model_dir), "--input", str(source), "--output", str(out), "--batch-size",
                     batch_size, "--temperature", "1.1", "--seed", "5", "--max-new-tokens", "9"]) == 0
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    alone = [generate(model, [tokenizer.encode(prompt)], 9, SamplingConfig(temperature=1.1, seed=5 + index),
                      eos_token_id=tokenizer.eos_token_id, valid_vocab_size=tokenizer.vocab_size)[0]
             for index, prompt in enumerate(PROMPTS)]
    written = lines(tmp_path / "out2.jsonl")
    assert [record["new_tokens"] for record in written] == [len(ids) for ids in alone]
    assert [record["generated"] for record in written] == [tokenizer.decode(ids) for ids in alone]


def test_a_longrope_model_goes_in_fixed_batches_seeded_by_their_first_record(tokenizer_dir, tmp_path):
    """LongRoPE's re-run past the original context cannot share a batch: its file goes in fixed
    batches of --batch-size, each one ``generate`` call seeded with --seed plus its first index."""
    import torch

    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=320, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                                      num_kv_heads=2, init_std=0.1, rope_scaling="longrope", rope_scaling_factor=4.0,
                                      rope_original_max_positions=12, rope_short_factors=[1.0, 1.1, 1.3, 1.6],
                                      rope_long_factors=[1.0, 3.0, 9.0, 27.0]))
    folder = save_model(model, tmp_path / "longrope", tokenizer_dir=tokenizer_dir)
    source = write_records(tmp_path / "in.jsonl", [{"prompt": prompt} for prompt in PROMPTS])
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(folder), "--input", str(source), "--output", str(out), "--batch-size", "2",
                 "--temperature", "0.9", "--seed", "3", "--max-new-tokens", "9"]) == 0
    tokenizer, loaded = load_tokenizer(folder), load_model(folder)
    expected = []
    for first in range(0, len(PROMPTS), 2):  # past the 12 original positions: the re-run happens
        expected += generate(loaded, [tokenizer.encode(prompt) for prompt in PROMPTS[first:first + 2]], 9,
                             SamplingConfig(temperature=0.9, seed=3 + first), eos_token_id=tokenizer.eos_token_id,
                             valid_vocab_size=tokenizer.vocab_size)
    assert [record["generated"] for record in lines(out)] == [tokenizer.decode(ids) for ids in expected]


RECORD_SCHEMA = {"type": "object", "required": ["animal", "legs"],
                 "properties": {"animal": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"}}}


@pytest.mark.parametrize("batching", ["continuous", "fixed batches"])
def test_a_json_schema_holds_every_generated_record_to_it(model_dir, tokenizer_dir, tmp_path, capsys, batching):
    """``--json-schema``: every record's ``generated`` text is a document of the schema, sampled from a
    random model, through the continuous batcher and through fixed batches (a LongRoPE model); a
    schema file that is not JSON, or asks for what decoding cannot hold to, is refused by name."""
    import torch

    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel

    folder = model_dir
    if batching == "fixed batches":
        torch.manual_seed(0)
        model = LanguageModel(ModelConfig(vocab_size=320, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                                          num_kv_heads=2, init_std=0.1, rope_scaling="longrope",
                                          rope_scaling_factor=4.0, rope_original_max_positions=64,
                                          rope_short_factors=[1.0, 1.1, 1.3, 1.6],
                                          rope_long_factors=[1.0, 3.0, 9.0, 27.0]))
        folder = save_model(model, tmp_path / "longrope", tokenizer_dir=tokenizer_dir)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(RECORD_SCHEMA))
    source = write_records(tmp_path / "in.jsonl", [{"prompt": prompt} for prompt in PROMPTS])
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(folder), "--input", str(source), "--output", str(out), "--batch-size", "2",
                 "--temperature", "1.0", "--seed", "3", "--max-new-tokens", "200", "--json-schema",
                 str(schema)]) == 0
    written = lines(out)
    values = [json.loads(record["generated"]) for record in written]
    assert all(value["animal"] in ("cat", "dog") and type(value["legs"]) is int and set(value) == {"animal", "legs"}
               for value in values), values
    assert all(record["finished"] for record in written)
    schema.write_text('{"type": "object",')
    assert main(["generate", str(folder), "--prompt", "a", "--json-schema", str(schema)]) == 2
    assert f"--json-schema {schema}: not valid JSON" in capsys.readouterr().err
    schema.write_text(json.dumps({"type": "string", "pattern": "^[a-z]+$"}))
    assert main(["generate", str(folder), "--prompt", "a", "--json-schema", str(schema)]) == 2
    assert f"--json-schema {schema}: pattern bound values by their content" in capsys.readouterr().err
