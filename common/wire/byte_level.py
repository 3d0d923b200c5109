"""GPT-2's byte-level alphabet, shared by the GGUF tokenizer converter (common.model) and the
per-token bytes the proxy reports with logprobs (common.text), which may not import each
other."""

from __future__ import annotations

from functools import cache


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def byte_of_char() -> dict[str, int]:
    """The inverse map: a byte-level vocabulary character -> its byte."""
    return {c: b for b, c in byte_alphabet().items()}
