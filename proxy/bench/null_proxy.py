"""A proxy that only forwards: the floor under `scripts/bench_proxy.py`'s latency phase.

    python -m proxy.bench.null_proxy --prefill URL --decode URL

For each POST of a streaming completion it does what pdserve's proxy does on the wire, and
nothing else: one call to the prefill stand-in, the SSE headers and a first event once the
answer is in, a decode call whose NDJSON lines it rewraps as SSE events, then `[DONE]`. No
validation, tokenizer, placement, detokenizing, metrics or traces. On asyncio streams over
keep-alive connections (one to each stand-in per client connection).

Run on the proxy's core at the same request rate, its TTFT is what the four loopback hops
(client -> proxy -> prefill -> proxy -> client) cost on this machine before any proxy
does any work: on a virtual machine, mostly waking the idle processes at each hop. It
prints `null proxy ready: URL` when it listens, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

_TIMEOUT_S = 30.0
_EVENT = b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n'
_DONE = b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n'


class _Node:
    """One keep-alive HTTP/1.1 connection to a stand-in."""

    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[asyncio.StreamReader, bytes]:
        """Send the request; (the reader, at the answer's body; the answer's head)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        return self.reader, (await self.reader.readuntil(b"\r\n\r\n")).lower()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _serve_client(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, prefill_url: str, decode_url: str
) -> None:
    prefill, decode = _Node(prefill_url), _Node(decode_url)
    n = 0
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request = json.loads(await reader.readexactly(_content_length(head.lower())))
            max_tokens = int(request.get("max_tokens") or 16)
            n += 1
            rid = f"null-{id(writer):x}-{n}"
            sampling = {"max_tokens": max_tokens}
            body = json.dumps(
                {"request_id": rid, "prompt_token_ids": [1, 2, 3, 4], "sampling": sampling,
                 "lease_s": 30.0}
            ).encode()  # fmt: skip
            node, answer = await asyncio.wait_for(
                prefill.post("/internal/prefill", body), _TIMEOUT_S
            )
            await node.readexactly(_content_length(answer))
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(_EVENT % b"t")
            )
            body = json.dumps({"request_id": rid, "sampling": sampling}).encode()
            node, answer = await asyncio.wait_for(decode.post("/internal/decode", body), _TIMEOUT_S)
            tokens = 1
            while b"chunked" in answer:
                size = int((await asyncio.wait_for(node.readuntil(b"\r\n"), _TIMEOUT_S))[:-2], 16)
                data = await node.readexactly(size + 2)
                if size == 0:
                    break
                tokens += data.count(b"\n") - 1
                writer.write(_chunk(_EVENT % b"t"))
            writer.write(_chunk(_DONE % tokens) + b"0\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
        pass  # the client went away (or a stand-in did): drop the connection
    except asyncio.CancelledError:
        # Shutdown: asyncio.run cancels the idle handlers. Python 3.11's start_server asks a
        # handler task for its exception, which raises (and logs a traceback) for a
        # cancelled one, so the handler ends normally instead.
        pass
    finally:
        prefill.close()
        decode.close()
        writer.close()


def _content_length(head: bytes) -> int:
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def main(prefill_url: str, decode_url: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    server = await asyncio.start_server(
        lambda r, w: _serve_client(r, w, prefill_url, decode_url), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    print(f"null proxy ready: http://127.0.0.1:{port}", flush=True)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    args = p.parse_args()
    asyncio.run(main(args.prefill, args.decode))
