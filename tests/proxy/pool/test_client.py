"""NodeClient's reading of transport failures: a connect timeout (a partition, a silent
node) means the request never reached the node, so the caller may send it to another one;
any other timeout does not."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from common.wire.node_messages import GenerateRequest, PrefillRequest
from common.wire.sampling_params import SamplingParams
from proxy.http.backend import BackendError
from proxy.pool.client import GENERATE_PATH, NodeClient, NodeTimeouts, NodeUnreachable

SP = SamplingParams(temperature=0.0, max_tokens=4)


def _client(error: type[BaseException]) -> NodeClient:
    client = NodeClient(NodeTimeouts(connect_s=0.5))

    class Session:
        def post(self, *args: Any, **kwargs: Any) -> Any:
            raise error("timed out")

    client._session = Session()  # type: ignore[assignment]
    return client


@pytest.mark.parametrize("op", ["prefill", "stream"])
def test_a_connect_timeout_is_unreachable_and_a_read_timeout_is_not(op: str) -> None:
    async def call(client: NodeClient) -> None:
        if op == "prefill":
            msg = PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=SP, lease_s=5)
            await client.prefill("http://n", msg)
        else:
            msg = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SP)
            await client.open_stream("http://n", GENERATE_PATH, msg, "r")

    with pytest.raises(NodeUnreachable, match="no connection within 0.5 s") as err:
        asyncio.run(call(_client(aiohttp.ConnectionTimeoutError)))
    assert not err.value.maybe_received  # nothing was sent: no Cancel needed
    with pytest.raises(BackendError) as err2:
        asyncio.run(call(_client(aiohttp.SocketTimeoutError)))
    assert not isinstance(err2.value, NodeUnreachable)  # it may be computing: not retried
