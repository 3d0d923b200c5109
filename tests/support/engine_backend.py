"""`TokenBackend` over an in-process engine: the proxy's HTTP layer tested without nodes."""

from __future__ import annotations

from common.engine.engine import RequestError
from common.engine.loop import AsyncEngine
from common.engine.scheduler import StepOutput
from proxy.http.backend import BackendError, GenerationRequest, TokenChunk, TokenStream


class EngineBackend:
    """`TokenBackend` over an in-process `AsyncEngine` (colocated prefill and decode).

    The caller owns the engine's life: `await engine.start()` before serving and
    `await engine.stop()` after.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def generate(self, req: GenerationRequest) -> TokenStream:
        try:  # as a node takes a request: the constraint compiled first, off the loop
            await self.engine.compile_constraint(req.sampling)
            outputs = self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling)
        except RequestError as e:
            raise BackendError.refused(str(e), param=e.param) from e
        if req.choice_ends is not None:  # choices the client is done with end here
            req.choice_ends.attach(lambda j: self.engine.abort(req.request_id, j))
        try:
            async for out in outputs:
                yield _chunk(out)
        except RequestError as e:
            raise BackendError.refused(str(e), param=e.param) from e
        except RuntimeError as e:  # AsyncEngine: the engine thread died
            raise BackendError.failed(f"the engine failed: {e}") from e
        finally:
            await outputs.aclose()  # aborts the request in the engine if it has not finished


def _chunk(out: StepOutput) -> TokenChunk:
    reason = out.finish_reason.value if out.finish_reason is not None else None
    if out.finished and reason is None:  # the engine thread died (AsyncEngine's sentinel)
        raise BackendError.failed("the engine stopped")
    return TokenChunk(
        list(out.new_token_ids),
        reason,
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
        choice=out.choice,
    )
