"""The SSE events of text deltas: the per-response template (`TextEvents`) writes the same
JSON as the pydantic models it replaces on the hot path."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given
from hypothesis import strategies as st

from proxy.http.responses import ChatFormat, CompletionFormat, ResponseMeta, TextEvents
from proxy.http.server import SSE_HEADERS, SseResponse
from proxy.http.text_stream import TextDelta
from tests.support.response_writes import transport_writes

FORMATS = (CompletionFormat, ChatFormat)


def _payload(event: bytes | None) -> object:
    assert event is not None and event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[6:])


@given(text=st.text(min_size=1), usage=st.booleans(), model=st.text(min_size=1, max_size=20))
def test_template_events_equal_the_models_output(text: str, usage: bool, model: str) -> None:
    for fmt_cls in FORMATS:
        fmt = fmt_cls(ResponseMeta("cmpl-1", model, 7, usage))
        fast = fmt.stream_delta(TextDelta(text))
        slow = fmt._delta_chunk(TextDelta(text))
        assert _payload(fast) == _payload(slow)


def test_a_finishing_delta_and_an_unlucky_name_take_the_models_path() -> None:
    for fmt_cls in FORMATS:
        fmt = fmt_cls(ResponseMeta("cmpl-1", "m", 7, True))
        done = _payload(fmt.stream_delta(TextDelta("end", "stop")))
        assert isinstance(done, dict) and done["choices"][0]["finish_reason"] == "stop"
        assert fmt.stream_delta(TextDelta("")) is None
        # A model name that contains the template's mark gets no template, and still the
        # right events.
        odd = fmt_cls(ResponseMeta("cmpl-1", TextEvents.mark(), 7, False))
        assert odd._text.event("x") is None
        assert _payload(odd.stream_delta(TextDelta("x"))) == _payload(
            odd._delta_chunk(TextDelta("x"))
        )


def test_sse_headers_go_out_with_the_first_event() -> None:
    """One write for the head and the first event: the first token's send, and the client's
    read of it, are not split in two."""
    resp = SseResponse(headers=SSE_HEADERS)
    at_prepare, writes = asyncio.run(transport_writes(resp, b"data: x\n\n"))
    assert at_prepare == 0
    assert len(writes) == 1
    assert writes[0].startswith(b"HTTP/1.1 200") and writes[0].endswith(b"\r\ndata: x\n\n\r\n")
