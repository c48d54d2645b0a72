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

    def mismatched(config):
        raise CollectiveMismatch(message)

    monkeypatch.setattr("meshlm.training.trainer.train", mismatched)
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "train.steps=1"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "train.steps=1"]) == 2
    assert capsys.readouterr().err == f"meshlm train: error: {message}\n"
