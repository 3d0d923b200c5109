"""Run an `LLMEngine` on its own thread and drive it from asyncio.

The engine thread loops "apply commands, step, publish outputs". It sleeps on an
event when idle, so a submit wakes it at once. Outputs reach the event loop via
`call_soon_threadsafe`; each request has its own asyncio queue. The HTTP event
loop never runs model code, so /health answers while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import TypeVar

from common.engine.engine import LLMEngine
from common.engine.scheduler import OutputKind, StepOutput
from common.wire.sampling_params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


def _ignore(result: object, error: BaseException | None) -> None:
    if error is not None:
        log.error("engine call failed: %r", error)


def _resolve(future: asyncio.Future[T], result: object, error: BaseException | None) -> None:
    if future.done():  # the awaiting caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]  # fn's result, typed T by call()


class EngineThread:
    """Steps an engine on a daemon thread and hands every step's outputs to `publish`.

    Every torch call of the engine belongs on this one thread, its construction and warm-up
    included (`run`, before `start`). GNU OpenMP, torch's CPU thread pool, gives each
    thread that starts a parallel region a team of workers of its own, and a second team
    slows the first one's every region: SmolLM2 in bfloat16 on 2 threads decoded at 110
    tokens/s (batch 8) on a thread other than the one that had loaded and warmed it, against
    200 on that one (a node with one thread has no team, so it never showed).
    """

    def __init__(self, idle_wait: float = 0.5, step_delay_s: float = 0.0) -> None:
        self.engine: LLMEngine | None = None
        self._publish: Callable[[list[StepOutput]], None] = lambda outputs: None
        self._idle_wait = idle_wait
        self._step_delay_s = step_delay_s  # testing: widen the windows between steps
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self.error: BaseException | None = None

    def run(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on this thread before stepping starts (build the engine, warm it up)."""
        future: Future[T] = Future()

        def call() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._calls.put(call)
        self._begin()
        return future

    def start(self, engine: LLMEngine, publish: Callable[[list[StepOutput]], None]) -> None:
        """Step `engine` from now on (after any calls `run` queued)."""
        self.engine, self._publish = engine, publish
        self._calls.put(None)
        self._begin()

    def _begin(self) -> None:
        if self._thread.ident is None:  # not started yet
            self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._calls.put(None)  # a thread still waiting for its calls ends, too
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        while (call := self._calls.get()) is not None:
            call()
        if self.engine is not None:
            self._run(self.engine)

    def _run(self, engine: LLMEngine) -> None:
        try:
            busy = False
            while not self._stop.is_set():
                if not engine.has_work():
                    if busy:  # just went idle: the books must balance now
                        engine.check_integrity_when_idle()
                    busy = False
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
                    continue
                busy = True
                outputs = engine.step()
                if outputs:
                    self._publish(outputs)
                if self._step_delay_s:
                    self._stop.wait(self._step_delay_s)
            # Stopping: apply what is still queued (aborts, releases), so blocks are freed.
            outputs = engine.apply_commands()
            engine.check_integrity_when_idle()  # publishes the final state too
            if outputs:
                self._publish(outputs)
        except BaseException as exc:  # the engine is broken: report, don't hang clients
            log.exception("engine thread died")
            self.error = exc
            self._publish([])


