"""The agent's public surface in one process (zmq backend): validation, asyncio, lifecycle.

Byte movement across real processes and every backend is covered by the e2e tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import wait

import pytest
import torch
import zmq

from common.wire.fingerprint import Fingerprint
from common.wire.messages import (
    Abort,
    Challenge,
    Handshake,
    HandshakeReply,
    Heartbeat,
    Hello,
    KVAborted,
    KVFirstToken,
    KVRegion,
    Message,
    PeerInfo,
    decode,
    encode,
)
from kv_transfer import (
    AgentClosed,
    HandshakeError,
    KVReceived,
    KVTransferAgent,
    MessageReceived,
    PeerConnected,
    PeerLost,
    TransferConfig,
    TransferDone,
    TransferFailed,
    TransferRejected,
)
from kv_transfer.auth import info_digest, mac
from kv_transfer.progress import SendCmd

# Push-mode writes (write() without the receiver's request_transfer) are the API under test
# here; the default refuses them (see test_an_unsolicited_write_is_refused_by_default).
CONFIG = TransferConfig(
    backend="zmq",
    heartbeat_interval_s=0.2,
    peer_timeout_s=2.0,
    handshake_timeout_s=3.0,
    accept_unsolicited_writes=True,
)


def make(engine_id: str, num_blocks: int = 8, weights: str = "w") -> KVTransferAgent:
    cache = torch.arange(num_blocks * 2 * 2 * 4 * 2 * 8, dtype=torch.float32).view(
        num_blocks, 2, 2, 4, 2, 8
    )
    return KVTransferAgent(CONFIG, cache, engine_id, Fingerprint.for_kv_cache(cache, weights))


@pytest.fixture
def pair() -> Iterator[tuple[KVTransferAgent, KVTransferAgent]]:
    p, d = make("prefill"), make("decode", num_blocks=4)
    try:
        d.connect(p.address)
        yield p, d
    finally:
        d.close()
        p.close()


def until(agent: KVTransferAgent, kind: type, timeout: float = 10.0) -> list:
    seen: list = []
    while not any(isinstance(e, kind) for e in seen):
        got = agent.wait_events(timeout)
        assert got, f"no {kind.__name__} within {timeout}s; saw {seen}"
        seen.extend(got)
    return seen


def test_bad_calls_are_rejected_at_once(pair) -> None:
    p, d = pair
    peer = d.agent_name
    with pytest.raises(TransferRejected, match="unknown peer"):
        p.write("r", "nobody", [0], [0])
    with pytest.raises(TransferRejected, match=r"dst_block_ids must be in \[0, 4\)"):
        p.write("r", peer, [0], [4])
    with pytest.raises(TransferRejected, match="src_block_ids contains duplicates"):
        p.write("r", peer, [1, 1], [0, 2])
    with pytest.raises(TransferRejected, match="2 source blocks but 1"):
        p.write("r", peer, [1, 2], [0])
    p.write("r", peer, [1], [0])
    with pytest.raises(TransferRejected, match="already has a live transfer"):
        p.write("r", peer, [2], [1])
    until(p, TransferDone)
    assert p.abort("r") is False  # finished: nothing to abort


def test_connect_is_idempotent_and_both_sides_see_the_peer(pair) -> None:
    p, d = pair
    assert d.connect(p.address) == p.agent_name
    assert p.peers() == [d.agent_name] and d.peers() == [p.agent_name]
    assert any(isinstance(e, PeerConnected) for e in p.poll_events())


def test_simultaneous_connects_meet_in_one_peer() -> None:
    a, b = make("a"), make("b")
    try:
        fa, fb = a.connect_async(b.address), b.connect_async(a.address)
        wait([fa, fb], timeout=10)
        assert fa.result() == b.agent_name and fb.result() == a.agent_name
        a.write("x", b.agent_name, [1], [2])
        until(b, KVReceived)
    finally:
        a.close()
        b.close()


def test_fingerprint_must_describe_the_cache() -> None:
    cache = torch.zeros(4, 2, 2, 4, 2, 8)
    wrong = Fingerprint.for_kv_cache(cache, "w").model_copy(update={"head_dim": 16})
    with pytest.raises(ValueError, match="head_dim"):
        KVTransferAgent(CONFIG, cache, "x", wrong)


def test_handshake_times_out_on_a_silent_address() -> None:
    import zmq

    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    agent = make("lonely")
    try:
        with pytest.raises(HandshakeError, match="timed out"):
            agent.connect(f"tcp://127.0.0.1:{port}")
    finally:
        agent.close()
        silent.close(linger=0)


def test_asyncio_owner_gets_events_without_blocking_the_loop(pair) -> None:
    p, d = pair

    async def run() -> list:
        d.request_transfer(p.agent_name, "async-1", [3, 1])
        got: list = []
        while not any(isinstance(e, MessageReceived) for e in got):
            got += await asyncio.wait_for(p.next_events(), 10)
        p.write("async-1", d.agent_name, [6, 7], [3, 1])
        landed: list = []
        while not any(isinstance(e, KVReceived) for e in landed):
            landed += await asyncio.wait_for(d.next_events(), 10)
        return landed

    asyncio.run(run())
    cache_p = p.layout.tensor
    assert torch.equal(d.layout.tensor[[3, 1]], cache_p[[6, 7]])


def test_closed_agent_refuses_calls() -> None:
    agent = make("short-lived")
    agent.close()
    agent.close()  # idempotent
    with pytest.raises(AgentClosed):
        agent.connect_async("tcp://127.0.0.1:1")


# -- authenticated handshakes (issue 13) ------------------------------------------------------

TOKEN = "kv-cluster-token-0123456789"


def make_with(token: str | None, engine_id: str) -> KVTransferAgent:
    cache = torch.zeros(4, 2, 2, 4, 2, 8)
    config = dataclasses.replace(CONFIG, cluster_token=token)
    return KVTransferAgent(config, cache, engine_id, Fingerprint.for_kv_cache(cache, "w"))


def test_agents_with_the_same_token_connect_and_transfer() -> None:
    a, b = make_with(TOKEN, "a"), make_with(TOKEN, "b")
    try:
        assert a.connect(b.address) == b.agent_name
        a.write("x", b.agent_name, [1], [2])
        until(b, KVReceived)
        # Crossing connects authenticate too.
        c = make_with(TOKEN, "c")
        try:
            fa, fc = a.connect_async(c.address), c.connect_async(a.address)
            wait([fa, fc], timeout=10)
            assert fa.result() == c.agent_name and fc.result() == a.agent_name
        finally:
            c.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("ours", "theirs", "error"),
    [
        ("wrong-token-0123456789", TOKEN, "failed authentication"),
        (None, TOKEN, "requires the cluster token"),
        (TOKEN, None, "has no cluster token"),
    ],
)
def test_a_peer_without_the_token_is_refused(ours, theirs, error) -> None:
    a, b = make_with(ours, "a"), make_with(theirs, "b")
    try:
        with pytest.raises(HandshakeError, match=error):
            a.connect(b.address)
        assert a.peers() == [] and b.peers() == []
    finally:
        a.close()
        b.close()


def _ask(address: str, *frames: Message) -> list[Message]:
    """Send `frames` from a raw zmq connection that never proves anything; the answers."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    answers = []
    try:
        for frame in frames:
            sock.send(encode(frame))
            assert sock.poll(5000), f"no answer to {frame.TYPE}"
            answers.append(decode(sock.recv()))
    finally:
        sock.close()
    return answers


