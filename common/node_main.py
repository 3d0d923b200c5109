"""`pdserve node --role prefill|decode|both` (and `pdserve prefill`, `pdserve decode`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from common.logs import setup_logging
from common.node import Node, NodeConfig, Role
from kv_transfer.config import BACKENDS, TransferConfig


def create_node(config: NodeConfig) -> Node:
    """The role's server class for `config.role`."""
    if config.role == "prefill":
        from prefill_node.server import PrefillNode

        return PrefillNode(config)
    if config.role == "decode":
        from decode_node.server import DecodeNode

        return DecodeNode(config)
    from decode_node.colocated import ColocatedNode

    return ColocatedNode(config)


def add_node_args(p: argparse.ArgumentParser, role: Role | None) -> None:
    from common.cli import add_engine_args

    if role is None:
        p.add_argument("--role", required=True, choices=["prefill", "decode", "both"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    p.add_argument("--engine-id", default="")
    p.add_argument("--kv-backend", default="nixl", choices=list(BACKENDS))
    p.add_argument("--kv-port", type=int, default=0, help="KV side-channel port (0: any)")
    p.add_argument("--kv-wait-timeout", type=float, default=30.0)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    d = p.add_argument_group("fault injection (tests and drills; keep 0 in production)")
    d.add_argument("--debug-step-delay", type=float, default=0.0, help="sleep after each step")
    d.add_argument(
        "--debug-transfer-delay", type=float, default=0.0, help="prefill: delay each KV write"
    )
    p.add_argument("--log-level", default="INFO")
    add_engine_args(p)
    p.set_defaults(func=cmd_node, fixed_role=role)


def node_config(args: argparse.Namespace) -> NodeConfig:
    from common.cli import engine_config

    transfer = TransferConfig.from_env(
        backend=args.kv_backend, host=args.host, side_channel_port=args.kv_port
    )
    return NodeConfig(
        role=args.fixed_role or args.role,
        engine=engine_config(args),
        host=args.host,
        port=args.port,
        transfer=transfer,
        engine_id=args.engine_id,
        kv_wait_timeout_s=args.kv_wait_timeout,
        drain_timeout_s=args.drain_timeout,
        debug_step_delay_s=args.debug_step_delay,
        debug_transfer_delay_s=args.debug_transfer_delay,
    )


def cmd_node(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return asyncio.run(serve(node_config(args)))


async def serve(config: NodeConfig) -> int:
    """Run a node until SIGINT/SIGTERM, then drain, free every block and return 0."""
    node = create_node(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await node.start()
        print(f"pdserve node ready: {url} role={config.role} engine={node.engine_id}", flush=True)
        await stop.wait()
        logging.getLogger(__name__).info("stopping: draining in-flight requests")
        await node.drain()
    finally:
        await node.stop()
    if node.engine is not None:
        node.engine.check_integrity()
        blocks = node.engine.state()["blocks"]
        logging.getLogger(__name__).info("stopped: blocks %s", json.dumps(blocks, sort_keys=True))
    print(f"pdserve node stopped: {url}", file=sys.stderr, flush=True)
    return 0
