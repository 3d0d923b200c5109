"""Transport backends behind one interface (base.Backend), chosen by TransferConfig.backend.

Each module is imported only when chosen: nixl and ucxx each load their own UCX.
"""

from __future__ import annotations

import importlib

from kv_transfer.backends.base import Backend, SendFn
from kv_transfer.config import TransferConfig
from kv_transfer.layout import CacheLayout

_BACKENDS: dict[str, tuple[str, str]] = {
    "nixl": ("kv_transfer.backends.nixl", "NixlBackend"),
    "ucxx": ("kv_transfer.backends.ucxx", "UcxxBackend"),
    "zmq": ("kv_transfer.backends.zmq", "ZmqBackend"),
}


def create_backend(
    agent_name: str, layout: CacheLayout, config: TransferConfig, send: SendFn
) -> Backend:
    module, cls_name = _BACKENDS[config.backend]
    cls: type[Backend] = getattr(importlib.import_module(module), cls_name)
    return cls(agent_name, layout, config, send)
