"""The transfer layer's plain records: transfer states and their legal transitions, config."""

from __future__ import annotations

import pytest

from kv_transfer import TransferConfig
from kv_transfer.state import (
    IllegalTransition,
    IncomingTransfer,
    InState,
    OutgoingTransfer,
    OutState,
)


def test_outgoing_transitions_are_checked() -> None:
    import numpy as np

    ids = np.zeros(1, dtype=np.int32)
    xfer = OutgoingTransfer("r", "p", ids, ids, 16)
    with pytest.raises(IllegalTransition):
        xfer.transition(OutState.DONE)  # must be posted first
    xfer.transition(OutState.POSTED)
    xfer.transition(OutState.ABORTING)
    xfer.transition(OutState.DONE)  # finished anyway
    assert xfer.terminal
    with pytest.raises(IllegalTransition):
        xfer.transition(OutState.FAILED)
    inc = IncomingTransfer("r", "p", ids)
    inc.transition(InState.ABORT_REQUESTED)
    assert inc.abort_requested
    inc.transition(InState.ABORTED)
    with pytest.raises(IllegalTransition):
        inc.transition(InState.LANDED)


def test_config_validation_and_env() -> None:
    with pytest.raises(ValueError, match="backend"):
        TransferConfig(backend="rdma")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        TransferConfig(heartbeat_interval_s=1.0, peer_timeout_s=1.5)
    cfg = TransferConfig.from_env(
        {
            "PDSERVE_KV_BACKEND": "zmq",
            "PDSERVE_KV_PEER_TIMEOUT_S": "4",
            "PDSERVE_KV_UCXX_ERROR_HANDLING": "0",
        },
        host="127.0.0.2",
    )
    assert (cfg.backend, cfg.peer_timeout_s, cfg.ucxx_error_handling, cfg.host) == (
        "zmq",
        4.0,
        False,
        "127.0.0.2",
    )
