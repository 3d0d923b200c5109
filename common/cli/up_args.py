"""`pdserve up` flags, and the engine flags `up` passes on to every node."""

from __future__ import annotations

import argparse

from common.cli.engine_args import add_engine_args
from common.cli.lazy import lazy
from common.cli.proxy_args import (
    add_admission_args,
    add_kv_streaming_arg,
    add_liveness_args,
    add_role_args,
    add_routing_arg,
)


def add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`pdserve up`."""
    p = sub.add_parser("up", help="start proxy + prefill and decode nodes on this machine")
    p.add_argument("--host", default="127.0.0.1", help="the proxy's listen address")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill nodes")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode nodes")
    p.add_argument(
        "--colocated",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="run N (default 1) colocated nodes instead: the baseline",
    )
    p.add_argument("--kv-backend", choices=["nixl", "ucxx", "zmq"], default=None)
    p.add_argument("--threads-per-node", type=int, default=1, help="torch threads per node")
    p.add_argument(
        "--pin-cores",
        action="store_true",
        help="bind node i to cores [i*T, (i+1)*T) of this process's CPU set "
        "(T = --threads-per-node; prefill nodes first); the proxy stays unbound",
    )
    p.add_argument("--node-args", default="", help="more node flags, one shell-quoted string")
    p.add_argument(
        "--prefill-node-args",
        default="",
        help="more flags for the prefill nodes only (after --node-args, so they win)",
    )
    p.add_argument(
        "--decode-node-args",
        default="",
        help="more flags for the decode nodes only (after --node-args, so they win)",
    )
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--stop-grace-s", type=float, default=20.0)
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of a node that exits while serving (backoff 1, 2, 4 ... 30 s): %(default)s",
    )
    p.add_argument("--log-dir", default=None, help="node logs (default: a new temp dir)")
    p.add_argument("--lease-s", type=float, default=30.0)
    add_admission_args(p)
    add_routing_arg(p)
    add_kv_streaming_arg(p)
    add_liveness_args(p)
    add_role_args(p.add_argument_group("roles (moving nodes between the pools)"))
    p.add_argument(
        "--demo",
        metavar="PROMPT",
        default=None,
        help="once serving, stream one chat completion for PROMPT through the proxy",
    )
    a = p.add_argument_group("authentication")
    a.add_argument(
        "--cluster-token-file",
        default=None,
        help="the proxy's and nodes' shared secret (else $PDSERVE_CLUSTER_TOKEN, else a new "
        "one for this run, written to <log dir>/cluster-token)",
    )
    a.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (else $PDSERVE_API_KEY, if set)",
    )
    add_engine_args(p)
    p.set_defaults(func=lazy("common.cli.up", "cmd_up"))


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on the command line that differ from their defaults (`--model`
    and `--threads` are handled apart), to pass on to every node."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    flags: list[str] = []
    for action in probe._actions:
        if action.dest in ("model", "threads", "help"):
            continue
        value = getattr(args, action.dest, action.default)
        if value != action.default:
            flag = action.option_strings[0]
            flags += [flag] if action.nargs == 0 else [flag, str(value)]  # a switch: no value
    return flags
