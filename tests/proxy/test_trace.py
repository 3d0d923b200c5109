"""The trace store keeps recent traces without handing the garbage collector their rows."""

from __future__ import annotations

import gc

from proxy.trace import PROXY, TraceStore


def test_rows_read_back_in_time_order_and_the_store_evicts_the_oldest() -> None:
    store = TraceStore(capacity=2)
    store.start("a", "completions")
    store.record("a", "received", t=2.0)
    store.record("a~1", "placed", owner="http://n", t=1.0, detail="migrated attempt")
    store.start("b", "completions")
    store.start("c", "completions")
    assert store.get("a") is None  # evicted, the oldest
    trace = store.get("c")
    assert trace is not None
    store.record("c", "received", t=5.0)
    store.record("c", "first token", t=4.0, detail="x")
    assert [(r.event, r.owner, r.t, r.detail) for r in trace.ordered()] == [
        ("first token", PROXY, 4.0, "x"),
        ("received", PROXY, 5.0, ""),
    ]
    assert trace.to_json()["rows"] == [
        {"event": "first token", "owner": PROXY, "t": 4.0, "detail": "x"},
        {"event": "received", "owner": PROXY, "t": 5.0, "detail": ""},
    ]


def test_a_traces_rows_are_not_tracked_by_the_garbage_collector() -> None:
    store = TraceStore(capacity=64)
    for i in range(64):
        store.start(f"r{i}", "completions")
        for event in ("received", "validated", "tokenized", "placed", "first token"):
            store.record(f"r{i}", event, detail=f"{i}")
    gc.collect()  # a collection untracks tuples that hold only strings and numbers
    trace = store.get("r0")
    assert trace is not None and len(trace.raw_rows) == 5
    assert not any(gc.is_tracked(row) for row in trace.raw_rows)
