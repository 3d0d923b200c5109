"""The proxy's counted histogram exposes what prometheus_client's would, and a chunk of k
tokens counts k inter-token gaps."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from proxy.metrics import ITL_BUCKETS, CountedHistogram, ProxyMetrics


def _lines(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("#") or "_created" in line:
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out


def test_counted_histogram_exposes_what_prometheus_client_would_for_the_same_observations() -> None:
    plain, counted = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("gap_seconds", "gaps", buckets=ITL_BUCKETS, registry=plain)
    ours = CountedHistogram("gap_seconds", "gaps", ITL_BUCKETS, counted)
    rng = random.Random(7)
    # bounds themselves, values past the last bound, zero, and a spread in between
    values = [0.0, ITL_BUCKETS[0], ITL_BUCKETS[10], 1e9, *(rng.expovariate(50) for _ in range(300))]
    for v in values:
        k = rng.randint(1, 6)
        for _ in range(k):
            reference.observe(v)
        ours.observe(v, k)
    want, got = _lines(plain), _lines(counted)
    assert want.keys() == got.keys()
    assert len([k for k in got if "_bucket" in k]) == len(ITL_BUCKETS) + 1  # and +Inf
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def test_a_chunk_of_k_tokens_is_k_inter_token_gaps() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    metrics.on_received("r", "completions")
    metrics.on_tokens("r", 1)  # the first token: TTFT, no gap
    metrics.on_tokens("r", 3)
    metrics.on_tokens("r", 2)
    metrics.on_tokens("r", 0)  # nothing
    got = _lines(registry)
    assert got["pdserve_proxy_ttft_seconds_count"] == 1
    assert got["pdserve_proxy_itl_seconds_count"] == 5
    assert got['pdserve_proxy_itl_seconds_bucket{le="+Inf"}'] == 5
