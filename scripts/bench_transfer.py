#!/usr/bin/env python3
"""KV-transfer latency/bandwidth per backend vs memcpy and bare NIXL (see kv_transfer/bench.py).

python scripts/bench_transfer.py [--backends nixl,ucxx,zmq] [--shapes tiny,8b]
                                 [--blocks 1,8,64,512] [--reps N] [--json FILE]
"""

import sys

from kv_transfer.bench.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
