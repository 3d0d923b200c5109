"""The proxy: the OpenAI-compatible HTTP surface in front of a token backend.

- `server.py`: `build_app` (routes, body checks, error middleware) and `make_runner`.
- `protocol.py`: request/response models (pydantic) and request parsing.
- `prepare.py`: model check, chat template, tokenization, context fitting, sampling params.
- `generation.py`: one request's backend stream, answered as SSE or as one JSON body.
- `text_stream.py`: token chunks -> text deltas (detokenization, stop ids, stop strings).
- `responses.py`: response bodies and SSE chunks per endpoint.
- `backend.py`: the `TokenBackend` contract, `BackendError`, and `EngineBackend`.
- `hooks.py`: `ProxyHooks`, the observation points for metrics and the request trace.
- `errors.py`: `ApiError` and the OpenAI error body.
"""