def test_a_stranger_learns_nothing_from_a_guarded_agent() -> None:
    b = make_with(TOKEN, "b")
    cache = torch.zeros(4, 2, 2, 4, 2, 8)
    info = PeerInfo(
        agent_name="intruder",
        engine_id="intruder",
        side_channel="tcp://127.0.0.1:9",
        backend="zmq",
        backend_metadata=b"",
        region=KVRegion(base_addr=0, num_blocks=4, block_bytes=cache[0].nbytes),
        fingerprint=Fingerprint.for_kv_cache(cache, "w"),
    )
    try:
        # A handshake without the challenge, and one with a made-up proof after a real one.
        (direct,) = _ask(b.address, Handshake(peer=info))
        hello, forged = _ask(
            b.address,
            Hello(agent_name="intruder", nonce=b"n" * 32),
            Handshake(peer=info, proof=b"p" * 32),
        )
        assert isinstance(hello, Challenge)
        for reply in (direct, forged):
            assert isinstance(reply, HandshakeReply) and not reply.accepted
            assert reply.peer is None and "cluster token" in (reply.error or "")
        assert b.peers() == []
    finally:
        b.close()


def test_an_unsolicited_write_is_refused_by_default() -> None:
    """A peer may write only what this agent asked it for, into the blocks it reserved."""
    strict = dataclasses.replace(CONFIG, accept_unsolicited_writes=False)
    caches = [torch.full((4, 2, 2, 4, 2, 8), float(v)) for v in (1, 0)]
    a, b = (
        KVTransferAgent(strict, c, name, Fingerprint.for_kv_cache(c, "w"))
        for c, name in zip(caches, ("a", "b"), strict=True)
    )
    try:
        a.connect(b.address)
        a.write("pushed", b.agent_name, [1], [2])
        failed = [e for e in until(a, TransferFailed) if isinstance(e, TransferFailed)]
        assert failed[0].request_id == "pushed"
        assert not caches[1].any()  # not one byte landed
        # Asked for, the same write lands, into exactly the reserved blocks.
        b.request_transfer(a.agent_name, "asked", [2])
        msg = next(e for e in until(a, MessageReceived) if isinstance(e, MessageReceived))
        assert msg.message.request_id == "asked"
        a.write("asked", b.agent_name, [1], [2])
        until(b, KVReceived)
        assert caches[1][2].eq(1).all() and not caches[1][[0, 1, 3]].any()
    finally:
        a.close()
        b.close()


