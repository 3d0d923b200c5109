"""Real processes on loopback, every backend: bytes land exactly, once, where asked.

The flow is the real one: decode connects and sends a TransferRequest naming its
reserved blocks; prefill answers with write(); both sides' events are counted.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.kv_agent_node import pattern
from tests.support.kv_agents import (
    AgentNode,
    CacheSpec,
    collect,
    count_terminal,
    messages,
    start_pair,
    terminal,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WAIT = 60.0  # generous bound for any awaited event

LAYOUTS = {
    "2L-2H-16D-bs4": dict(layers=2, heads=2, dim=16, block_size=4),
    "3L-4H-8D-bs16": dict(layers=3, heads=4, dim=8, block_size=16),
}


def expected(seed: int, ids: list[int], block_bytes: int) -> np.ndarray:
    return np.stack([pattern(seed, b, block_bytes) for b in ids])


def read(node: AgentNode, ids: list[int], block_bytes: int) -> np.ndarray:
    raw = node.call("read", ids=ids)
    return np.frombuffer(raw, dtype=np.uint8).reshape(len(ids), block_bytes)  # type: ignore[arg-type]


def transfer_requests(prefill: AgentNode, n: int) -> dict[str, dict]:
    """Wait for n TransferRequests at prefill; rid -> {peer, dst}."""
    events = collect(prefill, lambda ev: len(messages(ev, "transfer_request")) >= n, WAIT)
    reqs = messages(events, "transfer_request")
    assert len(reqs) == n, events
    return {
        e["message"]["request_id"]: {"peer": e["peer_id"], "dst": e["message"]["dst_block_ids"]}
        for e in reqs
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scattered_blocks_arrive_byte_exact(trio, dtype: str, layout: str) -> None:
    p_spec = CacheSpec(num_blocks=40, dtype=dtype, **LAYOUTS[layout])
    d_spec = CacheSpec(num_blocks=48, dtype=dtype, **LAYOUTS[layout])
    p, d = start_pair(trio.prefill, trio.decode1, trio.backend, p_spec, d_spec)
    trio.prefill.call("fill_pattern", ids=list(range(40)), seed=7)
    rng = np.random.default_rng(sum(map(ord, layout + dtype)))
    used: set[int] = set()
    for i in range(3):
        src = rng.choice(40, size=9, replace=False).tolist()  # random order, non-contiguous
        free = [b for b in range(48) if b not in used]
        dst = rng.choice(free, size=9, replace=False).tolist()
        used.update(dst)
        rid = f"req-{i}"
        trio.decode1.call("request", peer=p["name"], rid=rid, dst=dst)
        assert transfer_requests(trio.prefill, 1)[rid] == {"peer": d["name"], "dst": dst}
        trio.prefill.call("write", rid=rid, peer=d["name"], src=src, dst=dst)
        p_events = collect(trio.prefill, count_terminal(1), WAIT)
        d_events = collect(trio.decode1, count_terminal(1), WAIT)
        assert [e["kind"] for e in terminal(p_events)] == ["TransferDone"]
        assert [(e["kind"], e["request_id"]) for e in terminal(d_events)] == [("KVReceived", rid)]
        got = read(trio.decode1, dst, d_spec.block_bytes)
        assert np.array_equal(got, expected(7, src, p_spec.block_bytes))
    untouched = [b for b in range(48) if b not in used]
    assert not read(trio.decode1, untouched, d_spec.block_bytes).any()  # no stray bytes


def test_staged_caches_move_byte_exact(trio) -> None:
    """zmq and ucxx through host staging buffers on both sides (stage_host_cache: the path a
    GPU cache takes, on CPU caches here): scattered blocks land exactly, nothing else moves."""
    if trio.backend == "nixl":
        pytest.skip("nixl moves a cache in place, host or device")
    spec = dict(dtype="bfloat16", **LAYOUTS["3L-4H-8D-bs16"])
    p_spec, d_spec = CacheSpec(num_blocks=24, **spec), CacheSpec(num_blocks=32, **spec)
    staged = {"stage_host_cache": True}
    p, d = start_pair(
        trio.prefill, trio.decode1, trio.backend, p_spec, d_spec, staged, d_config=staged
    )
    trio.prefill.call("fill_pattern", ids=list(range(24)), seed=11)
    src, dst = [17, 3, 9, 0, 22], [30, 1, 12, 7, 5]
    trio.decode1.call("request", peer=p["name"], rid="staged", dst=dst)
    transfer_requests(trio.prefill, 1)
    trio.prefill.call("write", rid="staged", peer=d["name"], src=src, dst=dst)
    assert [e["kind"] for e in terminal(collect(trio.prefill, count_terminal(1), WAIT))] == [
        "TransferDone"
    ]
    d_events = terminal(collect(trio.decode1, count_terminal(1), WAIT))
    assert [(e["kind"], e["request_id"]) for e in d_events] == [("KVReceived", "staged")]
    assert np.array_equal(
        read(trio.decode1, dst, d_spec.block_bytes), expected(11, src, p_spec.block_bytes)
    )
    untouched = [b for b in range(32) if b not in dst]
    assert not read(trio.decode1, untouched, d_spec.block_bytes).any()


def test_32_concurrent_transfers_one_prefill_two_decodes(trio) -> None:
    tiny = dict(layers=4, heads=2, dim=64, block_size=16)  # the default model's block: 64 KiB
    p_spec, d_spec = CacheSpec(num_blocks=160, **tiny), CacheSpec(num_blocks=96, **tiny)
    p, d1 = start_pair(trio.prefill, trio.decode1, trio.backend, p_spec, d_spec)
    d2 = trio.decode2.start(trio.backend, "decode", d_spec.as_dict())
    assert trio.decode2.call("connect", address=p["address"]) == p["name"]
    trio.prefill.call("fill_pattern", ids=list(range(160)), seed=3)
    rng = np.random.default_rng(32)
    src_order = rng.permutation(160).tolist()
    decodes = {trio.decode1: d1["name"], trio.decode2: d2["name"]}
    free = {node: rng.permutation(96).tolist() for node in decodes}
    plan = {}
    for i in range(32):
        node = trio.decode1 if i % 2 else trio.decode2
        dst, free[node] = free[node][:4], free[node][4:]
        plan[f"r{i}"] = {"node": node, "peer": decodes[node], "src": src_order[i * 4 : i * 4 + 4]}
        plan[f"r{i}"]["dst"] = dst
        node.call("request", peer=p["name"], rid=f"r{i}", dst=dst)
    requests = transfer_requests(trio.prefill, 32)
    for rid, v in plan.items():  # all 32 issued back to back, none awaited
        assert requests[rid] == {"peer": v["peer"], "dst": v["dst"]}
        trio.prefill.call("write", rid=rid, peer=v["peer"], src=v["src"], dst=v["dst"])
    p_events = collect(trio.prefill, count_terminal(32), WAIT)
    d1_events = collect(trio.decode1, count_terminal(16), WAIT)
    d2_events = collect(trio.decode2, count_terminal(16), WAIT)
    for node in (trio.prefill, trio.decode1, trio.decode2):  # nothing more arrives later
        assert not terminal(node.events(wait=0.5))
    assert sorted(e["request_id"] for e in terminal(p_events, "TransferDone")) == sorted(plan)
    assert len(terminal(p_events)) == 32
    for node, events in ((trio.decode1, d1_events), (trio.decode2, d2_events)):
        rids = sorted(r for r, v in plan.items() if v["node"] is node)
        assert sorted(e["request_id"] for e in terminal(events, "KVReceived")) == rids
        assert len(terminal(events)) == 16
        for rid in rids:
            got = read(node, plan[rid]["dst"], d_spec.block_bytes)
            assert np.array_equal(got, expected(3, plan[rid]["src"], p_spec.block_bytes)), rid


def test_streamed_write_lands_in_segments_then_once(trio) -> None:
    """A streamed write (write(final=False), write_more ...) is one transfer: the receiver
    hears KVProgress per segment and one KVReceived when every block is in, the sender one
    TransferDone, and the bytes are exact."""
    spec = CacheSpec(num_blocks=24, layers=2, heads=2, dim=16, block_size=4)
    p, d = start_pair(trio.prefill, trio.decode1, trio.backend, spec, spec)
    trio.prefill.call("fill_pattern", ids=list(range(24)), seed=11)
    src, dst = [3, 9, 4, 17, 20, 1, 6], [10, 2, 23, 5, 11, 0, 8]
    trio.decode1.call("request", peer=p["name"], rid="s1", dst=dst)
    transfer_requests(trio.prefill, 1)
    groups = [(0, 2), (2, 3), (3, 6)]  # the last segment comes after a pause with nothing posted
    trio.prefill.call("write", rid="s1", peer=d["name"], src=src[:2], dst=dst[:2], final=False)
    for a, b in groups[1:]:
        collect(trio.decode1, lambda ev: any(e["kind"] == "KVProgress" for e in ev), WAIT)
        trio.prefill.call("write_more", rid="s1", peer=d["name"], src=src[a:b], dst=dst[a:b],
                          final=False)  # fmt: skip
    trio.prefill.call("write_more", rid="s1", peer=d["name"], src=src[6:], dst=dst[6:], final=True)
    p_events = collect(trio.prefill, count_terminal(1), WAIT)
    d_events = collect(trio.decode1, count_terminal(1), WAIT)
    assert [e["kind"] for e in terminal(p_events)] == ["TransferDone"]
    assert [e["kind"] for e in terminal(d_events)] == ["KVReceived"]
    got = read(trio.decode1, dst, spec.block_bytes)
    assert np.array_equal(got, expected(11, src, spec.block_bytes))


def test_streamed_write_aborted_between_segments_is_quiescent(trio) -> None:
    """The receiver aborts a streamed write between two segments: both sides end once,
    nothing more lands, and a later segment is refused (the write has ended)."""
    spec = CacheSpec(num_blocks=16, layers=2, heads=2, dim=16, block_size=4)
    p, d = start_pair(trio.prefill, trio.decode1, trio.backend, spec, spec)
    trio.prefill.call("fill_pattern", ids=list(range(16)), seed=5)
    trio.decode1.call("request", peer=p["name"], rid="s2", dst=[1, 2, 3, 4])
    transfer_requests(trio.prefill, 1)
    trio.prefill.call("write", rid="s2", peer=d["name"], src=[5, 6], dst=[1, 2], final=False)
    collect(trio.decode1, lambda ev: any(e["kind"] == "KVProgress" for e in ev), WAIT)
    trio.decode1.call("abort", rid="s2")
    d_events = collect(trio.decode1, count_terminal(1), WAIT)
    p_events = collect(trio.prefill, count_terminal(1), WAIT)
    assert [e["kind"] for e in terminal(d_events)] == ["Quiescent"]
    assert terminal(d_events)[0]["landed"] is False
    assert [(e["kind"], e["reason"]) for e in terminal(p_events)] == [
        ("TransferFailed", "aborted_by_peer")
    ]
    with pytest.raises(Exception, match="no open write"):
        trio.prefill.call("write_more", rid="s2", peer=d["name"], src=[7], dst=[3], final=True)
    assert not read(trio.decode1, [3, 4], spec.block_bytes).any()
