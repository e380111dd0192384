"""Two network namespaces joined by a veth pair: two "hosts" on one machine, each with its
own network stack (``lo`` and one address), for tests that run Ray across hosts for real.

    with netns_pair() as hosts:          # pytest.skip where namespaces cannot be made
        hosts.run("a", ["ray", "start", ...])  # a process on host a (10.231.0.1)

Invariants:
- Names are unique per use (a random suffix): two test runs on one machine (other worktrees'
  suites) never share a namespace or an interface, so both may use the same addresses.
- The veth ends are made inside their namespaces (``ip link add ... netns``), never in the
  machine's own namespace; neither namespace has a route beyond its /24: nothing sent there
  leaves them (no internet).
- On exit, however the block ends, every process in either namespace is SIGKILLed and both
  namespaces are deleted (which deletes the veth pair).
- Only the file system and the process table are shared with the machine (a process in a
  namespace sees every process, as Ray's driver does when it looks for its node's raylet).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from tests.waiting import wait_until

ADDRESSES = {"a": "10.231.0.1", "b": "10.231.0.2"}


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: try)."""
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`): not running as root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on PATH to make network namespaces"
    return None


@dataclass(frozen=True)
class Hosts:
    """The namespace names of hosts ``a`` and ``b`` (``ADDRESSES`` holds their IPs)."""

    names: dict[str, str]

    def cmd(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: ``ip netns exec`` execs it (same pid, no fork)."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def pids(self, host: str) -> list[int]:
        p = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True,
                           text=True, check=False)
        return [int(x) for x in p.stdout.split()]

    def net_id(self, host: str) -> str:
        """What ``readlink /proc/PID/ns/net`` reads for a process on ``host``."""
        return f"net:[{os.stat(f'/run/netns/{self.names[host]}').st_ino}]"

    def kill_all(self, host: str, wait_s: float = 30) -> None:
        """SIGKILL every process on ``host`` (again for any forked meanwhile) until none."""
        def none_left() -> bool:
            for pid in (pids := self.pids(host)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return not pids

        wait_until(none_left, wait_s, f"no process left on {host}", interval=0.1)


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if p.returncode:
        raise OSError(f"`ip {' '.join(args)}` failed: {p.stderr.strip() or p.returncode}")


@contextmanager
def netns_pair() -> Iterator[Hosts]:
    """Hosts ``a`` and ``b`` on one veth pair; ``pytest.skip`` (with the reason) where this
    machine cannot make them: not root, no ``ip``, or ``ip`` refused (EPERM in a container
    without CAP_SYS_ADMIN)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    hosts = Hosts({h: f"vlmbatch-{tag}-{h}" for h in ADDRESSES})
    made: list[str] = []
    try:
        try:
            for name in hosts.names.values():
                _ip("netns", "add", name)
                made.append(name)
            a, b = hosts.names["a"], hosts.names["b"]
            _ip("link", "add", f"vb{tag}a", "netns", a, "type", "veth", "peer", "name",
                f"vb{tag}b", "netns", b)
        except OSError as e:
            pytest.skip(f"cannot make network namespaces here: {e}")
        for h, name in hosts.names.items():
            _ip("-n", name, "addr", "add", f"{ADDRESSES[h]}/24", "dev", f"vb{tag}{h}")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", f"vb{tag}{h}", "up")
        yield hosts
    finally:
        for h, name in hosts.names.items():
            if name in made:
                hosts.kill_all(h)
                subprocess.run(["ip", "netns", "del", name], check=False)
