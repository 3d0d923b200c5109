"""The registered KV cache as the transfer layer sees it: an array of equal byte blocks.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous

    base_addr
    |<- block 0 ->|<- block 1 ->| ... |<- block num_blocks-1 ->|
    each block = every layer's K and V for block_size tokens = block_bytes bytes

So a block is one contiguous region, one transfer descriptor, and a write's
descriptor count never depends on the number of layers.

The cache lives in host memory ("DRAM") or in a GPU's ("VRAM", with the GPU's index as the
descriptors' device id). NIXL moves either kind directly (UCX picks cuda_ipc between GPUs of
one host and RDMA across hosts). The backends that move bytes through the CPU (zmq, ucxx)
read and write a device cache through host staging buffers (`gather`/`scatter`; pinned where
CUDA is present, so the copies run at full PCIe speed); a host cache they use in place, unless
`staged` asks for the staging path anyway (tests run the device path that way on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.wire.messages import KVRegion, MemoryKind
from kv_transfer.errors import TransferRejected


class CacheLayout:
    def __init__(self, kv_cache: torch.Tensor, staged: bool = False) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous (one region per block)")
        if kv_cache.device.type not in ("cpu", "cuda"):
            raise ValueError(f"KV caches live on the CPU or a CUDA GPU, got {kv_cache.device}")
        self.tensor = kv_cache
        self.device = kv_cache.device
        self.memory: MemoryKind = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        self.device_id = kv_cache.device.index or 0  # NIXL's device id: the GPU; 0 for DRAM
        # zmq and ucxx go through host buffers: always for a device cache, on request for a
        # host one (the same code path, testable without a GPU).
        self.staged = staged or self.memory == "VRAM"
        self._pin = torch.cuda.is_available()
        self.num_blocks = int(kv_cache.shape[0])
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self.base_addr = kv_cache.data_ptr()
        # blocks: [num_blocks, block_bytes] uint8 view of the same memory
        self.blocks = kv_cache.view(torch.uint8).view(self.num_blocks, self.block_bytes)

    @property
    def region(self) -> KVRegion:
        return KVRegion(
            base_addr=self.base_addr,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            device_id=self.device_id,
            memory=self.memory,
        )

    def host_blocks(self) -> np.ndarray:
        """[num_blocks, block_bytes] uint8 numpy view of a host cache, in place (not staged)."""
        if self.staged:
            raise ValueError("a staged (device) cache has no host view: use gather/scatter")
        return self.blocks.numpy()

    def staging(self, n: int) -> np.ndarray:
        """An empty [n, block_bytes] uint8 host buffer (pinned where CUDA is present)."""
        buf = torch.empty(
            (n, self.block_bytes), dtype=torch.uint8, device="cpu", pin_memory=self._pin
        )
        return buf.numpy()

    def gather(self, block_ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The bytes of `block_ids`, in order, copied into host memory ([n, block_bytes];
        into `out` if given). Waits for the copy (and so for the work that wrote them)."""
        ids = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64)).to(self.device)
        rows = out if out is not None else self.staging(len(block_ids))
        torch.from_numpy(rows).copy_(self.blocks.index_select(0, ids))
        return rows

    def scatter(self, block_ids: np.ndarray, rows: np.ndarray) -> None:
        """Write host `rows` ([n, block_bytes] uint8) into `block_ids`, in order; waits."""
        ids = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64)).to(self.device)
        data = torch.from_numpy(rows).to(self.device, non_blocking=self._pin)
        self.blocks.index_copy_(0, ids, data)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def block_addrs(self, region: KVRegion | None = None) -> np.ndarray:
        """[num_blocks, 3] uint64 rows (addr, len, device) — one descriptor per block."""
        r = region or self.region
        rows = np.empty((r.num_blocks, 3), dtype=np.uint64)
        rows[:, 0] = r.base_addr + np.arange(r.num_blocks, dtype=np.uint64) * r.block_bytes
        rows[:, 1] = r.block_bytes
        rows[:, 2] = r.device_id
        return rows


_SMALL = 32  # below this many ids, plain Python checks beat numpy's per-call overhead
_PLAIN_INT = {int}


def check_block_ids(
    block_ids: Sequence[int] | np.ndarray, num_blocks: int, what: str
) -> np.ndarray:
    """Validate ids (in range, no duplicates, non-empty) -> int32 array; raise TransferRejected."""
    if isinstance(block_ids, list) and 0 < len(block_ids) <= _SMALL:
        return _check_small(block_ids, num_blocks, what)
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise TransferRejected(f"{what} must be a non-empty list of block ids")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TransferRejected(f"{what} must be integers, got {ids.dtype}")
    if ids.min() < 0 or ids.max() >= num_blocks:
        raise TransferRejected(f"{what} must be in [0, {num_blocks}), got {ids.min()}..{ids.max()}")
    if np.unique(ids).size != ids.size:
        raise TransferRejected(f"{what} contains duplicates")
    return ids.astype(np.int32, copy=False)


def _check_small(block_ids: list[int], num_blocks: int, what: str) -> np.ndarray:
    # Plain ints (the usual case) pass the type check with one set of their types.
    if not set(map(type, block_ids)) <= _PLAIN_INT and not all(
        isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in block_ids
    ):
        raise TransferRejected(f"{what} must be integers")
    lo, hi = min(block_ids), max(block_ids)
    if lo < 0 or hi >= num_blocks:
        raise TransferRejected(f"{what} must be in [0, {num_blocks}), got {lo}..{hi}")
    if len(set(block_ids)) != len(block_ids):
        raise TransferRejected(f"{what} contains duplicates")
    return np.array(block_ids, dtype=np.int32)
