"""Seals on side-channel messages (kv_transfer/auth.py): forged, tampered, misdirected and
replayed messages are refused; fresh ones from the named sender are accepted."""

from __future__ import annotations

from kv_transfer.auth import SEAL_BYTES, Opener, Sealer

TOKEN = b"kv-cluster-token-0123456789"


def test_a_sealed_message_opens_once_and_only_from_its_sender() -> None:
    a, b = Sealer(TOKEN, b"side", "a-1"), Opener(TOKEN, b"side", "b-1")
    first, second = a.seal("b-1", b"hello"), a.seal("b-1", b"again")
    assert len(first) == SEAL_BYTES
    assert b.open("a-1", b"hello", first)
    assert not b.open("a-1", b"hello", first)  # a replay
    assert not b.open("c-1", b"again", second)  # another sender's name
    assert not b.open("a-1", b"agaiN", second)  # tampered
    assert b.open("a-1", b"again", second)
    assert not b.open("a-1", b"hello", None) and not b.open("a-1", b"hello", b"short")


def test_seals_depend_on_the_token_the_label_and_the_receiver() -> None:
    msg = b"KVDone"
    for sealer, receiver in (
        (Sealer(b"another-token-0123456789", b"side", "a-1"), "b-1"),  # wrong token
        (Sealer(TOKEN, b"data", "a-1"), "b-1"),  # another channel
        (Sealer(TOKEN, b"side", "a-1"), "b-2"),  # meant for another agent (incarnation)
    ):
        assert not Opener(TOKEN, b"side", "b-1").open("a-1", msg, sealer.seal(receiver, msg))


def test_an_older_message_is_refused_after_a_newer_one() -> None:
    """Sequence numbers only grow: a message held back and sent later is a replay."""
    a, b = Sealer(TOKEN, b"side", "a-1"), Opener(TOKEN, b"side", "b-1")
    old, new = a.seal("b-1", b"x"), a.seal("b-1", b"y")
    assert b.open("a-1", b"y", new)
    assert not b.open("a-1", b"x", old)
