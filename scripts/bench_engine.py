#!/usr/bin/env python3
"""pdserve's engine against transformers `generate` on the same weights (a benchmark, not a test).

    python scripts/bench_engine.py [--model smollm2-135m-instruct] [--dtype float32]
        [--threads 2] [--batches 1,8,32] [--prompt-len 64] [--output-len 64]
        [--prefill-len 1024] [--repeats 3] [--json out.json] [engine flags]

Both run in this one process, on the same checkpoint, dtype and torch threads, with
the same random-token prompts, greedy, every request generating exactly
--output-len tokens (EOS ignored). The runs alternate (pdserve, transformers,
pdserve, ...), so a load change on a shared machine hits both; each figure is the
median over --repeats runs.

    decode B    B requests together, greedy. Both sides timestamp every step (pdserve through
                `LLMEngine.generate`'s on_output, transformers through a streamer);
                tokens/s = tokens generated after every request has its first token,
                divided by the time from that moment to the last token.
    sampled B   the same with temperature 0.8 and top-p 0.95 (--sampled-batch, 0: none):
                the sampler's cost (softmax, nucleus, draw) on top of the forward.
    prefill N   one N-token prompt, one output token: N / wall time of the whole call.

--overhead B,B,... instead times pdserve alone, sampled (T=0.8, top-p 0.95), at each batch
size three ways, alternating: plain, with logprobs (5 most likely tokens a step), and
with structured output (a regex that stays open for the whole output, so every step
fills and applies a grammar bitmask): decode tokens/s, and each one's cost per decode
step over plain.

The engine runs with the serving defaults (`pdserve up`'s engine flags, which this
script accepts), so a long prompt is prefilled in chunks of
--max-num-batched-tokens as a server would. Prints a markdown table; --json
writes every run's figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.cli.engine_args import add_engine_args, engine_config
from common.engine.engine import LLMEngine
from common.engine.scheduler import StepOutput
from common.wire.sampling_params import SamplingParams, StructuredOutput

TEMPERATURE = 0.8
TOP_P = 0.95


@dataclass
class Run:
    """One timed generate call: prefill seconds and decode tokens/s."""

    wall_s: float
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class Row:
    what: str  # "decode" | "sampled" | "prefill"
    size: int  # batch (decode, sampled) or prompt tokens (prefill)
    runs: dict[str, list[float]] = field(default_factory=lambda: {"pdserve": [], "hf": []})

    def tok_s(self, side: str) -> float:
        return statistics.median(self.runs[side])

    def label(self) -> str:
        if self.what == "prefill":
            return f"prefill {self.size}"
        how = "" if self.what == "decode" else f", T={TEMPERATURE} top-p {TOP_P}"
        return f"decode, batch {self.size}{how}"


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


def pdserve_run(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_len: int,
    sampled: bool = False,
    **extra: Any,
) -> Run:
    how = {"temperature": TEMPERATURE, "top_p": TOP_P} if sampled else {"temperature": 0.0}
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True, **how, **extra)
    got: dict[str, int] = {}
    first: list[float] = []  # when the last request got its first token
    tokens_at_first = [0]
    cached = [0]  # prompt tokens the prefix cache gave

    def on_output(out: StepOutput) -> None:
        got[out.request_id] = got.get(out.request_id, 0) + len(out.new_token_ids)
        cached[0] += out.num_cached_tokens or 0
        if not first and len(got) == len(prompts):
            first.append(time.perf_counter())
            tokens_at_first[0] = sum(got.values())

    # Every run computes its prompts in full, as transformers does: the warm-up and the runs
    # before this one left the same prompts' blocks cached, and a hit made "prefill 800"
    # read 6,333 tok/s against 428 computed (session 28).
    engine.allocator.reset_cache()
    t0 = time.perf_counter()
    done = engine.generate(prompts, sp, on_output=on_output)
    t1 = time.perf_counter()
    total = sum(len(c.token_ids) for c in done)
    assert total == len(prompts) * output_len, (total, len(prompts), output_len)
    assert cached[0] == 0, f"a timed run took {cached[0]} prompt tokens from the prefix cache"
    return Run(t1 - t0, total - tokens_at_first[0], t1 - first[0])


class HFRunner:
    """transformers `generate` on the same checkpoint, timed per step by a streamer."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def run(self, prompts: list[list[int]], output_len: int, sampled: bool = False) -> Run:
        from transformers.generation.streamers import BaseStreamer

        stamps: list[float] = []

        class Stamps(BaseStreamer):  # put(): once for the prompt, then once a step
            def put(self, value: Any) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **(
                    {"do_sample": True, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 0}
                    if sampled
                    else {"do_sample": False}
                ),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=0,
                streamer=Stamps(),
            )
        t1 = time.perf_counter()
        assert out.shape == (len(prompts), ids.shape[1] + output_len), out.shape
        # stamps[1] is the first token's step; output_len - 1 steps follow it.
        decode_s = stamps[-1] - stamps[1] if output_len > 1 else 0.0
        return Run(t1 - t0, len(prompts) * (output_len - 1), decode_s)