class AsyncEngine:
    """asyncio front of an engine thread: `generate` streams a request's outputs."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        step_delay_s: float = 0.0,
        thread: EngineThread | None = None,
    ) -> None:
        """`loop` is the event loop every method of this front runs on; `thread`, the one
        that built `engine` (EngineThread.run), else a new one (with `step_delay_s`)."""
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._loop = loop
        self._thread = thread if thread is not None else EngineThread(step_delay_s=step_delay_s)
        self.died = asyncio.Event()  # set on this loop once the engine thread died

    async def start(self) -> None:
        self._thread.start(self.engine, self._publish_threadsafe)

    async def stop(self) -> None:
        await asyncio.to_thread(self._thread.stop)

    async def compile_constraint(self, sampling: SamplingParams) -> None:
        """Compile a constrained request's grammar on a worker thread (RequestError if it
        does not compile), so that the checks `generate` makes on the caller's thread find
        it compiled: a new schema (and xgrammar's first load) never stalls this loop."""
        if sampling.structured is not None:
            await asyncio.to_thread(self.engine.compile_constraint, sampling.structured)

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        hold_kv: bool = False,
        stream_kv: bool = False,
        transfer: object | None = None,
    ) -> AsyncGenerator[StepOutput, None]:
        """Stream a new request's outputs (raises RequestError at once if refused); see
        `LLMEngine.add_request` for the flags."""
        return self._submit(
            request_id,
            lambda: self.engine.add_request(
                request_id, prompt_token_ids, sampling, hold_kv, stream_kv, transfer
            ),
            1 if hold_kv else sampling.n,
        )

    def decode_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        sampling: SamplingParams,
    ) -> AsyncGenerator[StepOutput, None]:
        """Stream a request whose prompt KV landed in its reserved blocks."""
        return self._submit(
            request_id,
            lambda: self.engine.admit_prefilled(
                request_id, prompt_token_ids, first_token_id, sampling
            ),
            sampling.n,
        )

    def _submit(
        self, request_id: str, submit: Callable[[], None], choices: int = 1
    ) -> AsyncGenerator[StepOutput, None]:
        # The queue exists before the engine can produce output for the request.
        # The caller must iterate the stream to its end or aclose() it.
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            submit()
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._thread.wake()
        return self._stream(request_id, queue, choices)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[StepOutput], choices: int = 1
    ) -> AsyncGenerator[StepOutput, None]:
        """Yield outputs (of every choice) until the request finishes, each choice; abort it
        if the caller stops early."""
        finished = False
        ended: set[int] = set()
        try:
            while not finished:
                out = await queue.get()
                if out.kind is OutputKind.ENGINE_DEAD:
                    raise RuntimeError("the engine stopped") from self._thread.error
                if out.finished:
                    ended.add(out.choice)
                finished = len(ended) >= choices or (
                    out.finished and out.kind is not OutputKind.TOKENS
                )
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.engine.abort_request(request_id)
                self._thread.wake()

    def abort(self, request_id: str, choice: int | None = None) -> None:
        self.engine.abort_request(request_id, choice)
        self._thread.wake()

    def release_held(self, request_id: str) -> None:
        self.engine.release_held(request_id)
        self._thread.wake()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps and return its result here."""
        future: asyncio.Future[T] = self._loop.create_future()

        def done(result: object, error: BaseException | None) -> None:  # engine thread
            self._loop.call_soon_threadsafe(_resolve, future, result, error)

        self.engine.call(fn, done)
        self._thread.wake()
        return await future

    async def reserve(
        self,
        request_id: str,
        num_tokens: int,
        prompt_token_ids: list[int] | None = None,
        choices: int = 1,
    ) -> list[int] | None:
        """Reserve destination blocks (decode role); None if the engine has no room. With
        the prompt, cached leading blocks are shared (LLMEngine.reserve); `choices`: n.
        At once while the engine is idle or runs a forward pass (`reserve_now`), else
        between steps."""
        done, blocks = self.engine.reserve_now(request_id, num_tokens, prompt_token_ids, choices)
        if done:
            return blocks
        try:
            return await self.call(
                lambda: self.engine.reserve(request_id, num_tokens, prompt_token_ids, choices)
            )
        except asyncio.CancelledError:
            # The reservation may still be made; commands run in order, so this frees it.
            self.engine.call(lambda: self.engine.free_reserved(request_id), _ignore)
            self._thread.wake()
            raise

    def free_reserved(self, request_id: str) -> None:
        """Free a reservation (decode role) once its transfer is quiescent; applied between
        steps, before any later command."""
        self.engine.call(lambda: self.engine.free_reserved(request_id), _ignore)
        self._thread.wake()

    @property
    def error(self) -> BaseException | None:
        """Set once the engine thread died; the node should report unhealthy."""
        return self._thread.error

    def _publish_threadsafe(self, outputs: list[StepOutput]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        if not outputs and self._thread.error is not None:
            self.died.set()
            for rid, q in self._queues.items():
                q.put_nowait(StepOutput(rid, [], True, None, OutputKind.ENGINE_DEAD))
            return
        for out in outputs:
            queue = self._queues.get(out.route or out.request_id)
            if queue is not None:
                queue.put_nowait(out)
