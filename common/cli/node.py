"""`pdserve node --role prefill|decode|both` (and `pdserve prefill`, `pdserve decode`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from common.cli.engine_args import engine_config
from common.cli.logs import setup_logging
from common.cli.startup import freeze_startup_objects
from common.node.host import NodeHost, RoleFactory
from common.node.server import NodeConfig, NodeRole, NodeRuntime, NodeServer
from common.node.transfer import start_agent
from common.wire.auth import CLUSTER_TOKEN_ENV, read_secret
from decode_node.colocated import ColocatedNode
from decode_node.server import DecodeNode
from kv_transfer.config import TransferConfig
from prefill_node.server import PrefillNode


async def create_node(config: NodeConfig) -> NodeHost:
    """The node for `config.role`, over a complete runtime (model loaded, engine thread
    started, and for prefill and decode the KV-transfer agent registered). A prefill or
    decode node can change between the two at run time (POST /internal/role): both roles
    are built here, over the same runtime and agent."""
    runtime = await NodeRuntime.start(config)
    try:
        return NodeHost(config, runtime, await _role_factory(config, runtime))
    except BaseException:
        await runtime.front.stop()
        raise


async def _role_factory(config: NodeConfig, runtime: NodeRuntime) -> RoleFactory:
    if config.role == "both":

        def colocated(role: NodeRole) -> NodeServer:
            assert role == "both", role  # the host refuses to change a `both` node
            return ColocatedNode(config, runtime)

        return colocated
    agent = await start_agent(config, runtime)

    def transfer_role(role: NodeRole) -> NodeServer:
        match role:
            case "prefill":
                return PrefillNode(config, runtime, agent)
            case "decode":
                return DecodeNode(config, runtime, agent)
        raise ValueError(f"a KV-transfer node serves prefill or decode, not {role!r}")

    return transfer_role


def node_config(args: argparse.Namespace) -> NodeConfig:
    token = read_secret(args.cluster_token_file, CLUSTER_TOKEN_ENV)
    transfer = TransferConfig.from_env(
        backend=args.kv_backend,
        host=args.host,
        side_channel_port=args.kv_port,
        cluster_token=token,  # the KV side channel's handshake proves it too
    )
    return NodeConfig(
        role=args.fixed_role or args.role,
        engine=engine_config(args),
        host=args.host,
        port=args.port,
        transfer=transfer,
        engine_id=args.engine_id,
        kv_wait_timeout_s=args.kv_wait_timeout,
        sending_timeout_s=args.sending_timeout,
        drain_timeout_s=args.drain_timeout,
        role_drain_timeout_s=args.role_drain_timeout,
        cluster_token=token,
        insecure=args.insecure,
        debug_step_delay_s=args.debug_step_delay,
        debug_transfer_delay_s=args.debug_transfer_delay,
    )


def cmd_node(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return asyncio.run(serve(node_config(args)))


FATAL_STOP_TIMEOUT_S = 10.0  # a failed node exits within this, freed or not
EXIT_NODE_FAILED = 3


async def serve(config: NodeConfig, stop: asyncio.Event | None = None) -> int:
    """Run a node until SIGINT/SIGTERM (or `stop`), then drain, free every block and return
    0. If the node fails (its engine thread or its KV-transfer progress thread died: see
    NodeServer.fail), fail fast instead: /health already answers 503; close what can be
    closed within FATAL_STOP_TIMEOUT_S and return EXIT_NODE_FAILED, so that a supervisor
    (`pdserve up`, systemd, Kubernetes) restarts the node."""
    log = logging.getLogger(__name__)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    node = await create_node(config)
    failed = node.failed
    try:
        url = await node.start()
        freeze_startup_objects()
        print(f"pdserve node ready: {url} role={config.role} engine={node.engine_id}", flush=True)
        waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(failed.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not failed.is_set():
            log.info("stopping: draining in-flight requests")
            await node.drain()
    finally:
        if failed.is_set():
            log.critical("exiting: %s", node.failure)
            try:
                await asyncio.wait_for(node.stop(), FATAL_STOP_TIMEOUT_S)
            except Exception:  # exiting anyway: the supervisor restarts a clean process
                log.exception("stopping the failed node")
        else:
            await node.stop()
    if failed.is_set():
        print(f"pdserve node failed: {node.url}: {node.failure}", file=sys.stderr)
        return EXIT_NODE_FAILED
    node.engine.check_integrity()  # the engine thread has stopped: this thread owns it now
    blocks = node.engine.state()["blocks"]
    logging.getLogger(__name__).info("stopped: blocks %s", json.dumps(blocks, sort_keys=True))
    print(f"pdserve node stopped: {node.url}", file=sys.stderr, flush=True)
    return 0
