"""The proxy's one frozen settings record (`common.cli.proxy` fills it from flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.wire.auth import CLUSTER_TOKEN_ENV, is_loopback
from proxy.pool.client import NodeTimeouts
from proxy.pool.node_state import Role
from proxy.pool.placement import DISAGG_MODES
from proxy.pool.planner import PlannerConfig
from proxy.pool.router import POLICIES

Mode = Literal["disagg", "colocated"]
GC_INTERVAL_S = 0.5  # paced garbage collection (common/gc_pacing.py)


@dataclass(frozen=True)
class ProxySettings:
    model: str  # local HF model directory: tokenizer, chat template, context length
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model directory's name
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    mode: Mode = "disagg"  # colocated: route whole requests to `both` nodes
    lease_s: float = 30.0
    max_active_requests: int = 512  # edge: requests inside the pipeline at once
    edge_queue_capacity: int = 1024  # edge: more may wait; beyond max_active + this: 503
    edge_deadline_s: float = 60.0  # edge: the longest wait for admission (0: no limit)
    migrate_limit: int = 1  # times a stream may move to another decode node after a failure
    kv_streaming: bool = True  # KV written while the prompt computes (proxy/pool/disagg.py)
    routing: str = "cost"  # prefill placement policy (proxy/pool/router.py)
    disagg_mode: str = "auto"  # always | never | auto: conditional disaggregation (placement.py)
    local_prefill_max_tokens: int = 256  # auto: the longest uncached prompt prefilled locally
    slo_ttft_s: float | None = None  # auto: the TTFT objective a local prefill may rescue
    slo_tpot_s: float | None = None  # auto: the TPOT objective a local prefill must keep
    trace_capacity: int = 2048  # recent requests whose traces GET /debug/requests/{id}/trace has
    interstage_capacity: int = 0  # pre-decode requests; 0: the decode nodes' max_num_seqs
    prefill_backlog_s: float = 2.0  # prefill work admitted ahead, in seconds (0: no limit)
    interstage_max_wait_s: float = 300.0
    poll_interval_s: float = 0.5
    silent_after_s: float | None = None  # no good poll this long: no new work (None: default)
    timeouts: NodeTimeouts = field(default_factory=NodeTimeouts)
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout_s: float = 10.0
    gc_interval_s: float = GC_INTERVAL_S  # 0: CPython's own collector
    # Secrets (common/wire/auth.py): the cluster token is sent to every node and required on
    # /admin/* and /debug/*; the API key is required on /v1/*. None: not checked.
    cluster_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    insecure: bool = False  # allow a non-loopback host without a cluster token
    role_drain_timeout_s: float = 30.0  # a moved node's old role may run this long, then moves
    auto_roles: bool = False  # run the role planner (proxy/pool/planner.py)
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        if self.cluster_token is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without a cluster token (its /admin/* "
                f"would be open): give --cluster-token-file or ${CLUSTER_TOKEN_ENV}, or "
                "--insecure to accept the risk"
            )
        if self.mode not in ("disagg", "colocated"):
            raise ValueError(f"mode must be disagg or colocated, got {self.mode!r}")
        if self.colocated_mode and (self.prefill or self.decode):
            raise ValueError("--prefill/--decode cannot be combined with colocated nodes")
        if not self.colocated_mode and self.colocated:
            raise ValueError("--colocated nodes need --mode colocated")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
        if self.disagg_mode not in DISAGG_MODES:
            raise ValueError(
                f"disagg_mode must be one of {', '.join(DISAGG_MODES)}, got {self.disagg_mode!r}"
            )
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")
        if self.slo_ttft_s is not None and not self.slo_ttft_s > 0:
            raise ValueError("slo_ttft_s must be > 0")
        if self.slo_tpot_s is not None and not self.slo_tpot_s > 0:
            raise ValueError("slo_tpot_s must be > 0")
        if min(self.interstage_capacity, self.edge_deadline_s, self.prefill_backlog_s) < 0:
            raise ValueError(
                "interstage_capacity, edge_deadline_s and prefill_backlog_s must be >= 0"
            )
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
        if not 0 <= self.gc_interval_s <= 60:
            raise ValueError("gc_interval_s must be in [0, 60]")
        if not 0 <= self.role_drain_timeout_s <= 3600:
            raise ValueError("role_drain_timeout_s must be in [0, 3600]")
        if self.auto_roles and self.colocated_mode:
            raise ValueError("--auto-roles moves prefill and decode nodes: not with colocated")

    @property
    def colocated_mode(self) -> bool:
        return self.mode == "colocated"

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def node_urls(self) -> dict[Role, tuple[str, ...]]:
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode, Role.BOTH: self.colocated}
