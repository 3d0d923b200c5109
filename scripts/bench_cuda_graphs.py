#!/usr/bin/env python3
"""Decode step time on a CUDA GPU, eager against CUDA graphs, at live batch sizes between
the captured ones (a batch of 9 replays the graph of 16: the padding trade-off).

    python scripts/bench_cuda_graphs.py [--model tiny] [--dtype bfloat16]
                                        [--batches 1,2,3,4,5,8,9,16,17,32] [--steps 30]
                                        [--json OUT]

Per batch size: the median wall time of a decode step (engine.step(), sampling and the
read-back of the tokens included) and, from CUDA events around it, the GPU's time; their
difference is the host time the graphs exist to remove. Exit status 3 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.cli.models import model_dir  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402


def step_times(engine: LLMEngine, batch: int, steps: int) -> tuple[float, float]:
    """(wall, GPU) median seconds of a decode step with `batch` sequences decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [(7 * i + j) % 100 + 1 for j in range(32)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_output_tokens == 0 for s in sched.running):
        engine.step()
    engine.step()
    walls, gpus = [], []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        engine.step()
        end.record()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        gpus.append(start.elapsed_time(end) / 1e3)
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    while engine.has_work():
        engine.step()
    return statistics.median(walls), statistics.median(gpus)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,2,3,4,5,8,9,16,17,32")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda_graphs: no CUDA device", file=sys.stderr)
        return 3
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(model=model_dir(args.model), dtype=args.dtype, device="cuda",
                  kernel_backend="triton", max_num_seqs=max(batches), num_blocks=4096)  # fmt: skip
    rows = []
    engines = {m: LLMEngine(EngineConfig(**common, cuda_graphs=m == "graphs"))
               for m in ("eager", "graphs")}  # fmt: skip
    for b in batches:
        row: dict[str, float | int] = {"batch": b}
        for mode, engine in engines.items():
            wall, gpu = step_times(engine, b, args.steps)
            row[f"{mode}_ms"], row[f"{mode}_gpu_ms"] = wall * 1e3, gpu * 1e3
        rows.append(row)
        cells = [f"{m} {row[f'{m}_ms']:7.3f} ms (GPU {row[f'{m}_gpu_ms']:7.3f})" for m in engines]
        print(f"batch {b:3}: " + ", ".join(cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
