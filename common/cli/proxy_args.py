"""`pdserve proxy` flags."""

from __future__ import annotations

import argparse

from common.cli.lazy import lazy
from proxy.pool.client import NodeTimeouts
from proxy.pool.placement import DISAGG_MODES, PlacementConfig
from proxy.pool.planner import PlannerConfig
from proxy.pool.router import POLICIES
from proxy.settings import GC_INTERVAL_S


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--model",
        default=None,
        help="as for the nodes: smollm2-135m-instruct (default), tiny, a .gguf file or a directory",
    )
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
    add_admission_args(q)
    q.add_argument(
        "--migrate-limit",
        type=int,
        default=1,
        help="times a stream may be re-prefilled onto another decode node after a node failure",
    )
    add_routing_arg(q)
    add_kv_streaming_arg(q)
    add_liveness_args(q)
    add_role_args(p.add_argument_group("roles (moving nodes between the pools)"))
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
    p.add_argument(
        "--gc-interval-s",
        type=float,
        default=GC_INTERVAL_S,
        help="collect garbage on this timer instead of every 700 allocations "
        "(common/gc_pacing.py); 0: CPython's own collector",
    )
    add_auth_args(p)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")


def add_auth_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("authentication")
    a.add_argument(
        "--cluster-token-file",
        default=None,
        help="file holding the secret shared with the nodes (else $PDSERVE_CLUSTER_TOKEN): "
        "sent to them, and required on /admin/* and /debug/*",
    )
    a.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (else $PDSERVE_API_KEY, if set)",
    )
    a.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on a non-loopback address without a cluster token",
    )


def split_urls(values: list[str]) -> tuple[str, ...]:
    """Repeated and comma-separated flag values, flattened."""
    return tuple(u.strip() for v in values for u in v.split(",") if u.strip())


PROXY_HELP = "run the OpenAI-compatible proxy in front of node pools"


def add_proxy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`pdserve proxy` in the full command line (for `pdserve --help`)."""
    p = sub.add_parser("proxy", help=PROXY_HELP, description=PROXY_HELP)
    add_proxy_args(p)
    p.set_defaults(func=lazy("common.cli.proxy", "cmd_proxy"))


def proxy_parser() -> argparse.ArgumentParser:
    """`pdserve proxy` on its own: what `pdserve proxy ...` parses with, without the other
    subcommands' flags and what they import."""
    p = argparse.ArgumentParser(prog="pdserve proxy", description=PROXY_HELP)
    add_proxy_args(p)
    p.set_defaults(func=lazy("common.cli.proxy", "cmd_proxy"))
    return p


def add_admission_args(g: argparse._ActionsContainer) -> None:
    """Who gets into the pipeline, who waits at the edge, who is refused (proxy and up)."""
    g.add_argument(
        "--max-active-requests",
        type=int,
        default=512,
        help="requests inside the pipeline at once (fewer while the decode pool is full): "
        "%(default)s",
    )
    g.add_argument(
        "--edge-queue-capacity",
        type=int,
        default=1024,
        help="more requests may wait at the edge; the proxy holds max-active-requests + this, "
        "then answers 503: %(default)s",
    )
    g.add_argument(
        "--edge-deadline-s",
        type=float,
        default=60.0,
        help="the longest a request waits at the edge: one whose estimated wait is longer is "
        "refused at once (503 + Retry-After); X-Request-Deadline-Ms lowers it per request "
        "(0: no limit): %(default)s",
    )
    g.add_argument(
        "--interstage-capacity",
        type=int,
        default=0,
        help="requests admitted but not yet taken by a decode node (prefilling or in the "
        "inter-stage queue); 0: the decode nodes' max-num-seqs summed. Their prompt tokens "
        "are also bounded by the decode nodes' KV cache: %(default)s",
    )
    g.add_argument(
        "--prefill-backlog-s",
        type=float,
        default=2.0,
        help="prefill work admitted ahead of the prefill pool, in seconds at its measured "
        "rate (the rest waits at the edge, where the deadline applies; 0: no limit): "
        "%(default)s",
    )


