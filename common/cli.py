"""`pdserve` command line: one subcommand per user-facing tool."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

from common.config import EngineConfig
from kernels.dispatch import BACKENDS


def model_dir(arg: str | None) -> str:
    """The `--model` directory, or the built-in default model (generated on first use)."""
    if arg:
        return arg
    from common.tiny_model import default_model_dir

    return str(default_model_dir())


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="local HF model dir (default: built-in tiny model)"
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    g.add_argument("--kv-cache-memory-mb", type=int, default=256)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument(
        "--kernel-backend",
        default=None,
        choices=list(BACKENDS),
        help="attention/KV kernels (default: $PDSERVE_KERNELS or auto: Triton on CUDA, "
        "torch on CPU)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=model_dir(args.model),
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory_mb * 2**20,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        threads=args.threads,
        kernel_backend=args.kernel_backend,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from common.detokenizer import IncrementalDetokenizer
    from common.engine import LLMEngine, RequestError
    from common.sampling import SamplingParams
    from common.tokenizer import Tokenizer

    cfg = engine_config(args)
    tok = Tokenizer.from_dir(cfg.model)
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt)
    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(cfg)
    try:
        engine.add_request(uuid.uuid4().hex, ids, sampling)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(tok)
    out_ids: list[int] = []
    while engine.has_work():
        for out in engine.step():
            out_ids += out.new_token_ids
            text = detok.push(out.new_token_ids)
            if text and not args.json:
                print(text, end="", flush=True)
    tail = detok.flush()
    if args.json:
        print(json.dumps({"token_ids": out_ids, "text": tok.decode(out_ids)}))
    else:
        print(tail, flush=True)
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from common.tiny_model import make_tiny_model

    path = make_tiny_model(Path(args.dir))
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    g.set_defaults(func=cmd_generate)

    from common.launcher import add_up_parser
    from common.node_main import add_node_args
    from proxy.settings import add_proxy_parser

    add_node_args(
        sub.add_parser("node", help="run a node server (--role prefill|decode|both)"), None
    )
    add_node_args(sub.add_parser("prefill", help="run a prefill node"), "prefill")
    add_node_args(sub.add_parser("decode", help="run a decode node"), "decode")
    add_proxy_parser(sub)  # proxy.settings
    add_up_parser(sub)  # common.launcher

    sub.add_parser("bench-transfer", help="KV-transfer latency and bandwidth per backend")
    sub.add_parser("bench-serve", help="OpenAI-API load generator: latency, throughput, goodput")

    t = sub.add_parser("make-tiny-model", help="write the built-in default model to DIR")
    t.add_argument("dir")
    t.set_defaults(func=cmd_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench-transfer"]:  # its own parser (kv_transfer.bench), --help included
        from kv_transfer.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["bench-serve"]:  # its own parser (proxy.bench_serve), --help included
        from proxy.bench_serve import main as bench_serve_main

        return bench_serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # bad config or model directory: a message, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
