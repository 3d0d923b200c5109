#!/usr/bin/env python3
"""Chaos under load, across network namespaces (root and iproute2 needed).

    python scripts/chaos.py [--duration-s 60] [--fault-every-s 5] [--concurrency 6]
        [--model tiny] [--seed 0] [--json out.json]

Starts 2 prefill nodes, 2 decode nodes and a proxy, each in its own network namespace on a
private bridge (tests/support/netns.py), with a cluster token. A load generator in a fifth
namespace streams greedy completions (`ignore_eos`, fixed lengths) for --duration-s, while
this script injects a fault every --fault-every-s seconds (jittered): SIGKILL a node and
relaunch it on its address a little later, or cut a node's link for 1-4 s. Then it heals
everything and checks, and exits non-zero unless all hold:

    every request either completed with the offline engine's exact output for its prompt,
    or ended with a clear error (an SSE error event / HTTP error), none hung;
    every node is healthy and back at baseline (all blocks free, no request left);
    no progress-thread step error on any node.

Prints the figures: requests, completed, errors by kind, faults injected by kind, leaked
blocks. Every process it starts is stopped by pid, and the namespaces deleted, on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.bench.client import parse_sse_line  # noqa: E402
from tests.support import procs  # noqa: E402
from tests.support.netns import READY, Host, NetLab, get_json, spawn_in, wait_printed  # noqa: E402

TOKEN = "chaos-cluster-token-0123456789"
PORT, KV_PORT = 8100, 5600
NODES = ("prefill0", "prefill1", "decode0", "decode1")
WORDS = "the fox river moon lamp garden winter violin bread clock rain train".split()


# -- the load generator (runs inside the client namespace) -----------------------------------


async def _load(
    url: str, prompts: list[str], max_tokens: int, concurrency: int, until: float
) -> list[dict]:
    import aiohttp

    results: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=5, sock_read=60)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        text, error = "", None
        try:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    error = f"http {resp.status}: {(await resp.text())[:200]}"
                else:
                    async for raw in resp.content:
                        data = parse_sse_line(raw)
                        if data is None or data == "[DONE]":
                            continue
                        event = json.loads(data)
                        if "error" in event:
                            error = f"stream error: {event['error'].get('message', '')[:200]}"
                            break
                        text += "".join(c.get("text", "") for c in event.get("choices", []))
        except (aiohttp.ClientError, TimeoutError) as e:
            error = f"{type(e).__name__}: {e}"[:200]
        results.append({"i": i, "text": text, "error": error})

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        next_i = 0
        running: set[asyncio.Task[None]] = set()
        while time.time() < until or running:
            while time.time() < until and len(running) < concurrency and next_i < len(prompts):
                task = asyncio.ensure_future(one(session, next_i))
                running.add(task)
                next_i += 1
            if running:
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(0.05)
    return results


def load_worker(args: argparse.Namespace) -> int:
    spec = json.loads(Path(args.load_spec).read_text())
    results = asyncio.run(
        _load(spec["url"], spec["prompts"], spec["max_tokens"], spec["concurrency"], spec["until"])
    )
    Path(spec["out"]).write_text(json.dumps(results))
    return 0


# -- the cluster ------------------------------------------------------------------------------


class Chaos:
    def __init__(self, args: argparse.Namespace, lab: NetLab, logdir: Path) -> None:
        self.args, self.lab, self.logdir = args, lab, logdir
        self.hosts: dict[str, Host] = {n: lab.add(n) for n in (*NODES, "proxy", "client")}
        self.procs: dict[str, procs.Proc] = {}
        self.faults: Counter[str] = Counter()
        self.rng = random.Random(args.seed)

    def url(self, name: str) -> str:
        return f"http://{self.hosts[name].addr}:{PORT}"

    def argv(self, name: str) -> list[str]:
        cli = [sys.executable, "-m", "common.cli"]
        model = ["--model", self.args.model_dir]
        if name == "proxy":
            pools = []
            for role in ("prefill", "decode"):
                urls = ",".join(self.url(n) for n in NODES if n.startswith(role))
                pools += [f"--{role}", urls]
            return [*cli, "proxy", "--host", self.hosts[name].addr, "--port", str(PORT), *model,
                    *pools, "--poll-interval-s", "0.5"]  # fmt: skip
        role = name.rstrip("0123456789")
        return [*cli, "node", "--role", role, "--host", self.hosts[name].addr, "--port", str(PORT),
                "--kv-port", str(KV_PORT), *model, "--num-blocks", "256", "--threads", "1",
                "--kv-wait-timeout", "10"]  # fmt: skip

    def start(self, name: str, wait: bool = True) -> None:
        self.procs[name] = spawn_in(self.hosts[name], name, self.argv(name), self.logdir, TOKEN)
        if wait:
            self.wait_ready(name)

    def wait_ready(self, name: str) -> None:
        wait_printed(self.procs[name], READY["proxy" if name == "proxy" else "node"])

    def state(self, name: str) -> dict[str, Any] | None:
        got = get_json(self.hosts["client"], f"{self.url(name)}/state", TOKEN)
        return got["body"] if got["status"] == 200 else None

    # -- faults ----------------------------------------------------------------------------------

    async def inject(self, until: float) -> None:
        while time.time() < until:
            await asyncio.sleep(self.args.fault_every_s * self.rng.uniform(0.5, 1.5))
            if time.time() >= until:
                return
            victim = self.rng.choice(NODES)
            if self.rng.random() < 0.5:
                self.faults[f"kill {victim.rstrip('01')}"] += 1
                self.procs[victim].send_signal(signal.SIGKILL)
                self.procs[victim].wait(10)
                await asyncio.sleep(self.rng.uniform(0.5, 2.0))
                self.start(victim, wait=False)
                await asyncio.to_thread(self.wait_ready, victim)
            else:
                self.faults[f"link flap {victim.rstrip('01')}"] += 1
                self.lab.partition(victim)
                await asyncio.sleep(self.rng.uniform(1.0, 4.0))
                self.lab.heal(victim)

    def stop(self) -> None:
        procs.stop_all(list(self.procs.values()))


def offline_texts(model_dir: str, prompts: list[str], max_tokens: int) -> list[str]:
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.text.tokenizer import Tokenizer
    from common.wire.sampling_params import SamplingParams

    tok = Tokenizer.from_dir(model_dir)
    engine = LLMEngine(EngineConfig(model=model_dir, num_blocks=512, threads=2))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    done = engine.generate([tok.encode(p) for p in prompts], sp)
    return [tok.decode(c.token_ids) for c in done]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common.cli.models import model_dir

    args.model_dir = model_dir(args.model)
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) for _ in range(2000)]
    logdir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
    why = NetLab.unavailable()
    if why is not None:
        raise SystemExit(f"chaos: network namespaces unavailable: {why}")
    with NetLab() as lab:
        chaos = Chaos(args, lab, logdir)
        try:
            for name in NODES:
                chaos.start(name, wait=False)
            for name in NODES:
                chaos.wait_ready(name)
            chaos.start("proxy")
            until = time.time() + args.duration_s
            spec = logdir / "load.json"
            out = logdir / "results.json"
            load_spec = {
                "url": chaos.url("proxy"),
                "prompts": prompts,
                "max_tokens": args.max_tokens,
                "concurrency": args.concurrency,
                "until": until,
                "out": str(out),
            }
            spec.write_text(json.dumps(load_spec))
            load = procs.spawn(
                "load",
                chaos.hosts["client"].argv(sys.executable, __file__, "--load-spec", str(spec)),
                logdir / "load.log",
            )

            async def faults() -> None:
                await chaos.inject(until)

            asyncio.run(faults())
            for name in NODES:  # heal: every link up, every node running
                lab.heal(name)
                if not chaos.procs[name].alive():
                    chaos.start(name)
            code = load.wait(args.duration_s + 180)
            assert code == 0, load.log_tail()
            results = json.loads(out.read_text())
            deadline = time.monotonic() + 60
            states: dict[str, Any] = {}
            while time.monotonic() < deadline:
                states = {n: chaos.state(n) for n in NODES}
                if all(
                    s
                    and s["blocks"]["free"] == s["blocks"]["total"]
                    and not any(s["requests"].values())
                    for s in states.values()
                ):
                    break
                time.sleep(1.0)
        finally:
            chaos.stop()
    done = [r for r in results if r["error"] is None]
    want = offline_texts(args.model_dir, [prompts[r["i"]] for r in done], args.max_tokens)
    wrong = [r["i"] for r, w in zip(done, want, strict=True) if r["text"] != w]
    errors = Counter(r["error"].split(":")[0] for r in results if r["error"] is not None)
    leaked = {
        n: (s["blocks"]["total"] - s["blocks"]["free"]) if s else None for n, s in states.items()
    }
    step_errors = {n: s["kv_transfer"]["step_errors"] if s else None for n, s in states.items()}
    return {
        "duration_s": args.duration_s,
        "requests": len(results),
        "completed": len(done),
        "completed_but_wrong": wrong,
        "errors": dict(errors),
        "faults": dict(chaos.faults),
        "leaked_blocks": leaked,
        "busy_requests": {n: s["requests"] if s else None for n, s in states.items()},
        "step_errors": step_errors,
        "logs": str(logdir),
    }


def check(report: dict[str, Any]) -> list[str]:
    problems = []
    if report["completed_but_wrong"]:
        problems.append(f"outputs differ from offline: {report['completed_but_wrong'][:10]}")
    if any(v != 0 for v in report["leaked_blocks"].values()):
        problems.append(f"blocks not back: {report['leaked_blocks']}")
    if any(v != 0 for v in report["step_errors"].values()):
        problems.append(f"progress-step errors: {report['step_errors']}")
    if report["requests"] == 0 or report["completed"] == 0:
        problems.append("no request completed")
    hung = {k: v for k, v in report["errors"].items() if "Timeout" in k}
    if hung:
        problems.append(f"requests that hung until the client's timeout: {hung}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--fault-every-s", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--load-spec", default=None, help=argparse.SUPPRESS)  # the load worker
    args = ap.parse_args(argv)
    if args.load_spec:
        return load_worker(args)
    report = run(args)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    problems = check(report)
    for p in problems:
        print(f"chaos: FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
