"""The error a node call raises when the node did not (or may not have) taken the request."""

from __future__ import annotations

from proxy.http.backend import BackendError
from proxy.http.errors import SERVER_ERROR


class NodeUnreachable(BackendError):
    """The node did not take the request; another node may. `maybe_received`: the connection
    broke after the request was written (a dead node, or a stale pooled connection), so the
    caller also sends the node a Cancel in case it lives."""

    def __init__(self, url: str, reason: str, maybe_received: bool = False) -> None:
        super().__init__(
            503,
            f"node {url} is unavailable: {reason}",
            type=SERVER_ERROR,
            code="unavailable",
            retry_after=1.0,
        )
        self.url = url
        self.maybe_received = maybe_received
