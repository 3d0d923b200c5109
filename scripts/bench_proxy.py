#!/usr/bin/env python3
"""A load test of the proxy alone: how many requests and tokens one proxy core relays, and
the latency the proxy adds. THE NODES ARE STAND-INS that answer instantly
(`proxy.bench.standin`): nothing here measures serving, only the proxy's own cost.

    python scripts/bench_proxy.py [--duration-s S] [--json OUT] [--model M]
        [--streams C] [--output-tokens N] [--rate R] [--proxy-core K] [--proxies P]
        [--kv-streaming {on,off}] [--disagg-mode {always,auto,never}]

The proxy runs as its own process (`pdserve proxy`, the real one, in front of one prefill
and one decode stand-in), pinned to core K when the machine has more than one; this
process runs the client, and a child process of its own the stand-ins
(`proxy.bench.standin_process`: in one event loop with the client, an answer waited behind
the client's reads), on the other cores. Five phases of S seconds:

- throughput: C streams at once, closed loop, N output tokens each: relayed tokens/s;
- requests: C streams at once, closed loop, 2 output tokens each (a prefill call, a decode
  stream, the SSE response): new streaming requests/s;
- latency: R new requests/s, open loop, 16 tokens each, paced 20 ms apart by the decode
  stand-in: the client's TTFT (the proxy's whole added time, plus loopback hops to nodes
  that answer at once) and, per token, the time from the stand-in's write to the client's
  read (what the proxy's relay adds to every token);
- direct: the latency phase with no proxy: the client makes the calls a proxy would make
  (a one-call prefill, a decode stream) to the stand-ins itself: what the nodes and two
  loopback hops cost, so that the latency phase's TTFT less this is what the proxy adds;
- floor: the latency phase through `proxy.bench.null_proxy`, a proxy that only forwards,
  on the same core: what the loopback hops cost here before any proxy does any work.

Each phase reads the proxy's CPU time from /proc, so rates are also given per proxy core
(rate / fraction of a core the proxy used): when the client side is the bottleneck (the
proxy below one core), the per-core figure is what one saturated proxy core would relay.
`--proxies P` starts P proxies in front of the same stand-ins and spreads the clients over
them (each on its own core where there are enough). `--kv-streaming` is the proxy's flag:
on (its default), each prefill is the streamed call (the KV handle's line, then the first
token's), off the one-call prefill. `--disagg-mode` is the proxy's too, but defaults to
`always` here: every prompt takes the disaggregated path (a prefill call, then a decode
stream). Under `auto` the stand-ins' estimates decide, and a prompt the proxy prefills on
the decode stand-in is one call instead of two (a shorter path, not a faster proxy); each
proxy phase reports where its prompts went (`placements`, from the proxies' /metrics).

JSON (`--json OUT`): `requests_per_s`, `tokens_per_s`, `added_ttft_ms_p99` (the headline
numbers: requests phase, throughput phase, latency phase: the client's whole TTFT p99),
their per-core forms, `direct_ttft_ms_p99` and `ttft_over_direct_ms_{p50,p99}` (the latency
phase's quantiles less those with no proxy), `floor_ttft_ms_p99` and
`ttft_over_floor_ms_{p50,p99}` (less the forwarder's), `disagg_mode`, and each phase's
details. Exit status
0, or 1 when a phase completed no request.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # pdserve's packages; up_service

from compare_report import placements_between  # noqa: E402
from up_service import get, histogram_quantile  # noqa: E402

from common.cli.models import model_dir  # noqa: E402
from common.text.tokenizer import Tokenizer  # noqa: E402
from proxy.bench.standin_process import StandInProcess  # noqa: E402

TEXT = (
    " The proxy relays every token of every stream to its client as a server sent event,"
    " and this text is what the stand-in nodes stream back over and over again."
)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=10.0, help="seconds per phase")
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    p.add_argument("--model", default=None, help="the proxy's tokenizer (default model if unset)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams (closed loop)")
    p.add_argument("--output-tokens", type=int, default=256, help="throughput phase")
    p.add_argument("--rate", type=float, default=100.0, help="latency phase, new requests/s")
    p.add_argument("--token-interval-ms", type=float, default=20.0, help="latency phase")
    p.add_argument("--proxy-core", type=int, default=0, help="the first proxy's CPU core")
    p.add_argument("--proxies", type=int, default=1, help="proxies in front of the stand-ins")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument(
        "--proxy-profile", type=Path, default=None, metavar="FILE",
        help="run the (first) proxy under cProfile, stats written to FILE (slows it down)",
    )  # fmt: skip
    p.add_argument(
        "--phases",
        default="throughput,requests,latency,direct,floor",
        help="comma-separated subset",
    )
    p.add_argument(
        "--kv-streaming", choices=("on", "off"), default="on",
        help="the proxy's prefill call: streamed (its default: the KV handle's line, then the "
        "first token's) or one call",
    )  # fmt: skip
    p.add_argument(
        "--disagg-mode", choices=("always", "auto", "never"), default="always",
        help="the proxy's placement policy (here always: every prompt prefill call + decode "
        "stream; auto lets the stand-ins' estimates send some to the decode stand-in)",
    )  # fmt: skip
    return p


# -- the proxy processes ---------------------------------------------------------------------


@dataclass
class ProxyProcess:
    proc: subprocess.Popen[bytes]
    url: str = ""

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process so far (all its threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


async def start_proxy(
    model: str,
    prefill: str,
    decode: str,
    core: int | None,
    profile: Path | None = None,
    timeout_s: float = 120.0,
    kv_streaming: str = "on",
    disagg_mode: str = "always",
) -> ProxyProcess:
    python = [sys.executable]
    if profile is not None:  # cProfile writes it when the proxy exits (SIGTERM: a clean exit)
        python += ["-m", "cProfile", "-o", str(profile.resolve())]
    argv = [
        *python, "-m", "common.cli", "proxy", "--host", "127.0.0.1", "--port", "0",
        "--model", model, "--prefill", prefill, "--decode", decode, "--log-level", "WARNING",
        "--poll-interval-s", "0.5",
        # The stand-ins move no KV either way; streamed, the prefill answers in two lines.
        "--kv-streaming", kv_streaming, "--disagg-mode", disagg_mode,
    ]  # fmt: skip
    return await _start(argv, core, "pdserve proxy ready: ", timeout_s)


async def start_null_proxy(prefill: str, decode: str, core: int | None) -> ProxyProcess:
    """`proxy.bench.null_proxy`: a proxy that only forwards (the latency floor)."""
    argv = [sys.executable, "-m", "proxy.bench.null_proxy", "--prefill", prefill]
    return await _start([*argv, "--decode", decode], core, "null proxy ready: ", 30.0)


async def _start(argv: list[str], core: int | None, ready: str, timeout_s: float) -> ProxyProcess:
    """Start a proxy process (on `core`) and wait for its `ready` line, which ends in its URL."""
    if core is not None:
        argv = ["taskset", "-c", str(core), *argv]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proxy = ProxyProcess(proc)
    assert proc.stdout is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    lines: list[str] = []
    while not proxy.url:
        left = deadline - loop.time()
        line = b""
        if left > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                read = loop.run_in_executor(None, proc.stdout.readline)
                line = await asyncio.wait_for(read, left)
        if not line:
            proxy.stop()
            raise RuntimeError("the proxy did not start:\n" + "".join(lines[-20:]))
        text = line.decode(errors="replace")
        lines.append(text)
        if text.startswith(ready):
            proxy.url = text[len(ready) :].strip()
    # Keep draining its output so that it never blocks on a full pipe.
    loop.run_in_executor(None, _drain, proc)
    return proxy


def _drain(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write("[proxy] " + line.decode(errors="replace"))


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(2)) as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy at {url} did not become healthy")
        await asyncio.sleep(0.1)


# -- the client ------------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    tokens: int = 0
    ttft_s: float | None = None
    # Each text event's arrival (time.monotonic()) and the stream's text length so far, when
    # recorded (the latency phase).
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    record: bool = False
    request_id: str = ""
    error: str = ""


class Connection:
    """One keep-alive HTTP/1.1 connection to a proxy, for one request at a time. A small
    client on asyncio streams rather than aiohttp, so the client side stays cheaper than
    the proxy it loads."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port), limit=2**20)
        return cls(reader, writer)

    def close(self) -> None:
        self.writer.close()

    async def post(self, path: bytes, body: bytes) -> bytes:
        """POST `body` to `path` (a stand-in's node protocol); the answer's head, lowercased."""
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path, len(body), body)
        )
        return (await self.reader.readuntil(b"\r\n\r\n")).lower()

    async def stream(self, body: bytes, out: Outcome, t0: float) -> None:
        """POST `body` to /v1/completions and read its SSE answer into `out`."""
        self.writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        status_line = await self.reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        headers = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        for line in headers.split("\r\n"):
            if line.startswith("x-request-id:"):
                out.request_id = line.split(":", 1)[1].strip()
        if "transfer-encoding: chunked" not in headers:
            length = int(headers.split("content-length:", 1)[1].split("\r\n", 1)[0])
            await self.reader.readexactly(length)
            out.error = f"HTTP {status}"
            return
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            now = time.monotonic()
            if status != 200:
                continue
            for event in data[:-2].split(b"\n\n"):
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    out.ok = out.error == ""
                elif b'"text":"' in event and b'"text":""' not in event:
                    out.ttft_s = now - t0 if out.ttft_s is None else out.ttft_s
                    if out.record:
                        text = json.loads(event[6:])["choices"][0]["text"]
                        chars = len(text) + (out.arrivals[-1][1] if out.arrivals else 0)
                        out.arrivals.append((now, chars))
                elif b'"usage":{' in event:
                    out.tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                elif b'"error"' in event:
                    out.error = "stream error"
        if status != 200:
            out.error = f"HTTP {status}"