def test_a_dead_progress_thread_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer.progress import ProgressLoop

    agent = make("doomed")
    try:
        assert agent.failure() is None

        def step(self: ProgressLoop, ready: dict) -> None:
            raise RuntimeError("injected")

        monkeypatch.setattr(ProgressLoop, "_step", step)
        deadline = 50
        while agent.failure() is None and deadline:
            deadline -= 1
            agent.wait_events(0.1)
        assert isinstance(agent.failure(), RuntimeError)
        with pytest.raises(AgentClosed, match="progress thread stopped"):
            agent.connect("tcp://127.0.0.1:9")
    finally:
        agent.close()
    assert agent.failure() is None  # closed on purpose: not a failure


def test_writes_to_a_peer_that_reconnected_are_not_treated_as_the_lost_ones() -> None:
    """Issue 13: a peer declared lost and then reconnected got its new writes force-ended
    after the straggler grace period (queued ones then killed the progress thread)."""
    config = dataclasses.replace(
        CONFIG,
        heartbeat_interval_s=0.1,
        peer_timeout_s=0.5,
        close_timeout_s=0.2,
        max_inflight_per_peer=1,
    )
    cache = torch.zeros(64, 2, 2, 4, 2, 8)
    a = KVTransferAgent(config, cache, "a", Fingerprint.for_kv_cache(cache, "w"))
    b = KVTransferAgent(config, cache.clone(), "b", Fingerprint.for_kv_cache(cache, "w"))
    try:
        a.connect(b.address)
        # A stall as `a` sees a partition: `b`'s progress thread is held (its state lock
        # taken) until `a` declares it lost for silence.
        with b._loop.state_lock:
            seen: list = []
            while not any(isinstance(e, PeerLost) for e in seen):
                got = a.wait_events(5.0)
                assert got, "a never declared b lost"
                seen += got
        deadline = 100
        while deadline:  # reconnect once `b` also gave up the old connection
            deadline -= 1
            try:
                assert a.connect(b.address) == b.agent_name
                break
            except HandshakeError:
                b.wait_events(0.05)
        time.sleep(0.5)  # well past the straggler grace period
        rids = [f"w{i}" for i in range(20)]  # one in flight at a time: most of them queue
        for i, rid in enumerate(rids):
            a.write(rid, b.agent_name, [i], [i])
        done: set[str] = set()
        for _ in range(200):
            for e in a.wait_events(0.1):
                assert not isinstance(e, TransferFailed), e
                if isinstance(e, TransferDone):
                    done.add(e.request_id)
            if done == set(rids):
                break
        assert done == set(rids)
        assert a.failure() is None and a.step_errors == 0
    finally:
        a.close()
        b.close()


