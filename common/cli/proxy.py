"""`pdserve proxy`: its flags, and the settings record they fill."""

from __future__ import annotations

import argparse
import asyncio

from common.cli.logs import setup_logging
from common.cli.models import model_dir
from common.cli.proxy_args import planner_config, split_urls
from common.wire.auth import API_KEY_ENV, CLUSTER_TOKEN_ENV, read_secret
from proxy.main import serve
from proxy.pool.client import NodeTimeouts
from proxy.settings import ProxySettings


def cmd_proxy(args: argparse.Namespace) -> int:
    """Configure logging and serve until a signal."""
    setup_logging(args.log_level, args.access_log)
    return asyncio.run(serve(settings_from_args(args)))


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    colocated = split_urls(args.colocated)
    timeouts = NodeTimeouts(
        connect_s=args.connect_timeout_s,
        prefill_s=args.prefill_timeout_s,
        first_byte_s=args.first_byte_timeout_s,
        read_line_s=args.stream_timeout_s,
        stall_s=args.stall_timeout_s,
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
        edge_deadline_s=args.edge_deadline_s,
        migrate_limit=args.migrate_limit,
        kv_streaming=args.kv_streaming == "on",
        routing=args.routing,
        disagg_mode=args.disagg_mode,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        slo_ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
        slo_tpot_s=args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None,
        trace_capacity=args.trace_capacity,
        interstage_capacity=args.interstage_capacity,
        prefill_backlog_s=args.prefill_backlog_s,
        interstage_max_wait_s=args.interstage_max_wait_s,
        poll_interval_s=args.poll_interval_s,
        silent_after_s=args.silent_after_s,
        timeouts=timeouts,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout_s,
        gc_interval_s=args.gc_interval_s,
        cluster_token=read_secret(args.cluster_token_file, CLUSTER_TOKEN_ENV),
        api_key=args.api_key or read_secret(None, API_KEY_ENV),
        insecure=args.insecure,
        role_drain_timeout_s=args.role_drain_timeout_s,
        auto_roles=args.auto_roles,
        planner=planner_config(args),
    )