class DirectConnection:
    """The client without a proxy: one keep-alive connection to each stand-in, doing on the
    wire what `proxy.bench.null_proxy` does (a one-call prefill, then a decode stream), so
    that its TTFT is what the nodes and two loopback hops cost with no proxy at all."""

    def __init__(self, prefill: Connection, decode: Connection) -> None:
        self.prefill = prefill
        self.decode = decode

    @classmethod
    async def open(cls, prefill_url: str, decode_url: str) -> DirectConnection:
        return cls(await Connection.open(prefill_url), await Connection.open(decode_url))

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    async def stream(self, max_tokens: int, out: Outcome, t0: float) -> None:
        rid = f"direct-{id(self):x}-{time.monotonic_ns()}"
        sampling = {"max_tokens": max_tokens}
        body = json.dumps(
            {"request_id": rid, "prompt_token_ids": [1, 2, 3, 4], "sampling": sampling,
             "lease_s": 30.0}
        ).encode()  # fmt: skip
        head = await self.prefill.post(b"/internal/prefill", body)
        await self.prefill.reader.readexactly(_content_length(head))
        if not head.startswith(b"http/1.1 200"):
            out.error = "prefill HTTP " + head[9:12].decode(errors="replace")
            return
        out.ttft_s = time.monotonic() - t0
        body = json.dumps({"request_id": rid, "sampling": sampling}).encode()
        head = await self.decode.post(b"/internal/decode", body)
        if not head.startswith(b"http/1.1 200") or b"chunked" not in head:
            await self.decode.reader.readexactly(_content_length(head))
            out.error = "decode HTTP " + head[9:12].decode(errors="replace")
            return
        tokens = 1
        while True:
            size = int((await self.decode.reader.readuntil(b"\r\n"))[:-2], 16)
            data = await self.decode.reader.readexactly(size + 2)
            if size == 0:
                break
            tokens += data.count(b"\n") - 1
        out.tokens, out.ok = tokens, True


