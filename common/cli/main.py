"""`pdserve` command line: one subcommand per user-facing tool. The composition root: the only
package that imports the node roles and the proxy.

Each subcommand's handler module is imported only when that subcommand runs, so that the
proxy process never loads torch and `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from common.cli.lazy import lazy
from common.model.builtin import ModelFetchError


def build_parser() -> argparse.ArgumentParser:
    # The node and engine flags name torch-backed choices (kernel and KV backends): imported
    # here, so that `pdserve proxy`, which has its own parser, never loads them.
    from common.cli.engine_args import add_engine_args
    from common.cli.node_args import add_node_args
    from common.cli.proxy_args import add_proxy_parser
    from common.cli.up_args import add_up_parser

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation, streamed to stdout")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help='print {"token_ids", "text"} only')
    g.set_defaults(func=lazy("common.cli.generate", "cmd_generate"))

    add_node_args(
        sub.add_parser("node", help="run a node server (--role prefill|decode|both)"), None
    )
    add_node_args(sub.add_parser("prefill", help="run a prefill node"), "prefill")
    add_node_args(sub.add_parser("decode", help="run a decode node"), "decode")
    add_proxy_parser(sub)
    add_up_parser(sub)

    sub.add_parser("bench-transfer", help="KV-transfer latency and bandwidth per backend")
    sub.add_parser("bench-serve", help="OpenAI-API load generator: latency, throughput, goodput")

    t = sub.add_parser("make-tiny-model", help="write the built-in default model to DIR")
    t.add_argument("dir")
    t.set_defaults(func=lazy("common.cli.generate", "cmd_make_tiny_model"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench-transfer"]:  # its own parser (kv_transfer.bench.main), --help included
        from kv_transfer.bench.main import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["bench-serve"]:  # its own parser (proxy.bench.main), --help included
        from proxy.bench.main import main as bench_serve_main

        return bench_serve_main(argv[1:])
    if argv[:1] == ["proxy"]:  # its own parser: the proxy process never loads torch
        from common.cli.proxy_args import proxy_parser

        args = proxy_parser().parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, ModelFetchError) as e:  # bad config or model: no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
