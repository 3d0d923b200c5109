"""The stand-in nodes of `scripts/bench_proxy.py` in a process of their own.

In the benchmark's own process the stand-ins shared one event loop with the load client:
a prefill answer then waited behind whatever the client was reading, and that wait (3 ms
at the median, measured from the proxy's traces at 100 requests/s) was counted as latency
the proxy adds. In their own process they share the client's core(s) only through the
kernel's scheduler, which runs a short answer as soon as it is ready.

`StandInProcess` starts one prefill and one decode `StandInNode` in a spawned child and
drives it over a pipe: the decode stand-in's token pacing, and when it records each
streamed line's write time (`time.monotonic()`, one clock for every process of the
machine), which the client compares with its own reads.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import signal
from collections.abc import Sequence
from typing import Any

from proxy.bench.standin import StandInNode

_REPLY_TIMEOUT_S = 30.0


class StandInProcess:
    """One prefill and one decode stand-in in a child process; stopped by pid."""

    def __init__(self, tokens: Sequence[int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, list(tokens)), daemon=True)
        self._proc.start()
        child.close()
        urls = self._reply()
        self.prefill_url: str = urls["prefill"]
        self.decode_url: str = urls["decode"]

    def set_token_interval(self, seconds: float) -> None:
        self._call("interval", seconds)

    def record_writes(self) -> None:
        """From now on, keep when each decode line is written (the previous record cleared)."""
        self._call("record", None)

    def written(self) -> dict[str, list[float]]:
        """Stop recording; each recorded stream's line write times."""
        return self._call("written", None)

    def stop(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", None))
            except OSError:
                pass
            self._proc.join(10)
        if self._proc.is_alive() and self._proc.pid is not None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.join(10)
        self._conn.close()

    def _call(self, op: str, arg: object) -> Any:
        self._conn.send((op, arg))
        return self._reply()

    def _reply(self) -> Any:
        if not self._conn.poll(_REPLY_TIMEOUT_S):
            self.stop()
            raise TimeoutError("the stand-in process did not answer")
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise RuntimeError("the stand-in process exited") from None
        if not ok:
            raise RuntimeError(f"stand-in process: {value}")
        return value


def _serve(conn: multiprocessing.connection.Connection, tokens: list[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (Ctrl-C reaches both)
    asyncio.run(_main(conn, tokens))


async def _main(conn: multiprocessing.connection.Connection, tokens: list[int]) -> None:
    prefill, decode = StandInNode("prefill", tokens), StandInNode("decode", tokens)
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_command() -> None:
        try:
            op, arg = conn.recv()
        except (EOFError, OSError):  # the parent went away
            op, arg = "stop", None
        if op == "stop":
            if not done.done():
                done.set_result(None)
            return
        try:
            conn.send((True, _run(decode, op, arg)))
        except Exception as e:  # a bad command: the parent raises it
            conn.send((False, f"{type(e).__name__}: {e}"))

    try:
        await prefill.start()
        await decode.start()
        conn.send((True, {"prefill": prefill.url, "decode": decode.url}))
        loop.add_reader(conn.fileno(), on_command)
        await done
    finally:
        loop.remove_reader(conn.fileno())
        await decode.stop()
        await prefill.stop()


def _run(decode: StandInNode, op: str, arg: Any) -> Any:
    if op == "interval":
        decode.token_interval_s = float(arg)
        return None
    if op == "record":
        decode.written.clear()
        decode.record_writes = True
        return None
    if op == "written":
        decode.record_writes = False
        return dict(decode.written)
    raise ValueError(f"unknown command {op!r}")
