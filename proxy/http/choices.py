"""One backend stream of several choices (`SamplingParams.n` > 1), read as one stream per
choice.

The backend generates a request's n choices under one request id (one prefill, one KV
transfer; the node that decodes forks the sequence) and streams their chunks interleaved,
each tagged with its `choice`. The HTTP layer renders each choice as its own `Generation`, so
`ChoiceSplit` hands each one a stream of its own choice's chunks.

Ownership: the split owns the backend stream. Whichever choice needs its next chunk reads
the backend (one reader at a time) and files what it reads under its choice; a choice stream
closed early (a stop string) drops what comes for it later. The backend stream is closed once
every choice stream is closed, or at once when it fails, and then every choice raises the
failure. A choice closed before its finish (its text ended at a stop string) is reported to
the request's `ChoiceEnds`, so the backend can stop generating it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import replace

from proxy.http.backend import BackendError, ChoiceEnds, TokenChunk, TokenStream


class ChoiceSplit:
    """`n` streams, one per choice, over the backend stream `stream` of one request."""

    def __init__(self, stream: TokenStream, n: int, ends: ChoiceEnds | None = None) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._stream = stream
        self._ends = ends  # told of a choice closed before it finished
        self._queues: list[deque[TokenChunk] | None] = [deque() for _ in range(n)]
        self._lock = asyncio.Lock()  # one reader of the backend stream at a time
        self._error: BaseException | None = None
        self._open = n  # choice streams not yet closed
        self._first: TokenChunk | None = None  # choice 0's first chunk (the prompt's facts)
        self._started = [False] * n
        self.streams = [ChoiceStream(self, j) for j in range(n)]

    async def next(self, j: int) -> TokenChunk:
        """Choice `j`'s next chunk. Its first one carries what the backend reports once, on
        choice 0's first chunk (cached prompt tokens, prompt logprobs), so that every
        choice renders the prompt alike."""
        queue = self._queues[j]
        assert queue is not None, "read after close"
        while not queue:
            if self._error is not None:
                raise self._error
            async with self._lock:
                if not queue and self._error is None:
                    await self._read()
        chunk = queue.popleft()
        if not self._started[j]:
            self._started[j] = True
            chunk = self._with_prompt_facts(chunk)
        return chunk

    async def close(self, j: int, finished: bool) -> None:
        """Choice `j` is done with (idempotent); the last one closed closes the backend, and
        one closed before it `finished` is ended there (`ChoiceEnds`) if others go on."""
        if self._queues[j] is None:
            return
        self._queues[j] = None
        self._open -= 1
        if self._open == 0:
            await self._stream.aclose()
        elif not finished and self._ends is not None:
            self._ends.end(j)

    async def _read(self) -> None:
        """Read one backend chunk and file it under its choice (dropped if that choice's
        stream is closed)."""
        try:
            chunk = await anext(self._stream)
        except StopAsyncIteration:
            self._error = BackendError.failed("the backend ended the stream without finishing")
            return
        except BaseException as e:  # its error (or our cancellation): every choice's now
            self._error = e if isinstance(e, Exception) else BackendError.failed("cancelled")
            raise
        if not 0 <= chunk.choice < len(self._queues):
            self._error = BackendError.failed(f"the backend sent choice {chunk.choice}")
            await self._stream.aclose()
            return
        if chunk.choice == 0 and self._first is None:
            self._first = chunk
        queue = self._queues[chunk.choice]
        if queue is not None:
            queue.append(chunk)

    def _with_prompt_facts(self, chunk: TokenChunk) -> TokenChunk:
        first = self._first
        if chunk.choice == 0 or first is None:
            return chunk
        return replace(
            chunk,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs,
        )


class ChoiceStream:
    """One choice's chunks, as a `Generation` reads a backend stream (`anext`, `aclose`);
    it ends after the choice's finishing chunk."""

    def __init__(self, split: ChoiceSplit, choice: int) -> None:
        self._split = split
        self._choice = choice
        self._done = False

    def __aiter__(self) -> ChoiceStream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._done:
            raise StopAsyncIteration
        chunk = await self._split.next(self._choice)
        if chunk.finish_reason is not None:
            self._done = True
        return chunk

    async def aclose(self) -> None:
        finished, self._done = self._done, True
        await self._split.close(self._choice, finished)
