#!/usr/bin/env python3
"""Engine decode throughput and step overhead on the default model (a benchmark, not a test).

For each batch size B: B requests with short prompts are prefilled, then N full
engine steps (schedule + forward + sample + bookkeeping) each decode B tokens.
The bare forward runs the model alone on the inputs that step prepared (same
batch, same context), right after it. overhead = full step time / bare forward.

    python scripts/bench_engine.py [--model DIR] [--batches 1,8,32,64] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.cli.models import model_dir
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.runner import StepInputs
from common.wire.sampling_params import SamplingParams


def bench_batch(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    # Long enough that no request finishes while others still prefill or during timing.
    sp = SamplingParams(temperature=0.0, max_tokens=4 * steps + 64, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"b{batch}-{i}", ids, sp)
    engine.step()  # applies the adds, starts prefilling
    while any(s.num_uncomputed != 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill everything first
    engine.step()  # warm up the decode path
    # Capture each step's prepared inputs, so the bare forward after it runs the
    # very batch the step ran (same sequences, same context lengths). A bare
    # forward rewrites the same K/V into the same slots.
    prepare = engine.runner.prepare
    captured: list[StepInputs] = []
    engine.runner.prepare = lambda b: captured.append(prepare(b)) or captured[-1]  # type: ignore[method-assign]
    full: list[float] = []
    bare: list[float] = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            x = captured.pop()
            assert len(x.sample_rows) == batch, (len(x.sample_rows), batch, len(captured))
            hidden = engine.model(x.input_ids, x.positions, engine.kv_cache, x.meta)
            engine.model.compute_logits(hidden[x.sample_rows])
            t2 = time.perf_counter()
            full.append(t1 - t0)
            bare.append(t2 - t1)
    finally:
        engine.runner.prepare = prepare  # type: ignore[method-assign]
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    engine.step()
    engine.check_integrity()
    step_s = statistics.median(full)
    bare_s = statistics.median(bare)
    return {
        "batch": batch,
        "steps_per_s": 1 / step_s,
        "tokens_per_s": batch / step_s,
        "step_ms": step_s * 1e3,
        "forward_ms": bare_s * 1e3,
        "overhead": step_s / bare_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(
        EngineConfig(model=model_dir(args.model), max_num_seqs=max(batches), threads=args.threads)
    )
    rows = [bench_batch(engine, b, args.prompt_len, args.steps) for b in batches]
    print(f"model={engine.config.model} dtype={engine.dtype} threads={torch.get_num_threads()}")
    print("| batch | steps/s | tokens/s | step ms | forward ms | step/forward |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['steps_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['overhead']:.3f} |"
        )


if __name__ == "__main__":
    main()
