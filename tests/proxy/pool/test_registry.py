"""The node registry against stub nodes over real HTTP: health transitions (down when
stopped, up again when restarted at the same URL), fingerprint and role checks, routing
order, and the /admin/nodes routes."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from proxy.http.backend import BackendError
from proxy.pool.admin import AdminRoutes
from proxy.pool.client import NodeClient
from proxy.pool.node_state import Node, NodeStatus, Role
from proxy.pool.registry import NodeRegistry, RegistrationError, RegistryConfig
from proxy.pool.router import Policy
from tests.support.node_stubs import FAST, StubNode, eventually, run, stubs


class Registry:
    """A started NodeRegistry (fast polls) over its own client; always stopped."""

    def __init__(self, poll_interval_s: float = 0.05, roles: frozenset[Role] | None = None):
        self.client = NodeClient(FAST)
        config = RegistryConfig(poll_interval_s=poll_interval_s)
        if roles is not None:
            config = RegistryConfig(poll_interval_s=poll_interval_s, roles=roles)
        self.registry = NodeRegistry(self.client, config)

    async def __aenter__(self) -> NodeRegistry:
        await self.client.start()
        await self.registry.start()
        return self.registry

    async def __aexit__(self, *exc: object) -> None:
        await self.registry.stop()
        await self.client.close()


def test_a_stopped_node_goes_down_and_rejoins_when_restarted_at_the_same_url() -> None:
    async def body() -> None:
        node = StubNode("prefill")
        async with stubs(node), Registry() as registry:
            ups: list[str] = []
            registry.add_listener(lambda n: ups.append(n.url))
            entry = registry.add(node.url, "prefill")
            await eventually(lambda: entry.healthy, what="up")
            first_engine = entry.state.engine_id if entry.state else None
            port = node.port
            await node.stop()
            await eventually(lambda: entry.status is NodeStatus.DOWN, what="down")
            assert entry.error and node.url in entry.error
            with pytest.raises(BackendError) as err:
                registry.router.pick(Role.PREFILL, [1])
            assert err.value.status == 503
            await node.start(port)
            await eventually(lambda: entry.healthy, what="up again")
            assert entry.state is not None and entry.state.engine_id != first_engine
            assert ups == [node.url, node.url]
            assert registry.router.pick(Role.PREFILL, [1]).node is entry

    run(body())


def test_health_503_takes_a_node_out_of_rotation_until_it_answers_200() -> None:
    async def body() -> None:
        node = StubNode("decode")
        async with stubs(node), Registry() as registry:
            entry = registry.add(node.url, "decode")
            await eventually(lambda: entry.healthy)
            node.health_status = 503  # draining
            await eventually(lambda: entry.status is NodeStatus.DOWN)
            assert registry.decode_candidates() == []
            node.health_status = 200
            await eventually(lambda: entry.healthy)
            assert registry.decode_candidates() == [entry]

    run(body())


def test_a_node_with_another_model_fingerprint_is_refused_at_registration() -> None:
    async def body() -> None:
        good, other = StubNode("prefill", "fp-A"), StubNode("decode", "fp-B")
        async with stubs(good, other), Registry() as registry:
            await registry.register(good.url, "prefill")
            assert registry.fingerprint == "fp-A"
            with pytest.raises(RegistrationError) as err:
                await registry.register(other.url, "decode")
            assert err.value.status == 409
            assert "fingerprint" in err.value.message and "fp-B" in err.value.message
            assert [n.url for n in registry.nodes()] == [good.url]

    run(body())


def test_the_role_is_checked_against_the_nodes_state() -> None:
    async def body() -> None:
        node = StubNode("decode")
        async with stubs(node), Registry() as registry:
            with pytest.raises(RegistrationError) as err:
                await registry.register(node.url, "prefill")
            assert err.value.status == 409 and "role" in err.value.message
            with pytest.raises(RegistrationError) as err:
                await registry.register(node.url, "both")  # not routed to by this proxy
            assert err.value.status == 400
            entry = await registry.register(node.url)  # default: the role it reports
            assert entry.role is Role.DECODE and entry.healthy

    run(body())


def test_flag_nodes_are_verified_by_the_poller_and_the_first_sets_the_fingerprint() -> None:
    async def body() -> None:
        first, odd = StubNode("prefill", "fp-A"), StubNode("decode", "fp-B")
        async with stubs(first, odd):
            r = Registry()
            a, b = r.registry.add(first.url, "prefill"), r.registry.add(odd.url, "decode")
            async with r as registry:
                assert registry.fingerprint == "fp-A"
                assert a.healthy and b.status is NodeStatus.REFUSED
                assert b.error is not None and "fingerprint" in b.error
                assert registry.decode_candidates() == []

    run(body())


def _prefill(registry: NodeRegistry, exclude: frozenset[str] = frozenset()) -> Node:
    """Where the registry's router (default policy, no cache known) sends a prompt."""
    return registry.router.pick(Role.PREFILL, [1], exclude).node


