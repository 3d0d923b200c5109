"""What both pool backends do with a node's whole-request stream: open it (`open_generate`),
relay it as TokenChunks until every choice finished (`relay`), and report a stalled or
unreachable node (`report_stall`, `report_unreachable`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from common.wire.node_messages import GenerateRequest
from common.wire.stage import Stage
from proxy.http.backend import (
    BackendError,
    GenerationRequest,
    NodeLost,
    TokenStream,
)
from proxy.metrics import DisaggMetrics
from proxy.pool.client import GENERATE_PATH, NodeClient, NodeStream, NodeUnreachable
from proxy.pool.interstage import InterStageQueue
from proxy.pool.node_state import Node
from proxy.pool.registry import NodeRegistry
from proxy.trace import TraceStore

log = logging.getLogger(__name__)


async def open_generate(
    client: NodeClient, registry: NodeRegistry, node: Node, req: GenerationRequest
) -> NodeStream:
    """Open the request's whole-request stream on `node` (POST /internal/generate: it
    prefills and decodes). NodeUnreachable if it never took the request; on any other
    failure the node is told to cancel, unless it refused the request outright."""
    msg = GenerateRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=req.sampling,
        epoch=node.epoch,  # a node that changed role since: 409, NodeUnreachable
    )
    try:
        stall_s = registry.stall_timeout(node.url)
        return await client.open_stream(node.url, GENERATE_PATH, msg, req.request_id, stall_s)
    except NodeUnreachable:
        raise
    except BaseException as e:
        if not (isinstance(e, BackendError) and e.status < 500):
            client.cancel_soon(node.url, req.request_id)
        raise


def report_stall(
    registry: NodeRegistry,
    traces: TraceStore,
    metrics: DisaggMetrics | None,
    request_id: str,
    e: NodeLost,
    role: str,
) -> None:
    """A stream went silent: count it, trace it, and let the registry decide whether its
    node is hung (silent to polls as well), which moves the node's other work now."""
    if metrics is not None:
        metrics.stalls.labels(role).inc()
    hung = registry.stalled(e.url, e.message)
    detail = f"{e.message}; node {'silent to polls too: marked down' if hung else 'answers polls'}"
    traces.record(request_id, "stalled", detail=detail)
    log.warning("%s: stream stalled: %s", request_id, detail)


def report_unreachable(
    registry: NodeRegistry, client: NodeClient, node: Node, e: NodeUnreachable, request_id: str
) -> None:
    registry.report_failure(node.url, e.message)
    if e.maybe_received:
        client.cancel_soon(node.url, request_id)


async def relay(
    stream: NodeStream,
    req: GenerationRequest,
    client: NodeClient,
    queue: InterStageQueue | None = None,
    prefill_url: str | None = None,
    traces: TraceStore | None = None,
    on_first: Callable[[], None] | None = None,
) -> TokenStream:
    """A node's token stream of `req` as TokenChunks, until each of its choices finished
    (those the client is done with, `req.choice_ends`, are cancelled on the node); on any
    early end (close, error) the stream is dropped and the request cancelled on the node
    (and on `prefill_url` while no token came, since the KV transfer may still be in
    flight). Signals `queue` that capacity freed up. `on_first` runs at the first chunk,
    or at the end if none came (a node that prefills the prompt: it is computed then, or
    never will be)."""
    finished = received = False
    ended: set[int] = set()
    ends, choices = req.choice_ends, req.sampling.n
    if ends is not None:  # the choices the client is done with end on the node
        ends.attach(lambda j: client.cancel_soon(stream.url, stream.request_id, j))
    try:
        while True:
            try:
                chunk = await stream.next_chunk()
            finally:
                if stream.events and traces is not None:
                    traces.record_node(stream.request_id, stream.url, stream.events)
                stream.events = []
            if not received:
                if traces is not None:
                    traces.enter(stream.request_id, Stage.DECODE)
                if on_first is not None:
                    on_first()
            received = True
            if chunk.finish_reason is not None:
                ended.add(chunk.choice)
                finished = len(ended) == choices
            yield chunk
            if finished:
                return
    finally:
        if not received and on_first is not None:
            on_first()
        if ends is not None:
            ends.detach()
        stream.close()
        if not finished:
            client.cancel_soon(stream.url, stream.request_id)
            if prefill_url is not None and not received:
                client.cancel_soon(prefill_url, stream.request_id)
        if queue is not None:
            queue.notify_capacity()
