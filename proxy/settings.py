"""The proxy's one frozen settings record, and the `pdserve proxy` flags that fill it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from proxy.node_state import Role

Mode = Literal["disagg", "colocated"]


@dataclass(frozen=True)
class NodeTimeouts:
    """Seconds allowed per call kind."""

    connect_s: float = 3.0
    control_s: float = 5.0  # /health, /state, extend, cancel
    prefill_s: float = 120.0  # a whole prefill call: the node's queue plus compute
    first_byte_s: float = 60.0  # a token stream's headers (decode: reservation, maybe KV wait)
    read_line_s: float = 60.0  # between two lines of a token stream (the KV transfer included)
    cancel_grace_s: float = 2.0  # close(): how long pending cancels may still run

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"NodeTimeouts.{name} must be positive, got {value}")


@dataclass(frozen=True)
class ProxySettings:
    model: str  # local HF model directory: tokenizer, chat template, context length
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model directory's name
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    mode: Mode = "disagg"  # colocated: route whole requests to `both` nodes
    lease_s: float = 30.0
    max_active_requests: int = 512  # edge: requests inside the backend at once
    edge_queue_capacity: int = 1024  # edge: requests waiting for a slot; beyond: 503
    migrate_limit: int = 1  # times a stream may move to another decode node after a failure
    trace_capacity: int = 2048  # recent requests whose traces GET /debug/requests/{id}/trace has
    interstage_capacity: int = 256
    interstage_max_wait_s: float = 300.0
    poll_interval_s: float = 0.5
    timeouts: NodeTimeouts = field(default_factory=NodeTimeouts)
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "colocated"):
            raise ValueError(f"mode must be disagg or colocated, got {self.mode!r}")
        if self.colocated_mode and (self.prefill or self.decode):
            raise ValueError("--prefill/--decode cannot be combined with colocated nodes")
        if not self.colocated_mode and self.colocated:
            raise ValueError("--colocated nodes need --mode colocated")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")

    @property
    def colocated_mode(self) -> bool:
        return self.mode == "colocated"

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def node_urls(self) -> dict[Role, tuple[str, ...]]:
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode, Role.BOTH: self.colocated}


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="local HF model dir (default: built-in model)")
    p.add_argument("--served-model-name", default=None, help="the API's model name")
    p.add_argument("--max-model-len", type=int, default=None, help="context length to enforce")
    nodes = p.add_argument_group("nodes (URL[,URL]; repeatable; more via POST /admin/nodes)")
    nodes.add_argument("--prefill", action="append", default=[], metavar="URL[,URL]")
    nodes.add_argument("--decode", action="append", default=[], metavar="URL[,URL]")
    nodes.add_argument("--colocated", action="append", default=[], metavar="URL[,URL]")
    nodes.add_argument(
        "--mode",
        choices=["disagg", "colocated"],
        default=None,
        help="default: colocated if --colocated is given, else disagg",
    )
    q = p.add_argument_group("routing and queues")
    q.add_argument("--lease-s", type=float, default=30.0, help="prefill KV lease, extended")
    q.add_argument(
        "--max-active-requests", type=int, default=512, help="requests past the edge queue"
    )
    q.add_argument(
        "--edge-queue-capacity", type=int, default=1024, help="waiting requests; beyond: 503"
    )
    q.add_argument(
        "--migrate-limit",
        type=int,
        default=1,
        help="times a stream may be re-prefilled onto another decode node after a node failure",
    )
    q.add_argument("--interstage-capacity", type=int, default=256)
    p.add_argument("--trace-capacity", type=int, default=2048, help="recent request traces kept")
    q.add_argument("--interstage-max-wait-s", type=float, default=300.0)
    q.add_argument("--poll-interval-s", type=float, default=0.5, help="node health/state poll")
    t = p.add_argument_group("timeouts (seconds)")
    t.add_argument("--connect-timeout-s", type=float, default=NodeTimeouts.connect_s)
    t.add_argument("--prefill-timeout-s", type=float, default=NodeTimeouts.prefill_s)
    t.add_argument("--first-byte-timeout-s", type=float, default=NodeTimeouts.first_byte_s)
    t.add_argument("--stream-timeout-s", type=float, default=NodeTimeouts.read_line_s)
    t.add_argument("--shutdown-timeout-s", type=float, default=10.0)
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")


def split_urls(values: list[str]) -> tuple[str, ...]:
    """Repeated and comma-separated flag values, flattened."""
    return tuple(u.strip() for v in values for u in v.split(",") if u.strip())


def add_proxy_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`pdserve proxy`; called from `common.cli.build_parser` (imports stay light here)."""
    p = sub.add_parser("proxy", help="run the OpenAI-compatible proxy in front of node pools")
    add_proxy_args(p)
    p.set_defaults(func=cmd_proxy)


def cmd_proxy(args: argparse.Namespace) -> int:
    from proxy.main import run

    return run(settings_from_args(args), args.log_level, args.access_log)


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    from common.cli import model_dir

    colocated = split_urls(args.colocated)
    timeouts = NodeTimeouts(
        connect_s=args.connect_timeout_s,
        prefill_s=args.prefill_timeout_s,
        first_byte_s=args.first_byte_timeout_s,
        read_line_s=args.stream_timeout_s,
    )
    return ProxySettings(
        model=model_dir(args.model),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        prefill=split_urls(args.prefill),
        decode=split_urls(args.decode),
        colocated=colocated,
        mode=args.mode or ("colocated" if colocated else "disagg"),
        lease_s=args.lease_s,
        max_active_requests=args.max_active_requests,
        edge_queue_capacity=args.edge_queue_capacity,
        migrate_limit=args.migrate_limit,
        trace_capacity=args.trace_capacity,
        interstage_capacity=args.interstage_capacity,
        interstage_max_wait_s=args.interstage_max_wait_s,
        poll_interval_s=args.poll_interval_s,
        timeouts=timeouts,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout_s,
    )
