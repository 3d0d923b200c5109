"""TextStream and StopMatcher: stop strings cut exactly, partial matches never leak."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.text.tokenizer import Tokenizer
from proxy.http.backend import TokenChunk
from proxy.http.text_stream import StopMatcher, TextDelta, TextStream

ALPHABET = "ab cé€🌿\n你好"


def test_stop_matcher_holds_back_possible_prefixes() -> None:
    m = StopMatcher(["Hello", "ab"])
    assert m.push("xxHel") == ("xx", False) and m.held == "Hel"
    assert m.push("p") == ("Help", False) and m.held == ""
    assert m.push("a") == ("", False) and m.held == "a"
    assert m.push("") == ("", False)
    assert m.push("Hell") == ("a", False) and m.held == "Hell"
    assert m.push("o world") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_earliest_match_wins() -> None:
    m = StopMatcher(["cd", "bcx", "b"])
    assert m.push("abcd") == ("a", True)
    m = StopMatcher(["xyz"])
    assert m.push("xy") == ("", False)
    assert m.flush() == "xy"


def test_stop_matcher_rejects_empty() -> None:
    with pytest.raises(ValueError):
        StopMatcher([""])


def run_stream(
    tok: Tokenizer,
    ids: list[int],
    cuts: list[int],
    stops: list[str],
    finish: str = "length",
    stop_ids: tuple[int, ...] = (),
) -> tuple[list[TextDelta], TextStream]:
    """Feed `ids` split at `cuts`, as a backend would, until the stream finishes."""
    bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(ids)), len(ids)]
    chunks = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    stream = TextStream(tok, tok.encode("Prompt:"), stops, stop_ids)
    deltas = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        deltas.append(stream.push(TokenChunk(chunk, finish if last else None)))
        if stream.finished:
            break
    return deltas, stream


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(ALPHABET, min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stop_spans=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), max_size=3),
    extra_stop=st.text(ALPHABET, min_size=1, max_size=4),
)
# Overlapping stops: "a" completes before " \naa", which starts earlier.
@example(text=" \naa", cuts=[3], stop_spans=[(0, 4)], extra_stop="a")
def test_stop_strings_cut_at_first_match_and_never_leak(
    tiny_tokenizer: Tokenizer,
    text: str,
    cuts: list[int],
    stop_spans: list[tuple[int, int]],
    extra_stop: str,
) -> None:
    tok = tiny_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    stops = [full[a : a + n] for a, n in stop_spans if full[a : a + n]] + [extra_stop]
    deltas, stream = run_stream(tok, ids, cuts, stops)

    hits = [i for i in (full.find(s) for s in stops) if i >= 0]
    out = "".join(d.text for d in deltas)
    # Generation stops as soon as a stop string is complete (as OpenAI's does), so with
    # overlapping stops the cut depends on how the text arrived: a later-starting stop
    # that completes first wins over an earlier-starting one. Chunking-independent
    # truths: the output is the text up to the start of some stop occurrence, and it
    # holds no stop string; without any stop in the text it is the whole text.
    assert full.startswith(out)
    if hits:
        assert any(full[len(out) :].startswith(s) for s in stops)
        assert len(out) <= min(full.find(s) for s in stops if s in full) + max(map(len, stops))
    else:
        assert out == full
    assert stream.finish_reason == ("stop" if hits else "length")
    assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert not any(s in out for s in stops)
    # Nothing emitted was later taken back: every emitted prefix is a prefix of the output.
    emitted = ""
    for d in deltas:
        emitted += d.text
        assert out.startswith(emitted)


def test_stop_token_is_counted_not_rendered(tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    ids = tok.encode("hello world", add_special_tokens=False)
    stop_id = tok.encode("!", add_special_tokens=False)[0]
    deltas, stream = run_stream(tok, [*ids, stop_id], [2], [], "stop", (stop_id,))
    assert "".join(d.text for d in deltas) == "hello world"
    assert stream.completion_tokens == len(ids) + 1
    assert stream.finish_reason == "stop"


def test_partial_stop_flushed_at_end(tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    ids = tok.encode("one two thr", add_special_tokens=False)
    deltas, stream = run_stream(tok, ids, list(range(len(ids))), ["three"])
    assert "".join(d.text for d in deltas[:-1]) == "one two "
    assert deltas[-1] == TextDelta("thr", "length")


def test_chunk_after_finish_is_refused(tiny_tokenizer: Tokenizer) -> None:
    stream = TextStream(tiny_tokenizer, [5])
    stream.push(TokenChunk([6], "length"))
    with pytest.raises(RuntimeError):
        stream.push(TokenChunk([7]))


def test_stop_strings_wait_for_min_tokens(tiny_tokenizer: Tokenizer) -> None:
    """Until min_tokens tokens were generated a stop string does not end the stream (vLLM's
    rule: the token that reaches min_tokens is the first one checked)."""
    tok = tiny_tokenizer
    ids = tok.encode("xy ab ab ab", add_special_tokens=False)
    assert [tok.decode([t]) for t in ids] == ["xy", " ab", " ab", " ab"]
    chunks = [TokenChunk([t]) for t in ids]
    plain = TextStream(tok, [5], ["ab"])
    assert [plain.push(c).finish_reason for c in chunks[:2]] == [None, "stop"]
    stream = TextStream(tok, [5], ["ab"], min_tokens=3)
    deltas = [stream.push(c) for c in chunks[:3]]
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert "".join(d.text for d in deltas) == "xy ab "
