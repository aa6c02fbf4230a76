"""An output path that cannot be written is refused before the work, as a one-line error (exit 2), not a traceback
after it: `partition -o` naming a file (or a path under one), `schedule --csv` naming a directory, `profile --profile_directory` under a file."""
from __future__ import annotations

import pytest

from model_parallel.cli import profile as profile_cli
from model_parallel.cli import schedule as schedule_cli
from model_parallel.cli.partition import main as partition_main
from model_parallel.errors import ConfigError


def test_partition_refuses_an_output_directory_that_is_a_file_before_solving(tmp_path, capsys, reference_profiles):
    taken = tmp_path / "taken"
    taken.write_text("mine\n")
    profile = str(reference_profiles / "toy_dag.graph.txt")
    for out, named in ((taken, "exists and is not a directory"), (taken / "sub", f"{taken} is a file")):
        with pytest.raises(ConfigError, match=named):
            partition_main(["-f", profile, "-n", "2", "-o", str(out)])
    assert "Total number of states" not in capsys.readouterr().out  # refused before the solve
    assert taken.read_text() == "mine\n"


def test_partition_without_a_bad_output_writes_its_files(tmp_path, reference_profiles):
    out = tmp_path / "new" / "plan_dir"
    assert partition_main(["-f", str(reference_profiles / "toy_dag.graph.txt"), "-n", "2", "-o", str(out)]) == 0
    assert (out / "plan.json").is_file() and (out / "gpus=2.txt").is_file()


def test_schedule_csv_refuses_a_directory_before_printing(tmp_path, capsys):
    with pytest.raises(ConfigError, match="is a directory; give a file name"):
        schedule_cli.main(["1f1b", "-p", "2", "-m", "2", "--csv", str(tmp_path)])
    assert capsys.readouterr().out == ""
    assert list(tmp_path.iterdir()) == []  # no temporary file left beside it


def test_profile_refuses_a_profile_directory_under_a_file_before_timing(tmp_path, monkeypatch):
    taken = tmp_path / "taken"
    taken.write_text("mine\n")

    def never(*args, **kwargs):
        raise AssertionError("profiled before the output was checked")

    monkeypatch.setattr(profile_cli, "profile_arch", never)
    with pytest.raises(ConfigError, match=f"--profile_directory {taken / 'resnet18'}: {taken} is a file"):
        profile_cli.main(["-a", "resnet18", "-b", "2", "--profile_directory", str(taken)])