def test_a_lost_peer_that_speaks_before_our_redial_is_answered_is_heard() -> None:
    """A peer we declared lost and dial again may speak on its new connection before we
    read its handshake reply. Refused as lost, that message made it declare us lost in turn
    just as the reply made it our peer (the test above failed so, now and then). With a redial
    pending, its message waits for the reply; with none, it is refused."""
    config = dataclasses.replace(CONFIG, heartbeat_interval_s=0.1, peer_timeout_s=0.5)
    cache = torch.zeros(8, 2, 2, 4, 2, 8)
    a = KVTransferAgent(config, cache, "a", Fingerprint.for_kv_cache(cache, "w"))
    b = KVTransferAgent(config, cache.clone(), "b", Fingerprint.for_kv_cache(cache, "w"))
    try:
        a.connect(b.address)
        with b._loop.state_lock:  # b stalls until a declares it lost for silence
            until(a, PeerLost)
        until(b, PeerLost)  # b gives a up too (silent to it, or it refused b's heartbeat)
        beat = encode(Heartbeat(agent_name=b.agent_name, sent_at=time.time()))
        rejected = a.rejected_messages
        _intrude(a.address, b.agent_name, [beat])  # no redial pending: refused, as lost
        _await(lambda: a.rejected_messages == rejected + 1, a, "a refused the lost peer")
        with b._loop.state_lock:  # b reads nothing, so a's redial stays pending
            redial = a.connect_async(b.address)
            _await(a._loop.conns.connecting, a, "a redials b")
            rejected = a.rejected_messages
            _intrude(a.address, b.agent_name, [beat])  # b speaking ahead of its reply
            _await(lambda: bool(a._loop._early) or a.rejected_messages > rejected, a, "a read it")
            assert a.rejected_messages == rejected
        assert redial.result(5.0) == b.agent_name
        _await(lambda: not a._loop._early, a, "a heard the message once b was its peer")
        a.write("x", b.agent_name, [1], [2])
        assert any(isinstance(e, TransferDone) for e in until(a, TransferDone))
        assert a.rejected_messages == rejected
        assert not any(isinstance(e, PeerLost) for e in b.wait_events(0.5))
    finally:
        a.close()
        b.close()


def _intrude(address: str, as_name: str, *frames: list[bytes]) -> None:
    """Send `frames` to an agent's inbox from a raw connection that calls itself `as_name`
    (ROUTER_HANDOVER gives it that routing id)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, as_name.encode())
    sock.setsockopt(zmq.LINGER, 2000)  # close() waits until the frames are out
    sock.connect(address)
    try:
        for parts in frames:
            sock.send_multipart(parts)
    finally:
        sock.close()


def _await(predicate, agent: KVTransferAgent, what: str) -> None:
    for _ in range(100):
        if predicate():
            return
        agent.wait_events(0.05)
    raise AssertionError(f"never: {what}")


def test_a_message_in_a_peers_name_without_its_seal_is_refused() -> None:
    """Issue 13: after the handshake a peer was its ZeroMQ routing id, which anyone may claim,
    so a forged Abort stopped another node's transfer and a forged KVAborted freed blocks a
    write was still coming into. With a token every message carries the sender's seal."""
    a, b = make_with(TOKEN, "a"), make_with(TOKEN, "b")
    try:
        b.connect(a.address)
        b.request_transfer(a.agent_name, "r", [2])
        until(a, MessageReceived)
        # (Taking over b's routing id at a drops b's own connection: b then loses a.)
        forged = encode(Abort(request_id="r"))
        _intrude(a.address, b.agent_name, [forged], [forged, b"\0" * 40])
        _await(lambda: a.rejected_messages >= 2, a, "a refused both Aborts")
        assert not a._registry.is_tombstoned("r", b.agent_name)  # the Abort did nothing
    finally:
        a.close()
        b.close()
    a, b = make_with(TOKEN, "a"), make_with(TOKEN, "b")
    try:
        b.connect(a.address)
        b.request_transfer(a.agent_name, "r", [2])
        forged = encode(KVAborted(request_id="r", reason="forged"))
        _intrude(b.address, a.agent_name, [forged], [forged, b"\1" * 40])
        _await(lambda: b.rejected_messages >= 2, b, "b refused both KVAborted")
        ended = next(e for e in until(b, TransferFailed) if isinstance(e, TransferFailed))
        # It ends because a lost b (its connection was taken over), never as aborted by a.
        assert ended.request_id == "r" and ended.reason.value == "peer_lost"
    finally:
        a.close()
        b.close()


def test_a_reply_whose_peer_info_was_swapped_is_refused() -> None:
    """The handshake reply proves the answerer's PeerInfo: something on the path that
    answers the challenge correctly (it cannot without the token) still cannot swap the info."""
    a = make_with(TOKEN, "a")
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    cache = torch.zeros(4, 2, 2, 4, 2, 8)
    info = PeerInfo(
        agent_name="b-000000000000",
        engine_id="b",
        side_channel=f"tcp://127.0.0.1:{port}",
        backend="zmq",
        backend_metadata=b"tcp://127.0.0.1:9",
        region=KVRegion(base_addr=0, num_blocks=4, block_bytes=cache[0].nbytes),
        fingerprint=Fingerprint.for_kv_cache(cache, "w"),
    )
    try:
        future = a.connect_async(f"tcp://127.0.0.1:{port}")
        assert fake.poll(5000)
        ident, raw = fake.recv_multipart()
        hello = decode(raw)
        assert isinstance(hello, Hello)
        nonce = b"m" * 32
        proof = mac(TOKEN.encode(), b"challenge", hello.nonce, nonce)
        fake.send_multipart([ident, encode(Challenge(nonce=nonce, proof=proof))])
        assert fake.poll(5000)
        _, raw = fake.recv_multipart()
        assert isinstance(decode(raw), Handshake)
        # The proof of some other info (the true one), sent with a swapped one.
        true_proof = mac(TOKEN.encode(), b"accept", hello.nonce, nonce, info_digest(info))
        swapped = info.model_copy(update={"backend_metadata": b"tcp://127.0.0.1:10"})
        reply = HandshakeReply(accepted=True, peer=swapped, proof=true_proof)
        fake.send_multipart([ident, encode(reply)])
        with pytest.raises(HandshakeError, match="reply failed authentication"):
            future.result(timeout=10)
        assert a.peers() == []
    finally:
        fake.close()
        a.close()


