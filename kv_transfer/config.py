"""The KV-transfer layer's one frozen config, validated at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

BackendName = Literal["nixl", "ucxx", "zmq"]
BACKENDS: tuple[str, ...] = ("nixl", "ucxx", "zmq")

_ENV_PREFIX = "PDSERVE_KV_"


@dataclass(frozen=True)
class TransferConfig:
    """Settings of one node's KVTransferAgent.

    Defaults were chosen from measurements on a 2-core loopback machine; see
    kv_transfer/README.md ("Defaults") for the numbers behind each.
    """

    backend: BackendName = "nixl"
    host: str = "127.0.0.1"  # address the side channel (and zmq data socket) bind to
    side_channel_port: int = 0  # 0: an ephemeral port; read it back from agent.address
    heartbeat_interval_s: float = 1.0
    # Silence longer than this declares a peer lost. A killed process is seen at once
    # (its TCP connection drops); this bounds the wait for a hung or partitioned one.
    peer_timeout_s: float = 10.0
    handshake_timeout_s: float = 10.0
    # Posted (backend-owned) writes per peer; further writes queue in the layer, where
    # an abort stops them before any byte moves.
    max_inflight_per_peer: int = 4
    # A write up to this size is posted by write() itself when the progress thread is
    # idle and the backend posts synchronously (nixl): no thread hand-off, so a one-block
    # write costs about what bare NIXL does. Larger ones never block the caller. 0: off.
    inline_write_max_bytes: int = 4 * 2**20
    # While transfers are in flight the progress thread polls the backend; it sleeps
    # this long between polls (0: poll continuously in 0.5 ms slices, like a bare loop).
    busy_poll_interval_s: float = 0.0
    # With nothing in flight but writes to this agent expected: how often the backend is
    # polled anyway (nixl notifications; UCX transports that need the target's progress).
    idle_poll_interval_s: float = 0.005
    # With nothing in flight or expected: the longest sleep between passes (heartbeats and
    # commands wake the thread sooner). At 5 ms an idle node spent ~6% of a core polling.
    quiet_poll_interval_s: float = 0.1
    nixl_progress_thread: bool = False  # NIXL's own progress thread (see README: slower here)
    # How a nixl write's completion reaches the receiver: "side_channel" sends KVDone over
    # the side channel once the write is DONE (NIXL flushes the endpoint first, so the data
    # is in place); "nixl" attaches it to the transfer as a NIXL notification, which here
    # made every small write wait 1-12 ms for the receiver's UCX progress.
    nixl_notify: Literal["side_channel", "nixl"] = "side_channel"
    # UCX endpoint error handling. On: a dead peer's requests fail cleanly, but this
    # UCX (1.21) then avoids cma/sysv and sends over TCP. Off: shared memory, ~5x faster
    # here, but a sender dying mid-transfer makes UCX abort the receiving process.
    ucxx_error_handling: bool = True
    zmq_transport: Literal["tcp", "ipc"] = "tcp"
    ipc_dir: str = "/tmp"  # where zmq ipc sockets live when zmq_transport == "ipc"
    max_message_bytes: int = 16 * 2**20  # side-channel message size limit
    close_timeout_s: float = 5.0  # bound on close(): stop the thread, drain the backend
    # The cluster's shared secret: with it, a handshake is a mutual challenge-response (an
    # HMAC over both sides' nonces) and nothing about this agent (addresses, backend
    # metadata, memory keys) is sent before the peer proved it holds the same secret.
    # None: the handshake checks compatibility only (loopback deployments).
    cluster_token: str | None = field(default=None, repr=False)
    # A write nobody asked for (no request_transfer() for it from that peer): refused by
    # the two-sided receivers (zmq, ucxx) unless this is on (push-mode tests and tools).
    # nixl writes are one-sided: the receiver does not see them coming.
    accept_unsolicited_writes: bool = False
    # Receiving blocks of a sender lost mid-transfer, on a one-sided backend (nixl), are
    # held until the sender says no write is in progress (it is asked again when it comes
    # back) or a new incarnation replaces it; failing both, they are freed after this long.
    quarantine_timeout_s: float = 60.0
    # zmq and ucxx move a device (GPU) cache through host staging buffers; on, they move a
    # host cache that way too: the device path, run on a CPU (tests). nixl moves either kind
    # in place.
    stage_host_cache: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(
                f"side_channel_port must be in [0, 65536), got {self.side_channel_port}"
            )
        for name in ("heartbeat_interval_s", "peer_timeout_s", "handshake_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.peer_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"peer_timeout_s ({self.peer_timeout_s}) must be at least twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        if self.max_inflight_per_peer < 1:
            raise ValueError("max_inflight_per_peer must be >= 1")
        if (
            self.busy_poll_interval_s < 0
            or self.idle_poll_interval_s <= 0
            or self.quiet_poll_interval_s < self.idle_poll_interval_s
        ):
            raise ValueError("poll intervals must be >= 0 (busy), > 0 (idle), >= idle (quiet)")
        if self.nixl_notify not in ("side_channel", "nixl"):
            raise ValueError(f"nixl_notify must be side_channel or nixl, got {self.nixl_notify!r}")
        if self.zmq_transport not in ("tcp", "ipc"):
            raise ValueError(f"zmq_transport must be tcp or ipc, got {self.zmq_transport!r}")
        if self.quarantine_timeout_s <= 0:
            raise ValueError(
                f"quarantine_timeout_s must be positive, got {self.quarantine_timeout_s}"
            )
        if self.max_message_bytes < 4096:
            raise ValueError("max_message_bytes must be >= 4096")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> TransferConfig:
        """Config from PDSERVE_KV_<FIELD> variables (e.g. PDSERVE_KV_BACKEND), then overrides."""
        env = os.environ if environ is None else environ
        # Field name -> value parsed from the environment (or overridden): each field has
        # its own type, so the dict is Any-valued; __post_init__ validates the values.
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(_ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            default = f.default
            if isinstance(default, bool):
                values[f.name] = raw.lower() in ("1", "true", "yes", "on")
            elif isinstance(default, (int, float)):
                values[f.name] = type(default)(raw)
            else:
                values[f.name] = raw
        values.update(overrides)
        return cls(**values)
