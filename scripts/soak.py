#!/usr/bin/env python3
"""Soak: many streaming requests, random client disconnects at random moments, then proof
that nothing leaked and nothing was corrupted.

    python scripts/soak.py                         # starts pdserve up --prefill 2 --decode 2
    python scripts/soak.py --requests 500 --concurrency 32 --disconnect-prob 0.4
    python scripts/soak.py --base-url http://127.0.0.1:8000   # an already running proxy

Each request is a greedy streaming completion of a random slice of the built-in corpus with
a random `max_tokens`. With probability `--disconnect-prob` the client drops the connection
after a random delay (so it may be in the edge queue, prefill, the inter-stage queue, a KV
transfer, or decoding), otherwise it reads to the end. At the end the script checks:

- every node the proxy knows (`/admin/nodes`) is back at baseline: all blocks free, no
  request queued, running, held or reserved;
- every completed output equals the offline engine's output for the same prompt;
- the proxy's request counters moved by no errors during the run, and by no more
  cancellations than the disconnects the script induced.

It prints a JSON summary (`--json FILE` writes it too) and exits 0 only if every check holds.
The load is bounded by `--requests`; every HTTP call has a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.tiny.corpus import CORPUS  # noqa: E402
from common.wire.auth import CLUSTER_TOKEN_ENV  # noqa: E402

TIMEOUT = aiohttp.ClientTimeout(total=300, sock_connect=5)
CONTROL = aiohttp.ClientTimeout(total=10)


@dataclass
class Job:
    index: int
    prompt: str
    max_tokens: int
    drop_after_s: float | None  # None: read to the end


@dataclass
class Outcome:
    job: Job
    status: int = 0
    text: str = ""
    finished: bool = False  # [DONE] after a finish_reason
    dropped: bool = False  # the script disconnected before the end
    error: str | None = None


def make_jobs(n: int, seed: int, drop_prob: float, max_tokens: int, max_drop_s: float) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        size = rng.choice([1, 8, 60, 300, 900, 1800])
        start = rng.randrange(0, len(CORPUS) - size)
        drop = rng.uniform(0.0, max_drop_s) if rng.random() < drop_prob else None
        jobs.append(Job(i, CORPUS[start : start + size], rng.randint(1, max_tokens), drop))
    return jobs


async def run_job(session: aiohttp.ClientSession, url: str, model: str, job: Job) -> Outcome:
    out = Outcome(job)
    body = {
        "model": model,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def read() -> None:
        async with session.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = (await resp.text())[:300]
                return
            reason = None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    out.finished = reason is not None and out.error is None
                    return
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"].get("message", "error")
                for choice in event.get("choices", []):
                    out.text += choice.get("text", "")
                    reason = choice.get("finish_reason") or reason

    task = asyncio.ensure_future(read())
    try:
        if job.drop_after_s is None:
            await task
        else:
            done, _ = await asyncio.wait({task}, timeout=job.drop_after_s)
            if not done:
                out.dropped = True
                task.cancel()  # closes the connection: the client went away
            await asyncio.gather(task, return_exceptions=True)
            if done:
                task.result()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_load(url: str, jobs: list[Job], concurrency: int, progress: bool) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models", timeout=CONTROL) as resp:
            model = (await resp.json())["data"][0]["id"]

        async def one(job: Job) -> None:
            async with sem:
                outcomes.append(await run_job(session, url, model, job))
                if progress:
                    print(f"\r{len(outcomes)}/{len(jobs)} requests", end="", file=sys.stderr)

        await asyncio.gather(*(one(j) for j in jobs))
    if progress:
        print(file=sys.stderr)
    return sorted(outcomes, key=lambda o: o.job.index)


async def node_states(url: str) -> dict[str, Any]:
    # `pdserve up` guards /admin/* and the nodes' /state with its cluster token.
    token = os.environ.get(CLUSTER_TOKEN_ENV)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{url}/admin/nodes", timeout=CONTROL) as resp:
            nodes = (await resp.json())["nodes"]
        states = {}
        for node in nodes:
            async with session.get(f"{node['url']}/state", timeout=CONTROL) as resp:
                states[node["url"]] = await resp.json()
        return states


def at_baseline(state: dict[str, Any]) -> bool:
    b, r = state["blocks"], state["requests"]
    return b["free"] == b["total"] and not any(r.values())


async def wait_baseline(url: str, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        states = await node_states(url)
        if all(at_baseline(s) for s in states.values()):
            return True, states
        if time.monotonic() > deadline:
            return False, states
        await asyncio.sleep(0.1)


async def proxy_outcomes(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/metrics", timeout=CONTROL) as resp:
            text = await resp.text()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_proxy_requests_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = counts.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def reference_texts(model_dir: str, outcomes: list[Outcome]) -> dict[int, str]:
    """The offline engine's text for each completed job: all of them in one batch, and any
    that differ from what was served once more on their own (the check is one at a time)."""
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.text.tokenizer import Tokenizer
    from common.wire.sampling_params import SamplingParams

    tokenizer = Tokenizer.from_dir(model_dir)
    engine = LLMEngine(EngineConfig(model=model_dir, num_blocks=2048))

    def generate(batch: list[Outcome]) -> dict[int, str]:
        prompts = [tokenizer.encode(o.job.prompt) for o in batch]
        params = [
            SamplingParams(temperature=0.0, max_tokens=o.job.max_tokens, ignore_eos=True)
            for o in batch
        ]
        done = engine.generate(prompts, params)
        return {
            o.job.index: tokenizer.decode(c.token_ids) for o, c in zip(batch, done, strict=True)
        }

    texts = generate(outcomes)
    for o in outcomes:
        if texts[o.job.index] != o.text:
            texts.update(generate([o]))
    return texts


def start_service(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "common.cli", "up", "--port", str(port)]
    argv += ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    if args.model:
        argv += ["--model", args.model]
    log = open(Path(args.log_dir) / "soak-up.log", "wb")  # noqa: SIM115
    # The service's cluster token: ours, so node_states can read the nodes' /state.
    os.environ.setdefault(CLUSTER_TOKEN_ENV, secrets.token_urlsafe(24))
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited ({proc.returncode}); see {log.name}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    stop_service(proc)
    raise RuntimeError("pdserve up did not get healthy in 300 s")


def stop_service(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running proxy (default: start one)")
    p.add_argument("--model", default=None, help="model dir (default: the built-in model)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect-prob", type=float, default=0.3)
    p.add_argument("--max-drop-s", type=float, default=1.5, help="latest random disconnect")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-timeout-s", type=float, default=10.0)
    p.add_argument("--json", default=None, help="write the summary here too")
    p.add_argument("--log-dir", default=".", help="where the started service logs")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not 0 <= args.disconnect_prob <= 1 or args.requests < 1 or args.concurrency < 1:
        p.error("--disconnect-prob in [0, 1]; --requests and --concurrency >= 1")

    from common.cli.models import model_dir

    model = str(model_dir(args.model))
    args.model = model
    service = None
    url = args.base_url
    if url is None:
        service, url = start_service(args)
    try:
        jobs = make_jobs(
            args.requests, args.seed, args.disconnect_prob, args.max_tokens, args.max_drop_s
        )
        before = asyncio.run(proxy_outcomes(url))  # a proxy may have served others before
        started = time.monotonic()
        outcomes = asyncio.run(
            run_load(url.rstrip("/"), jobs, args.concurrency, not args.no_progress)
        )
        elapsed = time.monotonic() - started
        baseline, states = asyncio.run(wait_baseline(url, args.baseline_timeout_s))
        after = asyncio.run(proxy_outcomes(url))
        counts = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    finally:
        if service is not None:
            stop_service(service)

    completed = [o for o in outcomes if o.finished and not o.dropped]
    dropped = [o for o in outcomes if o.dropped]
    errors = [o for o in outcomes if not o.dropped and not o.finished]
    reference = reference_texts(model, completed)
    mismatched = [o.job.index for o in completed if o.text != reference[o.job.index]]
    server_errors = counts.get("server_error", 0.0) + counts.get("client_error", 0.0)
    checks = {
        "nodes_at_baseline": baseline,
        "outputs_equal_offline": not mismatched,
        "no_failed_requests": not errors,
        "proxy_reports_no_errors": server_errors == 0,
        "cancellations_only_induced": counts.get("cancelled", 0.0) <= len(dropped),
    }
    summary = {
        "requests": len(outcomes),
        "completed": len(completed),
        "disconnected": len(dropped),
        "failed": len(errors),
        "duration_s": round(elapsed, 2),
        "mismatched": mismatched,
        "failures": [{"index": o.job.index, "status": o.status, "error": o.error} for o in errors][
            :10
        ],
        "proxy_outcomes": counts,
        "checks": checks,
        "ok": all(checks.values()),
    }
    if not baseline:
        summary["node_states"] = states
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
