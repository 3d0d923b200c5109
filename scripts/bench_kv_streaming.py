#!/usr/bin/env python3
"""Exposed KV transfer time with and without streaming (issue 15, item 4).

    python scripts/bench_kv_streaming.py [--model M] [--prompt-len 1000] [--requests 8]
        [--max-num-batched-tokens 512] [--kv-backend nixl] [--up-args "..."] [--out DIR]

Starts two `pdserve up` services side by side (1P1D each, prefix caching off so every prompt
moves whole), one with `--kv-streaming off` and one with `--kv-streaming on`, and sends the
same prompts to both, one request at a time, alternating which service goes first (so a
machine whose load drifts treats both alike; an idle service's engines sleep). Each prompt
is `--prompt-len` tokens of the built-in corpus (a different slice each, 4 output tokens);
two warm-up requests each first. Each request's trace is read from its proxy. The *exposed*
transfer time is what a request waits for its KV after its prompt is done: from the prefill
node's "prefill done" row (first token sampled) to the decode node's "transfer done" row (the
last byte landed and, streamed, the first token with it); both rows are wall-clock times of
processes on this machine. Also reported: "prefill done" to the first decode token (what the
client sees as the gap after its first token), and the number of groups a streamed KV moved
in. Writes DIR/report.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # pdserve's packages; up_service

from up_service import UpService, get  # noqa: E402

from common.cli.models import model_dir  # noqa: E402
from common.text.tokenizer import Tokenizer  # noqa: E402
from common.tiny.corpus import CORPUS  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/kv-streaming"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--requests", type=int, default=8, help="measured requests per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-backend", choices=["nixl", "ucxx", "zmq"], default="nixl")
    p.add_argument("--modes", default="off,on", help="the --kv-streaming values, in order")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--up-args", default="", help="more `pdserve up` flags")
    return p


def prompts(tokenizer: Tokenizer, n: int, length: int) -> list[str]:
    """`n` different texts of about `length` tokens each (corpus slices; it wraps)."""
    ids = tokenizer.encode(CORPUS * 8)
    step = max(1, (len(ids) - length) // max(1, n))
    return [tokenizer.decode(ids[i * step : i * step + length]) for i in range(n)]


def complete(url: str, prompt: str) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        usage = json.loads(resp.read())["usage"]
        return resp.headers["X-Request-Id"], int(usage["prompt_tokens"])


def exposed(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds from "prefill done" to "transfer done" and to "first decode token"."""
    at = {r["event"]: r["t"] for r in rows}
    groups = sum(1 for r in rows if r["event"].startswith("kv group"))
    done = at["prefill done"]
    return {
        "exposed_ms": (at["transfer done"] - done) * 1e3,
        "to_first_decode_token_ms": (at["first decode token"] - done) * 1e3,
        "groups": groups + 1 if groups else 1,
    }


def start(args: argparse.Namespace, mode: str) -> UpService:
    up_args = ["--model", args.model, "--kv-backend", args.kv_backend, "--kv-streaming", mode,
               "--no-prefix-caching", "--max-num-batched-tokens",
               str(args.max_num_batched_tokens), *args.up_args.split()]  # fmt: skip
    return UpService(up_args, args.out / f"kv-streaming-{mode}", args.startup_timeout_s)


def measure(up: UpService, text: str) -> dict[str, Any]:
    rid, n_tokens = complete(up.url, text)
    trace = json.loads(get(f"{up.url}/debug/requests/{rid}/trace", headers=up.auth))
    return {"prompt_tokens": n_tokens, **exposed(trace["rows"])}


def summary(mode: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    values = [r["exposed_ms"] for r in rows]
    gaps = [r["to_first_decode_token_ms"] for r in rows]
    return {
        "mode": mode,
        "exposed_ms_p50": statistics.median(values),
        "exposed_ms_mean": statistics.fmean(values),
        "exposed_ms_min": min(values),
        "exposed_ms_max": max(values),
        "to_first_decode_token_ms_p50": statistics.median(gaps),
        "groups_p50": statistics.median(r["groups"] for r in rows),
        "requests": rows,
    }


def run(args: argparse.Namespace, texts: list[str]) -> list[dict[str, Any]]:
    modes = args.modes.split(",")
    services: dict[str, UpService] = {}
    try:
        for mode in modes:
            services[mode] = start(args, mode)
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for i, text in enumerate(texts):
            order = modes if i % 2 == 0 else modes[::-1]
            for mode in order:
                row = measure(services[mode], text)
                if i >= args.warmup:
                    rows[mode].append(row)
                time.sleep(0.2)
    finally:
        for up in services.values():
            up.stop()
    return [summary(m, rows[m]) for m in modes]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.model = model_dir(args.model)
    tokenizer = Tokenizer.from_dir(Path(args.model))
    texts = prompts(tokenizer, args.warmup + args.requests, args.prompt_len)
    results = run(args, texts)
    report = {"config": {k: str(v) for k, v in vars(args).items()}, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"prompt ~{args.prompt_len} tokens, {args.requests} requests per mode, "
          f"max-num-batched-tokens {args.max_num_batched_tokens}, {args.kv_backend}")  # fmt: skip
    print("kv-streaming  exposed p50 ms  mean  min  max  first decode token p50 ms  groups")
    for r in results:
        print(f"{r['mode']:<12}  {r['exposed_ms_p50']:13.1f}  {r['exposed_ms_mean']:.1f}  "
              f"{r['exposed_ms_min']:.1f}  {r['exposed_ms_max']:.1f}  "
              f"{r['to_first_decode_token_ms_p50']:24.1f}  {r['groups_p50']:g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
