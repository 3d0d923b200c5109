"""Subcommand handlers imported when they run, not when the parser is built."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable


def lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A handler that imports `module` (the subcommand's runtime) when called."""

    def run(args: argparse.Namespace) -> int:
        handler: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(module), name
        )
        return handler(args)

    return run
