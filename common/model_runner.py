"""Turns a scheduled batch into tensors, runs the model, samples."""

from __future__ import annotations

import torch

from common.attention import AttentionMetadata, PrefillSlice
from common.model import LlamaForCausalLM
from common.sampling import sample
from common.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, positions, attention metadata and the rows that sample."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        prefills: list[PrefillSlice] = []
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n > 1:
                prefills.append(
                    PrefillSlice(len(ids), n, start, torch.tensor(table[: -(-end // bs)]))
                )
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
        decode = batch.seqs[: batch.num_decode]
        width = max((len(s.block_table) for s in decode), default=0)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decode=batch.num_decode,
            decode_block_tables=torch.tensor(
                [s.block_table + [0] * (width - len(s.block_table)) for s in decode],
                dtype=torch.int64,
                device=self.device,
            ).view(len(decode), width),
            decode_context_lens=torch.tensor(
                [s.num_computed_tokens + 1 for s in decode], dtype=torch.int64, device=self.device
            ),
            prefills=prefills,
        )
        return (
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta,
            sample_rows,
        )

    def run(self, batch: ScheduledBatch) -> list[int]:
        """One forward over the batch; returns the sampled token of each sampling entry."""
        input_ids, positions, meta, rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[rows])
        sampling = [s for s, n in zip(batch.seqs, batch.num_new) if s.num_computed_tokens + n == s.num_tokens]
        return sample(
            logits, [s.sampling for s in sampling], [s.num_output_tokens for s in sampling]
        )
