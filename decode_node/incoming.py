"""Requests a decode node has reserved destination blocks for, until their KV lands.

Per request (DESIGN.md §3, decode side, before RUNNING):

    RESERVED --TransferRequest sent--> RECEIVING --KVReceived--> LANDED (-> engine, RUNNING)
       | cancel -> freed at once      |  failed / peer lost ----> freed (the layer says quiescent)
                                      |  cancel / timeout: Abort, freed only once quiescent

`done` resolves with True (landed) or False (the transfer ended without
landing) once the KV-transfer layer reports a terminal event for the request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum


class InState(str, Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    LANDED = "landed"
    FREED = "freed"


_LEGAL = {
    InState.RESERVED: frozenset({InState.RECEIVING, InState.FREED}),
    InState.RECEIVING: frozenset({InState.LANDED, InState.FREED}),
    InState.LANDED: frozenset({InState.FREED}),  # FREED here: landed but never admitted
    InState.FREED: frozenset(),
}


@dataclass
class Incoming:
    request_id: str
    blocks: list[int]
    done: asyncio.Future[bool]
    state: InState = InState.RESERVED
    peer_id: str | None = None
    cancelled: bool = False  # the proxy asked to cancel
    abandoned: bool = False  # no handler waits any more: free on the terminal event
    failure: str = ""
    events: list[tuple[str, float]] = field(default_factory=list)  # for the trace
    created: float = field(default_factory=time.monotonic)

    def transition(self, new: InState) -> None:
        if new not in _LEGAL[self.state]:
            raise RuntimeError(f"{self.request_id}: illegal {self.state.value} -> {new.value}")
        self.state = new
