"""`pdserve node --role prefill|decode|both` (and `pdserve prefill`, `pdserve decode`) flags."""

from __future__ import annotations

import argparse

from common.cli.engine_args import add_engine_args
from common.cli.lazy import lazy
from common.node.server import NodeRole
from kv_transfer.config import BACKENDS


def add_node_args(p: argparse.ArgumentParser, role: NodeRole | None) -> None:
    if role is None:
        p.add_argument("--role", required=True, choices=["prefill", "decode", "both"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    p.add_argument("--engine-id", default="")
    p.add_argument("--kv-backend", default="nixl", choices=list(BACKENDS))
    p.add_argument("--kv-port", type=int, default=0, help="KV side-channel port (0: any)")
    p.add_argument("--kv-wait-timeout", type=float, default=30.0)
    p.add_argument(
        "--sending-timeout",
        type=float,
        default=60.0,
        help="prefill: abort a KV write unfinished after this many seconds (its blocks are "
        "freed once the write is quiescent)",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument(
        "--role-drain-timeout",
        type=float,
        default=30.0,
        help="a role change (POST /internal/role) lets the old role's work run this long, "
        "then moves what is left (decode streams migrate, held KV is freed)",
    )
    p.add_argument(
        "--cluster-token-file",
        default=None,
        help="file holding the secret shared with the proxy (else $PDSERVE_CLUSTER_TOKEN); "
        "internal endpoints refuse requests without it",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on a non-loopback address without a cluster token",
    )
    d = p.add_argument_group("fault injection (tests and drills; keep 0 in production)")
    d.add_argument("--debug-step-delay", type=float, default=0.0, help="sleep after each step")
    d.add_argument(
        "--debug-transfer-delay", type=float, default=0.0, help="prefill: delay each KV write"
    )
    p.add_argument("--log-level", default="INFO")
    add_engine_args(p)
    p.set_defaults(func=lazy("common.cli.node", "cmd_node"), fixed_role=role)
