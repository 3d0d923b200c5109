"""When a node's NDJSON stream sends its headers: at `prepare` (they tell the proxy the node
took the request: the decode node's dispatcher goes on to the next once they came), or with
the first line (a streamed prefill, which prepares only once its KV handle's line is ready)."""

from __future__ import annotations

import asyncio

from common.node.server import ndjson_response
from tests.support.response_writes import transport_writes

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
