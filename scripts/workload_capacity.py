"""The most requests per second one engine can serve of a bench-serve dataset, offline.

Every request of the dataset (its first --requests lines: `{"prompt", "max_tokens"}` each, as
`scripts/mixed_workload.py` writes them) is handed to pdserve's engine at once, in this one
process: no arrival process, no objectives, no proxy, no network, no KV transfer. The engine
batches them as it schedules (chunked prefill beside the running decodes, up to
--max-num-seqs at a time), greedy, every request generating its `max_tokens` (bench-serve
sends `ignore_eos`). Requests / wall time is then a throughput ceiling: no deployment of N
such engines on N such cores sustains more than N times it on this workload, whatever its
placement, and one held to latency objectives sustains less (queues must stay short). The
comparison (`scripts/compare_disagg.sh`) runs it once on one pinned thread and reports each
deployment's goodput against it.

    python scripts/workload_capacity.py --data out/compare/search.jsonl [--requests 100]
        [--threads 1] [--json capacity.json] [engine flags]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from common.cli.engine_args import add_engine_args, engine_config
from common.engine.engine import LLMEngine
from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import SamplingParams

WARMUP = 4  # requests run once before the timed pass (first-call allocations, oneDNN setup)


def load(path: Path, limit: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens) of the dataset's first `limit` lines."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            rows.append((str(item["prompt"]), int(item["max_tokens"])))
        if len(rows) == limit:
            break
    if not rows:
        raise ValueError(f"{path} holds no requests")
    return rows


def measure(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    sps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in max_tokens]
    engine.generate(prompts[:WARMUP], sps[:WARMUP])
    engine.allocator.reset_cache()  # the timed pass computes every prompt in full
    t0 = time.perf_counter()
    done = engine.generate(prompts, sps)
    wall = time.perf_counter() - t0
    output = sum(len(c.token_ids) for c in done)
    assert output == sum(max_tokens), (output, sum(max_tokens))
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": output,
        "wall_s": wall,
        "requests_per_s": len(prompts) / wall,
        "core_s_per_request": wall / len(prompts),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--data", type=Path, required=True, help="a bench-serve JSONL dataset")
    ap.add_argument("--requests", type=int, default=100, help="its first lines: %(default)s")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.set_defaults(threads=1)
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    try:
        rows = load(args.data, args.requests)
    except (OSError, ValueError, KeyError) as e:
        print(f"workload_capacity: {e}", file=sys.stderr)
        return 2
    cfg = engine_config(args)
    engine = LLMEngine(cfg)
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_dir(cfg.model)
    prompts = [tokenizer.encode(prompt) for prompt, _ in rows]
    figures = measure(engine, prompts, [n for _, n in rows])
    engine.check_integrity()
    doc = {
        "model": cfg.model,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": args.threads,
        "dataset": str(args.data),
        **figures,
    }
    print(
        f"{doc['requests']} requests ({doc['prompt_tokens']} prompt, {doc['output_tokens']} "
        f"output tokens) in {figures['wall_s']:.1f} s on {args.threads} thread(s), "
        f"{doc['dtype']}: {figures['requests_per_s']:.3f} req/s"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