def test_prefill_goes_to_the_least_queued_node_counting_what_was_sent_since_the_poll() -> None:
    async def body() -> None:
        busy, idle = StubNode("prefill"), StubNode("prefill")
        busy.queued_prefill_tokens, idle.queued_prefill_tokens = 100, 10
        async with stubs(busy, idle), Registry(poll_interval_s=60) as registry:
            b, i = registry.add(busy.url, "prefill"), registry.add(idle.url, "prefill")
            await registry.poll_all()
            assert _prefill(registry) is i
            with registry.track(i, 200):  # in flight, not yet in its /state
                assert _prefill(registry) is b
                assert i.inflight == 1
            assert _prefill(registry) is b  # sent since the last poll still counts
            await registry.poll_all()
            assert _prefill(registry) is i
            assert _prefill(registry, frozenset({i.url})) is b

    run(body())


def test_tied_prefill_nodes_take_turns_whatever_the_dispatches_in_between() -> None:
    """Two idle prefill nodes share the prompts, however many times the inter-stage queue
    ordered the decode nodes between two picks (once a request, as a disaggregated run does,
    used to send every tie to the same prefill node)."""

    async def body() -> None:
        nodes = [StubNode("prefill"), StubNode("prefill"), StubNode("decode")]
        async with stubs(*nodes), Registry(poll_interval_s=60) as registry:
            a, b, _ = [registry.add(n.url, n.role) for n in nodes]
            await registry.poll_all()
            for dispatches in (1, 2, 1, 3):
                picks = []
                for _ in range(4):
                    picks.append(_prefill(registry))
                    for _ in range(dispatches):
                        registry.decode_candidates()
                assert picks.count(a) == picks.count(b) == 2, dispatches
                assert picks[0] is not picks[1]
            # The round-robin policy is the same rotation, ties or not.
            nodes[0].queued_prefill_tokens = 1000
            await registry.poll_all()
            registry.router.policy = Policy.ROUND_ROBIN
            picks = []
            for _ in range(4):
                picks.append(_prefill(registry))
                registry.decode_candidates()
            assert picks.count(a) == picks.count(b) == 2

    run(body())


def test_decode_candidates_are_ordered_by_free_capacity() -> None:
    async def body() -> None:
        nodes = [StubNode("decode") for _ in range(3)]
        for node, free in zip(nodes, (10, 50, 30), strict=True):
            node.free_blocks = free
        async with stubs(*nodes), Registry(poll_interval_s=60) as registry:
            entries = [registry.add(n.url, "decode") for n in nodes]
            await registry.poll_all()
            assert registry.decode_candidates() == [entries[1], entries[2], entries[0]]
            entries[2].sent(0, kv_tokens=16 * 25)  # 25 blocks of KV sent since the poll: 5 left
            assert registry.decode_candidates() == [entries[1], entries[0], entries[2]]

    run(body())


def test_admin_routes_register_list_and_remove_nodes() -> None:
    async def body() -> None:
        good, other = StubNode("prefill", "fp-A"), StubNode("decode", "fp-B")
        async with stubs(good, other), Registry() as registry:
            app = web.Application()
            AdminRoutes(registry).add_to(app)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            base = f"http://127.0.0.1:{runner.addresses[0][1]}/admin/nodes"
            timeout = aiohttp.ClientTimeout(total=5)
            try:
                async with aiohttp.ClientSession(timeout=timeout) as s:
                    await _admin_calls(s, base, good, other)
            finally:
                await runner.cleanup()

    run(body())


