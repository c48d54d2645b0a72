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
