"""`pdserve up` as a supervisor: a node SIGKILLed while serving is restarted on the same
address (the restart logged), the proxy takes it back, and requests succeed on it again."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.support.cluster import Service
from tests.support.http import http_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _node_pid(log: str, name: str) -> int:
    match = re.search(rf"{name}\s+(http://\S+)\s+\(pid (\d+)", log)
    assert match, log
    return int(match.group(2))


def test_a_killed_node_is_restarted_and_serves_again(tiny_model_dir: Path) -> None:
    with Service(tiny_model_dir, "--num-blocks", "128", "--max-restarts", "2") as service:
        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id

        def ask() -> int:
            out = client.completions.create(  # unseeded sampling may end at EOS: ask for all 4
                model=model, prompt="a fox", max_tokens=4, extra_body={"ignore_eos": True}
            )
            assert out.usage is not None
            return out.usage.completion_tokens

        assert ask() == 4
        log = service.log_path.read_text()
        old = _node_pid(log, "decode-0")
        os.kill(old, signal.SIGKILL)  # a child of the service under test
        deadline = time.monotonic() + 90
        while "decode-0 restarted (pid" not in service.log_path.read_text():
            assert time.monotonic() < deadline, service.log_path.read_text()[-3000:]
            assert service.proc.alive(), service.proc.log_tail()
            time.sleep(0.2)
        log = service.log_path.read_text()
        assert "decode-0 exited with -9; restarting it in" in log
        new = int(re.findall(r"decode-0 restarted \(pid (\d+)\)", log)[-1])
        assert new != old
        while True:  # the proxy takes it back once its /health answers
            nodes = http_json(f"{service.url}/admin/nodes", headers=service.auth)["nodes"]
            if all(n["status"] == "up" for n in nodes):
                break
            assert time.monotonic() < deadline, nodes
            time.sleep(0.2)
        assert ask() == 4
        service.wait_baseline()
