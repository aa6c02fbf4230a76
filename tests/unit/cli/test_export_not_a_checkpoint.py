"""`model-parallel export` on a folder that holds no committed checkpoint says what export needs (a training run's
--checkpoint_dir), not the resume's "start without --resume"; each reader of a checkpoint ends the error with its fix."""
from __future__ import annotations

import pytest

from model_parallel.cli.common import run_cli
from model_parallel.cli.export import main as export_main
from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint.store import load_checkpoint


def test_export_of_a_folder_without_a_checkpoint_says_what_export_needs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(export_main, [str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (f"{tmp_path}: no committed checkpoint (no 'latest' pointer, no step_<N>/manifest.json); export reads a "
            f"training run's --checkpoint_dir (its 'latest' pointer and step_<N>/ folders): give that folder") in err
    assert "--resume" not in err


def test_each_reader_ends_the_error_with_its_own_fix(tmp_path):
    with pytest.raises(CheckpointError, match=r"no committed checkpoint .*; start without --resume$"):
        load_checkpoint(tmp_path, fix="start without --resume")
    with pytest.raises(CheckpointError, match=r"no committed checkpoint .*; give the --checkpoint_dir of a training run"):
        load_checkpoint(tmp_path)
