"""`pdserve generate` (offline generation, streamed to stdout) and `pdserve make-tiny-model`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.cli.engine_args import engine_config
from common.engine.engine import LLMEngine, RequestError
from common.engine.scheduler import StepOutput
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from common.tiny.model import make_tiny_model
from common.wire.sampling_params import SamplingParams


def cmd_generate(args: argparse.Namespace) -> int:
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
    detok = IncrementalDetokenizer(tok)

    def show(out: StepOutput) -> None:
        text = detok.push(out.new_token_ids)
        if text and not args.json:
            print(text, end="", flush=True)

    try:
        (completion,) = engine.generate([ids], sampling, on_output=show)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tail = detok.flush()
    if args.json:
        out_ids = completion.token_ids
        print(json.dumps({"token_ids": out_ids, "text": tok.decode(out_ids)}))
    else:
        print(tail, flush=True)
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    path = make_tiny_model(Path(args.dir))
    print(path)
    return 0
