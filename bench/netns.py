"""Test hosts made of Linux network namespaces, for multi-host tests and benchmarks.

`Hosts(n)` creates n namespaces, each with one veth pair whose outer end is
attached to a bridge in the root namespace. Host i gets address 10.<net>.0.<i+2>/24
and the bridge 10.<net>.0.1, so the process that made them (in the root
namespace) reaches every host, and the hosts reach each other through the bridge.
Everything is removed on exit, also after an exception; names carry the creating
process id, and hosts left behind by a killed run are swept by the next one.

Without the right to make namespaces (not root, or no CAP_NET_ADMIN), `Hosts`
falls back to loopback addresses 127.0.<net>.<i+2> in the root namespace and says
so in `fallback_reason`; callers that need real hosts can skip on it.

Names are not resolved inside the hosts (no DNS there: a reverse lookup such as
Python http.server's getfqdn() stalls ~10 s); use the addresses.

Usage:
    with Hosts(2) as hosts:
        proc = hosts[0].popen(["kvstack", "serve", "--host", hosts[0].addr, ...])
        ...
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

PREFIX = "kvh"  # namespace / link names: kvh<pid>n<i>, bridge kvh<pid>br


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Host:
    """One test host: a namespace name (None in the loopback fallback) and its address."""

    name: Optional[str]
    addr: str

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """The command line that runs `cmd` on this host."""
        cmd = [str(c) for c in cmd]
        return ["ip", "netns", "exec", self.name, *cmd] if self.name else cmd

    def popen(self, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.wrap(cmd), **kwargs)

    def run(self, cmd: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(cmd), **kwargs)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Removes namespaces and bridges of earlier runs whose process is gone."""
    names = _ip("netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", "show", check=False).stdout, re.M)
    for name in names + links:
        m = re.match(rf"^{PREFIX}(\d+)(n\d+|br|v\d+)$", name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        if m.group(2).startswith("n") and name in names:
            _ip("netns", "del", name, check=False)
        elif name in links:
            _ip("link", "del", name, check=False)


class Hosts:
    """n test hosts on one bridge; a context manager that removes them on exit."""

    def __init__(self, n: int, net: Optional[int] = None, allow_fallback: bool = True):
        if n < 1 or n > 200:
            raise ValueError(f"Hosts: n must be 1..200, got {n}")
        self.n = n
        self.net = net if net is not None else 100 + os.getpid() % 150
        self.allow_fallback = allow_fallback
        self.hosts: list[Host] = []
        self.fallback_reason: Optional[str] = None
        self._tag = f"{PREFIX}{os.getpid()}"
        self._made_ns: list[str] = []
        self._bridge: Optional[str] = None

    @property
    def bridge_addr(self) -> str:
        """Address of the root namespace on the hosts' network."""
        return f"127.0.{self.net}.1" if self.fallback_reason else f"10.{self.net}.0.1"

    def __enter__(self) -> "Hosts":
        try:
            sweep_stale()
            self._make()
        except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as e:
            self._teardown()
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) and e.stderr else str(e)
            if not self.allow_fallback:
                raise RuntimeError(f"cannot create network namespaces: {detail}") from e
            self.fallback_reason = f"network namespaces unavailable ({detail}); using loopback addresses"
            self.hosts = [Host(None, f"127.0.{self.net}.{i + 2}") for i in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)

    def _make(self) -> None:
        br = f"{self._tag}br"
        _ip("link", "add", br, "type", "bridge")
        self._bridge = br
        _ip("addr", "add", f"10.{self.net}.0.1/24", "dev", br)
        _ip("link", "set", br, "up")
        for i in range(self.n):
            ns = f"{self._tag}n{i}"
            outer, inner = f"{self._tag}v{i}", f"{self._tag}i{i}"
            _ip("netns", "add", ns)
            self._made_ns.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", br)
            _ip("link", "set", outer, "up")
            addr = f"10.{self.net}.0.{i + 2}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", f"10.{self.net}.0.1")
            self.hosts.append(Host(ns, addr))

    def _teardown(self) -> None:
        for ns in self._made_ns:
            _ip("netns", "del", ns, check=False)  # takes its veth end, and so the pair, with it
        self._made_ns.clear()
        if self._bridge:
            _ip("link", "del", self._bridge, check=False)
            self._bridge = None


if __name__ == "__main__":  # a self-check: two hosts ping each other and the root namespace
    import sys

    with Hosts(2) as hs:
        print(hs.fallback_reason or f"hosts: {[h.addr for h in hs]} bridge {hs.bridge_addr}")
        for src, dst in ((hs[0], hs[1].addr), (hs[1], hs.bridge_addr)):
            rc = src.run(["ping", "-c", "1", "-W", "2", dst], capture_output=True).returncode
            print(f"{src.addr} -> {dst}: {'ok' if rc == 0 else 'FAILED'}")
            if rc:
                sys.exit(1)