def _content_length(head: bytes) -> int:
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])


class Pool:
    """Idle connections to one proxy."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.idle: list[Connection] = []

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


async def one_request(
    pool: Pool, model: str, max_tokens: int, timeout_s: float, record: bool = False
) -> Outcome:
    body = json.dumps(
        {
            "model": model,
            "prompt": "Relay this.",
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    out = Outcome(ok=False, record=record)
    t0 = time.monotonic()
    opener = partial(Connection.open, pool.url)
    return await on_idle(pool.idle, opener, lambda c: c.stream(body, out, t0), out, timeout_s)


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


async def on_idle(
    idle: list[C],
    opener: Callable[[], Awaitable[C]],
    call: Callable[[C], Awaitable[None]],
    out: Outcome,
    timeout_s: float,
) -> Outcome:
    """`call` on an idle connection (or a new one from `opener`), given back to `idle` once
    it read a whole answer; on an error or timeout, dropped, and `out` says why."""
    conn: C | None = None
    try:
        conn = idle.pop() if idle else await opener()
        await asyncio.wait_for(call(conn), timeout_s)
        idle.append(conn)
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
        out.ok, out.error = False, out.error or type(e).__name__
        if conn is not None:
            conn.close()
    return out


@dataclass
class PhaseResult:
    name: str
    wall_s: float
    proxy_cpu_s: float
    outcomes: list[Outcome]

    @property
    def done(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def cores(self) -> float:
        return self.proxy_cpu_s / self.wall_s

    def summary(self) -> dict[str, Any]:
        done = self.done
        tokens = sum(o.tokens for o in done)
        errors: dict[str, int] = {}
        for o in self.outcomes:
            if not o.ok:
                errors[o.error or "incomplete"] = errors.get(o.error or "incomplete", 0) + 1
        # Per proxy core: none where no proxy ran (the direct phase).
        per_core = self.cores if self.proxy_cpu_s > 0 else None
        return {
            "wall_s": round(self.wall_s, 3),
            "completed": len(done),
            "failed": len(self.outcomes) - len(done),
            "tokens": tokens,
            "errors": errors,
            "requests_per_s": round(len(done) / self.wall_s, 1),
            "tokens_per_s": round(tokens / self.wall_s, 1),
            "proxy_cores_used": round(self.cores, 3),
            "requests_per_s_per_proxy_core": _per(len(done) / self.wall_s, per_core),
            "tokens_per_s_per_proxy_core": _per(tokens / self.wall_s, per_core),
        }


def _per(rate: float, cores: float | None) -> float | None:
    return None if cores is None else round(rate / cores, 1)


class Bench:
    def __init__(
        self,
        proxies: list[ProxyProcess],
        model: str,
        standins: StandInProcess,
        timeout_s: float,
        pieces: list[str],
    ) -> None:
        # ends[k]: the stream's text length once its k-th token (k from 0) is rendered.
        self.ends = list(itertools.accumulate(len(pieces[k % len(pieces)]) for k in range(4096)))
        self.proxies = proxies
        self.pools = [Pool(p.url) for p in proxies]
        self.model = model
        self.standins = standins
        self.timeout_s = timeout_s
        self._next = 0

    def _pool(self) -> Pool:
        self._next += 1
        return self.pools[self._next % len(self.pools)]

    def close(self) -> None:
        for pool in self.pools:
            pool.close()

    async def _one(self, max_tokens: int, record: bool) -> Outcome:
        return await one_request(self._pool(), self.model, max_tokens, self.timeout_s, record)

    def _cpu(self) -> float:
        return sum(p.cpu_s() for p in self.proxies)

    async def closed_loop(
        self, name: str, streams: int, max_tokens: int, duration_s: float
    ) -> PhaseResult:
        outcomes: list[Outcome] = []
        end = time.monotonic() + duration_s

        async def worker() -> None:
            pool = self._pool()
            while time.monotonic() < end:
                outcomes.append(await one_request(pool, self.model, max_tokens, self.timeout_s))

        cpu0, t0 = self._cpu(), time.monotonic()
        await asyncio.gather(*(worker() for _ in range(streams)))
        return PhaseResult(name, time.monotonic() - t0, self._cpu() - cpu0, outcomes)

    async def open_loop(
        self, rate: float, max_tokens: int, duration_s: float, timed: bool = True
    ) -> tuple[PhaseResult, list[float]]:
        """`rate` requests/s for `duration_s` (a bounded count, evenly spaced); also, when
        `timed`, each token's relay time (stand-in write to client read), seconds."""
        count = max(1, int(rate * duration_s))
        if timed:
            self.standins.record_writes()
        tasks: list[asyncio.Task[Outcome]] = []
        cpu0, t0 = self._cpu(), time.monotonic()
        try:
            for i in range(count):
                delay = t0 + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(self._one(max_tokens, timed)))
            outcomes = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            writes = self.standins.written() if timed else {}
        result = PhaseResult("latency", time.monotonic() - t0, self._cpu() - cpu0, outcomes)
        relay: list[float] = []
        for o in result.done:
            written = writes.get(o.request_id, [])
            for arrived, chars in o.arrivals:
                # The stream's tokens are self.pieces in order (the first from the prefill,
                # then decode line i carries token i + 1); an event may carry several (the
                # proxy merges lines that waited): time its newest one.
                newest = bisect.bisect_right(self.ends, chars) - 1
                if 1 <= newest <= len(written):
                    relay.append(arrived - written[newest - 1])
        return result, relay


