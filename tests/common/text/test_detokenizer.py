"""IncrementalDetokenizer: streamed text equals the one-shot decode, never ends mid-character.

Run against the tiny model's byte-level BPE and a locally built SentencePiece-style tokenizer
(Metaspace, byte fallback, Llama-2 decoder chain) so both decoding paths are exercised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from common.tiny.corpus import CORPUS
from common.tiny.model import build_vocab, train_bpe

SP_SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
INTERESTING = [*"aé中文字😀👍🏽ñ…ü\u0301\u0303\u200d\n ▁", "👨‍👩‍👧", "🇫🇷", "<s>", "<|im_end|>"]

text_strategy = st.lists(
    st.one_of(
        st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"),
        st.sampled_from(INTERESTING),
    ),
    max_size=40,
).map("".join)
chunk_sizes = st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=8)
HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def make_sentencepiece_style_tokenizer() -> Tokenizer:
    """A Llama-2-like tokenizer: BPE with byte_fallback over an ASCII-ish alphabet.

    Characters outside the alphabet (CJK, emoji, Cyrillic...) encode as ``<0xNN>`` tokens.
    """
    english = CORPUS[: CORPUS.index("The quick brown fox")]
    words = Counter("▁" + w for w in english.split())
    merges = train_bpe(words, max_new_tokens=400)
    alphabet = sorted({c for w in words for c in w} | set("éèàüöäßçñ"))
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = build_vocab([*byte_tokens, *alphabet], merges, SP_SPECIALS)
    backend = HFTokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SP_SPECIALS])
    return Tokenizer(backend, eos_token_ids=[2], special_tokens={"bos_token": "<s>"})


@pytest.fixture(scope="module")
def sp_tokenizer() -> Tokenizer:
    return make_sentencepiece_style_tokenizer()


@pytest.fixture(params=["byte_level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest, tiny_tokenizer: Tokenizer) -> Tokenizer:
    if request.param == "byte_level":
        return tiny_tokenizer
    return request.getfixturevalue("sp_tokenizer")


def any_ids(tokenizer: Tokenizer) -> st.SearchStrategy[int]:
    """Any id, biased to specials and single bytes (ids 0..260 in both tokenizers), plus ids
    past the vocabulary (a padded embedding can produce them; decode drops them)."""
    n = tokenizer.vocab_size
    return st.one_of(
        st.integers(min_value=0, max_value=n - 1),
        st.integers(min_value=0, max_value=260),
        st.integers(min_value=n, max_value=n + 63),
    )


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int]
) -> tuple[list[str], str]:
    """Push ``ids`` in chunks of ``sizes`` (cycled); return the pushed texts and the flush."""
    pushed: list[str] = []
    pos, k = 0, 0
    while pos < len(ids):
        n = sizes[k % len(sizes)]
        pushed.append(detok.push(ids[pos : pos + n]))
        pos, k = pos + n, k + 1
    return pushed, detok.flush()


def test_sp_tokenizer_uses_byte_fallback(sp_tokenizer: Tokenizer) -> None:
    ids = sp_tokenizer.encode("the 中 😀", add_special_tokens=False)
    assert set(ids) & sp_tokenizer.byte_fallback_ids
    assert sp_tokenizer.decode(ids) == "the 中 😀"


@HYPOTHESIS
@given(text=text_strategy, sizes=chunk_sizes, skip=st.booleans())
def test_valid_text_streams_exactly(
    tokenizer: Tokenizer, text: str, sizes: list[int], skip: bool
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pushed, rest = stream(IncrementalDetokenizer(tokenizer, skip), ids, sizes)
    assert "".join(pushed) + rest == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in chunk for chunk in pushed)


@HYPOTHESIS
@given(data=st.data(), sizes=chunk_sizes, skip=st.booleans())
def test_random_ids_stream_exactly(
    tokenizer: Tokenizer, data: st.DataObject, sizes: list[int], skip: bool
) -> None:
    """Arbitrary ids (often invalid UTF-8, specials, byte-fallback runs): same text as decode.

    Exact for any stream shorter than ``max_pending`` (longer invalid byte-fallback runs are
    the documented exception)."""
    ids = data.draw(st.lists(any_ids(tokenizer), max_size=48))
    detok = IncrementalDetokenizer(tokenizer, skip, max_pending=64)
    pushed, rest = stream(detok, ids, sizes)
    assert "".join(pushed) + rest == tokenizer.decode(ids, skip_special_tokens=skip)


@HYPOTHESIS
@given(data=st.data(), sizes=chunk_sizes)
def test_window_bounded_for_garbage(
    tokenizer: Tokenizer, data: st.DataObject, sizes: list[int]
) -> None:
    """Whatever the ids, the decoded window stays O(max_pending) (exactness aside)."""
    ids = data.draw(st.lists(any_ids(tokenizer), max_size=64))
    detok = IncrementalDetokenizer(tokenizer, max_pending=2)
    pos, k, widest = 0, 0, 0
    while pos < len(ids):
        n = sizes[k % len(sizes)]
        detok.push(ids[pos : pos + n])
        widest = max(widest, detok.window_size)
        pos, k = pos + n, k + 1
    detok.flush()
    assert widest <= 2 * (4 * 2 + max(sizes))


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    im_start, im_end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    assert im_start is not None and im_end is not None
    ids = [im_start, *tokenizer.encode("héllo 中", add_special_tokens=False), im_end]
    pushed, rest = stream(IncrementalDetokenizer(tokenizer, skip), ids, [1])
    text = "".join(pushed) + rest
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip
    assert "héllo 中" in text


def test_window_stays_small(tokenizer: Tokenizer) -> None:
    """Per-token cost is bounded: the decoded window never spans the whole sequence."""
    text = CORPUS[:4000]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out, widest = [], 0
    for i in ids:
        out.append(detok.push([i]))
        widest = max(widest, detok.window_size)
    out.append(detok.flush())
    assert "".join(out) == tokenizer.decode(ids)
    assert len(ids) > 500 and widest <= 16


@pytest.mark.parametrize("max_pending", [1, 5, 16])
def test_max_pending_bounds_long_byte_fallback_runs(
    sp_tokenizer: Tokenizer, max_pending: int
) -> None:
    """A long valid run of <0xNN> tokens is cut on whole characters: bounded and still exact."""
    text = "中文字😀é" * 12
    ids = sp_tokenizer.encode(text, add_special_tokens=False)  # "▁", then mostly byte tokens
    detok = IncrementalDetokenizer(sp_tokenizer, max_pending=max_pending)
    out, widest = [], 0
    for i in ids:
        out.append(detok.push([i]))
        widest = max(widest, detok.window_size)
    assert widest <= 2 * max_pending + 8
    assert sum(1 for chunk in out if chunk) > 5  # streamed, not held to the end
    assert not any("\ufffd" in chunk for chunk in out)
    assert "".join(out) + detok.flush() == sp_tokenizer.decode(ids) == text


def test_holds_back_incomplete_characters(tiny_tokenizer: Tokenizer) -> None:
    emoji = "😀".encode()
    byte_ids = [tiny_tokenizer.token_to_id(_byte_symbol(b)) for b in emoji]
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert [detok.push([i]) for i in byte_ids if i is not None] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_prompt_context_keeps_leading_space(sp_tokenizer: Tokenizer) -> None:
    prompt = sp_tokenizer.encode("Hello", add_special_tokens=False)
    generated = sp_tokenizer.encode("Hello world", add_special_tokens=False)[len(prompt) :]
    assert sp_tokenizer.decode(generated) == "world"  # the SentencePiece decoder strips it
    detok = IncrementalDetokenizer(sp_tokenizer, prompt_ids=prompt)
    pushed, rest = stream(detok, generated, [1])
    assert "".join(pushed) + rest == " world"


def test_empty_push_and_flush(tiny_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert detok.push([]) == ""
    assert detok.flush() == ""
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tiny_tokenizer, max_pending=0)


def _byte_symbol(b: int) -> str:
    from common.tiny.model import bytes_to_unicode

    return bytes_to_unicode()[b]
