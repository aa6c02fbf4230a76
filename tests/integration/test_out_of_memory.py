"""A rank that runs out of memory says so in one line: its stage, the bytes it held and the limit
(runtime/observe/memory_probe.out_of_memory); anything else is not mistaken for it."""
from __future__ import annotations

import re
import subprocess
import sys

import torch
from torch import nn

from model_parallel.errors import OutOfMemoryError, PeerError
from model_parallel.runtime.observe.memory_probe import out_of_memory

CPU = torch.device("cpu")


def stage_after_one_step():
    stage = nn.Linear(100, 100)  # 40400 bytes of parameters
    optimizer = torch.optim.Adam(stage.parameters())
    stage(torch.ones(2, 100)).sum().backward()
    optimizer.step()
    return stage, optimizer


def _run_capped(code: str) -> str:
    """`code` in a fresh interpreter (it lowers its own memory limit); what it printed."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_an_allocation_refused_names_the_stage_the_bytes_held_and_the_limit():
    stage, optimizer = stage_after_one_step()
    refused = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 4000000 bytes. Error code 12 (Cannot allocate memory)")
    error = out_of_memory(refused, 3, 1, stage, optimizer, CPU)
    assert isinstance(error, OutOfMemoryError) and isinstance(error, MemoryError)
    text = str(error)
    assert "\n" not in text
    assert text.startswith("rank 3 (stage 1) ran out of memory: its stage held 0.000162 GB (parameters 4.04e-05 GB, "
                           "gradients 4.04e-05 GB, optimizer state 8.08e-05 GB)")
    assert "limit: " in text and "memory_per_worker" in text and "DefaultCPUAllocator" in text
    assert "--offload_optimizer DIR" in text  # Adam's state is held: it can go to disk without another plan
    assert out_of_memory(MemoryError(), 0, 0, stage, optimizer, CPU) is not None
    assert out_of_memory(RuntimeError("shape mismatch"), 0, 0, stage, optimizer, CPU) is None
    quoted = PeerError("rank 1 failed: rank 1 (stage 1) ran out of memory: ...")  # the peer's, not ours
    assert out_of_memory(quoted, 0, 0, stage, optimizer, CPU) is None


def test_a_real_refusal_under_rlimit_data_is_recognised_with_its_limit():
    code = (
        "import resource, torch\n"
        "from model_parallel.runtime.observe.memory_probe import out_of_memory\n"
        "cap = 2 * 1024 ** 3\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))\n"
        "try:\n"
        "    torch.empty(4 * 1024 ** 3, dtype=torch.uint8)\n"
        "except (MemoryError, RuntimeError) as error:\n"
        "    print(out_of_memory(error, 0, None, None, None, torch.device('cpu')))\n"
    )
    printed = _run_capped(code)
    assert "rank 0 (stage None) ran out of memory: its stage held 0 GB" in printed
    assert "offload" not in printed  # no optimizer state held: nothing to offload
    assert "limit: 2.15 GB (RLIMIT_DATA)" in printed
    # memory_per_worker prices the stage only: the advice leaves room for what the process holds besides it (torch).
    held = re.search(r"at most the limit less the ([0-9.]+) GB the process holds besides its stage \(([0-9.]+) GB\)", printed)
    assert held and abs(float(held.group(1)) + float(held.group(2)) - 2.15) < 0.01, printed


def test_no_limit_says_so(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    error = out_of_memory(MemoryError("x"), 1, 0, None, None, CPU)
    assert "limit: none (no RLIMIT_AS/RLIMIT_DATA: the machine's memory)" in str(error)


def test_layers_past_the_process_limit_are_refused_before_allocation():
    # A user's QA: a worker capped by RLIMIT_AS (the brief's way to make a model not fit one worker) died materializing
    # its layers with the allocator's raw RuntimeError and a traceback; the host-memory check let them through.
    code = (
        "import resource, torch\n"
        "from model_parallel.runtime.build.materialize import Initializer, materialize_layers\n"
        "from model_parallel.runtime.observe.memory_probe import status_bytes\n"
        "cap = status_bytes('VmSize') + 1024 ** 3\n"
        "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
        "with torch.device('meta'):\n"
        "    layers = {'big': torch.nn.Linear(1 << 15, 1 << 15), 'small': torch.nn.Linear(4, 4)}\n"  # 4 GiB
        "try:\n"
        "    materialize_layers(layers, ['big', 'small'], Initializer(seed=0))\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    printed = _run_capped(code)
    assert printed.startswith("InitError layers big, small: allocating 2 layer(s) (the largest, big, 4.0 GiB) needs "
                              "4.0 GiB, more than this process may still take"), printed
    assert "of its RLIMIT_AS" in printed and "--memory_per_worker" in printed
