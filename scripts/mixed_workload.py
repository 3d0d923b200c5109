"""Write a prefill-heavy mixed bench-serve dataset (JSONL, `{"prompt", "max_tokens"}` per line).

Two kinds of request, in fixed proportions (bench-serve shuffles the lines with its seed, so
the long prompts arrive at random among the others):

- decode-heavy: a short prompt and a long output; these are the ongoing decodes whose
  inter-token latency a long prefill on the same engine interrupts;
- prefill-heavy: a long prompt (default 1000-1500 tokens, within the built-in model's 2048
  context) and a short output.

Prompt lengths are exact in the model's tokens (bench-serve's random workload with the
model's tokenizer); each length is uniform in len * (1 +- range ratio).

    python scripts/mixed_workload.py --out mixed.jsonl --num-requests 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

from common.cli.models import model_dir
from common.text.tokenizer import Tokenizer
from proxy.bench.workload import RandomWorkload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("--model", default=None, help="its tokenizer (default: the built-in model)")
    p.add_argument("--num-requests", type=int, default=200, help="lines: %(default)s")
    p.add_argument(
        "--long-fraction", type=float, default=0.2, help="prefill-heavy share: %(default)s"
    )
    p.add_argument("--short-input", type=int, default=48, help="tokens: %(default)s")
    p.add_argument("--short-output", type=int, default=160, help="tokens: %(default)s")
    p.add_argument("--long-input", type=int, default=1250, help="tokens: %(default)s")
    p.add_argument("--long-output", type=int, default=12, help="tokens: %(default)s")
    p.add_argument("--range-ratio", type=float, default=0.2, help="%(default)s")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_requests < 1 or not 0.0 <= args.long_fraction <= 1.0:
        print("need --num-requests >= 1 and --long-fraction in [0, 1]", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_dir(model_dir(args.model))
    n_long = round(args.num_requests * args.long_fraction)
    kinds = [
        (
            args.num_requests - n_long,
            RandomWorkload(args.short_input, args.short_output, args.range_ratio),
        ),
        (n_long, RandomWorkload(args.long_input, args.long_output, args.range_ratio)),
    ]
    rng = random.Random(args.seed)
    lines = []
    for i, (count, workload) in enumerate(kinds):
        items = workload.items(args.seed + i, tokenizer)
        lines += [
            {"prompt": w.prompt, "max_tokens": w.max_tokens} for w in itertools.islice(items, count)
        ]
    rng.shuffle(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(
        f"{args.out}: {args.num_requests - n_long} short-prompt/long-output + {n_long} "
        f"long-prompt ({args.long_input} tokens +-{args.range_ratio:.0%})/short-output requests",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
