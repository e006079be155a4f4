"""A canned vLLM for throughput benchmarks: precomputed vLLM 0.32 replies from bench/data/, at once.

It must cost far less CPU than the proxies in front of it, so it is a bare asyncio protocol
speaking just enough HTTP/1.1 (keep-alive, Content-Length request bodies, chunked replies), not
an aiohttp app: about 15 µs per request instead of about 100. (gymproxy's `fake_vllm` is the
faithful one; use it for correctness, not for load.)

Every POST gets a chat completion, whatever its path. The reply is chosen from the body bytes,
without parsing JSON:

    `"stream":true` in the body    the 200-chunk stream of bench/data/chat_stream_tool.sse
    `"model":"bench-plain"`        bench/data/chat_completion_plain.json (content only)
    anything else                  bench/data/chat_completion_tool.json (reasoning + a tool call)

and, when the body asks for the tokens (`"return_token_ids":true`, as a capturing gymproxy does),
the `*_tokens` version of that reply: the prompt's ids, each generated token's id and log prob.

A stream's first chunk goes out with the headers, then one chunk every `--chunk-interval` seconds,
each in its own write, as vLLM sends one chunk per engine step (0: the whole stream in one write).
GET /health and GET /v1/models answer 200 for gymproxy's startup probe and health checks.

    python bench/upstream.py --port 8001 [--chunk-interval 0.001]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from email.utils import formatdate
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"

MODELS = (
    b'{"object":"list","data":[{"id":"bench-tool","object":"model","created":1764000000,"owned_by":"vllm",'
    b'"root":"bench-tool","parent":null,"max_model_len":32768,"permission":[]}]}'
)


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when it is installed (as gymproxy does), else the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Replies:
    """The canned reply bodies and their stream frames, with a Date header refreshed each second."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.plain = (DATA / "chat_completion_plain.json").read_bytes()
        self.tool = (DATA / "chat_completion_tool.json").read_bytes()
        self.frames = _frames(DATA / "chat_stream_tool.sse")
        self.plain_tokens = (DATA / "chat_completion_plain_tokens.json").read_bytes()
        self.tool_tokens = (DATA / "chat_completion_tool_tokens.json").read_bytes()
        self.frames_tokens = _frames(DATA / "chat_stream_tool_tokens.sse")
        self.date = b""
        self.refresh_date()

    def refresh_date(self) -> None:
        self.date = formatdate(time.time(), usegmt=True).encode()

    def head(self, status: bytes, content_type: bytes, length: int | None) -> bytes:
        size = b"content-length: %d\r\n" % length if length is not None else b"transfer-encoding: chunked\r\n"
        return b"HTTP/1.1 %s\r\ndate: %s\r\nserver: uvicorn\r\n%scontent-type: %s\r\n\r\n" % (
            status,
            self.date,
            size,
            content_type,
        )


def _frames(path: Path) -> list[bytes]:
    """One HTTP chunk per SSE frame, as uvicorn writes one per yielded chunk."""
    return [_chunk(frame + b"\n\n") for frame in path.read_bytes().split(b"\n\n") if frame]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class CannedVLLM(asyncio.Protocol):
    """One client connection: parse requests one at a time, answer each from `Replies`."""

    def __init__(self, replies: Replies) -> None:
        self.replies = replies
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = False  # a paced stream is still being written
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self.serve()

    def serve(self) -> None:
        """Answer every complete request in the buffer (a client may pipeline)."""
        while self.transport is not None and not self.busy:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower()
            length = _content_length(head)
            if length is None:
                self.fail(b"411 Length Required")
                return
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            self.answer(head, body)
            if b"\r\nconnection: close" in head and self.transport is not None and not self.busy:
                self.transport.close()

    def answer(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        replies = self.replies
        if head.startswith(b"get "):
            path = head.split(b" ", 2)[1]
            payload = MODELS if path.startswith(b"/v1/models") else b""
            self.transport.write(replies.head(b"200 OK", b"application/json", len(payload)) + payload)
        elif not head.startswith(b"post "):
            self.fail(b"405 Method Not Allowed")
        else:
            tokens = b'"return_token_ids":true' in body
            if b'"stream":true' in body:
                self.stream(replies.frames_tokens if tokens else replies.frames)
                return
            if b'"model":"bench-plain"' in body:
                payload = replies.plain_tokens if tokens else replies.plain
            else:
                payload = replies.tool_tokens if tokens else replies.tool
            self.transport.write(replies.head(b"200 OK", b"application/json", len(payload)) + payload)

    def stream(self, frames: list[bytes]) -> None:
        assert self.transport is not None
        replies = self.replies
        head = replies.head(b"200 OK", b"text/event-stream; charset=utf-8", None)
        if replies.interval <= 0:
            self.transport.write(head + b"".join(frames) + b"0\r\n\r\n")
            return
        self.busy = True
        self.transport.write(head + frames[0])
        self.timer = asyncio.get_running_loop().call_later(replies.interval, self.next_frame, frames, 1)

    def next_frame(self, frames: list[bytes], index: int) -> None:
        self.timer = None
        if self.transport is None or self.transport.is_closing():
            return  # the client went away: stop, as vLLM aborts the request
        if index < len(frames):
            self.transport.write(frames[index])
            self.timer = asyncio.get_running_loop().call_later(
                self.replies.interval, self.next_frame, frames, index + 1
            )
            return
        self.transport.write(b"0\r\n\r\n")
        self.busy = False
        if self.buffer:
            self.serve()

    def fail(self, status: bytes) -> None:
        assert self.transport is not None
        self.transport.write(self.replies.head(status, b"text/plain", 0))
        self.transport.close()


def _content_length(head: bytes) -> int | None:
    if b"\r\ntransfer-encoding:" in head:
        return None  # chunked request bodies: never sent by gymproxy or the floor below 1 MiB
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : end if end >= 0 else len(head)])


async def serve(host: str, port: int, interval: float) -> None:
    loop = asyncio.get_running_loop()
    replies = Replies(interval)

    def tick() -> None:
        replies.refresh_date()
        loop.call_later(1.0, tick)

    tick()
    server = await loop.create_server(lambda: CannedVLLM(replies), host, port, backlog=1024)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    print(
        f"canned vLLM on http://{host}:{port}/v1 (pid {os.getpid()}, {type(loop).__module__})",
        file=sys.stderr,
        flush=True,
    )
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument(
        "--chunk-interval", type=float, default=0.001, help="seconds between stream chunks (0: one write)"
    )
    args = parser.parse_args(argv)
    loop = new_loop()
    try:
        loop.run_until_complete(serve(args.host, args.port, args.chunk_interval))
    finally:
        loop.close()


if __name__ == "__main__":
    main()
