import json

import torch

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.cli import main
from meshlm.data.tokenizer import load_tokenizer
from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from tests.helpers.generation_model import tiny_model

def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def expected_ids(directory, prompts, max_new_tokens, sampling, tokenizer=None):
    return generate(load_model(directory), prompts, max_new_tokens, sampling,
                    eos_token_id=tokenizer.eos_token_id if tokenizer else None,
                    valid_vocab_size=tokenizer.vocab_size if tokenizer else None)


def test_prompt_ids_json_matches_generate(capsys, model_dir):
    code, out, _ = run_cli(capsys, model_dir, "--prompt-ids", "1,2,3", "--prompt-ids", "40,41",
                           "--max-new-tokens", 10, "--greedy", "--json")
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    tokenizer = load_tokenizer(model_dir)
    expected = expected_ids(model_dir, [[1, 2, 3], [40, 41]], 10, SamplingConfig(greedy=True), tokenizer)
    assert [record["ids"] for record in records] == expected
    assert [record["text"] for record in records] == [tokenizer.decode(ids) for ids in expected]
    assert all(token < tokenizer.vocab_size for ids in expected for token in ids)


def test_text_prompts_are_encoded_sampled_and_decoded(capsys, model_dir):
    code, out, _ = run_cli(capsys, model_dir, "--prompt", "the cat", "--prompt", "a dog sat",
                           "--max-new-tokens", 8, "--temperature", 0.9, "--top-k", 20, "--top-p", 0.9,
                           "--seed", 4)
    assert code == 0
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode("the cat"), tokenizer.encode("a dog sat")]
    sampling = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, seed=4)
    expected = expected_ids(model_dir, prompts, 8, sampling, tokenizer)
    assert out == "".join(tokenizer.decode(ids) + "\n" for ids in expected)


def test_prompt_files_are_read_whole_and_go_with_text_prompts_in_order(capsys, monkeypatch, tmp_path, model_dir):
    """--prompt-file: the file's whole text (newlines and quotes kept) is one prompt, as if it had
    been given with --prompt; - reads standard input; mixed with --prompt in the order given."""
    import io

    text = 'the cat\nsat "on"\n\tthe mat\n'
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    tokenizer = load_tokenizer(model_dir)
    code, out, _ = run_cli(capsys, model_dir, "--prompt", "a dog", "--prompt-file", tmp_path / "prompt.txt",
                           "--max-new-tokens", 6, "--greedy", "--json")
    assert code == 0
    expected = expected_ids(model_dir, [tokenizer.encode("a dog"), tokenizer.encode(text)], 6,
                            SamplingConfig(greedy=True), tokenizer)
    assert [json.loads(line)["ids"] for line in out.splitlines()] == expected
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    code, out, _ = run_cli(capsys, model_dir, "--prompt-file", "-", "--max-new-tokens", 6, "--greedy", "--json")
    assert code == 0 and json.loads(out)["ids"] == expected[1]


def test_prompts_missing_mixed_or_unreadable_are_refused(capsys, tmp_path, model_dir):
    code, _, err = run_cli(capsys, model_dir, "--max-new-tokens", 2)
    assert code == 2 and "no prompt given; pass --prompt TEXT, --prompt-file FILE or --prompt-ids" in err
    code, _, err = run_cli(capsys, model_dir, "--prompt", "a", "--prompt-ids", "1,2")
    assert code == 2 and "use one kind in a run" in err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for path, said in ((tmp_path / "missing.txt", "missing.txt: no such file"),
                       (tmp_path / "latin1.txt", "latin1.txt: not UTF-8 text (byte 3); save the prompt as UTF-8."),
                       (tmp_path, "cannot read it")):
        code, _, err = run_cli(capsys, model_dir, "--prompt-file", path)
        assert code == 2 and err.startswith("meshlm generate: error: --prompt-file ") and said in err, err


def test_without_tokenizer_ids_are_printed_and_text_prompts_refused(capsys, tmp_path, tokenizer_dir):
    directory = save_model(tiny_model(), tmp_path / "bare")
    code, out, _ = run_cli(capsys, directory, "--prompt-ids", "5,6", "--max-new-tokens", 6, "--greedy")
    assert code == 0
    [expected] = expected_ids(directory, [[5, 6]], 6, SamplingConfig(greedy=True))
    assert out == ",".join(map(str, expected)) + "\n"

    code, _, err = run_cli(capsys, directory, "--prompt", "the cat", "--max-new-tokens", 4, "--greedy")
    assert code == 2
    assert "--tokenizer" in err and "--prompt-ids" in err

    code, out, _ = run_cli(capsys, directory, "--prompt", "the cat", "--max-new-tokens", 4, "--greedy",
                           "--tokenizer", tokenizer_dir / "tokenizer.json", "--json")
    assert code == 0 and set(json.loads(out)) == {"ids", "text"}


