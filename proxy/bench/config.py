"""bench-serve's settings: the flags, and the one frozen config they make (checked at
construction; bad input raises ValueError with the flag's name)."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from common.wire.auth import CLUSTER_TOKEN_ENV
from proxy.bench.load import ARRIVALS, LoadConfig
from proxy.bench.search import SearchConfig
from proxy.bench.stats import Slo
from proxy.bench.workload import ConversationWorkload, JsonlWorkload, RandomWorkload

SCHEMA = "pdserve.bench_serve.v1"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DEFAULT_NUM_REQUESTS = 100
DEFAULT_SEARCH_START_RATE = 1.0  # req/s, when --goodput-search is given no --rate
SEARCH_RANGE = 64.0  # default min and max rate of a search: --rate / 64 and --rate * 64


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
    save_detailed: bool = False  # per-request records (TTFT, every ITL gap) in the JSON
    progress: bool = True
    search: SearchConfig | None = None  # --goodput-search: rates holds only its start
    reset_prefix_cache: bool = False  # POST /admin/reset_prefix_cache before each run
    admin_token: str | None = field(default=None, repr=False)  # that call's bearer token

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
        if self.search is not None:
            if self.slo.ttft_ms is None or self.slo.tpot_ms is None:
                raise ValueError("--goodput-search needs --slo-ttft-ms and --slo-tpot-ms")
            if self.slo.e2el_ms is not None:
                raise ValueError(
                    "--goodput-search judges TTFT and TPOT only (DistServe): drop --slo-e2el-ms"
                )
            if self.rates != (self.search.start_rate,):
                raise ValueError("--goodput-search takes one --rate: where the search starts")

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
            "reset_prefix_cache": self.reset_prefix_cache,
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


def make_parser(description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench-serve",
        description=description,
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
        default=None,
        help="requests/s; several values: one run each (a sweep); inf (default): all at once; "
        f"with --goodput-search, where it starts (default {DEFAULT_SEARCH_START_RATE:g})",
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
    g.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="POST /admin/reset_prefix_cache to the proxy before each run, so that every run "
        "(every rate of a sweep or search, which send the same prompts) starts with a cold "
        "prefix cache",
    )
    g.add_argument(
        "--cluster-token-file",
        type=Path,
        default=None,
        help="the cluster token the proxy's /admin endpoints want (`pdserve up` writes it to "
        "<log dir>/cluster-token); default $PDSERVE_CLUSTER_TOKEN",
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
    g = p.add_argument_group("SLOs, for attainment and goodput (none given: both are null)")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2el-ms", type=float, default=None)
    g = p.add_argument_group(
        "goodput search (DistServe): the highest rate with enough requests meeting both "
        "the TTFT and the TPOT SLO"
    )
    g.add_argument(
        "--goodput-search",
        action="store_true",
        help="from --rate, double while runs pass (halve while they fail), then bisect",
    )
    g.add_argument(
        "--goodput-attainment",
        type=float,
        default=0.9,
        help="a run passes when this share of its sent requests meets both SLOs: %(default)s",
    )
    g.add_argument("--max-search-runs", type=int, default=8, help="at most: %(default)s")
    g.add_argument(
        "--search-min-rate",
        type=float,
        default=None,
        help=f"halve no lower (default --rate / {SEARCH_RANGE:g}); failing here: goodput 0",
    )
    g.add_argument(
        "--search-max-rate",
        type=float,
        default=None,
        help=f"double no higher (default --rate * {SEARCH_RANGE:g})",
    )
    g.add_argument(
        "--search-tolerance",
        type=float,
        default=0.1,
        help="stop bisecting when failing / passing rate - 1 <= this: %(default)s",
    )
    g = p.add_argument_group("output (a table on stdout, a progress bar on stderr)")
    g.add_argument("--json", type=Path, default=None, help="results file (see above)")
    g.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="--json also gets a 'requests' list: each request's send time, token counts, "
        "TTFT and every gap between its chunks (ITL), in ms",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def search_from_args(args: argparse.Namespace) -> SearchConfig | None:
    if not args.goodput_search:
        return None
    if args.rate is not None and (len(args.rate) != 1 or math.isinf(args.rate[0])):
        raise ValueError("--goodput-search takes one finite --rate: where the search starts")
    start = args.rate[0] if args.rate is not None else DEFAULT_SEARCH_START_RATE
    return SearchConfig(
        start_rate=start,
        min_rate=args.search_min_rate or start / SEARCH_RANGE,
        max_rate=args.search_max_rate or start * SEARCH_RANGE,
        max_runs=args.max_search_runs,
        tolerance=args.search_tolerance,
        threshold=args.goodput_attainment,
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    search = search_from_args(args)
    if search is not None:
        rates: list[float] = [search.start_rate]
    else:
        rates = args.rate if args.rate is not None else [math.inf]
    num_requests = args.num_requests
    if num_requests is None and args.duration_s is None:
        num_requests = DEFAULT_NUM_REQUESTS
    load = LoadConfig(
        rate=rates[0],
        arrival=args.arrival,
        max_concurrency=args.max_concurrency,
        num_requests=num_requests,
        duration_s=args.duration_s,
        drain_timeout_s=args.drain_timeout_s or args.request_timeout_s,
    )
    for rate in rates[1:]:
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
        rates=tuple(rates),
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
        save_detailed=args.save_detailed,
        progress=args.progress,
        search=search,
        reset_prefix_cache=args.reset_prefix_cache,
        admin_token=_admin_token(args.cluster_token_file),
    )


def _admin_token(path: Path | None) -> str | None:
    if path is None:
        return os.environ.get(CLUSTER_TOKEN_ENV) or None
    try:
        return path.read_text().strip() or None
    except OSError as e:
        raise ValueError(f"--cluster-token-file: cannot read {path}: {e}") from None
