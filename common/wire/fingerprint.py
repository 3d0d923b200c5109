"""Compatibility fingerprint: what two nodes must agree on before KV bytes may flow.

A KV block copied between nodes is only meaningful if both sides computed it
with the same weights and lay it out identically. The fingerprint is exchanged
in the KV-transfer handshake; any difference refuses the connection with an
error that names the differing field (never a silent garbage transfer).

The number of blocks is deliberately not part of it: nodes may size their
caches differently.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Bump on any change to a cross-process message or to the transfer protocol.
PROTOCOL_VERSION = 1

# The only KV layout the engine uses (common/engine.py):
# kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
BLOCK_MAJOR_LAYOUT = "block-major:[num_blocks,num_layers,2,block_size,num_kv_heads,head_dim]"

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class FingerprintMismatch(ValueError):
    """Two fingerprints differ; `fields` names every differing field."""

    def __init__(self, fields: list[str], message: str) -> None:
        super().__init__(message)
        self.fields = fields


class Fingerprint(BaseModel):
    """What must match, field by field, for a KV transfer to be meaningful."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weights_hash: str = Field(min_length=1)
    dtype: str
    block_size: int = Field(gt=0)
    kv_layout: str = BLOCK_MAJOR_LAYOUT
    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    protocol_version: int = PROTOCOL_VERSION

    @classmethod
    def for_kv_cache(cls, kv_cache: object, weights_hash: str) -> Fingerprint:
        """Fingerprint of a block-major cache tensor (torch.Tensor, 6 dims)."""
        shape = tuple(getattr(kv_cache, "shape", ()))
        if len(shape) != 6 or shape[2] != 2:
            raise ValueError(
                "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got shape {shape}"
            )
        dtype = str(getattr(kv_cache, "dtype", "")).removeprefix("torch.")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported KV cache dtype {dtype!r}")
        _, layers, _, block_size, heads, head_dim = shape
        return cls(
            weights_hash=weights_hash,
            dtype=dtype,
            block_size=block_size,
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
        )

    def differences(self, other: Fingerprint) -> list[tuple[str, object, object]]:
        """(field, ours, theirs) for every field that differs, in declaration order."""
        ours, theirs = self.model_dump(), other.model_dump()
        return [(k, ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]]

    def check_compatible(self, other: Fingerprint) -> None:
        """Raise FingerprintMismatch naming each differing field; return if equal."""
        diffs = self.differences(other)
        if not diffs:
            return
        parts = [f"{k} differs (ours {a!r}, theirs {b!r})" for k, a, b in diffs]
        raise FingerprintMismatch(
            [k for k, _, _ in diffs], "incompatible KV fingerprint: " + "; ".join(parts)
        )
