"""pdserve's top-level packages have generic names (`common`, `kernels`, `proxy`, ...). A
distribution in the same environment that ships one of them shadows ours, or ours shadows it,
and whichever loses fails far from the cause: transformers 5.25 requires Hugging Face's
`kernels`, and its `from kernels import CUDAProperties` broke on ours in 106 tests at once.
This test names the clash instead."""

from __future__ import annotations

import importlib.metadata

import pytest

# From pyproject.toml's [tool.setuptools.packages.find].
TOP_LEVEL = ("common", "kernels", "kv_transfer", "prefill_node", "decode_node", "proxy")


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_no_other_installed_distribution_ships_a_top_level_package_of_ours(name: str) -> None:
    owners = set(importlib.metadata.packages_distributions().get(name, [])) - {"pdserve"}
    assert not owners, (
        f"installed distribution(s) {sorted(owners)} also ship a top-level `{name}` package; "
        "pin whatever pulls them in (see the test extra in pyproject.toml)"
    )
