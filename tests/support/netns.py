"""Network namespaces for multi-host tests.

Each host is its own network namespace with one veth link into a hub namespace, where a
bridge joins them on a private /24 that exists only inside the test; nothing is added to
the machine's own namespace. `partition(host)` takes a host's link down on the hub side
(a real partition: packets are dropped, sockets stay open), `heal(host)` brings it back.
Processes run in a host with `host.argv(...)` (`ip netns exec`). Needs root and `ip`;
`NetLab.unavailable()` says why not, for a skip message. `close()` deletes every namespace
(and with them the links), also when a test failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass(frozen=True)
class Host:
    name: str
    ns: str
    addr: str
    hub_link: str  # this host's veth end in the hub namespace

    def argv(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


class NetLab:
    def __init__(self, subnet: str = "10.213.7") -> None:
        self.prefix = f"pdt{os.getpid() % 100000}"
        self.subnet = subnet
        self.hub = f"{self.prefix}-hub"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why network namespaces cannot be used here, or None if they can."""
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is not installed"
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"pdt-probe-{os.getpid()}"
        try:
            _ip("netns", "add", probe)
        except (subprocess.CalledProcessError, OSError) as e:
            return f"cannot create a network namespace: {getattr(e, 'stderr', e)}"
        _ip("netns", "del", probe)
        return None

    def __enter__(self) -> NetLab:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, name: str) -> Host:
        i = len(self.hosts) + 1
        host = Host(name, f"{self.prefix}-{name}", f"{self.subnet}.{i + 1}", f"h{i}")
        self._add_ns(host.ns)
        _ip("link", "add", "v0", "netns", host.ns, "type", "veth", "peer", "name", host.hub_link,
            "netns", self.hub)  # fmt: skip
        _ip("-n", self.hub, "link", "set", host.hub_link, "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "v0")
        _ip("-n", host.ns, "link", "set", "v0", "up")
        self.hosts[name] = host
        return host

    def partition(self, name: str) -> None:
        _ip("-n", self.hub, "link", "set", self.hosts[name].hub_link, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.hub, "link", "set", self.hosts[name].hub_link, "up")

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._made.clear()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
