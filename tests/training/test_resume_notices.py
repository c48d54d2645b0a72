"""``meshlm train`` prints meshlm's warnings as one-line notices: resuming with a changed
``train.steps`` says so in ``meshlm train: note: ...``, not in a Python ``UserWarning`` with its
source line (meshlm/cli.py)."""

from __future__ import annotations

from meshlm.cli import main


def test_resuming_with_changed_settings_prints_a_one_line_note(corpus_blend, tmp_path, capfd):
    run = ["model.vocab_size=64", "model.hidden_size=32", "model.pattern=*-", "model.num_attention_heads=4",
           "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_every=0",
           "train.save_every=1", "train.progress=false", "train.tensorboard=false", "train.plot=false",
           "train.device=cpu", f"train.run_dir={tmp_path / 'run'}", f"data.blend={corpus_blend}"]
    assert main(["train", *run, "train.steps=1"]) == 0
    capfd.readouterr()
    assert main(["train", *run, "train.steps=2"]) == 0
    err = capfd.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("meshlm train: note: resuming ")]
    assert len(notes) == 1 and "train.steps: checkpoint 1, now 2" in notes[0]
    assert "UserWarning" not in err and "self.checkpoints.load" not in err
