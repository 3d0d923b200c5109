"""Reservations while a step's forward pass runs (`LLMEngine.reserve_now`).

A decode node reserves blocks for incoming KV. Between steps only, a reservation that
arrives as a step starts waits the whole step (50-100 ms for a full batch of the real model
here) before its KV may move; `reserve_now` makes it during the forward pass, which reads
only the batch's own blocks. These tests reserve from inside the forward (the runner is
wrapped), check the books after every step, and check that decoding is unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from common.engine.block_allocator import BlockState
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.wire.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
PROMPTS = {"a": list(range(5, 30)), "b": [9, 8, 7], "c": list(range(100, 117))}


def _engine(model_dir: Path, prefix_caching: bool = True) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir), num_blocks=64, block_size=8, enable_prefix_caching=prefix_caching
    )
    return LLMEngine(config)


def _during_forward(engine: LLMEngine, hook: Callable[[], None]) -> None:
    """Call `hook` inside every forward pass of `engine` (on the engine's own thread: the
    books are free there, as they are for any other thread)."""
    run = engine.runner.run

    def wrapped(batch):  # type: ignore[no-untyped-def]
        hook()
        return run(batch)

    engine.runner.run = wrapped  # type: ignore[method-assign]


def _decode_all(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    return tokens


def test_a_reservation_made_during_a_forward_pass_is_whole_and_decodes_as_between_steps(
    tiny_model_dir: Path,
) -> None:
    # Reference: every reservation made between steps.
    want = _engine(tiny_model_dir)
    for rid, ids in PROMPTS.items():
        assert want.reserve(rid, len(ids), ids) is not None
        want.admit_prefilled(rid, ids, 42, SP)
    expected = _decode_all(want)

    engine = _engine(tiny_model_dir)
    engine.reserve("a", len(PROMPTS["a"]), PROMPTS["a"])
    engine.admit_prefilled("a", PROMPTS["a"], 42, SP)
    made: dict[str, list[int] | None] = {}

    def reserve_the_others() -> None:
        for rid in ("b", "c"):
            if rid not in made:
                done, blocks = engine.reserve_now(rid, len(PROMPTS[rid]), PROMPTS[rid])
                assert done  # the books are free while the model runs
                made[rid] = blocks
                return  # one per forward

    _during_forward(engine, reserve_the_others)
    got: dict[str, list[int]] = {}
    for _ in range(2):  # two steps: "b" reserved in the first forward, "c" in the second
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    for rid in ("b", "c"):
        blocks = made[rid]
        assert blocks is not None and len(blocks) == -(-len(PROMPTS[rid]) // 8)
        assert all(engine.allocator.state(b) is BlockState.RESERVED for b in blocks)
        assert engine.state()["requests"]["reserved"] >= 1
        engine.admit_prefilled(rid, PROMPTS[rid], 42, SP)
    for rid, tokens in _decode_all(engine).items():
        got.setdefault(rid, []).extend(tokens)
    # The tiny model's KV is whatever the blocks hold (no transfer here), so the same
    # reservations (same blocks, same order of allocation) decode the same tokens.
    assert got == expected
    assert engine.state()["blocks"]["free"] == 64


def test_reserve_now_defers_to_queued_commands_and_to_a_busy_engine(
    tiny_model_dir: Path,
) -> None:
    engine = _engine(tiny_model_dir)
    engine.abort_request("unknown")  # a command waits: a reservation must not pass it
    assert engine.reserve_now("r", 16) == (False, None)
    engine.step()  # applies it
    done, blocks = engine.reserve_now("r", 16)
    assert done and blocks is not None and len(blocks) == 2
    assert engine.reserve_now("r", 16) == (True, None)  # one reservation per request

    holder_has_books = threading.Event()
    release = threading.Event()

    def hold_books() -> None:  # a step's schedule or postprocess, as another thread sees it
        with engine._books:
            holder_has_books.set()
            release.wait(10)

    holder = threading.Thread(target=hold_books)
    holder.start()
    try:
        assert holder_has_books.wait(10)
        assert engine.reserve_now("s", 16) == (False, None)
    finally:
        release.set()
        holder.join(10)
    engine.free_reserved("r")
    engine.check_integrity()
    assert engine.state()["blocks"]["free"] == 64


def test_reservations_from_another_thread_while_steps_run_keep_the_books(
    tiny_model_dir: Path,
) -> None:
    engine = _engine(tiny_model_dir, prefix_caching=True)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=40, ignore_eos=True))
    stop = threading.Event()
    counts = {"now": 0, "deferred": 0, "full": 0}

    def reserver() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            prompt = PROMPTS["a"] if i % 2 else list(range(200, 200 + i % 40 + 1))
            done, blocks = engine.reserve_now(f"x{i}", len(prompt), prompt)
            time.sleep(0)  # let the engine thread have the GIL
            if not done:
                counts["deferred"] += 1
                continue
            if blocks is None:
                counts["full"] += 1
                continue
            counts["now"] += 1
            engine.call(lambda rid=f"x{i}": engine.free_reserved(rid), lambda r, e: None)

    thread = threading.Thread(target=reserver)
    thread.start()
    try:
        while engine.has_work():
            engine.step()
            engine.check_integrity()
    finally:
        stop.set()
        thread.join(10)
    engine.apply_commands()  # the last frees
    engine.check_integrity()
    assert counts["now"] > 0
    assert engine.state()["requests"]["reserved"] == 0
    assert engine.state()["blocks"]["free"] == 64
