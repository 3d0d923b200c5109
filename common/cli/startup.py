"""What a long-running pdserve process does once it has started."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Keep what startup made (torch's modules, the model, the server) out of every later
    garbage collection: with torch loaded a full collection scans ~200k objects, about
    90 ms during which neither the engine thread nor the event loop runs (a decode step's
    tail). The proxy does the same (proxy.main.serve), and `pdserve up`, which hosts one."""
    gc.collect()
    gc.freeze()
