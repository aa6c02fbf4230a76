"""cli/worker_join.py and runtime/wire/join.py without processes: what --join refuses up front, the flag comparison,
the request slot (one joiner at a time, a withdrawn request never admitted), and the replaced process's hint."""
from __future__ import annotations

import time
from typing import Any

import pytest

from model_parallel.cli import worker
from model_parallel.cli.worker_join import compare_flags, job_flags, join_hint
from model_parallel.errors import ConfigError, ProtocolError
from model_parallel.runtime.wire import join as wire
from support.stores import DictStore

JOIN = ["--model", "mlp", "--join", "127.0.0.1:29500"]


@pytest.mark.parametrize("argv, message", [
    ([], "--join needs --checkpoint_dir"),
    (["--checkpoint_dir", "ck", "--rank", "2"], "a joining worker gets its rank from the job"),
    (["--checkpoint_dir", "ck", "--single_process"], "--join with --jobs or --single_process"),
])
def test_join_refuses_what_it_cannot_do_before_contacting_the_job(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        worker.main([*JOIN, *argv])


def test_a_bad_address_is_refused() -> None:
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        worker.main(["--model", "mlp", "--join", "somehost", "--checkpoint_dir", "ck"])


def flags(*argv: str) -> dict[str, Any]:
    return job_flags(worker.build_parser().parse_args(["--model", "mlp", "--checkpoint_dir", "ck", *argv]))


def test_flags_that_describe_one_process_may_differ_the_job_defining_ones_may_not() -> None:
    job = {"recover": True, "backend": "gloo", "flags": flags("--rank", "0", "--metrics", "a.jsonl", "--num_stages", "2")}
    compare_flags(job, flags("--join", "h:1", "--metrics", "b.jsonl"), "h:1")  # no error
    with pytest.raises(ConfigError, match=r"--batch_size 8 \(job\) vs 16 \(this worker\)"):
        compare_flags(job, flags("--batch_size", "16"), "h:1")
    with pytest.raises(ConfigError, match="runs without --recover"):
        compare_flags({**job, "recover": False}, flags(), "h:1")
    with pytest.raises(ConfigError, match="gloo"):
        compare_flags({**job, "backend": "nccl"}, flags(), "h:1")
    # A coordinator's address may be spelled per host; whether there is one may not differ.
    coordinated = {**job, "flags": flags("--coordinator", "10.0.0.1:7000")}
    compare_flags(coordinated, flags("--coordinator", "coord.local:7000"), "h:1")  # no error
    with pytest.raises(ConfigError, match="the job runs under a coordinator and this worker without one"):
        compare_flags(coordinated, flags(), "h:1")
    with pytest.raises(ConfigError, match="the job runs without a coordinator and this worker with one"):
        compare_flags(job, flags("--coordinator", "10.0.0.1:7000"), "h:1")


def test_the_request_slot_admits_one_joiner_and_never_a_withdrawn_one() -> None:
    store = DictStore()
    assert wire.take_request(store) is None  # idle: one check
    nonce = wire.post_request(store, "10.0.0.5", time.monotonic() + 1)
    with pytest.raises(Exception, match="another worker's join request"):
        wire.post_request(store, "10.0.0.6", time.monotonic() + 0.3)  # the slot is held
    assert wire.wait_admission(store, nonce, time.monotonic()) is None  # gave up: withdrawn
    assert wire.take_request(store) is None  # ... so never admitted
    nonce = wire.post_request(store, "10.0.0.6", time.monotonic() + 1)
    assert wire.take_request(store) == {"address": "10.0.0.6", "nonce": nonce}
    assert wire.take_request(store) is None  # taken once
    admission = wire.Admission(nonce, "10.0.0.6", 3, 2, (0, 2), ("a", "b", "c"), 29500, 0, 29500)
    store.set(wire.ADMIT.format(nonce), admission.to_json())
    assert wire.wait_admission(store, nonce, time.monotonic() + 1) == admission
    wire.free_slot(store)
    wire.post_request(store, "10.0.0.7", time.monotonic() + 1)  # the next one may post


@pytest.mark.parametrize("junk", [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b"[1, 2]", b'"text"'])
def test_junk_in_the_request_slot_is_freed_for_a_real_joiner(junk: bytes) -> None:
    # Any store client can write the slot: deep nesting (RecursionError) and non-UTF-8 bytes used to escape
    # take_request and leave the slot jammed, locking every later joiner out.
    store = DictStore()
    store.data[wire.REQUEST] = junk
    assert wire.take_request(store) is None
    assert store.get(wire.REQUEST) == b""
    wire.post_request(store, "10.0.0.7", time.monotonic() + 1)  # the next one may post


def test_an_admission_must_give_the_joiner_the_next_unused_original_rank() -> None:
    bad = wire.Admission("n", "h", 1, 2, (0, 2), ("a", "b", "c"), 29500, 0, 29500).to_json()
    with pytest.raises(ProtocolError, match="next unused one"):
        wire.Admission.from_json(bad)
    with pytest.raises(ProtocolError, match="malformed"):
        wire.Admission.from_json('{"nonce": 1}')


def test_the_replaced_hint_is_the_job_command_with_join_instead_of_the_world_flags() -> None:
    argv = ["--rank", "1", "--world_size", "3", "--dist_addr", "10.0.0.1", "--dist_port", "29500", "--model", "mlp",
            "--checkpoint_dir", "ck", "--recover", "--resume"]
    hint = join_hint(argv, "10.0.0.1:29500", 1)
    assert hint.endswith("--join 10.0.0.1:29500 --model mlp --checkpoint_dir ck"), hint


@pytest.mark.parametrize("argv0, spec, launcher", [
    ("/venv/bin/model-parallel", None, "model-parallel worker"),
    ("/x/model_parallel/cli/worker.py", "model_parallel.cli.worker", "-m model_parallel.cli.worker"),
])
def test_the_replaced_hint_is_how_this_worker_was_started(monkeypatch, argv0, spec, launcher) -> None:
    # QA: a worker started as `model-parallel worker` was told to come back with `python model-parallel --join ...`
    # (and one started with `python -m model_parallel.cli.worker` with `python worker.py --join ...`): neither runs.
    import importlib.machinery
    import sys

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(sys, "argv", [argv0])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__",
                        importlib.machinery.ModuleSpec(spec, None) if spec else None, raising=False)
    hint = join_hint(["--rank", "1", "--model", "mlp", "--checkpoint_dir", "ck", "--recover"], "10.0.0.1:29500", 1)
    assert f"{launcher} --join 10.0.0.1:29500 --model mlp --checkpoint_dir ck" in hint, hint


