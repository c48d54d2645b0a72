"""The `meshlm` command's error reporting: one clear line, exit status 2."""

from meshlm.cli import main


def test_config_error_is_printed_once_under_torchrun(monkeypatch, capsys):
    """Every rank finds the same config error; only global rank 0 prints it."""
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "parallel.tp=0"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "parallel.tp=0"]) == 2
    assert "meshlm train: error: parallel.tp=0 must be a positive integer." in capsys.readouterr().err


def test_a_collective_mismatch_is_printed_once_as_one_line(monkeypatch, capsys):
    """Every rank compares the same records and raises the same CollectiveMismatch; rank 0 prints it."""
    from meshlm.parallel.collective_log import CollectiveMismatch

    message = "collective check after step 3: ranks 0 and 1 diverge on group dp (ranks [0, 1]) at its call #0"

    def mismatched(config, **options):
        raise CollectiveMismatch(message)

    monkeypatch.setattr("meshlm.training.trainer.train", mismatched)
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "train.steps=1"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "train.steps=1"]) == 2
    assert capsys.readouterr().err == f"meshlm train: error: {message}\n"


def test_help_lists_the_commands_without_importing_torch():
    """``meshlm --help`` imports no command module (nor torch), so it answers at once."""
    import subprocess
    import sys

    script = ("import sys\nfrom meshlm.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
              "print('torch imported' if 'torch' in sys.modules else 'torch not imported')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "torch not imported"
    assert "upcycle" in done.stdout and "turn a dense model" in done.stdout


def test_a_command_s_help_shows_its_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit) as exited:
        main(["train", "--help"])
    assert exited.value.code == 0
    assert "--list-keys" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["checkpoint", "inspect", "--help"])
    assert "--no-verify" in capsys.readouterr().out


def test_meshlm_warnings_are_one_line_notes_and_other_libraries_keep_python_s_form(capsys):
    from meshlm.cli import PACKAGE_DIR, _show_notice

    shown = []
    _show_notice("train", lambda *args: shown.append(args), UserWarning("a changed setting"), UserWarning,
                 str(PACKAGE_DIR / "training" / "trainer.py"), 204)
    assert capsys.readouterr().err == "meshlm train: note: a changed setting\n" and not shown
    _show_notice("train", lambda *args: shown.append(args), UserWarning("deprecated"), UserWarning,
                 "/usr/lib/python3/site-packages/torch/nn/modules/module.py", 7)
    assert capsys.readouterr().err == "" and shown[0][1:4] == (UserWarning, "/usr/lib/python3/site-packages/torch/nn/"
                                                                            "modules/module.py", 7)


def test_an_unrecognized_option_is_answered_by_its_command_with_what_was_meant(capsys):
    """Options a command lacks are reported by that command (its usage, ``meshlm train: error:``),
    not by bare ``meshlm``; an option spelling a positional argument (``--config``, as other
    trainers take it) says to give it by position, and a misspelled option names the close ones."""
    import pytest

    with pytest.raises(SystemExit) as exited:
        main(["train", "--config", "configs/tiny.yaml"])
    error = capsys.readouterr().err
    assert exited.value.code == 2
    assert error.startswith("usage: meshlm train ")
    assert ("meshlm train: error: unrecognized arguments: --config. CONFIG.yaml is a positional argument: "
            "give it without --config (meshlm train CONFIG.yaml ...).") in error
    with pytest.raises(SystemExit):
        main(["train", "--config-file=run.yaml"])
    assert "give it without --config-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["checkpoint", "inspect", "runs/x", "--no-verfy"])
    error = capsys.readouterr().err
    assert error.startswith("usage: meshlm checkpoint inspect ")
    assert "meshlm checkpoint inspect: error: unrecognized arguments: --no-verfy. Did you mean --no-verify" in error
    with pytest.raises(SystemExit):
        main(["train", "configs/tiny.yaml", "--fast"])
    assert capsys.readouterr().err.endswith("meshlm train: error: unrecognized arguments: --fast.\n")


def test_a_misspelled_option_is_named_before_the_required_one_it_left_missing(capsys):
    """``meshlm score CKPT --inpt FILE``: argparse alone says ``--input`` is required; the misspelling
    that caused it is the useful sentence. Abbreviations, which argparse takes (or calls ambiguous),
    and words after a bare ``--`` are not reported."""
    import pytest

    from meshlm.cli import build_parser, command_parsers, unknown_long_options

    with pytest.raises(SystemExit) as exited:
        main(["score", "CKPT", "--inpt", "pairs.jsonl"])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "required" not in error
    assert "meshlm score: error: unrecognized arguments: --inpt. Did you mean --input (not --inpt)?" in error
    parsers = command_parsers(build_parser("generate"), ["generate", "CKPT"])
    assert [parser.prog for parser in parsers] == ["meshlm", "meshlm generate"]
    assert unknown_long_options(parsers, ["generate", "CKPT", "--max-new", "3", "--prompt=hi", "--greedy"]) == []
    assert unknown_long_options(parsers, ["generate", "CKPT", "--prompt", "--", "--literal"]) == []
    assert unknown_long_options(parsers, ["generate", "CKPT", "--prompt-fil=x", "--max-new-tokenz=3"]) == [
        "--max-new-tokenz=3"]  # --prompt-fil abbreviates --prompt-file alone
    assert unknown_long_options(parsers, ["generate", "CKPT", "--prompt-"]) == []  # argparse: ambiguous
    with pytest.raises(SystemExit):
        main(["generate", "CKPT", "--prompt-", "x"])
    assert "ambiguous option: --prompt- could match --prompt-file, --prompt-ids" in capsys.readouterr().err
