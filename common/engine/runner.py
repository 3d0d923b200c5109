"""Turns a scheduled batch into tensors, runs the model, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.engine.cuda_graphs import DecodeGraphs
from common.engine.grammar import apply_grammar
from common.engine.logits_processors import apply_processors
from common.engine.sampling import sample, token_logprobs, token_logprobs_rows
from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import Sequence
from common.model.attention import AttentionMetadata, PrefillBatch, PrefillSlice
from common.model.decoder import LlamaForCausalLM
from common.wire.logprobs import TokenLogprobs
from kernels.dispatch import Kernels

_PROMPT_SLICE = 256  # prompt positions whose logits are computed at once (prompt logprobs)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: list[int]  # flat rows whose logits are sampled
    sample_seqs: list[Sequence]  # the sequence of each sampled row
    # Prompt logprobs: per asking sequence in a prefill chunk, (its first prompt position
    # in this chunk, the flat rows whose next token is a prompt token, those tokens).
    prompt_rows: list[tuple[Sequence, int, list[int], list[int]]] = field(default_factory=list)


@dataclass
class StepSample:
    """A step's sampled tokens, one per sampling entry, and their logprobs where asked."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    # request id -> (first position, logprobs of the prompt tokens after it): positions
    # computed this step of the prompts that asked (`SamplingParams.prompt_logprobs`).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        kernels: Kernels,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids  # masked by min_tokens
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.kernels = kernels
        self.device = kv_cache.device
        self.last_sample_s = 0.0  # the sampling time of the last run() (engine metrics)
        self._varlen = kernels.paged_prefill_attention_varlen is not None
        self.graphs: DecodeGraphs | None = None  # set by the engine with --cuda-graphs

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prefills: list[PrefillSlice] = []
        prompt_rows: list[tuple[Sequence, int, list[int], list[int]]] = []
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            last = min(end, seq.num_prompt_tokens - 1)  # positions whose next token is prompt
            if seq.sampling.prompt_logprobs is not None and start < last:
                rows_ = list(range(len(ids), len(ids) + last - start))
                prompt_rows.append((seq, start, rows_, seq.token_ids[start + 1 : last + 1]))
            if n > 1:
                used = torch.tensor(table[: -(-end // bs)], device=self.device)
                prefills.append(PrefillSlice(len(ids), n, start, used))
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if end == seq.num_tokens:
                rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        decode = batch.seqs[: batch.num_decode]
        width = max((len(s.block_table) for s in decode), default=0)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in decode]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode=batch.num_decode,
            decode_block_tables=self._tensor(tables).view(len(decode), width),
            decode_context_lens=self._tensor([s.num_computed_tokens + 1 for s in decode]),
            prefills=prefills,
            kernels=self.kernels,
            prefill_batch=self._prefill_batch(batch) if prefills and self._varlen else None,
        )
        return StepInputs(
            self._tensor(ids), self._tensor(positions), meta, rows, sample_seqs, prompt_rows
        )

    def run(self, batch: ScheduledBatch) -> StepSample:
        """One forward over the batch; returns the sampled token of each sampling entry."""
        x = self.prepare(batch)
        graphs = self.graphs
        if (
            graphs is not None
            and not x.meta.prefills
            and not x.prompt_rows
            and x.sample_rows
            and graphs.fits(batch.num_decode, x.meta.decode_block_tables.shape[1])
        ):
            logits = graphs.run(x.input_ids, x.positions, x.meta)  # one row per sequence
            if len(x.sample_rows) != logits.shape[0]:
                logits = logits[x.sample_rows]
            return self._sample(logits, x)
        hidden = self.model(x.input_ids, x.positions, self.kv_cache, x.meta)
        prompt_lps = self._prompt_logprobs(hidden, x) if x.prompt_rows else {}
        if not x.sample_rows:
            self.last_sample_s = 0.0
            if self.device.type == "cuda":
                # Nothing to sample, so nothing waits for the GPU: wait here, because the KV
                # this step wrote may be shipped (streamed groups) as soon as it returns, by a
                # DMA that does not follow this stream.
                torch.cuda.synchronize(self.device)
            return StepSample([], prompt_logprobs=prompt_lps)
        out = self._sample(self.model.compute_logits(hidden[x.sample_rows]), x)
        out.prompt_logprobs = prompt_lps
        return out

    @torch.inference_mode()
    def _prompt_logprobs(
        self, hidden: torch.Tensor, x: StepInputs
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """The model's own log-softmax (no processors, temperature 1) at each prompt
        position of the asking sequences, in slices of rows to bound the logits' memory."""
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        for seq, start, rows, targets in x.prompt_rows:
            k = seq.sampling.prompt_logprobs or 0
            lps: list[TokenLogprobs] = []
            for a in range(0, len(rows), _PROMPT_SLICE):
                part = rows[a : a + _PROMPT_SLICE]
                logits = self.model.compute_logits(hidden[part])
                lps += token_logprobs_rows(logits, k, targets[a : a + _PROMPT_SLICE])
            out[seq.request_id] = (start, lps)
        return out

    @torch.inference_mode()  # (the logits are inference tensors, processed in place)
    def _sample(self, logits: torch.Tensor, x: StepInputs) -> StepSample:
        started = time.perf_counter()
        seqs = x.sample_seqs
        params = [s.sampling for s in seqs]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            apply_grammar(logits, constrained, [seqs[i].matcher for i in constrained])
        if any(p.processed for p in params):
            histories = [s.token_ids for s in seqs]
            prompts = [s.num_prompt_tokens for s in seqs]
            logits = apply_processors(logits, params, histories, prompts, self.eos_token_ids)
        tokens = sample(logits, params, [s.num_output_tokens for s in seqs])
        logprobs = token_logprobs(logits, params, tokens)
        self.last_sample_s = time.perf_counter() - started
        return StepSample(tokens, logprobs)

    def _prefill_batch(self, batch: ScheduledBatch) -> PrefillBatch:
        """The step's prefill chunks (every sequence after the decodes) for one launch."""
        bs = self.block_size
        seqs = batch.seqs[batch.num_decode :]
        lens = batch.num_new[batch.num_decode :]
        used = [-(-(s.num_computed_tokens + n) // bs) for s, n in zip(seqs, lens, strict=True)]
        width = max(used)
        tables = [s.block_table[:u] + [0] * (width - u) for s, u in zip(seqs, used, strict=True)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        return PrefillBatch(
            block_tables=self._tensor(tables).view(len(seqs), width),
            cu_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            start_pos=torch.tensor(
                [s.num_computed_tokens for s in seqs], dtype=torch.int32, device=self.device
            ),
            max_q=max(lens),
        )

    def _tensor(self, data: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=self.device)