def test_eos_id_flag_overrides_the_tokenizer(capsys, model_dir):
    [reference] = expected_ids(model_dir, [[7, 8, 9]], 12, SamplingConfig(greedy=True))
    eos = reference[2]
    code, out, _ = run_cli(capsys, model_dir, "--prompt-ids", "7,8,9", "--max-new-tokens", 12, "--greedy",
                           "--eos-id", eos, "--json")
    assert code == 0
    assert json.loads(out)["ids"] == reference[:reference.index(eos) + 1]


def test_user_errors_exit_with_status_2(capsys, tmp_path, model_dir):
    code, _, err = run_cli(capsys, tmp_path / "missing", "--prompt-ids", "1", "--max-new-tokens", 2)
    assert code == 2 and "missing" in err
    code, _, err = run_cli(capsys, model_dir, "--prompt-ids", "1", "--max-new-tokens", 2, "--greedy",
                           "--temperature", 0.5)
    assert code == 2 and "--greedy" in err and "--temperature" in err
    code, _, err = run_cli(capsys, model_dir, "--prompt-ids", "1", "--max-new-tokens", 2, "--top-p", 1.5)
    assert code == 2 and "top_p" in err
    (model_dir / "tokenizer.json").write_text("{ not a tokenizer")
    code, _, err = run_cli(capsys, model_dir, "--prompt-ids", "1", "--max-new-tokens", 2, "--greedy")
    assert code == 2 and "tokenizer.json" in err


def test_run_directory_resolves_to_the_latest_complete_step(capsys, tmp_path):
    run = tmp_path / "run"
    for step in (9, 10):
        save_model(tiny_model(seed=step), run / "checkpoints" / f"step_{step}")
    (run / "checkpoints" / "step_11").mkdir()  # an interrupted save: no config.json
    assert resolve_model_dir(run) == run / "checkpoints" / "step_10"
    assert resolve_model_dir(run / "checkpoints") == run / "checkpoints" / "step_10"
    assert resolve_model_dir(run / "checkpoints" / "step_9") == run / "checkpoints" / "step_9"

    code, out, _ = run_cli(capsys, run, "--prompt-ids", "3,4", "--max-new-tokens", 5, "--greedy", "--json")
    assert code == 0
    assert [json.loads(out)["ids"]] == expected_ids(run / "checkpoints" / "step_10", [[3, 4]], 5,
                                                     SamplingConfig(greedy=True))


def test_eos_falls_back_to_the_converted_hf_config(tmp_path):
    import json

    from meshlm.inference.cli import choose_eos

    (tmp_path / "config.json").write_text(json.dumps({"format": "meshlm", "hf": {"eos_token_id": [2, 7]}}))
    assert choose_eos(None, None, tmp_path) == [2, 7]
    assert choose_eos(5, None, tmp_path) == 5
    (tmp_path / "config.json").write_text(json.dumps({"format": "meshlm"}))
    assert choose_eos(None, None, tmp_path) is None


