"""Decode steps replayed from CUDA graphs (`--cuda-graphs`), as vLLM and SGLang do.

A decode-only step launches a few kernels per layer; at small batches the GPU finishes them
faster than Python issues them, so the step's time is host time. A CUDA graph records one
step's launches once and replays them with one call. Graphs fix every shape, so:

- batch sizes: one graph per captured size (1, 2, 4, 8, then every 8 up to the engine's
  `max_num_seqs`); a live batch runs in the smallest captured size that holds it, its
  extra rows padding (slot -1: nothing stored; context 1 over block 0: read, ignored);
- the block-table width is the engine's whole context (`max_model_len / block_size`
  columns), so the decode kernel's split count, chosen from the width, is fixed too;
- inputs go through static buffers, copied in before each replay; outputs are the
  captured step's logits, read back for the live rows.

A step with a prefill chunk, or a batch larger than the largest graph, runs eagerly. Padding
costs compute (a batch of 9 runs as 16): `scripts/bench_cuda_graphs.py` reports the step time
of live batches between captured sizes, eager beside graphed.

CUDA only, and not yet run on a GPU when this was written (the development machines have
none): `tests/common/engine/test_cuda_graphs.py` checks graphed against eager outputs where a
GPU is present, and scripts/gpu_check.sh runs it.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left

import torch

from common.model.attention import AttentionMetadata
from common.model.decoder import LlamaForCausalLM
from kernels.dispatch import Kernels

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += range(16, max_num_seqs + 1, 8)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    """One captured decode step per batch size, over static input buffers."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        kernels: Kernels,
        max_num_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        device = kv_cache.device
        if device.type != "cuda" or kernels.name != "triton":
            raise ValueError(
                "--cuda-graphs needs a CUDA device and the Triton kernels, got "
                f"{device} with {kernels.name}"
            )
        self.model, self.kv_cache, self.kernels = model, kv_cache, kernels
        self.sizes = capture_sizes(max_num_seqs)
        self.width = max_blocks_per_seq
        n = self.sizes[-1]
        i64 = torch.int64
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slots = torch.full((n,), -1, dtype=i64, device=device)
        self.tables = torch.zeros((n, self.width), dtype=i64, device=device)
        self.context_lens = torch.ones(n, dtype=i64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0

    def capture(self) -> float:
        """Capture every size, largest first (the smaller ones reuse its memory pool);
        seconds taken."""
        started = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up launches (allocations, autotuning)
                for _ in range(2):
                    self._step(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._step(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        log.info("captured %d decode graphs (batch %s) in %.2f s", len(self.sizes), self.sizes,
                 seconds)  # fmt: skip
        return seconds

    def fits(self, num_seqs: int, width: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1] and width <= self.width

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The logits of a decode-only step ([num_seqs, vocab]), by replay."""
        n = input_ids.shape[0]
        size = self.sizes[bisect_left(self.sizes, n)]
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.tables[:n, :width].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.context_lens[n:size].fill_(1)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:n]

    def _step(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode=size,
            decode_block_tables=self.tables[:size],
            decode_context_lens=self.context_lens[:size],
            prefills=[],
            kernels=self.kernels,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
        return self.model.compute_logits(hidden)
