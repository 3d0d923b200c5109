"""What an aiohttp response writes to its transport, and when: for the tests of responses
whose headers go out with their first write."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from unittest import mock

from aiohttp import web
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request


class _RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def writelines(self, lines: Iterable[bytes | bytearray | memoryview]) -> None:
        self.writes.append(b"".join(lines))

    def is_closing(self) -> bool:
        return False


def recording_request(method: str = "POST", path: str = "/") -> tuple[web.Request, list[bytes]]:
    """A request whose response writes go to a list: (the request, its transport's writes)."""
    transport = _RecordingTransport()
    protocol = mock.Mock(transport=transport, _paused=False)  # never waits to drain
    writer = StreamWriter(protocol, asyncio.get_running_loop())
    request = make_mocked_request(
        method, path, writer=writer, protocol=protocol, transport=transport
    )
    return request, transport.writes


async def transport_writes(resp: web.StreamResponse, first: bytes) -> tuple[int, list[bytes]]:
    """Prepare `resp` and write `first`: how many transport writes `prepare` made, and all
    the writes after `first`."""
    request, writes = recording_request()
    await resp.prepare(request)
    at_prepare = len(writes)
    await resp.write(first)
    return at_prepare, writes
