"""Blocking HTTP helpers for tests: JSON over urllib."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def http_json(
    url: str,
    body: dict[str, Any] | None = None,
    timeout: float = 10.0,
    headers: dict[str, str] | None = None,
) -> Any:
    """GET `url` (or POST `body` as JSON) and decode the JSON answer; HTTPError on 4xx/5xx."""
    data = None if body is None else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=all_headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())
