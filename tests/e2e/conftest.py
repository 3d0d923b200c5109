"""Clusters of real processes, shared per module (or, for the slow 2P2D nodes, by the modules
that kill, restart and stop nodes) to keep start-up cost down."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Completion, LLMEngine
from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import SamplingParams
from tests.support.cluster import Cluster, Topology, start_cluster


@pytest.fixture(scope="module")
def offline_completion(tiny_model_dir: Path) -> Callable[[list[int], SamplingParams], Completion]:
    """`offline_completion(prompt_ids, sampling)`: the offline engine's Completion for one
    prompt run alone (cached per prompt and sampling), to compare served output with."""
    # No prefix cache: the reference computes every prompt in full.
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_blocks=256, enable_prefix_caching=False)
    )
    cache: dict[tuple[tuple[int, ...], SamplingParams], Completion] = {}

    def run(prompt: list[int], sampling: SamplingParams) -> Completion:
        key = (tuple(prompt), sampling)
        if key not in cache:
            (cache[key],) = engine.generate([prompt], sampling)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def offline_token_ids(
    offline_completion: Callable[[list[int], SamplingParams], Completion],
) -> Callable[[list[int], SamplingParams], list[int]]:
    """`offline_token_ids(prompt_ids, sampling)`: the offline engine's output token ids."""
    return lambda prompt, sampling: offline_completion(prompt, sampling).token_ids


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture
def cluster_factory(tiny_model_dir: Path) -> Iterator[Callable[..., Cluster]]:
    """Start clusters inside a test; all of them are stopped when it ends."""
    started: list[Cluster] = []

    def make(topology: Topology, **engine: object) -> Cluster:
        cluster = start_cluster(tiny_model_dir, topology, **engine)
        started.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            cluster.close()


@pytest.fixture(scope="session")
def slow_2p2d(tiny_model_dir: Path) -> Iterator[Cluster]:
    """2P2D nodes without a proxy, for tests that fail nodes (each module starts its own
    proxies). Prefill steps take 0.2 s and decode steps 0.03 s, and a decode node runs at
    most 2 sequences, so streams last and prefilled requests queue; a decode node drains
    for 1 s on SIGTERM. Tests that kill a node start it again (`Cluster.restart`)."""
    cluster = Cluster(tiny_model_dir)
    try:
        for i in range(2):
            cluster.node("prefill", f"prefill-{i}", wait=False, debug_step_delay=0.2)
        for i in range(2):
            cluster.node(
                "decode", f"decode-{i}", wait=False, debug_step_delay=0.03, max_num_seqs=2,
                drain_timeout=1,
            )  # fmt: skip
        cluster.wait_all()
        yield cluster
    finally:
        cluster.close()
