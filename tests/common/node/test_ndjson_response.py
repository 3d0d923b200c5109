"""When a node's NDJSON stream sends its headers: at `prepare` (they tell the proxy the node
took the request: the decode node's dispatcher goes on to the next once they came), or with
the first line (a streamed prefill, which prepares only once its KV handle's line is ready);
and that a stream's last line goes out with the body's end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

from common.engine.scheduler import StepOutput
from common.engine.sequence import FinishReason
from common.node.server import ndjson_response, stream_outputs
from tests.support.response_writes import recording_request, transport_writes

LINE = b'{"type":"x"}\n'


def test_headers_go_out_at_prepare_by_default() -> None:
    at_prepare, writes = asyncio.run(transport_writes(ndjson_response(), LINE))
    assert at_prepare == 1 and writes[0].endswith(b"\r\n\r\n")
    assert writes[1:] == [b"%x\r\n%s\r\n" % (len(LINE), LINE)]


def test_headers_go_out_with_the_first_line_when_asked() -> None:
    at_prepare, writes = asyncio.run(transport_writes(ndjson_response(with_first_line=True), LINE))
    assert at_prepare == 0 and len(writes) == 1
    head, body = writes[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"application/x-ndjson" in head
    assert body == b"%x\r\n%s\r\n" % (len(LINE), LINE)


def _outputs(*outs: StepOutput) -> AsyncGenerator[StepOutput, None]:
    async def gen() -> AsyncGenerator[StepOutput, None]:
        for out in outs:
            yield out

    return gen()


async def _stream_writes(choices: int, *outs: StepOutput) -> list[bytes]:
    """The transport writes of `stream_outputs` over `outs` (the request's engine outputs),
    aiohttp's own `write_eof` after the handler included."""
    request, writes = recording_request()
    resp = await stream_outputs(request, "r", _outputs(*outs), choices=choices)
    await resp.write_eof()
    return writes


def _lines(body: bytes) -> list[dict[str, object]]:
    """The NDJSON lines of chunked body bytes (each chunk one line)."""
    out = []
    while body:
        size, rest = body.split(b"\r\n", 1)
        n = int(size, 16)
        if n:
            out.append(json.loads(rest[:n]))
        body = rest[n + 2 :]
    return out


def test_the_finishing_line_and_the_body_end_go_out_in_one_write() -> None:
    """So that the proxy reads them at once and keeps the connection for its next call."""
    writes = asyncio.run(
        _stream_writes(
            1,
            StepOutput("r", [5], False),
            StepOutput("r", [6], True, FinishReason.LENGTH),
        )
    )
    assert len(writes) == 3  # the head, a line, the last line with the end
    assert [line["token_ids"] for line in _lines(writes[1])] == [[5]]
    assert writes[2].endswith(b"\r\n0\r\n\r\n")
    (last,) = _lines(writes[2])
    assert last["token_ids"] == [6] and last["finish_reason"] == "length"


def test_with_several_choices_the_body_ends_with_the_last_to_finish() -> None:
    writes = asyncio.run(
        _stream_writes(
            2,
            StepOutput("r", [5], True, FinishReason.STOP, choice=1),
            StepOutput("r", [6], False, choice=0),
            StepOutput("r", [7], True, FinishReason.LENGTH, choice=0),
        )
    )
    assert len(writes) == 4
    assert not any(w.endswith(b"0\r\n\r\n") for w in writes[:3])
    assert [line["choice"] for w in writes[1:] for line in _lines(w)] == [1, 0, 0]
    assert writes[3].endswith(b"\r\n0\r\n\r\n")
