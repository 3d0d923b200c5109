"""Process-wide logging setup for every pdserve command: one format, one place."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "INFO", access_log: bool = False) -> None:
    """Configure the root logger; aiohttp's per-request access log stays quiet unless asked
    for (health and state pollers hit every node several times a second)."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
    if not access_log:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
