"""The KV side channel's records (common.wire.messages) and the model fingerprint: one
encoder, a type tag and a version on every record, refusals with a reason."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.wire.fingerprint import Fingerprint, FingerprintMismatch
from common.wire.messages import (
    Abort,
    Handshake,
    HandshakeReply,
    KVAborted,
    KVDone,
    KVRegion,
    MessageError,
    PeerInfo,
    Release,
    TransferRequest,
    decode,
    encode,
)

FP = Fingerprint(
    weights_hash="abc", dtype="float32", block_size=16, num_layers=4, num_kv_heads=2, head_dim=64
)


@given(
    rid=st.text(min_size=1, max_size=40),
    blocks=st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=64),
)
def test_transfer_request_roundtrip(rid: str, blocks: list[int]) -> None:
    msg = TransferRequest(request_id=rid, dst_agent="d-1", dst_engine_id="d", dst_block_ids=blocks)
    assert decode(encode(msg)) == msg


def test_every_record_roundtrips_with_its_type_tag() -> None:
    info = PeerInfo(
        agent_name="p-1",
        engine_id="p",
        side_channel="tcp://127.0.0.1:1",
        backend="nixl",
        backend_metadata=b"\x00\xffmeta",
        region=KVRegion(base_addr=4096, num_blocks=8, block_bytes=1024),
        fingerprint=FP,
    )
    records = [
        Handshake(peer=info),
        HandshakeReply(accepted=False, error="no", peer=info),
        KVDone(request_id="r"),
        KVAborted(request_id="r", reason="x"),
        Abort(request_id="r"),
        Release(request_id="r", reason="lease expired"),
    ]
    for msg in records:
        raw = msgpack.unpackb(encode(msg), raw=False)
        assert raw["type"] == msg.TYPE and raw["version"] == 1
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"\xc1", "not a msgpack message"),
        (msgpack.packb("hello"), "must be a map"),
        (msgpack.packb({"type": "pickle", "version": 1}), "unknown message type"),
        (msgpack.packb({"type": "kv_done", "version": 7, "request_id": "r"}), "protocol version 7"),
        (msgpack.packb({"type": "kv_done", "version": 1}), "request_id"),
        (msgpack.packb({"type": "kv_done", "version": 1, "request_id": "r", "x": 1}), "x"),
    ],
)
def test_bad_messages_are_refused_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(MessageError, match=reason):
        decode(payload)


def test_fingerprint_mismatch_names_each_differing_field() -> None:
    other = FP.model_copy(update={"dtype": "bfloat16", "weights_hash": "zzz"})
    with pytest.raises(FingerprintMismatch) as e:
        FP.check_compatible(other)
    assert e.value.fields == ["weights_hash", "dtype"]
    assert "dtype differs (ours 'float32', theirs 'bfloat16')" in str(e.value)
    FP.check_compatible(FP.model_copy())


def test_fingerprint_for_kv_cache() -> None:
    import torch

    cache = torch.zeros(3, 4, 2, 16, 2, 64, dtype=torch.bfloat16)
    fp = Fingerprint.for_kv_cache(cache, "abc")
    assert fp == FP.model_copy(update={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="num_blocks, num_layers, 2"):
        Fingerprint.for_kv_cache(torch.zeros(3, 4, 16), "abc")