def test_a_member_that_cannot_admit_says_how_to_resume_from_the_admission_checkpoint(tmp_path, monkeypatch) -> None:
    # QA: a member killed during an admission (after the stop committed checkpoint 17) ended every other process with
    # exit 3 and no last line naming that checkpoint and the resume command.
    from types import SimpleNamespace

    from model_parallel.cli import worker_join
    from model_parallel.errors import PeerError
    from model_parallel.runtime.wire import recovery

    (tmp_path / "step_17").mkdir()
    (tmp_path / "latest").write_text("step_17\n")

    def no_group(*_args, **_kwargs):
        raise PeerError("rank 0: the process group of generation 1 (original ranks [0, 1, 2]) did not form within 5 s")

    monkeypatch.setattr(recovery, "abandon", lambda *a, **k: True)
    monkeypatch.setattr(recovery, "reform", no_group)
    left = []

    def leave(code, line, hint):
        left.append((code, line, hint))
        raise SystemExit(code)

    lineage = recovery.Lineage(0, 0, (0, 1), ("h", "h"), 29500, 0, 29500, None, None)
    survivor = SimpleNamespace(admitting=wire.Admission("n", "h", 2, 1, (0, 1), ("h", "h"), 29500, 0, 29500),
                               lineage=lineage, options=SimpleNamespace(timeout=5.0), rank=0,
                               health=SimpleNamespace(stop=lambda *a: None), backend="gloo", _leave=leave,
                               args=SimpleNamespace(checkpoint_dir=str(tmp_path)),
                               argv=["--rank", "0", "--model", "mlp", "--checkpoint_dir", str(tmp_path), "--recover"])
    with pytest.raises(SystemExit):
        worker_join.admit(survivor, 0.0, 18)
    [(code, line, hint)] = left
    assert code == 3 and "cannot admit original rank 2" in line, line
    assert hint is not None and f"latest committed checkpoint: {tmp_path / 'step_17'}; resume every rank with:" in hint, hint
    assert hint.endswith("--recover --resume"), hint
