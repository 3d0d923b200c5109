"""`pdserve bench-serve`: an OpenAI-API load generator for any server (the pdserve proxy,
vLLM, SGLang, ...): streaming requests on a schedule, latency and throughput per run.

    pdserve bench-serve --base-url http://127.0.0.1:8000 --endpoint chat \\
        --tokenizer ~/.cache/pdserve/models/smollm2-135m-instruct \\
        --rate 0.25 0.5 --num-requests 30 --input-len 256 --output-len 64 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 200 --json out/run.json --plot-dir out/
    (sized for the default model, SmolLM2-135M-Instruct, served on a 2-core CPU)

Each `--rate` value is one run (the same requests, the same seed); a run reports TTFT, TPOT,
ITL and end-to-end latency (mean, p50, p90, p99), request and token throughput, SLO
attainment (share of sent requests meeting every SLO given) and a per-run goodput
(requests per second meeting them). Output goes to a table on stdout, `--json FILE` (one
rate: FILE; a sweep: one file per rate, same schema, run.json -> run-rate1.json,
run-rate2.json, ...) and `--plot-dir DIR` (cdf-rate<R>.png per run, latency_vs_rate.png
for a sweep). `--save-detailed` adds each request's record to the JSON (send time, token
counts, TTFT, every ITL gap), to find which requests and which gaps make a tail.

`--goodput-search --slo-ttft-ms T --slo-tpot-ms P` finds goodput as DistServe defines it:
the highest rate at which at least 90% (--goodput-attainment) of the requests meet both
objectives, by a bounded search over runs of the same requests starting at --rate (see
proxy/bench/search.py). `--json FILE` is then one file: the rate, the attainment curve and
every run behind it; `--plot-dir` adds attainment_vs_rate.png.
Exit status: 0, or 1 if a run (a search: every run) completed no request (results are still
written), or 2 for bad arguments or when the model list cannot be read.

Modules: `config` (flags, settings), `workload` (what is asked), `client` (one request,
timed), `load` (arrivals, concurrency, bounds), `stats` (numbers), `search` (the goodput
search's decisions), `report` (tables, plots).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from common.text.tokenizer import Tokenizer
from proxy.bench.client import RequestResult, send_request
from proxy.bench.config import SCHEMA, BenchConfig, config_from_args, make_parser
from proxy.bench.load import Progress, run_load
from proxy.bench.report import (
    plot_attainment,
    plot_cdfs,
    plot_sweep,
    rate_label,
    search_table,
    summary_table,
    sweep_table,
)
from proxy.bench.search import RateSearch, document
from proxy.bench.stats import detailed, samples_ms, summarize
from proxy.bench.workload import (
    ConversationWorkload,
    JsonlWorkload,
    RandomWorkload,
    Session,
    TokenCounter,
    WorkItem,
    request_body,
)

MODELS_TIMEOUT_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    return make_parser(__doc__.split("\n\nModules:")[0])


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id of GET /v1/models; ValueError when it cannot be had."""
    url = base_url + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as r:
            r.raise_for_status()
            body = await r.json(content_type=None)
        return str(body["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"cannot read the model list at {url} ({e!r}); pass --model") from None


async def reset_prefix_cache(
    session: aiohttp.ClientSession, base_url: str, token: str | None = None
) -> None:
    """Every node behind the proxy forgets its unused cached blocks; ValueError if not."""
    url = base_url + "/admin/reset_prefix_cache"
    try:
        timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        async with session.post(url, timeout=timeout, headers=headers) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise ValueError(f"POST {url}: HTTP {resp.status}: {body[:300]}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ValueError(f"POST {url} failed: {e!r}") from None


def load_tokenizer(cfg: BenchConfig) -> TokenCounter | None:
    if cfg.tokenizer is None or not isinstance(cfg.workload, RandomWorkload):
        return None
    return Tokenizer.from_dir(cfg.tokenizer)


def _items(cfg: BenchConfig, tokenizer: TokenCounter | None) -> Iterator[WorkItem]:
    """The run's requests; every run of a sweep gets the same ones."""
    if isinstance(cfg.workload, JsonlWorkload):
        return cfg.workload.items(cfg.seed)
    assert isinstance(cfg.workload, RandomWorkload)
    return cfg.workload.items(cfg.seed, tokenizer)


async def run_rate(
    cfg: BenchConfig,
    session: aiohttp.ClientSession,
    model: str,
    rate: float,
    tokenizer: TokenCounter | None,
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """One run at `rate`: the JSON document and the raw samples (for the CDF plot)."""
    load = replace(cfg.load, rate=rate)
    if cfg.reset_prefix_cache:
        await reset_prefix_cache(session, cfg.base_url, cfg.admin_token)

    async def send(item: WorkItem, run_start: float) -> RequestResult:
        body = request_body(
            item, cfg.endpoint, model, cfg.temperature, cfg.ignore_eos, cfg.extra_body
        )
        return await send_request(session, cfg.url, body, run_start)

    async def converse(talk: Session, run_start: float) -> list[RequestResult]:
        """The turns of one conversation, in order; it stops at a failed turn."""
        assert isinstance(cfg.workload, ConversationWorkload)
        results: list[RequestResult] = []
        answers: list[str] = []
        for t in range(len(talk.users)):
            if t:
                await asyncio.sleep(cfg.workload.think_time_s)
            results.append(await send(talk.turn(t, answers), run_start))
            if not results[-1].ok:
                break
            answers.append(results[-1].text)
        return results

    progress = Progress(load, f"rate {rate_label(rate)}", enabled=cfg.progress)
    if isinstance(cfg.workload, ConversationWorkload):
        talks = cfg.workload.sessions(cfg.seed, tokenizer)
        outcome = await run_load(load, talks, converse, cfg.seed + 1, progress)
    else:
        outcome = await run_load(load, _items(cfg, tokenizer), send, cfg.seed + 1, progress)
    summary = summarize(outcome.results, outcome.duration_s, cfg.slo)
    if cfg.save_detailed:
        summary["requests"] = detailed(outcome.results)
    doc = {"schema": SCHEMA, "config": cfg.record(model, rate), **summary}
    return doc, samples_ms(outcome.results)


def json_paths(path: Path, rates: tuple[float, ...]) -> list[Path]:
    """One rate: `path`; a sweep: `<stem>-rate<R><suffix>` beside it, one per rate."""
    if len(rates) == 1:
        return [path]
    return [path.with_name(f"{path.stem}-rate{rate_label(r)}{path.suffix}") for r in rates]


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _show_run(
    cfg: BenchConfig, model: str, rate: float, doc: dict[str, Any], samples: dict[str, list[float]]
) -> None:
    """A finished run's table on stdout and, with --plot-dir, its latency CDFs."""
    print(summary_table(doc, rate), flush=True)
    if cfg.plot_dir:
        cfg.plot_dir.mkdir(parents=True, exist_ok=True)
        title = f"{cfg.endpoint}, rate {rate_label(rate)} req/s, {model}"
        plot_cdfs(samples, cfg.plot_dir / f"cdf-rate{rate_label(rate)}.png", title)


async def sweep(
    cfg: BenchConfig, session: aiohttp.ClientSession, model: str, tokenizer: TokenCounter | None
) -> list[dict[str, Any]]:
    """One run per --rate; one JSON file each."""
    runs = []
    paths = json_paths(cfg.json_path, cfg.rates) if cfg.json_path else []
    for i, rate in enumerate(cfg.rates):
        doc, samples = await run_rate(cfg, session, model, rate, tokenizer)
        runs.append(doc)
        _show_run(cfg, model, rate, doc, samples)
        if paths:
            _write_json(paths[i], doc)
    if len(runs) > 1:
        print(sweep_table(runs), flush=True)
        if cfg.plot_dir:
            plot_sweep(runs, cfg.plot_dir / "latency_vs_rate.png")
    return runs


async def goodput_search(
    cfg: BenchConfig, session: aiohttp.ClientSession, model: str, tokenizer: TokenCounter | None
) -> list[dict[str, Any]]:
    """Runs at the rates the search asks for (the same requests each time), then its answer:
    one JSON file with every run, the search table, the attainment plot."""
    assert cfg.search is not None
    search = RateSearch(cfg.search)
    runs = []
    while (rate := search.next_rate()) is not None:
        doc, samples = await run_rate(cfg, session, model, rate, tokenizer)
        runs.append(doc)
        _show_run(cfg, model, rate, doc, samples)
        search.record(rate, doc["slo_attainment"] or 0.0)  # None: nothing was sent
    config = {k: v for k, v in cfg.record(model, cfg.search.start_rate).items() if k != "rate"}
    result = document(search.result(), cfg.search, cfg.slo, config, runs)
    print(search_table(result), flush=True)
    if cfg.json_path:
        _write_json(cfg.json_path, result)
    if cfg.plot_dir:
        if len(runs) > 1:
            plot_sweep(runs, cfg.plot_dir / "latency_vs_rate.png")
        plot_attainment(result, cfg.plot_dir / "attainment_vs_rate.png")
    return runs


async def bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Every run made (a sweep's or a goodput search's), each as its JSON document."""
    timeout = aiohttp.ClientTimeout(
        total=cfg.request_timeout_s, sock_connect=min(10.0, cfg.request_timeout_s)
    )
    connector = aiohttp.TCPConnector(limit=cfg.load.max_concurrency or 0)
    tokenizer = load_tokenizer(cfg)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = cfg.model or await first_model(session, cfg.base_url)
        if cfg.search is not None:
            return await goodput_search(cfg, session, model, tokenizer)
        return await sweep(cfg, session, model, tokenizer)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        runs = asyncio.run(bench(cfg))
    except (ValueError, OSError) as e:
        print(f"pdserve bench-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if cfg.search is not None:  # a search's fast runs may fail wholesale; not all of them
        return 0 if any(run["completed"] > 0 for run in runs) else 1
    return 0 if all(run["completed"] > 0 for run in runs) else 1
