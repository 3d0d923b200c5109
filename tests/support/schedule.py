"""How the suite is split between pytest-xdist's two workers (`-n 2 --dist loadfile` in
pyproject.toml's addopts): a test module is one unit of work, so that its module-scoped
clusters start once, and the units go out heaviest first, so that neither worker is left
with a long module at the end while the other idles.

pytest-xdist's own loadfile ordering sends the modules with the most tests first, which on
this suite put the few-test, minute-long real-model modules last. Here a unit's weight is
what it took in a measured run (`MODULE_SECONDS`), or, for a module not listed, a second
per test (an overestimate for most: they go after the listed ones and fill the gaps).
Modules that share a session fixture too costly to build twice (the transformers reference
model) form one unit (`SHARED`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest

# Torch threads for an engine a test runs in its own process: one per worker when the suite
# runs on two workers (two threads each would oversubscribe two cores, and OpenMP's spinning
# threads then burn the other worker's time), two when it runs alone.
TORCH_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2

# Seconds per module (setup, call and teardown summed), from one `pytest --durations=0` run
# of the whole suite on two workers (2-core machine, 2026-12-02), rounded; only the heavy
# modules need an entry.
MODULE_SECONDS: dict[str, float] = {
    "tests/e2e/test_service.py": 185,
    "tests/kv_transfer/test_kv_failures_e2e.py": 140,
    "tests/common/model/test_gguf.py": 120,
    "tests/e2e/test_netns.py": 105,
    "tests/e2e/test_node_failures.py": 95,
    "tests/e2e/test_real_model.py": 90,
    "tests/common/model/test_processors_real_model.py": 60,
    "tests/e2e/test_cancel_stages.py": 60,
    "tests/e2e/test_kv_streaming.py": 55,
    "tests/e2e/test_role_change.py": 50,
    "tests/kv_transfer/test_kv_transfer_e2e.py": 40,
    "tests/kernels/test_kernel_scripts.py": 35,
    "tests/e2e/test_chaos.py": 35,
    "tests/e2e/test_bench_serve.py": 30,
    "tests/kernels/test_triton_attention.py": 30,
    "tests/e2e/test_hung_nodes.py": 25,
    "tests/e2e/test_routing.py": 25,
    "tests/e2e/test_fuzz_http.py": 25,
}

# Modules that must run on one worker: they share a session-scoped fixture that costs
# tens of seconds to build (transformers loading SmolLM2 from its GGUF file).
SHARED: dict[str, str] = {
    "tests/common/model/test_gguf.py": "smollm2-reference",
    "tests/common/model/test_processors_real_model.py": "smollm2-reference",
}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or its module's shared group."""
    module = module_of(nodeid)
    return SHARED.get(module, module)


def order_heaviest_first(items: list[pytest.Item]) -> None:
    """Reorders items in place: units by weight, heaviest first; within a unit, the order
    pytest chose (which keeps tests of one parametrized module fixture together)."""
    weight: dict[str, float] = defaultdict(float)
    counted: set[str] = set()
    for item in items:
        module = module_of(item.nodeid)
        if module in MODULE_SECONDS:
            if module not in counted:
                weight[unit_of(item.nodeid)] += MODULE_SECONDS[module]
                counted.add(module)
        else:
            weight[unit_of(item.nodeid)] += 1.0
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(unit_of(item.nodeid), i)
    position = {item.nodeid: i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[float, int, int]:
        unit = unit_of(item.nodeid)
        return (-weight[unit], first[unit], position[item.nodeid])

    items.sort(key=key)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """For `--dist loadfile`: xdist's scope scheduling over `unit_of`, in collection order
    (which `order_heaviest_first` made); None for any other --dist, left to xdist."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class HeaviestModuleFirst(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False
    return HeaviestModuleFirst(config, log)
