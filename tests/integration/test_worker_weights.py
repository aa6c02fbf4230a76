"""`--weights PATH` on the worker command line: a 2-rank run from a safetensors file trains exactly as the
single-process reference initialised from the same file; a missing or malformed path is one line, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO
import torch
from safetensors.torch import save_file

from model_parallel.cli.worker import build_parser, check_inputs
from model_parallel.codegen.naming import state_key
from model_parallel.errors import InitError
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.trainer import single_process_reference
from support.mlp import assert_params_close, reference_params

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
ROOT = REPO
TRAIN = ["--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01", "--timeout", "30"]


def _weights_file(directory: Path) -> tuple[Path, dict]:
    """`--model mlp`'s tensors under another seed (so they differ from the init rule's), as a file."""
    values = {name: tensor.detach().clone().contiguous() for name, tensor in recipe("mlp").model(7).state_dict().items()}
    path = directory / "model.safetensors"
    save_file(values, str(path))
    return path, values


def test_two_ranks_from_a_safetensors_file_match_the_reference(tmp_path: Path) -> None:
    path, values = _weights_file(tmp_path)
    steps = 2
    result = launch_workers(["--model", "mlp", "--weights", str(path), "--steps", str(steps),
                             "--checkpoint_dir", str(tmp_path / "ck"), *TRAIN], 2, timeout=150)
    assert result.ok, result.summary()
    r = recipe("mlp")
    model = r.model(0)
    model.load_state_dict(values)
    single_process_reference(model, r.criterion, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), r.data(8, 0),
                             TrainConfig(batch_size=8, num_microbatches=4), steps)
    want = {state_key(k): v.detach() for k, v in model.named_parameters()}
    got = load_checkpoint(tmp_path / "ck").params()
    assert_params_close(got, want, "--weights run")
    seeded = reference_params(steps)  # the same run from the init rule: the file's values must have been used
    assert any(not torch.allclose(got[k], seeded[k]) for k in seeded)
    # Rank 0's end-of-run table: per rank, the predicted footprint against the measured bytes; what the
    # stage keeps between steps (parameters + SGD momentum) is predicted exactly.
    out = result.output(0)
    assert "memory per stage, predicted vs measured:" in out, out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["0", "0"], ["1", "1"])]
    assert len(rows) == 2, out
    for rank, stage, total, measured, error, static, held, activations, stashed, peak in rows:
        assert float(static) == float(held) > 0 and float(total) > float(static) and float(peak) >= 0
        assert measured == error == stashed == "n/a"  # without --measure_memory


def test_a_missing_or_malformed_weights_path_is_refused(tmp_path: Path) -> None:
    parser = build_parser()
    with pytest.raises(InitError, match=r"--weights .*nowhere: no such file or directory; give a \.safetensors file"):
        check_inputs(parser.parse_args(["--model", "mlp", "--weights", str(tmp_path / "nowhere")]))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(InitError, match=r"bad\.safetensors: not a readable safetensors file"):
        check_inputs(parser.parse_args(["--model", "mlp", "--weights", str(bad)]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InitError, match=r"empty: no \*\.safetensors file"):
        check_inputs(parser.parse_args(["--model", "mlp", "--weights", str(tmp_path / "empty")]))
    # The command line: one line on stderr, exit 2, before joining any world.
    done = subprocess.run([sys.executable, str(ROOT / "test_parallel_0.py"), "--model", "mlp", "--rank", "0",
                           "--world_size", "2", "--weights", str(bad)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "not a readable safetensors file" in done.stderr
    assert "Traceback" not in done.stderr


_CAPPED = """
import resource, sys
import torch
from model_parallel.errors import OutOfMemoryError
from model_parallel.runtime.build.weights import weight_source
size = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize:")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (8 << 20), resource.RLIM_INFINITY))  # 8 MiB to spare, the file is 64
try:
    weight_source(sys.argv[1])
except OutOfMemoryError as error:
    print("OOM", error)
"""


@pytest.mark.slow
def test_a_mapping_the_memory_cap_refuses_is_out_of_memory_not_a_bad_file(tmp_path: Path) -> None:
    # Under RLIMIT_AS the memory-map of a good file failed with ENOMEM and was reported as "not a readable
    # safetensors file ... give the model's .safetensors files": a fix that cannot help.
    save_file({"fc.weight": torch.zeros(16 << 20)}, str(tmp_path / "model.safetensors"))  # 64 MiB
    run = subprocess.run([sys.executable, "-c", _CAPPED, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("OOM "), run.stdout + run.stderr[-2000:]
    assert "memory-mapping the weights file (0.0671 GB) was refused" in run.stdout
    assert "RLIMIT_AS" in run.stdout and "the file is fine" in run.stdout and "not a readable" not in run.stdout
