"""`--single_process` (the oracle run: every stage in this process, nothing written) refuses the flags it would
ignore, instead of exiting 0 with no checkpoint, no metrics and a "resume" from step 0."""
from __future__ import annotations

import pytest

from model_parallel.cli.common import run_cli
from model_parallel.cli.worker import main


@pytest.mark.parametrize("extra, named", [
    (["--checkpoint_dir", "ck", "--checkpoint_every", "1"], "--checkpoint_dir, --checkpoint_every"),
    (["--checkpoint_dir", "ck", "--resume"], "--checkpoint_dir, --resume"),
    (["--metrics", "m.jsonl"], "--metrics"),
])
def test_single_process_refuses_what_it_would_ignore_with_exit_2(tmp_path, monkeypatch, capsys, extra, named):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_cli(main, ["--single_process", "--model", "mlp", "--steps", "1", *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --single_process with {named}: single-process mode (the oracle/check run) does not checkpoint, " \
           f"resume, write metrics or traces; drop {named}, or run the pipeline to have them (torchrun" in err
    assert not list(tmp_path.iterdir())  # refused before anything was written
