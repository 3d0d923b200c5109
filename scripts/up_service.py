"""`pdserve up` as the benchmark scripts run it: one service in its own process group,
started on port 0 and found at the URL its ready line names, stopped by pid.

    from up_service import UpService          # scripts/ is on sys.path for `python scripts/x.py`
    with UpService(["--prefill", "2", "--decode", "2"], Path("out/run")) as up:
        ...  # up.url, up.pids, up.auth, up.node_urls("prefill"), up.metrics()
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"^pdserve proxy ready: (\S+)", re.M)
NODE_ROW = re.compile(r"^\s+\S+\s+(http://\S+)\s+\(pid (\d+)", re.M)  # up's node table


def get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return str(resp.read().decode())


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in Prometheus text whose labels include `labels`."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if m and all(
            dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")).get(k) == v
            for k, v in labels.items()
        ):
            total += float(m.group(2))
    return total


def histogram_quantile(
    before: str, after: str, name: str, q: float, **labels: str
) -> tuple[float | None, float]:
    """The q-quantile (linear within a bucket, as Prometheus's histogram_quantile) of the
    observations of histogram `name` (labels including `labels`) made between two scrapes
    of the same process, and their count; (None, 0) if there were none."""

    def buckets(text: str) -> dict[float, float]:
        out: dict[float, float] = {}
        pattern = re.compile(rf"^{re.escape(name)}_bucket\{{([^}}]*)\}} (\S+)$")
        for line in text.splitlines():
            m = pattern.match(line)
            if not m:
                continue
            tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if all(tags.get(k) == v for k, v in labels.items()):
                le = float(tags["le"])
                out[le] = out.get(le, 0.0) + float(m.group(2))
        return out

    b0, b1 = buckets(before), buckets(after)
    cum = sorted((le, b1[le] - b0.get(le, 0.0)) for le in b1)
    total = cum[-1][1] if cum else 0.0
    if total <= 0:
        return None, 0.0
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in cum:
        if count >= rank:
            if le == float("inf"):
                return lower, total  # beyond the last bound: the bound is all we know
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0), total
        lower, below = le, count
    return lower, total


class UpService:
    """`pdserve up --port 0 --log-dir DIR/node-logs *up_args`; its output in DIR/up.log.
    Ready when the proxy's /health says ok; RuntimeError (with the log's tail) if it exits
    or is not ready within `startup_timeout_s`."""

    def __init__(self, up_args: list[str], out: Path, startup_timeout_s: float = 300.0) -> None:
        self.dir = out
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "up.log"
        self.url = ""
        self.pids: dict[str, int] = {}  # node URL -> pid
        argv = [sys.executable, "-m", "common.cli", "up", "--port", "0",
                "--log-dir", str(self.dir / "node-logs"),
                "--startup-timeout-s", str(startup_timeout_s), *up_args]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO, start_new_session=True)  # fmt: skip
        try:
            self._wait_ready(startup_timeout_s + 30)
        except BaseException:
            self.stop()
            raise
        token = (self.dir / "node-logs" / "cluster-token").read_text().strip()
        self.auth = {"Authorization": f"Bearer {token}"}

    def __enter__(self) -> UpService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log_path.read_text(errors="replace")
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not get ready:\n{text[-3000:]}")
            m = READY.search(text)
            if m:
                self.url = m.group(1)
                self.pids = {url: int(pid) for url, pid in NODE_ROW.findall(text)}
                try:
                    if json.loads(get(self.url + "/health")).get("status") == "ok":
                        return
                except OSError:
                    pass
            time.sleep(0.3)

    def node_urls(self, role: str) -> list[str]:
        nodes = json.loads(get(self.url + "/admin/nodes", headers=self.auth))["nodes"]
        return [n["url"] for n in nodes if n["role"] == role]

    def metrics(self, url: str | None = None) -> str:
        """`/metrics` of the proxy (or of the node at `url`)."""
        return get((url or self.url) + "/metrics")

    def stop(self) -> None:
        """SIGTERM (`pdserve up` drains and stops its nodes), SIGKILL after 90 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