def test_an_abort_from_another_peer_does_not_stop_the_transfer() -> None:
    """Issue 13: any peer could Abort any request id before its write existed (the id was
    tombstoned for everyone). An Abort now stops that request's transfer to its sender only."""
    a, b, c = make_with(TOKEN, "a"), make_with(TOKEN, "b"), make_with(TOKEN, "c")
    try:
        b.connect(a.address)
        c.connect(a.address)
        b.request_transfer(a.agent_name, "r", [2])
        c.send(a.agent_name, Abort(request_id="r"))  # c never asked for "r"
        seen: list = []
        while sum(isinstance(e, MessageReceived) for e in seen) < 2:
            got = a.wait_events(10)
            assert got, seen
            seen += got
        a.write("r", b.agent_name, [1], [2])
        until(b, KVReceived)
        until(a, TransferDone)
    finally:
        for agent in (a, b, c):
            agent.close()


def test_the_progress_thread_sleeps_long_unless_a_write_is_expected() -> None:
    """An idle node's progress thread must not wake every 5 ms (it cost ~6% of a core): with
    nothing in flight or expected it sleeps up to quiet_poll_interval_s (commands and the
    side channel wake it); while a write to it is expected, idle_poll_interval_s."""
    config = dataclasses.replace(CONFIG, heartbeat_interval_s=30.0, peer_timeout_s=60.0)
    cache = torch.zeros(4, 2, 2, 4, 2, 8)
    fp = Fingerprint.for_kv_cache(cache, "w")
    p = KVTransferAgent(config, cache.clone(), "prefill", fp)
    d = KVTransferAgent(config, cache.clone(), "decode", fp)
    try:
        d.connect(p.address)
        quiet, idle = (round(s * 1000) for s in (config.quiet_poll_interval_s,
                                                 config.idle_poll_interval_s))  # fmt: skip
        assert d._loop._timeout_ms() == quiet and p._loop._timeout_ms() == quiet
        d.request_transfer(p.agent_name, "r", [0])
        deadline = time.monotonic() + 10.0
        while not d._loop.book.expecting():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert d._loop._timeout_ms() == idle
        until(p, MessageReceived)  # the TransferRequest
        p.write("r", d.agent_name, [1], [0])
        until(d, KVReceived)
        assert d._loop._timeout_ms() == quiet
    finally:
        d.close()
        p.close()


def test_a_send_leaves_from_the_owners_thread_while_the_progress_thread_waits(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TransferRequest and the first token go out in the owner's call when the progress
    thread is idle (one cross-thread hop less on the KV's path), never ahead of a queued
    command, and never while that thread is mid-step (it holds the state lock)."""
    p, d = pair
    loop = d._loop
    monkeypatch.setattr(loop, "_run_commands", lambda: False)  # it runs no command any more
    first = SendCmd(p.agent_name, KVFirstToken(request_id="r1", token_id=3))
    with loop.state_lock:
        assert not loop.try_run(first, wake=False)  # mid-step: left to the queue
    while not loop.try_run(first, wake=False):  # False only while a step holds the lock
        time.sleep(0.001)
    msg = next(e for e in until(p, MessageReceived) if isinstance(e, MessageReceived))
    assert msg.message == KVFirstToken(request_id="r1", token_id=3)

    loop.commands.append(SendCmd(p.agent_name, KVFirstToken(request_id="r2", token_id=4)))
    behind = SendCmd(p.agent_name, KVFirstToken(request_id="r3", token_id=5))
    assert not loop.try_run(behind, wake=False)  # a queued command goes first
    assert not p.wait_events(0.3)  # and neither was sent by anyone
    loop.commands.clear()