class DirectBench(Bench):
    """The open loop with no proxy: the client calls the stand-ins itself."""

    def __init__(self, standins: StandInProcess, timeout_s: float) -> None:
        super().__init__([], "", standins, timeout_s, ["t"])
        self.idle: list[DirectConnection] = []

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    def _cpu(self) -> float:
        return 0.0  # no proxy

    async def _one(self, max_tokens: int, record: bool) -> Outcome:
        out = Outcome(ok=False)
        t0 = time.monotonic()
        opener = partial(DirectConnection.open, self.standins.prefill_url, self.standins.decode_url)
        return await on_idle(
            self.idle, opener, lambda c: c.stream(max_tokens, out, t0), out, self.timeout_s
        )


def quantile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def stream_tokens(tokenizer: Tokenizer) -> list[int]:
    """Token ids that each render to text on their own, so every token is one SSE event."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    usable = [i for i in ids if tokenizer.decode([i]).strip() and tokenizer.decode([i]).isascii()]
    if len(usable) < 8:
        raise RuntimeError("the tokenizer gave too few plain tokens for the stand-ins")
    return usable


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = model_dir(args.model)
    tokenizer = Tokenizer.from_dir(model)
    tokens = stream_tokens(tokenizer)
    cores = _cores()
    pinned = len(cores) > 1
    proxy_cores = [cores[(args.proxy_core + i) % len(cores)] for i in range(args.proxies)]
    client_cores = set(cores) - set(proxy_cores) or set(cores)
    if pinned:
        os.sched_setaffinity(0, client_cores)
    proxies: list[ProxyProcess] = []
    standins: StandInProcess | None = None
    try:
        standins = StandInProcess(tokens)  # on the client's cores (the affinity is inherited)
        for core in proxy_cores:
            pc = core if pinned else None
            profile = args.proxy_profile if not proxies else None
            proxies.append(
                await start_proxy(
                    model,
                    standins.prefill_url,
                    standins.decode_url,
                    pc,
                    profile,
                    kv_streaming=args.kv_streaming,
                    disagg_mode=args.disagg_mode,
                )  # fmt: skip
            )
        timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for proxy in proxies:
                await wait_healthy(session, proxy.url)
            async with session.get(proxies[0].url + "/v1/models") as resp:
                served = (await resp.json())["data"][0]["id"]
        pieces = [tokenizer.decode([t]) for t in tokens]
        bench = Bench(proxies, served, standins, args.request_timeout_s, pieces)
        try:
            await bench.closed_loop("warm-up", 8, 16, min(2.0, args.duration_s))
            return await _phases(args, bench, standins, proxy_cores if pinned else [])
        finally:
            bench.close()
    finally:
        for proxy in proxies:
            proxy.stop()
        if standins is not None:
            standins.stop()
        if pinned:
            os.sched_setaffinity(0, cores)


async def _phases(
    args: argparse.Namespace, bench: Bench, standins: StandInProcess, proxy_cores: list[int]
) -> dict[str, Any]:
    phases = {name.strip() for name in args.phases.split(",") if name.strip()}
    report: dict[str, Any] = {
        "what": "the proxy alone, in front of stand-in nodes that answer instantly",
        "proxies": args.proxies,
        "kv_streaming": args.kv_streaming,
        "disagg_mode": args.disagg_mode,
        "proxy_cores": proxy_cores,
        "duration_s": args.duration_s,
        "phases": {},
    }
    if "throughput" in phases:
        standins.set_token_interval(0.0)
        seen = await _placements(bench)
        r = await bench.closed_loop("throughput", args.streams, args.output_tokens, args.duration_s)
        report["phases"]["throughput"] = {
            "streams": args.streams, "output_tokens": args.output_tokens, **r.summary(),
            "placements": await _placed_since(bench, seen),
        }  # fmt: skip
        report["tokens_per_s"] = r.summary()["tokens_per_s"]
        report["tokens_per_s_per_proxy_core"] = r.summary()["tokens_per_s_per_proxy_core"]
    if "requests" in phases:
        standins.set_token_interval(0.0)
        seen = await _placements(bench)
        r = await bench.closed_loop("requests", args.streams, 2, args.duration_s)
        report["phases"]["requests"] = {
            "streams": args.streams, "output_tokens": 2, **r.summary(),
            "placements": await _placed_since(bench, seen),
        }  # fmt: skip
        report["requests_per_s"] = r.summary()["requests_per_s"]
        report["requests_per_s_per_proxy_core"] = r.summary()["requests_per_s_per_proxy_core"]
    if "latency" in phases:
        standins.set_token_interval(args.token_interval_ms / 1000)
        seen = await _placements(bench)
        r, relay = await bench.open_loop(args.rate, 16, args.duration_s)
        now = await _placements(bench)
        before, after = seen[0], now[0]  # the first proxy's, for its histograms
        placed = _placed_between(seen, now)

        def own_ms(name: str, q: float) -> float | None:
            value, _ = histogram_quantile(before, after, name, q)
            return None if value is None else round(1000 * value, 3)

        report["phases"]["latency"] = {
            "rate": args.rate,
            "token_interval_ms": args.token_interval_ms,
            **r.summary(),
            **_ttft_ms(r),
            "token_relay_ms_p50": quantile_ms(relay, 0.5),
            "token_relay_ms_p99": quantile_ms(relay, 0.99),
            "events_timed": len(relay),
            # The first proxy's own histograms over the phase (interpolated within buckets):
            # received to first token from the prefill node, and a chunk's arrival from the
            # decode node to its event written to the client.
            "proxy_ttft_ms_p50": own_ms("pdserve_proxy_ttft_seconds", 0.5),
            "proxy_ttft_ms_p99": own_ms("pdserve_proxy_ttft_seconds", 0.99),
            "proxy_relay_ms_p50": own_ms("pdserve_proxy_relay_seconds", 0.5),
            "proxy_relay_ms_p99": own_ms("pdserve_proxy_relay_seconds", 0.99),
            "placements": placed,
        }
        report["added_ttft_ms_p99"] = report["phases"]["latency"]["ttft_ms_p99"]
        report["added_token_ms_p99"] = report["phases"]["latency"]["token_relay_ms_p99"]
    if "direct" in phases:
        standins.set_token_interval(args.token_interval_ms / 1000)
        direct = DirectBench(standins, args.request_timeout_s)
        try:
            r, _ = await direct.open_loop(args.rate, 16, args.duration_s, timed=False)
        finally:
            direct.close()
        report["phases"]["direct"] = {
            "what": "the client calling the stand-ins itself, no proxy; same rate",
            "rate": args.rate, **r.summary(), **_ttft_ms(r),
        }  # fmt: skip
        report["direct_ttft_ms_p99"] = report["phases"]["direct"]["ttft_ms_p99"]
        if "latency" in phases:
            # What the proxy adds to a client's TTFT (its hops included): the quantiles'
            # difference with and without it.
            lat, base = report["phases"]["latency"], report["phases"]["direct"]
            for q in ("p50", "p99"):
                a, b = lat[f"ttft_ms_{q}"], base[f"ttft_ms_{q}"]
                report[f"ttft_over_direct_ms_{q}"] = None if None in (a, b) else round(a - b, 3)
    if "floor" in phases:
        report["phases"]["floor"] = await _floor(args, bench, standins, proxy_cores)
        report["floor_ttft_ms_p99"] = report["phases"]["floor"]["ttft_ms_p99"]
        if "latency" in phases:
            # What pdserve's work adds to the hops any proxy costs: the quantiles' difference
            # (two runs of the same open loop, not request by request).
            lat, floor = report["phases"]["latency"], report["phases"]["floor"]
            for q in ("p50", "p99"):
                a, b = lat[f"ttft_ms_{q}"], floor[f"ttft_ms_{q}"]
                over = None if a is None or b is None else round(a - b, 3)
                report[f"ttft_over_floor_ms_{q}"] = over
    return report


async def _placements(bench: Bench) -> list[str]:
    """Each proxy's /metrics text now."""
    return [await asyncio.to_thread(get, p.url + "/metrics") for p in bench.proxies]


