"""Issue 13, authentication: with a cluster token, every internal endpoint of nodes and proxy
refuses a request without it (401, OpenAI-style body, `WWW-Authenticate: Bearer`); /health
and /metrics stay open; the proxy sends the token to its nodes, so serving works unchanged.
`--api-key` guards the proxy's OpenAI API. Without a token, a node or proxy refuses to
listen on a non-loopback address."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from common.wire.auth import CLUSTER_TOKEN_ENV, bearer
from tests.support import procs
from tests.support.cluster import Cluster, start_cluster

pytestmark = pytest.mark.e2e

TOKEN = "test-cluster-token-0123456789"
API_KEY = "test-api-key-0123456789"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    c = start_cluster(tiny_model_dir, (1, 1, 0), token=TOKEN)
    try:
        yield c
    finally:
        c.close()


def call(url: str, headers: dict[str, str] | None = None, body: bytes | None = None):
    req = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def assert_refused(url: str, headers: dict[str, str] | None = None, body: bytes | None = None):
    status, head, raw = call(url, headers, body)
    assert status == 401, (url, status, raw)
    assert head.get("WWW-Authenticate") == "Bearer"
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error


def test_internal_endpoints_need_the_cluster_token(cluster: Cluster) -> None:
    assert cluster.proxy is not None
    prefill, decode = cluster.nodes()
    # The proxy told the decode node the prefill node's side channel with the token, and
    # the two made their handshake with it (the module's first test: no request yet).
    deadline = time.monotonic() + 30
    while decode.state()["kv_transfer"]["peers"] != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert decode.state()["kv_transfer"]["peers"] == 1
    assert_refused(f"{decode.url}/internal/kv_peers", None, b"{}")
    wrong = bearer("not-the-token-at-all-0000")
    for url in (prefill.url, decode.url):
        for headers in (None, wrong, {"Authorization": TOKEN}):  # missing, wrong, no scheme
            assert_refused(f"{url}/state", headers)
            assert_refused(f"{url}/internal/cancel", headers, b"{}")
        assert call(f"{url}/state", bearer(TOKEN))[0] == 200
        assert call(f"{url}/health")[0] == 200  # open: load balancers
        assert call(f"{url}/metrics")[0] == 200  # open: scrapers
    assert_refused(f"{prefill.url}/internal/prefill", None, b"{}")
    assert_refused(f"{decode.url}/internal/decode", None, b"{}")
    assert_refused(f"{cluster.proxy.url}/admin/nodes")
    assert call(f"{cluster.proxy.url}/admin/nodes", bearer(TOKEN))[0] == 200


def test_the_proxy_serves_through_authenticated_nodes(cluster: Cluster) -> None:
    assert cluster.proxy is not None
    client = openai.OpenAI(base_url=f"{cluster.proxy.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model, prompt="hi", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 4
    cluster.wait_baseline()


def test_api_key_guards_the_openai_api(cluster: Cluster) -> None:
    prefill, decode = cluster.nodes()
    proxy = cluster.start_proxy(prefill=[prefill], decode=[decode], api_key=API_KEY)
    base = f"{proxy.url}/v1"
    bad = openai.OpenAI(base_url=base, api_key="wrong-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0)
    model = good.models.list().data[0].id
    out = good.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert call(f"{proxy.url}/health")[0] == 200


@pytest.mark.parametrize("command", ["node", "proxy"])
def test_no_token_no_listening_beyond_loopback(command: str, tiny_model_dir: Path) -> None:
    argv = [sys.executable, "-m", "common.cli", command, "--host", "0.0.0.0", "--port", "0"]
    argv += ["--model", str(tiny_model_dir)]
    if command == "node":
        argv += ["--role", "decode"]
    env = procs.child_env()
    env.pop(CLUSTER_TOKEN_ENV, None)
    result = procs.run(argv, env=env, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "refusing to listen on 0.0.0.0 without a cluster token" in output
