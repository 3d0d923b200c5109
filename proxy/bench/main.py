"""`pdserve bench-serve`: an OpenAI-API load generator for any server (the pdserve proxy,
vLLM, SGLang, ...): streaming requests on a schedule, latency and throughput per run.

    pdserve bench-serve --base-url http://127.0.0.1:8000 --endpoint chat \\
        --tokenizer ~/.cache/pdserve/models/smollm2-135m-instruct \\
        --rate 0.25 0.5 --num-requests 30 --input-len 256 --output-len 64 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 200 --json out/run.json --plot-dir out/
    (sized for the default model, SmolLM2-135M-Instruct, served on a 2-core CPU)

Each `--rate` value is one run (the same requests, the same seed); a run reports TTFT, TPOT,
ITL and end-to-end latency (mean, p50, p90, p99), request and token throughput, and goodput
(completed requests per second meeting every SLO given, as in DistServe). Output goes to a
table on stdout, `--json FILE` (one rate: FILE; a sweep: one file per rate, same schema,
run.json -> run-rate1.json, run-rate2.json, ...) and `--plot-dir DIR` (cdf-rate<R>.png per
run, latency_vs_rate.png for a sweep).
Exit status: 0, or 1 if a run completed no request (its results are still written), or 2
for bad arguments or when the model list cannot be read.

Modules: `bench_workload` (what is asked), `bench_client` (one request, timed),
`bench_load` (arrivals, concurrency, bounds), `bench_stats` (numbers), `bench_report`
(table, plots).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from common.text.tokenizer import Tokenizer
from proxy.bench.client import RequestResult, send_request
from proxy.bench.load import ARRIVALS, LoadConfig, Progress, run_load
from proxy.bench.report import plot_cdfs, plot_sweep, rate_label, summary_table, sweep_table
from proxy.bench.stats import Slo, samples_ms, summarize
from proxy.bench.workload import (
    ConversationWorkload,
    JsonlWorkload,
    RandomWorkload,
    Session,
    TokenCounter,
    WorkItem,
    request_body,
)

SCHEMA = "pdserve.bench_serve.v1"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DEFAULT_NUM_REQUESTS = 100
MODELS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    endpoint: str
    model: str | None  # None: the first of GET /v1/models
    rates: tuple[float, ...]
    load: LoadConfig  # its rate is replaced per run
    workload: RandomWorkload | JsonlWorkload | ConversationWorkload
    slo: Slo
    request_timeout_s: float = 300.0
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None
    dataset: str | None = None
    seed: int = 0
    json_path: Path | None = None
    plot_dir: Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {list(ENDPOINTS)}")
        if not self.rates:
            raise ValueError("--rate needs at least one value")
        if not self.request_timeout_s > 0:
            raise ValueError("--request-timeout-s must be > 0")
        if isinstance(self.workload, ConversationWorkload) and self.endpoint != "chat":
            raise ValueError("conversations (--turns > 1) need --endpoint chat")
        if isinstance(self.workload, JsonlWorkload) and self.endpoint == "completions":
            if any(item.prompt is None for item in self.workload.items_in_file):
                raise ValueError('the dataset has "messages" lines: use --endpoint chat')

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    def record(self, model: str, rate: float) -> dict[str, Any]:
        """The run's settings as they go into its JSON."""
        w = self.workload
        random_w = w if isinstance(w, RandomWorkload) else None
        talk = w if isinstance(w, ConversationWorkload) else None
        return {
            "base_url": self.base_url,
            "endpoint": self.endpoint,
            "model": model,
            "rate": "inf" if math.isinf(rate) else rate,  # JSON has no infinity
            "arrival": self.load.arrival,
            "max_concurrency": self.load.max_concurrency,
            "num_requests": self.load.num_requests,
            "duration_s": self.load.duration_s,
            "drain_timeout_s": self.load.drain_timeout_s,
            "request_timeout_s": self.request_timeout_s,
            "dataset": self.dataset,
            "input_len": random_w.input_len if random_w else None,
            "output_len": random_w.output_len if random_w else None,
            "range_ratio": random_w.range_ratio if random_w else None,
            "prefix_len": random_w.prefix_len if random_w else None,
            "num_prefixes": random_w.num_prefixes if random_w else None,
            "prefix_zipf": random_w.prefix_zipf if random_w else None,
            "prefix_seed": random_w.prefix_seed if random_w else None,
            "conversation": None
            if talk is None
            else {
                "turns": talk.turns,
                "system_len": talk.system_len,
                "user_len": talk.user_len,
                "output_len": talk.output_len,
                "think_time_s": talk.think_time_s,
            },
            "tokenizer": self.tokenizer,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "extra_body": self.extra_body,
            "seed": self.seed,
        }


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench-serve",
        description=__doc__.split("\n\nModules:")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="without /v1: %(default)s")
    p.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    g = p.add_argument_group("load")
    g.add_argument(
        "--rate",
        type=_rate,
        nargs="+",
        default=[math.inf],
        help="requests/s; several values: one run each (a sweep); inf (default): all at once",
    )
    g.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default="poisson",
        help="gaps between sends: exponential (poisson, default) or 1/rate (fixed)",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"requests per run (default: {DEFAULT_NUM_REQUESTS} unless --duration-s is given)",
    )
    g.add_argument("--duration-s", type=float, default=None, help="stop sending after this")
    g.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="wait this long for the requests in flight at the end, then cancel them "
        "(default: --request-timeout-s)",
    )
    g.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="per request: %(default)s"
    )
    g = p.add_argument_group("requests")
    g.add_argument(
        "--dataset", type=Path, default=None, help='JSONL: {"prompt"|"messages", "max_tokens"?}'
    )
    g.add_argument("--input-len", type=int, default=256, help="random prompt tokens: %(default)s")
    g.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens shared by every random prompt, before its own --input-len (with "
        "--turns: the system prompt's length): %(default)s",
    )
    g.add_argument(
        "--num-prefixes",
        type=int,
        default=1,
        help="random prompts: this many distinct shared prefixes of --prefix-len: 1",
    )
    g.add_argument(
        "--prefix-zipf",
        type=float,
        default=0.0,
        help="the k-th prefix is picked with weight 1/k**Z (0: uniform): 0",
    )
    g.add_argument(
        "--prefix-seed",
        type=int,
        default=None,
        help="seed of the shared prefixes only (default: --seed); a warm-up run with another "
        "--seed and this one sends the same prefixes with other prompts",
    )
    g.add_argument(
        "--turns",
        type=int,
        default=1,
        help="> 1: conversations (--endpoint chat) of this many turns, each sending the whole "
        "history, previous answers included; --num-requests counts conversations: %(default)s",
    )
    g.add_argument(
        "--think-time-s", type=float, default=0.0, help="between a conversation's turns: 0"
    )
    g.add_argument(
        "--output-len", type=int, default=64, help="output tokens (max_tokens): %(default)s"
    )
    g.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- r): 0"
    )
    g.add_argument(
        "--tokenizer", default=None, help="local HF model dir: exact random prompt lengths"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="%(default)s")
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (for servers that refuse the field)",
    )
    g.add_argument(
        "--extra-body", type=_json_object, default={}, help="JSON object merged into each body"
    )
    g.add_argument("--seed", type=int, default=0, help="prompts, lengths, arrivals: %(default)s")
    g = p.add_argument_group("SLOs, for goodput (none given: goodput is null)")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2el-ms", type=float, default=None)
    g = p.add_argument_group("output (a table on stdout, a progress bar on stderr)")
    g.add_argument("--json", type=Path, default=None, help="results file (see above)")
    g.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    num_requests = args.num_requests
    if num_requests is None and args.duration_s is None:
        num_requests = DEFAULT_NUM_REQUESTS
    load = LoadConfig(
        rate=args.rate[0],
        arrival=args.arrival,
        max_concurrency=args.max_concurrency,
        num_requests=num_requests,
        duration_s=args.duration_s,
        drain_timeout_s=args.drain_timeout_s or args.request_timeout_s,
    )
    for rate in args.rate[1:]:
        replace(load, rate=rate)  # each run's bounds are valid
    workload: RandomWorkload | JsonlWorkload | ConversationWorkload
    if args.dataset is not None:
        workload = JsonlWorkload.load(args.dataset, args.output_len)
    else:
        workload = RandomWorkload(
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.prefix_len,
            args.num_prefixes,
            args.prefix_zipf,
            args.prefix_seed,
        )
    if args.turns > 1:
        if args.dataset is not None:
            raise ValueError("--turns and --dataset cannot be combined")
        workload = ConversationWorkload(
            args.prefix_len, args.input_len, args.output_len, args.turns, args.think_time_s,
            args.range_ratio,
        )  # fmt: skip
    return BenchConfig(
        base_url=args.base_url.rstrip("/").removesuffix("/v1"),
        endpoint=args.endpoint,
        model=args.model,
        rates=tuple(args.rate),
        load=load,
        workload=workload,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms),
        request_timeout_s=args.request_timeout_s,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        tokenizer=args.tokenizer,
        dataset=str(args.dataset) if args.dataset else None,
        seed=args.seed,
        json_path=args.json,
        plot_dir=args.plot_dir,
        progress=args.progress,
    )


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
    return {"schema": SCHEMA, "config": cfg.record(model, rate), **summary}, samples_ms(
        outcome.results
    )