async def _placed_since(bench: Bench, before: list[str]) -> dict[str, int]:
    return _placed_between(before, await _placements(bench))


def _placed_between(before: list[str], now: list[str]) -> dict[str, int]:
    """Where the proxies placed the prompts between two scrapes of each ("placement/reason"
    -> count, summed over the proxies): under `always` all remote, reason mode."""
    counts: dict[str, int] = {}
    for text, after in zip(before, now, strict=True):
        for (where, reason), n in placements_between(text, after).items():
            key = f"{where}/{reason}"
            counts[key] = counts.get(key, 0) + n
    return dict(sorted(counts.items()))


async def _floor(
    args: argparse.Namespace, bench: Bench, standins: StandInProcess, proxy_cores: list[int]
) -> dict[str, Any]:
    """The latency phase's open loop against a proxy that only forwards, on the same core:
    what the hops cost before any proxy does any work."""
    standins.set_token_interval(args.token_interval_ms / 1000)
    core = proxy_cores[0] if proxy_cores else None
    null = await start_null_proxy(standins.prefill_url, standins.decode_url, core)
    try:
        # (pieces: the forwarder's events each carry the text "t"; its tokens go untimed)
        floor = Bench([null], bench.model, standins, args.request_timeout_s, ["t"])
        try:
            r, _ = await floor.open_loop(args.rate, 16, args.duration_s, timed=False)
        finally:
            floor.close()
    finally:
        null.stop()
    return {
        "what": "a proxy that only forwards (proxy.bench.null_proxy), same core and rate",
        "rate": args.rate,
        **r.summary(),
        **_ttft_ms(r),
    }


