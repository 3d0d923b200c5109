"""The agent's public surface in one process (zmq backend): validation, asyncio, lifecycle.

Byte movement across real processes and every backend is covered by the e2e tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import wait

import pytest
import torch

from common.wire.fingerprint import Fingerprint
from kv_transfer import (
    AgentClosed,
    HandshakeError,
    KVReceived,
    KVTransferAgent,
    MessageReceived,
    PeerConnected,
    TransferConfig,
    TransferDone,
    TransferRejected,
)

CONFIG = TransferConfig(
    backend="zmq", heartbeat_interval_s=0.2, peer_timeout_s=2.0, handshake_timeout_s=3.0
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
