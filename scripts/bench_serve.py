#!/usr/bin/env python3
"""Serving benchmark against any OpenAI-compatible server (see proxy/bench_serve.py).

python scripts/bench_serve.py --base-url http://127.0.0.1:8000 [--endpoint chat]
       [--rate R [R ...]] [--max-concurrency N] [--num-requests N] [--duration-s S]
       [--input-len N] [--output-len N] [--dataset FILE] [--json FILE] [--plot-dir DIR]
"""

import sys

from proxy.bench.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