async def _admin_calls(
    s: aiohttp.ClientSession, base: str, good: StubNode, other: StubNode
) -> None:
    async with s.post(base, json={"url": good.url + "/", "role": "prefill"}) as r:
        assert r.status == 201
        assert (await r.json())["url"] == good.url and (await r.json())["healthy"] is True
    async with s.post(base, json={"url": other.url, "role": "decode"}) as r:
        assert r.status == 409
        error = (await r.json())["error"]
        assert "fingerprint" in error["message"] and error["code"] == "node_conflict"
    async with s.post(base, json={"url": "http://127.0.0.1:1", "role": "decode"}) as r:
        assert r.status == 502
    async with s.post(base, json={"role": "decode"}) as r:
        assert r.status == 400
    async with s.post(base, json={"url": "not a url"}) as r:
        assert r.status == 400
    async with s.get(base) as r:
        listed = await r.json()
    assert listed["fingerprint"] == "fp-A"
    assert [(n["url"], n["role"], n["healthy"]) for n in listed["nodes"]] == [
        (good.url, "prefill", True)
    ]
    assert listed["nodes"][0]["model_fingerprint"] == "fp-A"
    async with s.delete(base, params={"url": good.url}) as r:
        assert r.status == 200
    async with s.delete(base, params={"url": good.url}) as r:
        assert r.status == 404
    async with s.get(base) as r:
        assert (await r.json())["nodes"] == []


def test_a_node_that_changed_role_moves_to_its_new_pool_and_drains_meanwhile() -> None:
    async def body() -> None:
        node, misconfigured = StubNode("prefill"), StubNode("decode")
        async with stubs(node, misconfigured), Registry() as registry:
            lost: list[str] = []
            registry.add_lost_listener(lambda n: lost.append(n.url))
            entry = registry.add(node.url, "prefill")
            wrong = registry.add(misconfigured.url, "prefill")  # reports decode at epoch 0
            await eventually(lambda: entry.healthy and wrong.status is NodeStatus.REFUSED)
            node.role_state = "draining"  # another proxy is moving it: no new work
            await eventually(lambda: entry.status is NodeStatus.DRAINING)
            assert registry.healthy(Role.PREFILL) == []
            node.role, node.epoch, node.role_state = "decode", 1, "serving"
            await eventually(lambda: entry.healthy, what="up in its new role")
            assert entry.role is Role.DECODE and entry.epoch == 1
            assert registry.decode_candidates() == [entry]
            assert lost == [node.url]  # the inter-stage queue drops what waited on its KV
            assert wrong.status is NodeStatus.REFUSED

    run(body())


def test_decode_nodes_are_told_each_prefill_nodes_side_channel_once_per_incarnation() -> None:
    """So that a decode node makes the KV handshake before a pair's first request: every
    decode node is told every healthy prefill node's side channel, each once, again after
    it restarts (it knows nobody then), and again on the next poll when a call failed."""

    def told(node: StubNode) -> list[list[str]]:
        return [msg.side_channels for path, msg in node.calls if path == "/internal/kv_peers"]

    async def body() -> None:
        p0, p1 = StubNode("prefill"), StubNode("prefill")
        p0.side_channel, p1.side_channel = "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"
        d0, d1 = StubNode("decode"), StubNode("decode")
        d1.kv_peers_status = 500
        async with stubs(p0, p1, d0, d1), Registry() as registry:
            registry.add(p0.url, "prefill")
            entry0 = registry.add(d0.url, "decode")
            entry1 = registry.add(d1.url, "decode")
            await eventually(lambda: told(d0) == [[p0.side_channel]], what="told p0")
            registry.add(p1.url, "prefill")
            await eventually(lambda: len(told(d0)) == 2, what="told p1")
            assert told(d0)[1] == [p1.side_channel]  # only the new one
            assert entry0.kv_peers_told == {p0.side_channel, p1.side_channel}
            # A failed call is not counted as told: the next poll tries again.
            await eventually(lambda: len(told(d1)) >= 2, what="retried")
            assert entry1.kv_peers_told == set()
            d1.kv_peers_status = 200
            await eventually(lambda: len(entry1.kv_peers_told) == 2, what="told d1")
            # A restart (a new engine id) forgets its peers: told both again.
            port = d0.port
            await d0.stop()
            d0.calls.clear()
            await d0.start(port)
            await eventually(lambda: bool(told(d0)), what="told after restart")
            assert told(d0) == [sorted([p0.side_channel, p1.side_channel])]
            assert told(p0) == [] and told(p1) == []

    run(body())
