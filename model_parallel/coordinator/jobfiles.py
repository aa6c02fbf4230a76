"""The seed workflow's per-user state: the job the converter wrote last, and the coordinator's token file.

PipeDream's step 4 is `python test_socket.py` with no arguments, then `python test_parallel_0.py
--rank N --dist_addr IP` on each worker. To keep those command lines, step 3 (the converter) records
the package it wrote, and the coordinator serves that package when it is given none:

    $XDG_CACHE_HOME/model_parallel/last_job.json     (default ~/.cache/model_parallel/)
        {"package": "/abs/path/models/resnet18/gpus=3", "arch": "resnet18", "num_stages": 3, ...}
    $XDG_CACHE_HOME/model_parallel/coordinator.token  (mode 0600, a fresh secret per coordinator start)

Workers on the coordinator's machine (or machines sharing the home directory) read the token file;
others get the token through `$MODEL_PARALLEL_TOKEN` or `--token-file`, never on the command line
(it would show in `ps`). Both files are written atomically (`fileio`); the directory is created 0700.
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any, Optional

from model_parallel import jsonbound
from model_parallel.errors import PlanError
from model_parallel.fileio import atomic_write_json, atomic_write_text

CACHE_ENV = "XDG_CACHE_HOME"
COORDINATOR_ENV = "MODEL_PARALLEL_COORDINATOR"  # HOST:PORT of the coordinator, for workers
DEFAULT_COORDINATOR_PORT = 29600  # the rendezvous store of rank 0 uses another one (--dist_port, 29500)
LAST_JOB = "last_job.json"
# Worker flags a coordinator may set for the workers that ask it for the job (the worker parses them
# with its own argument parser, ahead of its command line, so its own flags win).
SERVED_FLAGS: dict[str, type] = {"batch_size": int, "num_microbatches": int, "steps": int, "schedule": str,
                                 "optimizer": str, "lr": float, "momentum": float, "weight_decay": float, "eps": float,
                                 "seed": int}
TOKEN_FILE = "coordinator.token"


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/model_parallel`, else `~/.cache/model_parallel` (not created here)."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "model_parallel"


def _ensure_cache_dir() -> Path:
    path = cache_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def last_job_path() -> Path:
    return cache_dir() / LAST_JOB


def token_path() -> Path:
    return cache_dir() / TOKEN_FILE


def record_last_job(package: Path, **info: Any) -> Path:
    """Remember `package` (a directory with graph.json + plan.json) as the job `test_socket.py` serves by default."""
    record = {"package": str(Path(package).resolve()), **info, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return atomic_write_json(_ensure_cache_dir() / LAST_JOB, record)


def read_last_job() -> Path:
    """The package the converter wrote last; PlanError saying how to make one when there is none."""
    path = last_job_path()
    fix = ("run step 3 (model_parallel/optimizer/convert_graph_to_model.py ...) first, or give the job: "
           "--package DIR, or --graph G --plan P")
    if not path.is_file():
        raise PlanError(f"no job to serve: {path} does not exist (no package converted yet as this user); {fix}")
    record = jsonbound.load_file(path, error=PlanError, what="last job record", fix=fix)
    package = record.get("package") if isinstance(record, dict) else None
    if not isinstance(package, str) or not package:
        raise PlanError(f"{path}: no \"package\" path in the last job record; {fix}")
    if not (Path(package) / "graph.json").is_file() or not (Path(package) / "plan.json").is_file():
        raise PlanError(f"{path}: the last converted package {package} is gone or lacks graph.json/plan.json; {fix}")
    return Path(package)


def write_fresh_token() -> tuple[bytes, Path]:
    """A new random token, written (mode 0600) where workers on this machine look for it."""
    token = secrets.token_hex(32)
    path = atomic_write_text(_ensure_cache_dir() / TOKEN_FILE, token + "\n")  # mkstemp: created 0600
    os.chmod(path, 0o600)
    return token.encode("utf-8"), path


def default_token_file() -> Optional[str]:
    """The local token file when it exists (a worker's last resort for the token), else None."""
    path = token_path()
    return str(path) if path.is_file() else None


def coordinator_port() -> int:
    """The coordinator's default port: the one `$MODEL_PARALLEL_COORDINATOR` names, else 29600 (one
    variable then tells the coordinator and its workers where to meet)."""
    text = os.environ.get(COORDINATOR_ENV, "")
    port = text.rpartition(":")[2]
    return int(port) if port.isascii() and port.isdigit() and 0 < int(port) < 65536 else DEFAULT_COORDINATOR_PORT


def coordinator_address(flag: Optional[str], dist_addr: Optional[str]) -> Optional[str]:
    """A worker's coordinator: `--coordinator`, else `$MODEL_PARALLEL_COORDINATOR`, else rank 0's host on the
    default port (the seed's master server and rank 0 often share a machine); None when nothing says."""
    if flag:
        return flag
    if os.environ.get(COORDINATOR_ENV):
        return os.environ[COORDINATOR_ENV]
    if dist_addr:
        host = f"[{dist_addr}]" if ":" in dist_addr else dist_addr
        return f"{host}:{DEFAULT_COORDINATOR_PORT}"
    return None
