"""Separate network hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

    with netns.hosts(3) as net:              # 3 hosts, 10.200.0.1 .. 10.200.0.3 on their eth0
        p = net.spawn(0, [python, "-c", ...], env={...}, log=tmp / "h0.log")
        net.wait_all(timeout=60)             # kills everything left on timeout, raises HostTimeout

Layout (everything lives inside namespaces this module creates, nothing in the root namespace):

    <ns>-h0 [eth0 10.200.0.1] ---veth--- [p0 ┐
    <ns>-h1 [eth0 10.200.0.2] ---veth--- [p1 ├ br0 ]  <ns>-sw (the "switch")
    ...                                      ┘

Names carry this process's pid (`mpt<pid>x<n>-h0`), so concurrent runs never collide and a crashed
run's leftovers are recognised (owner pid dead) and removed by the next run. Teardown always kills
what was spawned, then every process still inside the namespaces, then deletes the namespaces.
Needs root and iproute2 (`apt-get install -y iproute2`); `unavailable_reason()` says why not.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional, Union

SUBNET = "10.200.0"  # private; only ever configured inside namespaces created here
_PREFIX = "mpt"
_NAME_RE = re.compile(rf"^{_PREFIX}(\d+)x\d+-")
_counter = itertools.count()


class HostTimeout(AssertionError):
    """A spawned process did not finish in time (it and its siblings were killed)."""


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable_reason() -> Optional[str]:
    """None when namespaces can be made here, else a sentence saying why (for pytest.skip)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"{_PREFIX}{os.getpid()}x{next(_counter)}-probe"
    try:
        result = _ip("netns", "add", probe, check=False)
        if result.returncode != 0:
            return f"`ip netns add` is not permitted here: {result.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list_namespaces() -> list[str]:
    result = _ip("netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _delete_namespace(name: str) -> None:
    """Kill every process left inside `name` (only ones our tests started live there), then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", name, check=False)


def remove_stale() -> list[str]:
    """Delete namespaces left by earlier runs of this module whose owning process is gone."""
    removed = []
    for name in _list_namespaces():
        match = _NAME_RE.match(name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            _delete_namespace(name)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the shared subnet, and the interface carrying it."""

    index: int
    namespace: str
    address: str
    interface: str = "eth0"

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host."""
        return ["ip", "netns", "exec", self.namespace, *map(str, argv)]

    def env(self) -> dict[str, str]:
        """Environment that makes gloo and torch.distributed use this host's interface."""
        return {"GLOO_SOCKET_IFNAME": self.interface, "TP_SOCKET_IFNAME": self.interface}


@dataclass
class Network:
    """Hosts plus the processes spawned on them (reaped on teardown)."""

    hosts: tuple[Host, ...]
    switch: str
    processes: list[tuple[Host, subprocess.Popen]] = field(default_factory=list)
    _logs: list[IO] = field(default_factory=list)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def spawn(self, index: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              log: Union[str, Path, None] = None, cwd: Union[str, Path, None] = None) -> subprocess.Popen:
        """Start `argv` on host `index` (stdout+stderr to `log` if given, else a pipe)."""
        host = self.hosts[index]
        full_env = {**os.environ, **host.env(), "OMP_NUM_THREADS": "1", **(env or {})}
        out: Union[int, IO] = subprocess.PIPE
        if log is not None:
            handle = open(log, "wb")  # noqa: SIM115 - closed on teardown
            self._logs.append(handle)
            out = handle
        process = subprocess.Popen(host.command(argv), env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                   cwd=cwd, start_new_session=True)
        self.processes.append((host, process))
        return process

    def run(self, index: int, argv: Sequence[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
        """Run a short command on host `index` and return its result."""
        return subprocess.run(self.hosts[index].command(argv), capture_output=True, text=True, timeout=timeout)

    def wait_all(self, timeout: float) -> list[int]:
        """Wait for every spawned process; on timeout kill them all and raise `HostTimeout`."""
        deadline = time.monotonic() + timeout
        codes = []
        for host, process in self.processes:
            try:
                codes.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise HostTimeout(f"process on {host.namespace} ({host.address}) still running after {timeout:.0f} s; killed") from None
        return codes

    def kill_all(self) -> None:
        for _, process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for _, process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self.kill_all()
        for handle in self._logs:
            handle.close()
        for host in self.hosts:
            _delete_namespace(host.namespace)
        _delete_namespace(self.switch)


@contextmanager
def hosts(count: int, rate_mbit: Optional[float] = None) -> Iterator[Network]:
    """`count` hosts on one subnet; optional `rate_mbit` limits each host's egress (tc tbf)."""
    if not 1 <= count <= 250:
        raise ValueError(f"count must be 1..250, got {count}")
    remove_stale()
    prefix = f"{_PREFIX}{os.getpid()}x{next(_counter)}"
    switch = f"{prefix}-sw"
    network = Network(hosts=tuple(Host(i, f"{prefix}-h{i}", f"{SUBNET}.{i + 1}") for i in range(count)), switch=switch)
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in network.hosts:
            _ip("netns", "add", host.namespace)
            # Create the pair directly inside the two namespaces: no name ever exists in the root namespace.
            _ip("link", "add", host.interface, "netns", host.namespace, "type", "veth",
                "peer", "name", f"p{host.index}", "netns", switch)
            _ip("-n", switch, "link", "set", f"p{host.index}", "master", "br0")
            _ip("-n", switch, "link", "set", f"p{host.index}", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            if rate_mbit:
                subprocess.run(host.command(["tc", "qdisc", "add", "dev", host.interface, "root", "tbf",
                                             "rate", f"{rate_mbit}mbit", "burst", "32kbit", "latency", "400ms"]),
                               check=True, capture_output=True, timeout=10)
        yield network
    finally:
        network.close()
