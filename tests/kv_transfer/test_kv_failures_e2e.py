"""Real processes, every backend: kills, aborts, refusals. Nothing lands after it may not.

Kill tests issue 16 transfers of 16 MiB (1 MiB blocks, one in flight at a time)
in one call and SIGKILL a side right after. The survivor must end every transfer
exactly once within a bounded wait, and whatever it reports as done must be
byte-exact in the destination (for a killed receiver: read from its
shared-memory cache file).
"""

from __future__ import annotations

import os
import signal
import time

import msgpack
import numpy as np
import pytest
import zmq

from common.wire.messages import TransferRequest, encode
from tests.support.kv_agent_node import pattern
from tests.support.kv_agents import (
    CacheSpec,
    NodeError,
    collect,
    count_terminal,
    messages,
    read_shm,
    start_pair,
    terminal,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WAIT = 60.0
BIG = dict(layers=8, heads=8, dim=64, block_size=16)  # 1 MiB float32 blocks
N, PER = 16, 16  # transfers, blocks per transfer


def plan(seed: int) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    src, dst = rng.permutation(N * PER).tolist(), rng.permutation(N * PER).tolist()
    return {
        f"k{i}": {"src": src[i * PER : (i + 1) * PER], "dst": dst[i * PER : (i + 1) * PER]}
        for i in range(N)
    }


def exact(blocks: np.ndarray, seed: int, src: list[int]) -> bool:
    return all(
        np.array_equal(blocks[j], pattern(seed, s, blocks.shape[1])) for j, s in enumerate(src)
    )


def ended_once(events: list[dict], rids: list[str]) -> dict[str, dict]:
    ends = terminal(events)
    assert sorted(e["request_id"] for e in ends) == sorted(rids), ends
    return {e["request_id"]: e for e in ends}


def test_receiver_killed_mid_transfer(trio, victim, shm_path) -> None:
    spec = CacheSpec(num_blocks=N * PER, **BIG)
    cfg = {"max_inflight_per_peer": 1}
    p, d = start_pair(trio.prefill, victim, trio.backend, spec, spec, p_config=cfg, d_shm=shm_path)
    trio.prefill.call("fill_pattern", ids=list(range(N * PER)), seed=11)
    work = plan(1)
    writes = [{"rid": rid, **w} for rid, w in work.items()]
    trio.prefill.call("write_then_abort", peer=d["name"], writes=writes, abort=[])
    victim.kill()
    events = collect(
        trio.prefill,
        lambda ev: len(terminal(ev)) >= N and any(e["kind"] == "PeerLost" for e in ev),
        WAIT,
    )
    ends = ended_once(events, list(work))
    assert {e["kind"] for e in ends.values()} <= {"TransferDone", "TransferFailed"}
    failed = [r for r, e in ends.items() if e["kind"] == "TransferFailed"]
    assert failed, "the kill should interrupt the stream of writes"
    assert all(ends[r]["reason"] == "peer_lost" for r in failed)
    cache = read_shm(shm_path, spec)
    for rid in (r for r, e in ends.items() if e["kind"] == "TransferDone"):
        assert exact(cache[work[rid]["dst"]], 11, work[rid]["src"]), rid


def test_sender_killed_mid_transfer(trio, victim) -> None:
    spec = CacheSpec(num_blocks=N * PER, **BIG)
    cfg = {"max_inflight_per_peer": 1}
    p, d = start_pair(victim, trio.decode1, trio.backend, spec, spec, p_config=cfg)
    victim.call("fill_pattern", ids=list(range(N * PER)), seed=12)
    work = plan(2)
    for rid, w in work.items():
        trio.decode1.call("request", peer=p["name"], rid=rid, dst=w["dst"])
    collect(victim, lambda ev: len(messages(ev, "transfer_request")) >= N, WAIT)
    writes = [{"rid": rid, **w} for rid, w in work.items()]
    victim.call("write_then_abort", peer=d["name"], writes=writes, abort=[])
    victim.kill()
    events = collect(
        trio.decode1,
        lambda ev: len(terminal(ev)) >= N and any(e["kind"] == "PeerLost" for e in ev),
        WAIT,
    )
    ends = ended_once(events, list(work))
    assert {e["kind"] for e in ends.values()} <= {"KVReceived", "TransferFailed"}
    failed = [r for r, e in ends.items() if e["kind"] == "TransferFailed"]
    assert failed and all(ends[r]["reason"] == "peer_lost" for r in failed)
    for rid in (r for r, e in ends.items() if e["kind"] == "KVReceived"):
        raw = trio.decode1.call("read", ids=work[rid]["dst"])
        blocks = np.frombuffer(raw, dtype=np.uint8).reshape(PER, spec.block_bytes)
        assert exact(blocks, 12, work[rid]["src"]), rid


def test_abort_mid_transfer_then_blocks_reused(trio) -> None:
    spec = CacheSpec(num_blocks=N * PER, **BIG)
    cfg = {"max_inflight_per_peer": 1}
    p, d = start_pair(trio.prefill, trio.decode1, trio.backend, spec, spec, p_config=cfg)
    trio.prefill.call("fill_pattern", ids=list(range(N * PER)), seed=13)
    work = plan(3)
    for rid, w in work.items():
        trio.decode1.call("request", peer=p["name"], rid=rid, dst=w["dst"])
    collect(trio.prefill, lambda ev: len(messages(ev, "transfer_request")) >= N, WAIT)
    aborted = [f"k{i}" for i in range(N // 2, N)]
    writes = [{"rid": rid, **w} for rid, w in work.items()]
    trio.prefill.call("write_then_abort", peer=d["name"], writes=writes, abort=aborted)
    p_ends = ended_once(collect(trio.prefill, count_terminal(N), WAIT), list(work))
    d_ends = ended_once(collect(trio.decode1, count_terminal(N), WAIT), list(work))
    for rid in aborted:  # Quiescent, unless the write had already finished
        assert p_ends[rid]["kind"] in ("Quiescent", "TransferDone")
    not_landed = [
        r for r in aborted if p_ends[r]["kind"] == "Quiescent" and not p_ends[r]["landed"]
    ]
    assert not_landed, "some aborted writes should still have been queued"
    for rid, e in p_ends.items():
        landed = e["kind"] == "TransferDone" or e.get("landed")
        assert d_ends[rid]["kind"] == ("KVReceived" if landed else "TransferFailed"), rid
    # The owner frees the quiescent blocks and reuses them: no late write may land.
    reused = [b for r in not_landed for b in work[r]["dst"]]
    sentinel = np.full((len(reused), spec.block_bytes), 0xA5, dtype=np.uint8)
    trio.decode1.call("fill", ids=reused, data=sentinel.tobytes())
    time.sleep(1.0)
    assert not terminal(trio.decode1.events(wait=0.2))
    raw = trio.decode1.call("read", ids=reused)
    assert np.array_equal(np.frombuffer(raw, dtype=np.uint8).reshape(sentinel.shape), sentinel)
    with pytest.raises(NodeError, match="aborted"):  # and no write for it may start again
        trio.prefill.call("write", rid=not_landed[0], peer=d["name"], src=[0], dst=[0])


def test_receiver_abort_before_the_write(trio) -> None:
    spec = CacheSpec(num_blocks=32, layers=2, heads=2, dim=16, block_size=4)
    p, d = start_pair(trio.prefill, trio.decode1, trio.backend, spec, spec)
    trio.decode1.call("request", peer=p["name"], rid="a0", dst=[1, 2])
    trio.decode1.call("request", peer=p["name"], rid="a1", dst=[3, 4])
    assert trio.decode1.call("abort", rid="a0") is True
    p_events = collect(trio.prefill, lambda ev: len(messages(ev, "abort")) >= 1, WAIT)
    assert len(messages(p_events, "transfer_request")) == 2
    with pytest.raises(NodeError, match="aborted"):
        trio.prefill.call("write", rid="a0", peer=d["name"], src=[5, 6], dst=[1, 2])
    trio.prefill.call("write", rid="a1", peer=d["name"], src=[7, 8], dst=[3, 4])
    d_ends = ended_once(collect(trio.decode1, count_terminal(2), WAIT), ["a0", "a1"])
    assert d_ends["a0"]["kind"] == "Quiescent" and d_ends["a0"]["landed"] is False
    assert d_ends["a1"]["kind"] == "KVReceived"


@pytest.mark.parametrize(
    "field, d_change",
    [
        ("weights_hash", {"weights_hash": "other-weights"}),
        ("dtype", {"dtype": "bfloat16"}),
        ("num_kv_heads", {"heads": 4}),
    ],
)
def test_fingerprint_mismatch_refused(trio, field: str, d_change: dict) -> None:
    base = dict(num_blocks=16, layers=2, heads=2, dim=16, block_size=4)
    p = trio.prefill.start(trio.backend, "prefill", CacheSpec(**base).as_dict())
    weights = d_change.get("weights_hash", "w0")
    bad = CacheSpec(
        **{**base, **{k: v for k, v in d_change.items() if k != "weights_hash"}}
    ).as_dict()
    trio.decode1.start(trio.backend, "decode", bad, weights_hash=weights)
    with pytest.raises(NodeError, match=rf"HandshakeError: .*{field} differs"):
        trio.decode1.call("connect", address=p["address"])
    # the prefill node keeps serving compatible peers
    good = trio.decode2.start(trio.backend, "decode", CacheSpec(**base).as_dict())
    assert trio.decode2.call("connect", address=p["address"]) == p["name"]
    trio.prefill.call("write", rid="fp-ok", peer=good["name"], src=[1], dst=[2])
    assert terminal(collect(trio.decode2, count_terminal(1), WAIT))[0]["kind"] == "KVReceived"


def test_malformed_and_unknown_messages_rejected(trio) -> None:
    spec = CacheSpec(num_blocks=16, layers=2, heads=2, dim=16, block_size=4)
    p = trio.prefill.start(trio.backend, "prefill", spec.as_dict())
    bad = [
        b"\xc1 not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"type": "no_such_type", "version": 1}),
        msgpack.packb({"type": "kv_done", "version": 99, "request_id": "x"}),
        msgpack.packb({"type": "transfer_request", "version": 1, "request_id": "x"}),
        encode(
            TransferRequest(request_id="x", dst_agent="a", dst_engine_id="e", dst_block_ids=[1])
        ),
        b"\x00" * (17 * 2**20),
    ]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(p["address"])
    try:
        for payload in bad:
            sock.send(payload)
            assert sock.poll(10_000), "no reply to a bad message"
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["type"] == "reject" and reply["reason"]
    finally:
        sock.close(linger=0)
    assert trio.prefill.call("rejected") == len(bad)
    d = trio.decode1.start(trio.backend, "decode", spec.as_dict())  # still serving
    assert trio.decode1.call("connect", address=p["address"]) == p["name"]
    trio.prefill.call("write", rid="after-junk", peer=d["name"], src=[3], dst=[4])
    assert terminal(collect(trio.decode1, count_terminal(1), WAIT))[0]["kind"] == "KVReceived"


def _asked_then_stopped(trio, victim, rid: str, config: dict) -> tuple[dict, dict]:
    """A fresh sender (the victim) and receiver (decode1, with `config`); the receiver asks
    for `rid` into blocks 1 and 2, and once the sender has the request it is SIGSTOPped
    (the caller SIGCONTs it). Returns both start() results."""
    spec = CacheSpec(num_blocks=8, layers=2, heads=2, dim=16, block_size=4)
    p = victim.start(trio.backend, "prefill", spec.as_dict())
    d = trio.decode1.start(trio.backend, "decode", spec.as_dict(), config=config)
    assert trio.decode1.call("connect", address=p["address"]) == p["name"]
    trio.decode1.call("request", peer=p["name"], rid=rid, dst=[1, 2])
    collect(victim, lambda ev: len(messages(ev, "transfer_request")) >= 1, WAIT)
    os.kill(victim.proc.pid, signal.SIGSTOP)
    return p, d


def test_blocks_of_a_silent_sender_stay_quarantined_until_it_answers(trio, victim) -> None:
    """Issue 13: a receiver freed its blocks as soon as it declared the sender lost, though
    a live (stalled, partitioned) sender's one-sided write could still land in them. Here the
    sender is stopped (SIGSTOP) until the receiver declares it lost for silence. nixl: the
    request fails at once (TransferLost) but its blocks stay held until the sender, back and
    asked again, says no write is in progress. zmq, ucxx: the receiver stops taking the
    peer's bytes when it drops it, so the transfer just fails."""
    p, d = _asked_then_stopped(trio, victim, "q", {"peer_timeout_s": 1.0})
    try:
        events = collect(trio.decode1, lambda ev: any(e["kind"] == "PeerLost" for e in ev), WAIT)
        if trio.backend != "nixl":
            (end,) = ended_once(events, ["q"]).values()
            assert end["kind"] == "TransferFailed" and end["reason"] == "peer_lost"
            return
        assert [e["request_id"] for e in events if e["kind"] == "TransferLost"] == ["q"]
        assert not terminal(events) and trio.decode1.call("quarantined") == 1
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    # Back: the receiver connects again and asks; the sender has no write for it.
    deadline = time.monotonic() + WAIT
    while True:
        try:
            trio.decode1.call("connect", address=p["address"])
            break
        except NodeError:
            assert time.monotonic() < deadline, "never reconnected"
            time.sleep(0.2)
    (end,) = ended_once(collect(trio.decode1, count_terminal(1), WAIT), ["q"]).values()
    assert end["kind"] == "TransferFailed" and "quarantine ended" in end["detail"]
    assert trio.decode1.call("quarantined") == 0
    with pytest.raises(NodeError, match="aborted"):  # it asked with an Abort: no write now
        victim.call("write", rid="q", peer=d["name"], src=[3, 4], dst=[1, 2])


def test_a_receiver_redials_a_lost_sender_to_end_its_quarantine(trio, victim) -> None:
    """As above, but nobody connects again: the receiver itself redials the lost sender of
    its quarantined write (every two heartbeats), so the quarantine ends with the sender's
    answer, not with the 60 s timeout, even when no new transfer from it is ever asked for
    (the decode node of a deployment whose later prompts are all prefilled locally)."""
    if trio.backend != "nixl":
        pytest.skip("only one-sided writes are quarantined")
    _asked_then_stopped(trio, victim, "r", {"peer_timeout_s": 1.0, "heartbeat_interval_s": 0.2})
    try:
        events = collect(trio.decode1, lambda ev: any(e["kind"] == "PeerLost" for e in ev), WAIT)
        assert trio.decode1.call("quarantined") == 1, events
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    (end,) = ended_once(collect(trio.decode1, count_terminal(1), WAIT), ["r"]).values()
    assert end["kind"] == "TransferFailed" and "quarantine ended" in end["detail"], end
    assert trio.decode1.call("quarantined") == 0
    assert trio.decode1.call("quarantine_timeouts") == 0


def test_quarantine_ends_when_a_new_incarnation_takes_the_address(trio, victim) -> None:
    """A sender killed and started again on the same address is a new incarnation: the old
    process can write nothing any more, so its quarantined blocks are released at the
    handshake with the new one (well before any timeout)."""
    spec = CacheSpec(num_blocks=8, layers=2, heads=2, dim=16, block_size=4)
    slow = {"quarantine_timeout_s": 600.0, "close_timeout_s": 600.0, "peer_timeout_s": 1.0}
    p = victim.start(trio.backend, "prefill", spec.as_dict())
    trio.decode1.start(trio.backend, "decode", spec.as_dict(), config=slow)
    trio.decode1.call("connect", address=p["address"])
    trio.decode1.call("request", peer=p["name"], rid="z", dst=[1, 2])
    collect(victim, lambda ev: len(messages(ev, "transfer_request")) >= 1, WAIT)
    port = int(p["address"].rsplit(":", 1)[1])
    victim.kill()
    events = collect(trio.decode1, lambda ev: any(e["kind"] == "PeerLost" for e in ev), WAIT)
    if trio.backend == "nixl":
        assert not terminal(events) and trio.decode1.call("quarantined") == 1
        again = trio.decode2.start(
            trio.backend, "prefill", spec.as_dict(), config={"side_channel_port": port}
        )
        assert again["address"] == p["address"] and again["name"] != p["name"]
        trio.decode1.call("connect", address=again["address"])
        events = collect(trio.decode1, count_terminal(1), WAIT)
    (end,) = ended_once(events, ["z"]).values()
    assert end["kind"] == "TransferFailed" and end["reason"] == "peer_lost"
    if trio.backend == "nixl":
        assert "new incarnation" in end["detail"]
    assert trio.decode1.call("quarantined") == 0
