"""The load a proxy counts on a node between polls (proxy/pool/sent.py): sends leave the
prefill queue once computed or once a poll's state holds them, and a state read before a
prompt was computed is credited for it until a newer one comes."""

from __future__ import annotations

from proxy.pool.sent import SentLoad


def test_a_send_counts_until_computed_or_until_a_later_poll_returns() -> None:
    load = SentLoad()
    a = load.send(100, kv_tokens=0)
    load.send(50, kv_tokens=64)
    assert load.queued(reported=10) == 160 and load.requests == 2 and load.kv_tokens == 64
    load.computed(a)
    assert load.queued(10) == 60
    load.computed(a)  # idempotent
    assert load.queued(10) == 60
    mark = load.poll_began()
    c = load.send(30)  # after the poll began: not in its state
    load.poll_returned(mark)  # a and b are in the state now (b as queued, say 50)
    assert load.queued(reported=50) == 50 + 30
    assert load.requests == 1 and load.kv_tokens == 0 and load.tokens == 30
    load.computed(c)
    assert load.queued(50) == 50


def test_a_prompt_computed_after_the_poll_read_it_is_credited_until_a_newer_state() -> None:
    load = SentLoad()
    a = load.send(120)
    mark = load.poll_began()
    load.poll_returned(mark)  # the state shows a queued: 120
    assert load.queued(reported=120) == 120
    load.computed(a)  # computed since that state was read
    assert load.queued(120) == 0
    mark = load.poll_began()
    load.poll_returned(mark)  # a newer state, read after the computation: no credit left
    assert load.credit == 0 and load.queued(reported=0) == 0 and load.queued(40) == 40


def test_a_prompt_computed_while_a_poll_is_in_flight_is_credited_against_its_state() -> None:
    load = SentLoad()
    a = load.send(200)
    mark = load.poll_began()  # its state may be read before or after the computation
    load.computed(a)
    assert load.queued(reported=0) == 0  # the current (older) state never held it
    load.poll_returned(mark)
    assert load.queued(reported=200) == 0  # read before the computation: credited
    assert load.queued(reported=0) == 0  # read after it: never below zero
    mark = load.poll_began()
    load.poll_returned(mark)
    assert load.queued(reported=200) == 200  # a later state is taken as it is


def test_a_poll_that_never_returns_leaves_the_counts_to_the_next() -> None:
    load = SentLoad()
    a = load.send(80)
    load.poll_began()  # fails: no poll_returned
    mark = load.poll_began()
    load.computed(a)
    load.poll_returned(mark)
    assert load.tokens == 0 and load.requests == 0
    assert load.queued(reported=80) == 0
