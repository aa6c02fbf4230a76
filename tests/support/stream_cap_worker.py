"""Child of tests/integration/test_checkpoint_stream_cap.py: checkpoint and resume an offloaded AdamW under a cap.

`python stream_cap_worker.py DIR` trains a stack of linear layers one step with its optimizer state offloaded, then
sets RLIMIT_DATA to what the process holds plus MARGIN (a fraction of the state) and, under it: save_shard,
finalize, load_checkpoint, load_into and load_optimizer_state_by_name into a second offloaded optimizer, the way a
checkpoint and a resume do. Exit 0 and "streamed" when all fits and the resumed state equals the saved one bitwise;
exit 3 on MemoryError (the unstreamed code). It also checks the cap bites: the state held whole (as the shard writer
before streaming did) must not fit under it ("control: whole state refused").
"""
from __future__ import annotations

import io
import resource
import sys
from pathlib import Path

import torch

from model_parallel.allocator import keep_freed_memory
from model_parallel.runtime.checkpoint import store as ckpt
from model_parallel.runtime.step.offload import attach, offload_of, step_optimizer

MB = 1 << 20
LAYERS, WIDTH = 8, 2048  # 8 x 16 MB of parameters, 256 MB of AdamW state
MARGIN = 96 * MB  # 3 parameters' state: what a streamed write or resume may hold; the state is 256 MB


def vm_data() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def main(root: Path) -> int:
    keep_freed_memory()  # as a worker does
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    named = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attach(optimizer, root / "offload", 64 * MB)
    model(torch.randn(2, WIDTH)).sum().backward()
    step_optimizer(optimizer)
    for p in model.parameters():
        p.grad = None
    saved = {name: p.detach().clone() for name, p in named.items()}
    resumed = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    again = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    attach(again, root / "offload2", 64 * MB)
    named_again = dict(resumed.named_parameters())
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401 - imported before the cap, as a run has

    cap = vm_data() + MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        ckpt.save_shard(root / "ck", 1, 0, named, {}, ckpt.optimizer_state_by_name(optimizer, named))
        ckpt.finalize(root / "ck", 1, {}, None)
        checkpoint = ckpt.load_checkpoint(root / "ck")
        checkpoint.load_into(resumed)
        ckpt.load_optimizer_state_by_name(again, named_again, checkpoint.optimizer_state(list(named_again)), copy=False)
    except (MemoryError, RuntimeError) as error:  # torch's allocator raises RuntimeError
        print(f"out of memory under the cap: {str(error)[:200]}")
        return 3
    try:  # the control: the whole state at once, as one torch.save payload, must not fit
        whole = {name: dict(entry) for name, entry in ckpt.optimizer_state_by_name(optimizer, named).items()}
        torch.save(whole, io.BytesIO())
        print("control: the whole state fit under the cap")
        return 4
    except (MemoryError, RuntimeError):
        whole = None
        print("control: whole state refused")
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    old = offload_of(optimizer)
    new = offload_of(again)
    assert old is not None and new is not None
    states = dict((id(p), s) for p, s in old.state_of(optimizer))
    ids = {id(q): id(p) for p, q in zip(model.parameters(), resumed.parameters())}
    count = 0
    for q, state in new.state_of(again):
        for key, value in state.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(states[ids[id(q)]][key])):
                print(f"state {key} of a parameter differs after the resume")
                return 5
        count += 1
    if count != LAYERS or any(not torch.equal(saved[n], p) for n, p in named_again.items()):
        print(f"resumed {count} of {LAYERS} parameters' state, or a parameter differs")
        return 5
    print(f"streamed: cap {cap / MB:.0f} MB (VmData + {MARGIN / MB:.0f} MB), state {2 * LAYERS * WIDTH**2 * 4 / MB:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
