"""Which kernel implementation runs: Triton on CUDA, the torch reference on CPU.

The backend is one of
    auto    Triton for CUDA tensors (torch if Triton cannot be imported), torch otherwise
    triton  always Triton (CPU tensors only under TRITON_INTERPRET=1: a test mode)
    torch   always the torch reference
The process default comes from `PDSERVE_KERNELS` (read here, once, on first use)
and can be changed with `set_backend`; an engine picks its own with
`EngineConfig.kernel_backend` and resolves it once, at construction, into a
`Kernels` table (see `kernels_for`), so a step pays no dispatch cost.

The module-level functions below (`store_kv`, ...) dispatch per call on the
process default and the tensors' device, for callers without a `Kernels` table.
Triton is imported only when a Triton backend is first needed.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kernels import reference

log = logging.getLogger(__name__)

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[Backend, ...] = ("auto", "triton", "torch")
ENV_VAR = "PDSERVE_KERNELS"


class KernelBackendError(RuntimeError):
    """The Triton backend was asked for but cannot be loaded."""


@dataclass(frozen=True)
class Kernels:
    """One implementation of every kernel, with the reference's signatures."""

    name: str
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    pack_blocks: Callable[..., torch.Tensor]
    unpack_blocks: Callable[..., None]
    # Every prefill chunk of a step in one launch (kernels.reference's contract); None: the
    # step calls paged_prefill_attention once per chunk (the torch reference: SDPA per
    # sequence is what it would do inside anyway).
    paged_prefill_attention_varlen: Callable[..., torch.Tensor] | None = None


TORCH = Kernels(
    name="torch",
    store_kv=reference.store_kv,
    paged_decode_attention=reference.paged_decode_attention,
    paged_prefill_attention=reference.paged_prefill_attention,
    pack_blocks=reference.pack_blocks,
    unpack_blocks=reference.unpack_blocks,
)


@functools.cache
def _load_triton() -> Kernels | KernelBackendError:
    # The outcome, failure included, is cached: a broken install is tried once.
    try:
        from kernels import triton_attention, triton_cache, triton_prefill
    except Exception as e:  # a broken triton install fails in many ways
        return KernelBackendError(f"the Triton kernel backend is unavailable: {e!r}")
    return Kernels(
        name="triton",
        store_kv=triton_cache.store_kv,
        paged_decode_attention=triton_attention.paged_decode_attention,
        paged_prefill_attention=triton_prefill.paged_prefill_attention,
        pack_blocks=triton_cache.pack_blocks,
        unpack_blocks=triton_cache.unpack_blocks,
        paged_prefill_attention_varlen=triton_prefill.paged_prefill_attention_varlen,
    )


def triton_kernels() -> Kernels:
    """The Triton implementation (imports triton on first call), or KernelBackendError."""
    loaded = _load_triton()
    if isinstance(loaded, KernelBackendError):
        raise KernelBackendError(str(loaded))
    return loaded


def check_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name  # narrowed to Backend by the membership test


_default: Backend | None = None  # None: not yet read from the environment
_warned_fallback = False


def get_backend() -> Backend:
    """The process default: set_backend's, else $PDSERVE_KERNELS, else auto."""
    global _default
    if _default is None:
        value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        try:
            _default = check_backend(value)
        except ValueError as e:
            raise ValueError(f"${ENV_VAR}: {e}") from None
    return _default


def set_backend(name: str | None) -> None:
    """Set the process default backend (None: back to $PDSERVE_KERNELS). Engines
    resolve theirs at construction: this reaches only engines built later."""
    global _default
    _default = None if name is None else check_backend(name)


def kernels_for(device: torch.device | str, backend: str | None = None) -> Kernels:
    """The kernels to run on `device`: `backend`, or the process default if None."""
    mode = get_backend() if backend is None else check_backend(backend)
    if mode == "torch":
        return TORCH
    if mode == "triton":
        return triton_kernels()
    if torch.device(device).type != "cuda":
        return TORCH
    loaded = _load_triton()
    if isinstance(loaded, KernelBackendError):
        global _warned_fallback
        if not _warned_fallback:
            _warned_fallback = True
            log.warning("%s; falling back to the torch kernels", loaded)
        return TORCH
    return loaded


def _on(t: torch.Tensor) -> Kernels:
    return kernels_for(t.device)


def store_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See kernels.reference.store_kv."""
    _on(kv_cache).store_kv(kv_cache, layer, k, v, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See kernels.reference.paged_decode_attention."""
    return _on(q).paged_decode_attention(q, kv_cache, layer, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
) -> torch.Tensor:
    """See kernels.reference.paged_prefill_attention."""
    return _on(q).paged_prefill_attention(q, kv_cache, layer, block_table, start_pos, scale)


def pack_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """See kernels.reference.pack_blocks."""
    return _on(kv_cache).pack_blocks(kv_cache, block_ids, out)


def unpack_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """See kernels.reference.unpack_blocks."""
    _on(kv_cache).unpack_blocks(staging, kv_cache, block_ids)
