#!/usr/bin/env python3
"""The hung-node scenario of issue 16, measured: what a user and an operator see when a
decode node stops (SIGSTOP) for a while and then resumes (SIGCONT).

    python scripts/hang_scenario.py [--model M] [--streams 8] [--max-tokens 400]
        [--stop-s 20] [--new-after-s 3] [--new 4] [--up-args "..."] [--json out.json]

Starts `pdserve up --decode 2` (proxy, 1 prefill node, 2 decode nodes), streams --streams
greedy completions of --max-tokens tokens, stops the decode node running the most of them
once every stream is under way, sends --new more requests --new-after-s seconds later,
resumes the node after --stop-s seconds, waits for every request, then checks that every
node is back at baseline (all blocks free, no request left). Reports, per stream, the
longest silence between two tokens (the acceptance bound is the stall timeout plus one
re-prefill), where the new requests were decoded and how long they took, the proxy's stall
and migration counts by cause, and whether every stream ended complete. Every process is
stopped by pid when the script ends. Exit status 0 if all requests completed, none of the
new ones was decoded on the stopped node and every node was back at baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # pdserve's packages; up_service

import aiohttp  # noqa: E402
from up_service import UpService  # noqa: E402

from proxy.bench.client import parse_sse_line  # noqa: E402

PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain in detail how bread is made, step by step.",
    "Describe a journey across a desert on a camel.",
    "Tell the history of a small mountain village.",
    "Write a letter from a sailor to his family.",
    "Describe a garden through the four seasons.",
    "Tell a story about a clockmaker and a lost key.",
    "Explain how rivers shape the land over time.",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="as for pdserve up")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--stop-s", type=float, default=20.0)
    p.add_argument("--new-after-s", type=float, default=3.0)
    p.add_argument("--new", type=int, default=4)
    p.add_argument("--new-max-tokens", type=int, default=32)
    p.add_argument("--up-args", default="", help="more `pdserve up` flags")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--timeout-s", type=float, default=300.0, help="bound on the whole run")
    return p


class Stream:
    def __init__(self, prompt: str, max_tokens: int) -> None:
        self.prompt, self.max_tokens = prompt, max_tokens
        self.times: list[float] = []  # monotonic arrival of each content event
        self.tokens = 0
        self.request_id = ""
        self.finish: str | None = None
        self.error: str | None = None
        self.sent = 0.0

    async def run(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        body = {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        self.sent = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                self.request_id = resp.headers.get("X-Request-Id", "")
                if resp.status != 200:
                    self.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for raw in resp.content:
                    data = parse_sse_line(raw)
                    if data is None or data == "[DONE]":
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        self.error = str(event["error"].get("message"))
                        continue
                    for choice in event.get("choices", []):
                        if choice.get("text"):
                            self.times.append(time.monotonic())
                            self.tokens += 1
                        if choice.get("finish_reason"):
                            self.finish = choice["finish_reason"]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.error = repr(e)

    def longest_gap(self) -> float:
        stamps = [self.sent, *self.times]
        return max((b - a for a, b in zip(stamps, stamps[1:], strict=False)), default=0.0)


def _at_baseline(state: dict[str, Any]) -> bool:
    """All blocks free (cached ones count as free) and no request left."""
    blocks = state["blocks"]
    return blocks["free"] == blocks["total"] and not any(state["requests"].values())


async def _json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Any:
    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return await r.json(content_type=None)


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("pdserve_proxy_stalls_total", "pdserve_proxy_migrations_total")):
            name, value = line.rsplit(" ", 1)
            if float(value):
                out[name] = float(value)
    return out


async def scenario(up: UpService, args: argparse.Namespace) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=args.timeout_s, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = (await _json(session, f"{up.url}/v1/models", {}))["data"][0]["id"]
        nodes = (await _json(session, f"{up.url}/admin/nodes", up.auth))["nodes"]
        decode = [n["url"] for n in nodes if n["role"] == "decode"]
        streams = [Stream(PROMPTS[i % len(PROMPTS)], args.max_tokens) for i in range(args.streams)]
        tasks = [asyncio.ensure_future(s.run(session, up.url, model)) for s in streams]
        deadline = time.monotonic() + 120
        while not all(s.tokens >= 10 or s.finish or s.error for s in streams):
            if time.monotonic() > deadline:
                raise RuntimeError("streams did not get under way")
            await asyncio.sleep(0.05)
        running = {u: (await _json(session, f"{u}/state", up.auth))["requests"]["running"]
                   for u in decode}  # fmt: skip
        victim = max(decode, key=lambda u: running[u])
        pid = up.pids[victim]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            await asyncio.sleep(args.new_after_s)
            fresh = [Stream(PROMPTS[-1 - i % len(PROMPTS)], args.new_max_tokens)
                     for i in range(args.new)]  # fmt: skip
            fresh_tasks = [asyncio.ensure_future(s.run(session, up.url, model)) for s in fresh]
            await asyncio.sleep(max(0.0, stopped_at + args.stop_s - time.monotonic()))
            done_while_stopped = [s.finish is not None for s in streams + fresh]
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        await asyncio.gather(*tasks, *fresh_tasks)
        placed = []
        for s in fresh:
            trace = await _json(session, f"{up.url}/debug/requests/{s.request_id}/trace", up.auth)
            rows = [r for r in trace.get("rows", []) if r["event"] == "dispatched"]
            placed.append(rows[0]["detail"] if rows else None)
        baseline_s = None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            states = [await _json(session, f"{n['url']}/state", up.auth) for n in nodes]
            if all(_at_baseline(st) for st in states):
                baseline_s = time.monotonic() - t0
                break
            await asyncio.sleep(0.2)
        metrics = await _metrics(session, up.url)
    return {
        "stopped_node": victim,
        "stop_s": round(resumed_at - stopped_at, 2),
        "streams": [
            {
                "chunks": s.tokens,
                "finish": s.finish,
                "error": s.error,
                "longest_silence_s": round(s.longest_gap(), 2),
            }
            for s in streams
        ],  # fmt: skip
        "new_requests": [
            {
                "decoded_on": where,
                "chunks": s.tokens,
                "error": s.error,
                "ttft_s": round(s.times[0] - s.sent, 2) if s.times else None,
                "latency_s": round(s.times[-1] - s.sent, 2) if s.times else None,
            }
            for s, where in zip(fresh, placed, strict=True)
        ],  # fmt: skip
        "finished_while_stopped": sum(done_while_stopped),
        "baseline_after_resume_s": None if baseline_s is None else round(baseline_s, 2),
        "metrics": metrics,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="pdserve-hang-"))
    up = UpService(["--model", args.model, "--decode", "2", *args.up_args.split()], out, 240.0)
    try:
        result = asyncio.run(asyncio.wait_for(scenario(up, args), args.timeout_s))
    finally:
        up.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    complete = all(s["finish"] == "length" and not s["error"] for s in result["streams"])
    complete = complete and all(not r["error"] for r in result["new_requests"])
    avoided = all(r["decoded_on"] != result["stopped_node"] for r in result["new_requests"])
    ok = complete and avoided and result["baseline_after_resume_s"] is not None
    after = result["baseline_after_resume_s"]
    print(
        f"\ncomplete: {complete}; new requests avoided the stopped node: {avoided}; "
        f"baseline after resume: {after} s",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
