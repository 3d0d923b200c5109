"""pdserve's top-level packages have generic names (`common`, `kernels`, `proxy`, ...). A
distribution in the same environment that ships one of them shadows ours, or ours shadows it,
and whichever loses fails far from the cause: transformers 5.25 requires Hugging Face's
`kernels`, and its `from kernels import CUDAProperties` broke on ours in 106 tests at once.
This test names the clash instead."""

from __future__ import annotations

import importlib.metadata


def test_no_other_installed_distribution_ships_a_top_level_package_of_ours() -> None:
    owners_by_name = importlib.metadata.packages_distributions()
    ours = sorted(name for name, owners in owners_by_name.items() if "pdserve" in owners)
    assert "kernels" in ours, f"pdserve's install lists top-level packages {ours}"
    clashes = {
        name: sorted(set(owners_by_name[name]) - {"pdserve"})
        for name in ours
        if set(owners_by_name[name]) - {"pdserve"}
    }
    assert not clashes, (
        f"other installed distributions ship top-level packages of ours: {clashes}; "
        "pin whatever pulls them in (see the test extra in pyproject.toml)"
    )