def alternate(repeats: int, *sides: tuple[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Run each side once to warm up, then `repeats` rounds, alternating."""
    for _, fn in sides:
        fn()
    runs: dict[str, list[float]] = {name: [] for name, _ in sides}
    for _ in range(repeats):
        for name, fn in sides:
            runs[name].append(fn())
    return runs


# Open for any 64-token output (no stop allowed before 300 characters).
OPEN_REGEX = StructuredOutput(kind="regex", spec="[a-z ,.]{300,}")
OVERHEAD_MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "structured": {"structured": OPEN_REGEX},
}


def overhead(engine: LLMEngine, batches: list[int], args: argparse.Namespace) -> list[dict]:
    """Decode tokens/s per mode and batch, and the cost per step over plain."""
    vocab = engine.model_config.vocab_size
    out = []
    for b in batches:
        prompts = prompts_for(b, args.prompt_len, vocab, b)

        def timed(kw: dict[str, Any], prompts: list[list[int]] = prompts) -> float:
            return pdserve_run(engine, prompts, args.output_len, True, **kw).decode_tok_s

        sides = [(mode, lambda kw=kw: timed(kw)) for mode, kw in OVERHEAD_MODES.items()]
        runs = alternate(args.repeats, *sides)
        tok_s = {m: statistics.median(v) for m, v in runs.items()}
        step_ms = {m: 1000 * b / t for m, t in tok_s.items()}  # one token per row a step
        row = {"batch": b, "tok_s": tok_s, "step_ms": step_ms, "runs": runs}
        out.append(row)
        print(f"  batch {b}: {runs}", flush=True)
    print("\n| batch | mode | decode tok/s | ms / step | over plain |")
    print("|---:|---|---:|---:|---:|")
    for row in out:
        plain = row["step_ms"]["plain"]
        for mode in OVERHEAD_MODES:
            ms = row["step_ms"][mode]
            over = "" if mode == "plain" else f"{100 * (ms - plain) / plain:+.1f}%"
            print(f"| {row['batch']} | {mode} | {row['tok_s'][mode]:.1f} | {ms:.1f} | {over} |")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--sampled-batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true", help="time pdserve alone")
    ap.add_argument(
        "--overhead", default="", help="batches: logprobs / structured-output cost per step"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.set_defaults(threads=2)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    cfg = engine_config(args)
    engine = LLMEngine(cfg)
    if args.overhead:
        torch.set_num_threads(args.threads)
        rows_ = overhead(engine, [int(b) for b in args.overhead.split(",")], args)
        engine.check_integrity()
        if args.json is not None:
            head_ = {"model": cfg.model, "dtype": str(engine.dtype), "threads": args.threads}
            args.json.write_text(json.dumps(head_ | {"overhead": rows_}, indent=2) + "\n")
        return
    hf = None if args.no_transformers else HFRunner(cfg.model, engine.dtype)
    vocab = engine.model_config.vocab_size
    torch.set_num_threads(args.threads)  # one setting for both sides

    def sides(prompts: list[list[int]], out_len: int, what: str) -> list[tuple[str, Any]]:
        sampled = what == "sampled"

        def pick(r: Run) -> float:
            return len(prompts[0]) / r.wall_s if what == "prefill" else r.decode_tok_s

        s = [("pdserve", lambda: pick(pdserve_run(engine, prompts, out_len, sampled)))]
        if hf is not None:
            s.append(("hf", lambda: pick(hf.run(prompts, out_len, sampled))))
        return s

    plan = [
        ("decode", b, prompts_for(b, args.prompt_len, vocab, b), args.output_len) for b in batches
    ]
    if b := args.sampled_batch:
        plan.append(("sampled", b, prompts_for(b, args.prompt_len, vocab, b), args.output_len))
    if args.prefill_len:
        plan.append(("prefill", args.prefill_len, prompts_for(1, args.prefill_len, vocab, 0), 1))
    rows: list[Row] = []
    for what, size, prompts, out_len in plan:
        rows.append(Row(what, size, alternate(args.repeats, *sides(prompts, out_len, what))))
        print(f"  {rows[-1].label()}: {rows[-1].runs}", flush=True)
    engine.check_integrity()

    import transformers

    head = {
        "model": cfg.model,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_name(),
    }
    print(
        f"\nmodel={head['model']} dtype={head['dtype']} threads={head['threads']} "
        f"prompt={args.prompt_len} output={args.output_len} repeats={args.repeats} "
        f"torch={head['torch']} transformers={head['transformers']} cpu={head['cpu']}\n"
    )
    print("| what | pdserve tok/s | transformers tok/s | pdserve / transformers |")
    print("|---|---:|---:|---:|")
    out_rows = []
    for r in rows:
        pd_t = r.tok_s("pdserve")
        hf_t = r.tok_s("hf") if hf is not None else float("nan")
        print(f"| {r.label()} | {pd_t:.1f} | {hf_t:.1f} | {pd_t / hf_t:.2f} |")
        out_rows.append(
            {"what": r.what, "size": r.size, "pdserve_tok_s": pd_t, "transformers_tok_s": hf_t}
            | {f"{k}_runs": v for k, v in r.runs.items()}
        )
    if args.json is not None:
        args.json.write_text(json.dumps(head | {"rows": out_rows}, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
