"""A held block set's lease: expiry, extension (never shortened, capped), peer."""

from __future__ import annotations

import pytest

from prefill_node.lease import Lease


def test_lease_expiry_and_extension() -> None:
    lease = Lease.grant("r1", [3, 1, 2], ttl_s=10.0, now=100.0)
    assert lease.deadline == 110.0 and not lease.expired(109.9) and lease.expired(110.0)
    longer = lease.extend(30.0, now=105.0)
    assert longer.deadline == 135.0 and lease.deadline == 110.0  # a new value
    assert lease.extend(1.0, now=105.0).deadline == 110.0  # never shortened
    assert lease.extend(30.0, now=105.0, max_deadline=120.0).deadline == 120.0
    assert lease.with_peer("d-1").peer == "d-1"
    assert lease.remaining(104.0) == 6.0
    with pytest.raises(ValueError, match="expired"):
        lease.extend(5.0, now=111.0)
    with pytest.raises(ValueError, match="duplicate"):
        Lease.grant("r2", [1, 1], ttl_s=1.0)