def test_speculative_prefill_chunk_and_stats_flags(capsys, tmp_path, tokenizer_dir):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=320, hidden_size=32, pattern="M*-", num_attention_heads=4,
                                      num_kv_heads=2, mamba_head_dim=8, init_std=0.1, mtp_depth=2))
    directory = save_model(model, tmp_path / "mtp", tokenizer_dir=tokenizer_dir)
    prompt_args = ("--prompt-ids", "1,2,3", "--prompt-ids", "40,41", "--max-new-tokens", 9, "--greedy", "--json")
    code, plain, _ = run_cli(capsys, directory, *prompt_args)
    assert code == 0
    code, out, err = run_cli(capsys, directory, *prompt_args, "--speculative", "mtp", "--prefill-chunk", 2, "--stats")
    assert code == 0 and out == plain
    stats = json.loads(err)
    generated = sum(len(json.loads(line)["ids"]) for line in out.splitlines())
    assert stats["prefill_tokens"] == 5 and stats["decode_tokens"] == generated and stats["cache_bytes"] > 0
    assert stats["same_tokens_as_plain"] is True and stats["drafted_tokens"] > 0 and "speedup" in stats
    assert 0 <= stats["acceptance_rate"] <= 1

    code, out, err = run_cli(capsys, directory, *prompt_args, "--stats")
    assert code == 0 and out == plain and "acceptance_rate" not in json.loads(err)

    sampled_args = ("--prompt-ids", "1,2,3", "--max-new-tokens", 9, "--temperature", "0.8", "--top-k", 5,
                    "--seed", 4, "--json", "--speculative", "mtp", "--stats")
    code, out, err = run_cli(capsys, directory, *sampled_args)
    stats = json.loads(err)
    assert code == 0 and len(json.loads(out)["ids"]) == 9 and stats["drafted_tokens"] > 0
    assert stats["same_tokens_as_plain"] is None and "speedup" in stats  # sampled: a distribution, not the draws
    assert run_cli(capsys, directory, *sampled_args)[1] == out  # the seed repeats the tokens


def test_speculative_needs_mtp_depths(capsys, model_dir):
    code, _, err = run_cli(capsys, model_dir, "--prompt-ids", "1,2", "--max-new-tokens", 4, "--greedy",
                           "--speculative", "mtp")
    assert code == 2 and "model.mtp_depth=0" in err
    code, _, err = run_cli(capsys, model_dir, "--prompt-ids", "1,2", "--max-new-tokens", 4, "--prefill-chunk", 0)
    assert code == 2 and "prefill_chunk=0" in err


def test_max_new_tokens_defaults_to_128(capsys, tmp_path):
    directory = save_model(tiny_model(), tmp_path / "bare")  # no tokenizer, so no eos: all 128 tokens
    code, out, _ = run_cli(capsys, directory, "--prompt-ids", "5,6", "--greedy", "--json")
    assert code == 0
    assert [json.loads(out)["ids"]] == expected_ids(directory, [[5, 6]], 128, SamplingConfig(greedy=True))
    assert len(json.loads(out)["ids"]) == 128


def test_compile_flag_gives_the_same_tokens_and_reports_compile_seconds(capsys, monkeypatch, model_dir):
    import functools

    import meshlm.inference.generate as generate_module

    monkeypatch.setattr(generate_module, "DecodeStep",  # aot_eager: the graph without Inductor's code generation
                        functools.partial(generate_module.DecodeStep, backend="aot_eager"))
    torch._dynamo.reset()
    prompt_args = ("--prompt-ids", "1,2,3", "--prompt-ids", "40,41", "--max-new-tokens", 6, "--greedy", "--json")
    code, plain, _ = run_cli(capsys, model_dir, *prompt_args)
    code, out, err = run_cli(capsys, model_dir, *prompt_args, "--compile", "--stats")
    assert code == 0 and out == plain
    assert json.loads(err)["compile_seconds"] >= 0


def test_json_schema_holds_each_prompts_reply_to_it(capsys, tmp_path, model_dir):
    """``--json-schema``: the printed replies of text prompts (sampled from a random model) are each a
    document of the schema, the same tokens ``generate`` draws under the same constraints."""
    from meshlm.inference.constrained.grammar import GrammarCache
    from meshlm.inference.constrained.json_schema import read_schema
    from meshlm.inference.constrained.token_constraint import TokenConstraint

    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, out, _ = run_cli(capsys, model_dir, "--prompt", "the cat", "--prompt", "a dog", "--max-new-tokens", 100,
                           "--seed", 2, "--json", "--json-schema", tmp_path / "schema.json")
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    values = [json.loads(record["text"]) for record in records]
    assert all(1 <= len(value) <= 3 and all(isinstance(item, bool) for item in value) for value in values), values
    tokenizer = load_tokenizer(model_dir)
    grammar = GrammarCache(tokenizer, tokenizer.vocab_size).grammar("s", read_schema(schema, "s"))
    expected = generate(load_model(model_dir), [tokenizer.encode("the cat"), tokenizer.encode("a dog")], 100,
                        SamplingConfig(seed=2), eos_token_id=tokenizer.eos_token_id,
                        valid_vocab_size=tokenizer.vocab_size,
                        constraints=[TokenConstraint(grammar, [tokenizer.eos_token_id]) for _ in range(2)])
    assert [record["ids"] for record in records] == expected