def _ttft_ms(r: PhaseResult) -> dict[str, float | None]:
    ttfts = [o.ttft_s for o in r.done if o.ttft_s is not None]
    return {"ttft_ms_p50": quantile_ms(ttfts, 0.5), "ttft_ms_p99": quantile_ms(ttfts, 0.99)}


def print_report(report: dict[str, Any]) -> None:
    cores = report["proxy_cores"]
    print(f"bench_proxy: {report['what']} ({report['proxies']} proxy, cores {cores})")
    for name, phase in report["phases"].items():
        line = (
            f"  {name:10s} {phase['completed']:6d} done {phase['failed']:4d} failed  "
            f"{phase['requests_per_s']:9.1f} req/s {phase['tokens_per_s']:10.1f} tok/s"
        )
        if phase["requests_per_s_per_proxy_core"] is not None:  # (none without a proxy)
            line += (
                f"  proxy {phase['proxy_cores_used']:.2f} cores -> "
                f"{phase['requests_per_s_per_proxy_core']:9.1f} req/s "
                f"{phase['tokens_per_s_per_proxy_core']:10.1f} tok/s per core"
            )
        print(line)
        if "placements" in phase:
            placed = ", ".join(f"{k} {n}" for k, n in phase["placements"].items()) or "none"
            print(f"  {'':10s} placed ({report['disagg_mode']}): {placed}")
        if name == "floor":
            print(
                f"  {'':10s} TTFT p50 {phase['ttft_ms_p50']} ms p99 {phase['ttft_ms_p99']} ms "
                "(a proxy that only forwards: the hops' own cost here)"
            )
            if "ttft_over_floor_ms_p99" in report:
                print(
                    f"  {'':10s} pdserve's TTFT over the floor: "
                    f"p50 {_signed(report['ttft_over_floor_ms_p50'])} ms, "
                    f"p99 {_signed(report['ttft_over_floor_ms_p99'])} ms"
                )
        if name == "direct":
            print(
                f"  {'':10s} TTFT p50 {phase['ttft_ms_p50']} ms p99 {phase['ttft_ms_p99']} ms "
                "(no proxy: the client calls the stand-ins itself)"
            )
            if "ttft_over_direct_ms_p99" in report:
                print(
                    f"  {'':10s} pdserve's TTFT over no proxy: "
                    f"p50 {_signed(report['ttft_over_direct_ms_p50'])} ms, "
                    f"p99 {_signed(report['ttft_over_direct_ms_p99'])} ms"
                )
        if name == "latency":
            print(
                f"  {'':10s} TTFT p50 {phase['ttft_ms_p50']} ms p99 {phase['ttft_ms_p99']} ms; "
                f"token relay p50 {phase['token_relay_ms_p50']} ms "
                f"p99 {phase['token_relay_ms_p99']} ms ({phase['events_timed']} events)"
            )
            print(
                f"  {'':10s} the proxy's own: TTFT p50 {phase['proxy_ttft_ms_p50']} ms "
                f"p99 {phase['proxy_ttft_ms_p99']} ms; relay p50 {phase['proxy_relay_ms_p50']} ms "
                f"p99 {phase['proxy_relay_ms_p99']} ms"
            )


def _signed(ms: float | None) -> str:
    """A difference in ms, signed; "n/a" where a phase had no first tokens to time."""
    return "n/a" if ms is None else f"{ms:+}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.duration_s <= 0 or args.streams < 1 or args.rate <= 0 or args.proxies < 1:
        print("bench_proxy: --duration-s, --streams, --rate, --proxies must be positive")
        return 2
    report = asyncio.run(run(args))
    print_report(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(p["completed"] > 0 for p in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