def add_liveness_args(g: argparse._ActionsContainer) -> None:
    """How soon a hung node's streams move and it stops getting work (proxy and up)."""
    g.add_argument(
        "--stall-timeout-s",
        type=float,
        default=NodeTimeouts.stall_s,
        help="a token stream silent this long after its first token (at least 4x the "
        "node's slowest recent step) is stalled: continued on another node (0: off): "
        "%(default)s",
    )
    g.add_argument(
        "--silent-after-s",
        type=float,
        default=None,
        help="a node with no good health/state poll for this long gets no new work while "
        "another answers (default: max(2, 4 poll intervals))",
    )


def add_role_args(g: argparse._ActionsContainer) -> None:
    """Moving nodes between the pools (POST /admin/nodes/role, --auto-roles; proxy and up)."""
    g.add_argument(
        "--role-drain-timeout-s",
        type=float,
        default=30.0,
        help="a node being moved to the other pool finishes its work this long, then its "
        "streams migrate and its held KV is freed: %(default)s",
    )
    g.add_argument(
        "--auto-roles",
        action="store_true",
        help="move one node at a time from the pool with slack to the pool whose queue wait "
        "stays longer (at least one node stays in each pool)",
    )
    d = PlannerConfig()
    g.add_argument(
        "--auto-roles-window-s",
        type=float,
        default=d.window_s,
        help="a pool's wait must be the longer one for this long before a move: %(default)s",
    )
    g.add_argument(
        "--auto-roles-interval-s",
        type=float,
        default=d.interval_s,
        help="at most one move per this many seconds: %(default)s",
    )
    g.add_argument(
        "--auto-roles-margin-s",
        type=float,
        default=d.margin_s,
        help="by how much one pool's queue wait must exceed the other's: %(default)s",
    )
    g.add_argument(
        "--auto-roles-sample-s",
        type=float,
        default=d.sample_s,
        help="seconds between the planner's samples of the queue waits: %(default)s",
    )


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(
        window_s=args.auto_roles_window_s,
        interval_s=args.auto_roles_interval_s,
        margin_s=args.auto_roles_margin_s,
        sample_s=args.auto_roles_sample_s,
    )


def add_kv_streaming_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--kv-streaming",
        choices=["on", "off"],
        default="on",
        help="on: the prefill node writes each finished group of KV blocks to the decode node "
        "while later chunks compute (the decode node is engaged when the prefill node takes "
        "the request); off: one write after the first token: %(default)s",
    )


def add_routing_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--routing",
        choices=list(POLICIES),
        default="cost",
        help="where to prefill: cost (the node with the lowest estimated time to first token, "
        "weighing its cached prefix against its queue), cache-affinity, least-load or "
        "round-robin: %(default)s",
    )
    g.add_argument(
        "--disagg-mode",
        choices=list(DISAGG_MODES),
        default="auto",
        help="where prompts are prefilled: always on the prefill pool, never (on the decode "
        "node that decodes them), or auto: on the decode node when that is estimated to give "
        "an earlier first token and the prompt is short (conditional disaggregation): "
        "%(default)s",
    )
    g.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=PlacementConfig.local_max_tokens,
        help="auto: the most uncached prompt tokens a decode node prefills itself (bounds the "
        "stall a local prefill adds to its other streams): %(default)s",
    )
    g.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        help="auto: the time-to-first-token objective; a prompt whose estimated first token on "
        "the prefill pool would miss it is prefilled on a decode node that meets it, even when "
        "that costs the node's streams more than it saves (0: no objective): %(default)s",
    )
    g.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=0.0,
        help="auto: the time-per-output-token objective; a prompt is prefilled on a decode "
        "node only if the stall leaves each of the node's streams within it (0: no "
        "objective): %(default)s",
    )
