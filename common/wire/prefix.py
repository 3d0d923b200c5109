"""Chained block hashes: the names of prompt prefixes, the same in every process.

A node's prefix cache files each full block of KV under the hash of (its parent block's
hash, the block's token ids, a salt naming everything else the KV depends on: model
weights, dtype, block size). The proxy computes the same hashes for a prompt to find which
node holds how much of it (KV events), so this lives in the wire package both import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def block_hash(parent: int | None, token_ids: Sequence[int], salt: bytes = b"") -> int:
    """The chained hash of one full block: it names the KV of these tokens after exactly
    the tokens its parent hash names, under `salt` (whatever else changes the KV: model,
    dtype, block size). 128 bits of SHA-256, the same in every process."""
    h = hashlib.sha256(salt)
    h.update(b"\0" * 16 if parent is None else parent.to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest()[:16], "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes = b"", start: list[int] | None = None
) -> list[int]:
    """Chained hashes of every full block of `token_ids` (extending `start`, the hashes of
    the first blocks if already known)."""
    out = list(start or [])
    parent = out[-1] if out else None
    for i in range(len(out), len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        out.append(parent)
    return out


def event_key(block_hash: int, secret: str | None) -> bytes:
    """What a block hash is published as in KV events: 16 bytes of SHA-256 over (the
    cluster secret, the hash), so that only holders of the secret can match prompts."""
    h = hashlib.sha256((secret or "").encode())
    h.update(block_hash.to_bytes(16, "little"))
    return h.digest()[:16]


def prompt_keys(
    token_ids: Sequence[int], block_size: int, salt: bytes, secret: str | None
) -> list[bytes]:
    """The event keys of a prompt's full blocks, in order (what a router looks up)."""
    return [event_key(h, secret) for h in block_hashes(token_ids, block_size, salt)]