def json_paths(path: Path, rates: tuple[float, ...]) -> list[Path]:
    """One rate: `path`; a sweep: `<stem>-rate<R><suffix>` beside it, one per rate."""
    if len(rates) == 1:
        return [path]
    return [path.with_name(f"{path.stem}-rate{rate_label(r)}{path.suffix}") for r in rates]


async def bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(
        total=cfg.request_timeout_s, sock_connect=min(10.0, cfg.request_timeout_s)
    )
    connector = aiohttp.TCPConnector(limit=cfg.load.max_concurrency or 0)
    runs = []
    tokenizer = load_tokenizer(cfg)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = cfg.model or await first_model(session, cfg.base_url)
        paths = json_paths(cfg.json_path, cfg.rates) if cfg.json_path else []
        for i, rate in enumerate(cfg.rates):
            doc, samples = await run_rate(cfg, session, model, rate, tokenizer)
            runs.append(doc)
            print(summary_table(doc, rate), flush=True)
            if paths:
                paths[i].parent.mkdir(parents=True, exist_ok=True)
                paths[i].write_text(json.dumps(doc, indent=2) + "\n")
            if cfg.plot_dir:
                cfg.plot_dir.mkdir(parents=True, exist_ok=True)
                title = f"{cfg.endpoint}, rate {rate_label(rate)} req/s, {model}"
                plot_cdfs(samples, cfg.plot_dir / f"cdf-rate{rate_label(rate)}.png", title)
    if len(runs) > 1:
        print(sweep_table(runs), flush=True)
        if cfg.plot_dir:
            plot_sweep(runs, cfg.plot_dir / "latency_vs_rate.png")
    return runs


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
    return 0 if all(run["completed"] > 0 for run in runs) else 1
