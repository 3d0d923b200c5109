"""The proxy: the OpenAI-compatible HTTP surface in front of a token backend.

HTTP layer (text in, text out):

- `server.py`: `build_app` (routes, body checks, error middleware) and `make_runner`.
- `protocol.py`: request/response models (pydantic) and request parsing.
- `prepare.py`: model check, chat template, tokenization, context fitting, sampling params.
- `generation.py`: one request's backend stream, answered as SSE or as one JSON body.
- `text_stream.py`: token chunks -> text deltas (detokenization, stop ids, stop strings).
- `responses.py`: response bodies and SSE chunks per endpoint.
- `backend.py`: the `TokenBackend` contract, `BackendError`, and `EngineBackend`.
- `hooks.py`: `ProxyHooks`, the observation points for metrics and the request trace.
- `errors.py`: `ApiError` and the OpenAI error body.

Node pools (token ids in, token ids out), in `pool/`:

- `disagg.py`: `DisaggBackend` (prefill -> inter-stage queue -> decode, cancel at each
  stage, migration of a lost stream); `colocated.py`: `ColocatedBackend` (`both` nodes).
- `placement.py`: conditional disaggregation (prefill on the prefill pool or locally).
- `router.py`: which node, weighing each node's prefix cache against its queue;
  `kv_index.py`: the nodes' prefix caches, kept from their KV events.
- `interstage.py`: the inter-stage queue: bounded FIFO of prefilled requests waiting for
  decode capacity, one dispatcher, prefill lease extension; `budget.py`: the pre-decode
  budget the edge admits against.
- `registry.py`: `NodeRegistry`: nodes by URL, health/state poller, fingerprint check.
- `node_state.py`: one node's role, status (enum with transitions), last `/state`, load.
- `client.py`: the nodes' internal HTTP API: timeouts per call, errors; `node_stream.py`
  (NDJSON token streams), `prefill_stream.py` (a streamed prefill call), `relay.py`
  (a node's stream relayed as token chunks), `node_errors.py`.
- `admin.py`: `GET|POST|DELETE /admin/nodes`; `roles.py`: moving a node between the
  pools; `planner.py`: `--auto-roles`.

Around them: `edge.py` (admission), `trace.py` (request traces), `metrics.py` (Prometheus
metrics: requests, TTFT, ITL, E2E, inter-stage queue), `settings.py` and `main.py`
(`pdserve proxy`: flags -> `ProxySettings` -> app -> serve).

Serving benchmark (a client of the OpenAI surface, for any server):

- `bench/main.py`: `pdserve bench-serve` (rate sweeps, the goodput search, JSON and plot
  files); `bench/config.py` (flags, the frozen config).
- `bench/workload.py` (requests asked), `bench/client.py` (one timed SSE request),
  `bench/load.py` (arrivals, concurrency cap, bounds), `bench/stats.py` (latency
  distributions, throughput, SLO attainment), `bench/search.py` (the goodput (DistServe)
  search's decisions), `bench/report.py` (tables, PNG plots).
"""
