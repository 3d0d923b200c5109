"""The proxy's view of its nodes: who they are, whether they are up, how loaded they are.

Every node is polled (`GET /health` and `GET /state`) every `poll_interval_s`, each node on
its own (a hung node's poll delays no other's); a failed or 503 poll marks it DOWN, the next
good one marks it UP again, so a node restarted at the same URL rejoins by itself.

Hung is not dead. A node whose last good poll is older than `silent_after_s` is *silent*: it
gets no new work while another node of its role answers (stale numbers are not trusted). A
poll that fails outright (timed out, refused) marks the node DOWN and ends the work waiting
on it (`NodeClient.abort`: its streams and calls, the decode streams waiting for its KV, and,
through the lost-node listeners, inter-stage entries whose KV it holds), so that the proxy
continues that work elsewhere at once; unless the node answered something else while the
poll waited (`NodeClient.heard_since`): then the poll's own connection was stuck (after a
partition heals, one in TCP's retransmission backoff stays silent for seconds), and the
node keeps its status until the next poll. A 503 poll (draining) ends nothing: a draining node
finishes what it has. All nodes of one proxy must serve the same model: the first node whose
`/state` is read sets the pool's `model_fingerprint`, and a node with another one is REFUSED
(at `register`, with an error; when found by the poller, it is kept out of rotation).

Roles change at run time (proxy/pool/roles.py, or another proxy): a node draining for a
change (or being moved by this proxy) is DRAINING, with no new work; a prefill or decode node
found serving the other role at a new epoch or incarnation moves to that pool.

Routing reads the last `/state` plus what this proxy sent since that poll began (which the
state cannot show yet), and each node's prefix cache as its KV events tell it (`index`): the
`router` (router.py) picks where to prefill; decode candidates are offered roomiest first,
counting the blocks of the prompt a node has cached as room (they need no transfer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from proxy.http.backend import BackendError
from proxy.pool.client import NodeClient, NodeUnreachable
from proxy.pool.kv_index import KVIndex
from proxy.pool.node_state import (
    SWITCHABLE_ROLES,
    Node,
    NodeState,
    NodeStatus,
    Role,
    normalize_url,
)
from proxy.pool.router import Policy, Router

log = logging.getLogger(__name__)

NodeListener = Callable[[Node], None]


class RegistrationError(Exception):
    """A node cannot join: `status` 400 (bad request), 409 (conflict), 502 (unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RegistryConfig:
    poll_interval_s: float = 0.5
    roles: frozenset[Role] = frozenset({Role.PREFILL, Role.DECODE})  # roles this proxy routes to
    silent_after_s: float | None = None  # None: max(2 s, 4 polls)

    def __post_init__(self) -> None:
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {self.poll_interval_s}")
        if self.silent_after_s is not None and self.silent_after_s <= self.poll_interval_s:
            raise ValueError("silent_after_s must be longer than poll_interval_s")

    @property
    def silence_s(self) -> float:
        if self.silent_after_s is not None:
            return self.silent_after_s
        return max(2.0, 4 * self.poll_interval_s)


class NodeRegistry:
    """Nodes by URL. `start()` runs one poll round, then polls in the background."""

    def __init__(self, client: NodeClient, config: RegistryConfig | None = None) -> None:
        self.client = client
        self.config = config or RegistryConfig()
        self.fingerprint: str | None = None  # the pool's, set by the first node seen
        self._fingerprint_source: str | None = None
        self._nodes: dict[str, Node] = {}
        self._listeners: list[NodeListener] = []
        self._lost_listeners: list[NodeListener] = []
        self._poller: asyncio.Task[None] | None = None
        self._polls: dict[str, asyncio.Task[None]] = {}  # the poll in flight, by node
        # Each rotation's own count of turns (a pool's candidates, the dispatch order): one
        # shared count let the dispatches between two prefill picks decide the next pick's
        # tie, and with two prefill nodes one dispatch a request sent every tie to the same.
        self._turns: dict[str, int] = {}
        self.index: KVIndex | None = None  # the nodes' prefix caches (set by the proxy)
        self.router = Router(self.candidates, Policy.COST)

    # -- membership --------------------------------------------------------------------------

    def add(self, url: str, role: Role | str) -> Node:
        """Add a node (from flags) without contacting it; the poller verifies it."""
        url, role = _normalize(url), self._check_role(role)
        node = self._nodes.get(url)
        if node is not None:
            if node.role is not role:
                raise RegistrationError(409, f"{url} is already registered as {node.role.value}")
            return node
        node = self._nodes[url] = Node(url, role)
        return node

    async def register(self, url: str, role: Role | str | None = None) -> Node:
        """Add a node now (POST /admin/nodes): it must answer, with the given role (default:
        the role it reports) and the pool's fingerprint; RegistrationError otherwise."""
        url = _normalize(url)
        try:
            healthy = await self.client.health(url)
            state = NodeState.parse(await self.client.state(url))
        except (NodeUnreachable, ValueError) as e:
            raise RegistrationError(502, f"cannot register {url}: {e}") from None
        expected = self._check_role(role if role is not None else state.role)
        problem = self._mismatch(url, expected, state, None)
        if problem:
            raise RegistrationError(409, problem)
        node = self.add(url, expected)
        self._apply(node, healthy, state)
        return node

    def remove(self, url: str) -> Node | None:
        url = _normalize(url)
        if self.index is not None:
            self.index.forget(url)
        return self._nodes.pop(url, None)

    def get(self, url: str) -> Node | None:
        return self._nodes.get(url)

    def nodes(self) -> list[Node]:
        return list(self._nodes.values())

    def healthy(self, role: Role) -> list[Node]:
        return [n for n in self._nodes.values() if n.role is role and n.healthy]

    def routable(self, role: Role) -> list[Node]:
        """Healthy nodes of `role` that answered recently; the silent ones only if every
        healthy node is silent (then the proxy itself is likely the one behind)."""
        healthy = self.healthy(role)
        now = time.monotonic()
        heard = [n for n in healthy if not n.silent(now, self.config.silence_s)]
        return heard or healthy

    def add_listener(self, listener: NodeListener) -> None:
        """`listener(node)` is called (on the loop) whenever a node becomes healthy."""
        self._listeners.append(listener)

    def add_lost_listener(self, listener: NodeListener) -> None:
        """`listener(node)` is called (on the loop) when a node is found unreachable."""
        self._lost_listeners.append(listener)

    # -- routing -----------------------------------------------------------------------------

    def decode_candidates(self, prompt_token_ids: list[int] | None = None) -> list[Node]:
        """Healthy decode nodes, roomiest first (the first offer goes there): a free slot,
        then free blocks plus the blocks of the prompt the node has cached."""
        nodes = self._rotated(self.routable(Role.DECODE), "dispatch")

        def room(n: Node) -> tuple[bool, int]:
            slot, free = n.decode_room()
            if self.index is not None and prompt_token_ids:
                cache = self.index.caches.get(n.url)
                if cache is not None:
                    free += self.index.matched_tokens(n, prompt_token_ids) // cache.block_size
            return slot, free

        return sorted(nodes, key=room, reverse=True)

    @contextlib.contextmanager
    def track(self, node: Node, prefill_tokens: int, kv_tokens: int = 0) -> Iterator[int]:
        """Count a request sent to `node` (for routing: `Node.sent`, whose ticket it yields)
        and in a call to it while the block runs. The caller says when its prompt is
        computed (`Node.computed`)."""
        ticket = node.sent(prefill_tokens, kv_tokens)
        node.inflight += 1
        try:
            yield ticket
        finally:
            node.inflight -= 1

    def report_failure(self, url: str, reason: str) -> None:
        """A call found the node unreachable: out of rotation until a poll finds it up."""
        node = self._nodes.get(url)
        if node is not None and node.status is NodeStatus.UP:
            self._set(node, NodeStatus.DOWN, reason)

    def stalled(self, url: str, reason: str) -> bool:
        """A stream from `url` stalled. If the node is silent too, it is hung: DOWN, and
        the rest of its work moves now. True if so."""
        node = self._nodes.get(url)
        now = time.monotonic()
        if node is None or not node.silent(now, self.config.silence_s):
            return False
        peers = [n for n in self.healthy(node.role) if n is not node]
        if peers and all(n.silent(now, self.config.silence_s) for n in peers):
            return False  # every node is silent: more likely this proxy is the one behind
        if node.status is NodeStatus.UP:
            self._set(node, NodeStatus.DOWN, f"stalled: {reason}")
        self._lost(node, f"stalled: {reason}")
        return True

    def stall_timeout(self, url: str) -> float:
        """How long a stream from `url` may stay silent: the configured stall timeout, but
        at least 4 times the slowest recent engine step the node reported."""
        base = self.client.timeouts.stall_s
        node = self._nodes.get(url)
        step = node.state.step_time_max_s if node is not None and node.state else None
        return max(base, 4 * step) if base > 0 and step else base

    def candidates(self, role: Role, exclude: frozenset[str] = frozenset()) -> list[Node]:
        """Healthy nodes of `role` not in `exclude` (silent ones only if all are), rotated
        (ties break round robin); BackendError (503) if there are none."""
        nodes = [n for n in self.routable(role) if n.url not in exclude]
        if not nodes:
            raise BackendError.unavailable(f"no healthy {role.value} node", retry_after=1.0)
        return self._rotated(nodes, role.value)

    def _rotated(self, nodes: list[Node], rotation: str) -> list[Node]:
        """`nodes` rotated by one more each time `rotation` turns, so that its ties are
        broken round robin."""
        turn = self._turns[rotation] = self._turns.get(rotation, 0) + 1
        k = turn % len(nodes) if nodes else 0
        return nodes[k:] + nodes[:k]

    # -- polling -----------------------------------------------------------------------------

    async def start(self) -> None:
        for node in list(self._nodes.values()):  # in order: the first registered sets the pool
            await self._poll(node)
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        tasks = [t for t in (self._poller, *self._polls.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._poller = None
        self._polls.clear()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(n) for n in list(self._nodes.values())))

    async def _poll_forever(self) -> None:
        """Every interval, a poll of each node whose last poll has come back."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            for node in list(self._nodes.values()):
                if node.url not in self._polls:
                    task = loop.create_task(self._poll(node))
                    self._polls[node.url] = task
                    task.add_done_callback(functools.partial(self._polled, node.url))

    def _polled(self, url: str, task: asyncio.Task[None]) -> None:
        if self._polls.get(url) is task:
            del self._polls[url]
        if not task.cancelled() and task.exception() is not None:
            log.error("polling %s failed", url, exc_info=task.exception())

    async def _poll(self, node: Node) -> None:
        mark = node.load.poll_began()
        began = asyncio.get_running_loop().time()
        try:
            healthy = await self.client.health(node.url)
            state = NodeState.parse(await self.client.state(node.url))
        except (NodeUnreachable, ValueError) as e:
            if isinstance(e, NodeUnreachable) and self.client.heard_since(node.url, began):
                # The node answered other calls while this poll waited: its connection was
                # stuck, not the node (the next poll, on a new connection, tells).
                log.warning("poll of %s failed (%s), but the node answered meanwhile; "
                            "it stays %s", node.url, e.message, node.status.value)  # fmt: skip
                return
            if self._nodes.get(node.url) is node:
                self._set(node, NodeStatus.DOWN, str(e))
                if isinstance(e, NodeUnreachable):
                    self._lost(node, e.message)
            return
        if self._nodes.get(node.url) is not node:  # removed meanwhile
            return
        node.load.poll_returned(mark)
        problem = self._mismatch(node.url, node.role, state, node.state)
        if problem:
            self._set(node, NodeStatus.REFUSED, problem)
            return
        if state.role != node.role.value and node.moving_to is None:
            self._moved(node, Role(state.role), f"it reports {state.role} at epoch {state.epoch}")
        self._apply(node, healthy, state)
        await self._introduce(node)

    async def _introduce(self, node: Node) -> None:
        """Tell a decode node the side channels of the prefill nodes it was not told of yet,
        so that it makes the KV-transfer handshake with each before that node's first
        request to it, not inside it (~30 ms on the second token's path)."""
        if node.role is not Role.DECODE or not node.healthy or node.state is None:
            return
        key = (node.state.engine_id, node.state.epoch)
        if node.kv_peers_key != key:  # restarted or changed role: it knows nobody
            node.kv_peers_key, node.kv_peers_told = key, set()
        channels = {
            p.state.kv_transfer.side_channel
            for p in self.healthy(Role.PREFILL)
            if p.state is not None and p.state.kv_transfer is not None
        }
        new = sorted(channels - node.kv_peers_told - {""})
        if not new:
            return
        try:
            await self.client.kv_peers(node.url, new)
        except (NodeUnreachable, BackendError) as e:  # the next poll tries again
            log.info("could not tell %s its prefill peers: %s", node.url, e)
            return
        node.kv_peers_told.update(new)

    # -- checks and transitions --------------------------------------------------------------

    def _check_role(self, role: Role | str) -> Role:
        try:
            role = Role(role)
        except ValueError:
            raise RegistrationError(400, f"unknown role {role!r}") from None
        if role not in self.config.roles:
            allowed = ", ".join(sorted(r.value for r in self.config.roles))
            raise RegistrationError(400, f"this proxy routes to {allowed} nodes, not {role.value}")
        return role

    def _mismatch(
        self, url: str, role: Role, state: NodeState, known: NodeState | None
    ) -> str | None:
        """Why `state` cannot serve as `role` in this pool; None if it can (a node that
        changed role since `known`, the last state read, is taken in its new role)."""
        if state.role != role.value and not self._changed_role(role, state, known):
            return f"{url} reports role {state.role!r}, registered as {role.value!r}"
        if self.fingerprint is not None and state.model_fingerprint != self.fingerprint:
            return (
                f"{url} serves model fingerprint {state.model_fingerprint!r}, but this pool "
                f"serves {self.fingerprint!r} (set by {self._fingerprint_source}); refused"
            )
        return None

    def _changed_role(self, role: Role, state: NodeState, known: NodeState | None) -> bool:
        """`state` is the other of prefill/decode, at a new epoch or incarnation (or past 0)."""
        try:
            reported = Role(state.role)
        except ValueError:
            return False
        if not {role, reported} <= SWITCHABLE_ROLES or reported not in self.config.roles:
            return False
        if known is None:
            return state.epoch > 0
        return (known.epoch, known.engine_id) != (state.epoch, state.engine_id)

    def _apply(self, node: Node, healthy: bool, state: NodeState) -> None:
        if self.fingerprint is None:
            self.fingerprint, self._fingerprint_source = state.model_fingerprint, node.url
            log.info("pool model fingerprint %s (from %s)", self.fingerprint, node.url)
        node.observe(state, time.monotonic())
        if self.index is not None:
            self.index.observe(node)
        if not healthy:
            self._set(node, NodeStatus.DOWN, "GET /health answered 503")
        elif node.moving_to is not None:
            self._set(node, NodeStatus.DRAINING, f"moving to {node.moving_to.value}")
        elif state.role_state != "serving":
            self._set(node, NodeStatus.DRAINING, f"changing role ({state.role_state})")
        else:
            self._set(node, NodeStatus.UP, None)

    # -- role changes (proxy/pool/roles.py) --------------------------------------------------

    def begin_move(self, node: Node, role: Role) -> None:
        node.moving_to = role  # no new work until `end_move`
        if node.status is not NodeStatus.DRAINING:
            self._set(node, NodeStatus.DRAINING, f"moving to {role.value}")

    async def end_move(self, node: Node, role: Role | None) -> None:
        """The move ended: the node serves as `role` (None: the move failed, it keeps its
        role); polled now, so that it takes work in its pool at once."""
        node.moving_to = None
        if role is not None and role is not node.role:
            self._moved(node, role, "moved by this proxy")
        await self._poll(node)

    def _moved(self, node: Node, role: Role, why: str) -> None:
        """`node` serves as `role` now. A former prefill node holds no KV any more: requests
        waiting in the inter-stage queue for KV it held are told (they prefill again)."""
        old, node.role = node.role, role
        log.info("node %s moves from the %s pool to the %s pool (%s)", node.url, old.value,
                 role.value, why)  # fmt: skip
        if old is Role.PREFILL:
            for listener in self._lost_listeners:
                listener(node)

    def _lost(self, node: Node, reason: str) -> None:
        """`node` is unreachable or hung: end what waits on it, so that it moves now."""
        ended = self.client.abort(node.url, reason)
        if ended:
            log.warning(
                "node %s lost (%s): ended %d streams and calls on it", node.url, reason, ended
            )
        for listener in self._lost_listeners:
            listener(node)

    def _set(self, node: Node, status: NodeStatus, error: str | None) -> None:
        previous = node.status
        node.transition(status, error)
        if previous is status:
            return
        log.info(
            "node %s (%s): %s -> %s %s",
            node.url,
            node.role.value,
            previous.value,
            status.value,
            error or "",
        )
        if status is NodeStatus.UP:
            for listener in self._listeners:
                listener(node)


def _normalize(url: str) -> str:
    try:
        return normalize_url(url)
    except ValueError as e:
        raise RegistrationError(400, str(e)) from None
