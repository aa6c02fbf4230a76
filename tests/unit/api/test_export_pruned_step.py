"""`export` of a checkpoint directory a running job still prunes (`--checkpoint_every 1 --keep_checkpoints 2`): the
step `latest` named can be deleted while export reads it. Export then reads `latest` again (up to READ_TRIES times)
and says, if the job kept deleting, that a running job prunes that step and how to export instead. The prune is
simulated without timing: the graph reader deletes the step it is asked for and moves `latest` on, as a commit of
the next step and the prune after it would."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from model_parallel.api import export
from model_parallel.cli.common import run_cli
from model_parallel.cli.export import main as export_main
from model_parallel.codegen.naming import state_key_map
from model_parallel.errors import CheckpointError
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.checkpoint import model_files
from model_parallel.runtime.checkpoint import store as ckpt
from model_parallel.runtime.checkpoint.layout import LATEST, step_dir


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _checkpoints(root: Path, steps: range) -> None:
    """Committed steps whose tensors are the model's times the step; `latest` names the first."""
    model = _model()
    graph, _ = trace_model(model, (torch.zeros(2, 4),))
    keys = state_key_map(graph)
    for step in steps:
        params = {keys[k]: v.detach() * step for k, v in model.state_dict().items()}
        ckpt.save_shard(root, step, 0, params, {})
        model_files.write_model_files(step_dir(root, step), graph)
        ckpt.finalize(root, step, {"world_size": 1}, None, expected_ranks=[0])
    (root / LATEST).write_text(f"step_{steps[0]}\n")


def _pruning(monkeypatch, root: Path, prunes: int, midway: bool = False) -> list[int]:
    """The graph reader deletes the step it reads and moves `latest` to the next, `prunes` times (`midway`: only its
    graph.json, as a prune's rmtree that has not reached the manifest yet)."""
    read = model_files.checkpoint_graph
    pruned: list[int] = []

    def prune_then_read(folder):
        if len(pruned) < prunes:
            step = int(Path(folder).name.removeprefix("step_"))
            (root / LATEST).write_text(f"step_{step + 1}\n")
            if midway:
                (Path(folder) / model_files.GRAPH_FILE).unlink()
            else:
                shutil.rmtree(folder)
            pruned.append(step)
        return read(folder)

    monkeypatch.setattr(model_files, "checkpoint_graph", prune_then_read)
    return pruned


@pytest.mark.parametrize("midway", [False, True], ids=["deleted", "being_deleted"])
def test_a_step_pruned_mid_read_is_read_again_from_latest(tmp_path, monkeypatch, midway):
    _checkpoints(tmp_path / "ck", range(1, 6))
    # READ_TRIES is 3: the third read finds its step
    pruned = _pruning(monkeypatch, tmp_path / "ck", prunes=2, midway=midway)
    written = export.export_checkpoint(tmp_path / "ck", None, tmp_path / "out")
    assert pruned == [1, 2]
    state = load_file(written)
    want = {k: v * 3 for k, v in _model().state_dict().items()}  # step 3: the one `latest` named on the last try
    assert state.keys() == want.keys() and all(torch.allclose(state[k], want[k]) for k in want)


def test_a_job_that_keeps_pruning_is_named_with_the_fix(tmp_path, monkeypatch, capsys):
    _checkpoints(tmp_path / "ck", range(1, 9))
    pruned = _pruning(monkeypatch, tmp_path / "ck", prunes=100)
    with pytest.raises(SystemExit) as exit_:
        run_cli(export_main, [str(tmp_path / "ck"), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and pruned == [1, 2, 3]
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert (f"{tmp_path / 'ck' / 'step_3'}: deleted while export read it (3 time(s) in a row, each the step 'latest' "
            "named): a running job prunes its checkpoints (it keeps only its newest --keep_checkpoints); export after "
            "the run ends, or give the run a larger --keep_checkpoints") in err, err
    assert not (tmp_path / "out").exists()


def test_a_step_asked_for_by_number_is_not_replaced(tmp_path, monkeypatch):
    _checkpoints(tmp_path / "ck", range(1, 4))
    _pruning(monkeypatch, tmp_path / "ck", prunes=1)
    with pytest.raises(CheckpointError, match=r"step_1: deleted while export read it \(1 time\(s\)"):
        export.export_checkpoint(tmp_path / "ck", None, tmp_path / "out", step=1)


def test_an_error_in_a_step_that_is_still_there_is_not_retried(tmp_path):
    _checkpoints(tmp_path / "ck", range(1, 3))
    (step_dir(tmp_path / "ck", 1) / model_files.GRAPH_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"records no graph\.json.*pass --graph GRAPH"):
        export.export_checkpoint(tmp_path / "ck", None, tmp_path / "out")


def test_a_step_that_was_never_committed_is_named_with_the_committed_ones(tmp_path):
    # QA: `export CK --step 6` of a run that checkpointed odd steps said "step_6: deleted while export read it (1
    # time(s) in a row, each the step 'latest' named): a running job prunes its checkpoints" of a finished run.
    _checkpoints(tmp_path / "ck", range(1, 4))
    with pytest.raises(CheckpointError, match=r"--step 6: .* holds no committed step 6 \(committed steps: \[1\]\); "
                                              r"give one of them"):
        export.export_checkpoint(tmp_path / "ck", None, tmp_path / "out", step=6)
    assert not (tmp_path / "out").exists()
