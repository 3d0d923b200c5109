"""Where a request is: one vocabulary for the engine, the nodes, cancel answers, metrics
labels and the proxy's trace.

Two views share it. A node reports where it holds a request (`NODE_STAGES`); the proxy
tracks where a request is in the pipeline (`PIPELINE_STAGES`). TRANSFER belongs to both:
for a node, its KV is being written or received; for the proxy, the request was dispatched to
a decode node that has not produced a token yet.
"""

from __future__ import annotations

from enum import Enum


class Stage(str, Enum):
    # the proxy's view of the pipeline
    EDGE = "edge"  # waiting at the proxy's edge queue
    PREFILL = "prefill"  # sent to a prefill node, no first token yet
    INTERSTAGE = "interstage"  # prefilled, waiting in the inter-stage queue
    TRANSFER = "transfer"  # KV moving between nodes (both views)
    DECODE = "decode"  # producing tokens
    # a node's view of what it holds
    QUEUED = "queued"  # in an engine's waiting queue (new, or preempted)
    RUNNING = "running"  # in an engine's running batch (computing a prompt, or decoding)
    HELD = "held"  # prefill node: prompt KV held under a lease for transfer
    RESERVED = "reserved"  # decode node: destination blocks reserved, transfer not started


PIPELINE_STAGES = (Stage.EDGE, Stage.PREFILL, Stage.INTERSTAGE, Stage.TRANSFER, Stage.DECODE)
NODE_STAGES = (Stage.QUEUED, Stage.RUNNING, Stage.HELD, Stage.TRANSFER, Stage.RESERVED)
