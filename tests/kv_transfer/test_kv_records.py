"""Messages, fingerprint, lease, transfer states, config: the layer's plain records."""

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
from kv_transfer import TransferConfig
from kv_transfer.state import (
    IllegalTransition,
    IncomingTransfer,
    InState,
    OutgoingTransfer,
    OutState,
)
from prefill_node.lease import Lease

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


def test_lease_expiry_and_extension() -> None:
    lease = Lease.grant("r1", [3, 1, 2], ttl_s=10.0, now=100.0)
    assert lease.deadline == 110.0 and not lease.expired(109.9) and lease.expired(110.0)
    longer = lease.extend(30.0, now=105.0)
    assert longer.deadline == 135.0 and lease.deadline == 110.0  # a new value
    assert lease.extend(1.0, now=105.0).deadline == 110.0  # never shortened
    assert lease.extend(30.0, now=105.0, max_deadline=120.0).deadline == 120.0
    assert lease.with_peer("d-1").peer == "d-1"
    assert lease.remaining(104.0) == 6.0
    with pytest.raises(ValueError, match="expired"):
        lease.extend(5.0, now=111.0)
    with pytest.raises(ValueError, match="duplicate"):
        Lease.grant("r2", [1, 1], ttl_s=1.0)


def test_outgoing_transitions_are_checked() -> None:
    import numpy as np

    ids = np.zeros(1, dtype=np.int32)
    xfer = OutgoingTransfer("r", "p", ids, ids, 16)
    with pytest.raises(IllegalTransition):
        xfer.transition(OutState.DONE)  # must be posted first
    xfer.transition(OutState.POSTED)
    xfer.transition(OutState.ABORTING)
    xfer.transition(OutState.DONE)  # finished anyway
    assert xfer.terminal
    with pytest.raises(IllegalTransition):
        xfer.transition(OutState.FAILED)
    inc = IncomingTransfer("r", "p", ids)
    inc.transition(InState.ABORT_REQUESTED)
    assert inc.abort_requested
    inc.transition(InState.ABORTED)
    with pytest.raises(IllegalTransition):
        inc.transition(InState.LANDED)


def test_config_validation_and_env() -> None:
    with pytest.raises(ValueError, match="backend"):
        TransferConfig(backend="rdma")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        TransferConfig(heartbeat_interval_s=1.0, peer_timeout_s=1.5)
    cfg = TransferConfig.from_env(
        {
            "PDSERVE_KV_BACKEND": "zmq",
            "PDSERVE_KV_PEER_TIMEOUT_S": "4",
            "PDSERVE_KV_UCXX_ERROR_HANDLING": "0",
        },
        host="127.0.0.2",
    )
    assert (cfg.backend, cfg.peer_timeout_s, cfg.ucxx_error_handling, cfg.host) == (
        "zmq",
        4.0,
        False,
        "127.0.0.2",
    )


def test_bench_tiny_shape_is_the_built_in_models() -> None:
    """bench-transfer's "tiny" shape (written out, kv_transfer imports no model) is the tiny
    model's KV block."""
    from common.engine.config import EngineConfig
    from common.tiny.model import TinyLlamaShape
    from kv_transfer.bench.main import SHAPES

    t, s = TinyLlamaShape(), SHAPES["tiny"]()
    assert (s.layers, s.heads, s.head_dim) == (
        t.num_hidden_layers,
        t.num_key_value_heads,
        t.head_dim,
    )
    assert s.block_size == EngineConfig(model="").block_size
