"""bench-transfer's report: the per-write overhead over bare NIXL, in the table and the goals."""

from __future__ import annotations

from kv_transfer.bench.report import GOAL_OVERHEAD_US, goals, markdown_table, overhead_us


def rec(backend: str, blocks: int, p50_us: float, shape: str = "tiny") -> dict:
    nbytes = blocks * 65536
    return {
        "backend": backend,
        "shape": shape,
        "num_blocks": blocks,
        "bytes": nbytes,
        "p50_us": p50_us,
        "p99_us": p50_us * 2,
        "gbps": nbytes / p50_us / 1e3,
        "memcpy_gbps": 10.0,
    }


def test_overhead_is_the_p50_difference_at_the_same_point() -> None:
    assert overhead_us(rec("nixl", 1, 51.5), rec("nixl-bare", 1, 26.0)) == 25.5
    assert overhead_us(rec("nixl", 8, 20.0), rec("nixl-bare", 8, 26.0)) == -6.0


def test_the_table_has_the_overhead_on_layer_rows_only() -> None:
    table = markdown_table(
        [rec("nixl", 1, 70), rec("nixl-bare", 1, 26), rec("nixl", 8, 90), rec("nixl-bare", 8, 80)]
    ).splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    col = head.index("over bare µs")
    cells = {
        (row[0], row[2]): row[col]
        for row in ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])
    }
    assert cells[("nixl", "1")] == "+44"
    assert cells[("nixl", "8")] == "+10"
    assert cells[("nixl-bare", "1")] == cells[("nixl-bare", "8")] == ""


def test_goals_judge_the_one_block_overhead_against_the_goal() -> None:
    under = GOAL_OVERHEAD_US - 1
    met = goals([rec("nixl", 1, 26 + under), rec("nixl-bare", 1, 26)])
    missed = goals([rec("nixl", 1, 139), rec("nixl-bare", 1, 26), rec("nixl", 8, 500, "8b")])
    assert f"per-write overhead, one block, tiny: {26 + under:.0f} - 26 us = {under:.0f} us" in met
    assert met.splitlines()[-1].endswith(": met")
    line = [x for x in missed.splitlines() if "per-write overhead" in x]
    assert line == [
        f"- per-write overhead, one block, tiny: 139 - 26 us = 113 us over bare "
        f"(goal <= {GOAL_OVERHEAD_US:.0f} us): NOT met"
    ]


def test_goals_split_the_overhead_at_bare_plus_a_notification() -> None:
    text = goals([rec("nixl", 1, 100), rec("nixl-bare", 1, 20), rec("nixl-bare+notify", 1, 60)])
    assert (
        "so telling the receiver alone costs 40 us; the layer's own overhead beyond that: 40 us"
        in text
    )
