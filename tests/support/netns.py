"""Network namespaces for multi-host tests.

Each host is its own network namespace with one veth link into a hub namespace, where a
bridge joins them on a private /24 that exists only inside the test; nothing is added to
the machine's own namespace. `partition(host)` takes a host's link down on the hub side
(a real partition: packets are dropped, sockets stay open), `heal(host)` brings it back.
Processes run in a host with `host.argv(...)` (`ip netns exec`); `spawn_in`,
`wait_printed` and `get_json` start pdserve processes there and talk to them from a client
host. Needs root and `ip`;
`NetLab.unavailable()` says why not, for a skip message. `close()` deletes every namespace
(and with them the links), also when a test failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.wire.auth import CLUSTER_TOKEN_ENV
from tests.support import procs


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


# -- pdserve processes inside hosts ------------------------------------------------------------

READY = {"proxy": "pdserve proxy ready", "node": "pdserve node ready"}

# GET a URL from inside a host with an optional bearer token: {"status", "body"} on stdout.
_GET = r"""
import json, sys, urllib.error, urllib.request
headers = {"Authorization": "Bearer " + sys.argv[2]} if len(sys.argv) > 2 else {}
request = urllib.request.Request(sys.argv[1], headers=headers)
try:
    with urllib.request.urlopen(request, timeout=10) as r:
        print(json.dumps({"status": r.status, "body": json.loads(r.read())}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": json.loads(e.read())}))
"""


def spawn_in(host: Host, name: str, argv: list[str], log_dir: Path, token: str) -> procs.Proc:
    """`argv` (a pdserve command) run in `host` with the cluster token; its log rewritten."""
    env = procs.child_env(**{CLUSTER_TOKEN_ENV: token})
    return procs.spawn(name, host.argv(*argv), log_dir / f"{name}.log", env=env)


def wait_printed(proc: procs.Proc, marker: str, timeout: float = 120) -> None:
    """Until `proc`'s log holds `marker` (its ready line): it cannot be polled from here."""
    log = proc.log_path
    procs.wait_ready(proc, lambda: marker in log.read_text(errors="replace"), timeout)


def get_json(client: Host, url: str, token: str | None = None) -> dict[str, Any]:
    """GET `url` from inside `client`: {"status": ..., "body": ...}."""
    argv = client.argv(sys.executable, "-c", _GET, url, *([token] if token else []))
    out = procs.run(argv, timeout=60)
    if out.returncode != 0:
        return {"status": None, "body": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])
