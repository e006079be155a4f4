"""The client's side of a stream: the upstream's SSE payloads as they arrive (`Payloads`), and the
event-stream response they are written to (`SSEWriter`: keep-alives while the upstream is silent,
`ClientGone` when the client leaves).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from aiohttp import web

from .sse import DONE, SSEDecoder

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"


class Payloads:
    """An upstream SSE body's data payloads, `[DONE]` noted, each adapted to a chat chunk if asked;
    an event over `max_event_size` bytes is an `SSEError`."""

    __slots__ = ("_decoder", "_adapt", "done")

    def __init__(self, adapt: Callable[[bytes], bytes] | None, max_event_size: int) -> None:
        self._decoder = SSEDecoder(max_event_size)
        self._adapt = adapt
        self.done = False

    def feed(self, data: bytes) -> Iterable[bytes]:
        payloads = self._decoder.feed(data)
        if DONE in payloads:
            self.done = True
            payloads = [payload for payload in payloads if payload != DONE]
        return payloads if self._adapt is None else map(self._adapt, payloads)


class ClientGone(Exception):
    """The client closed its connection mid-stream."""


class SSEWriter:
    """A prepared event-stream response that sends `: keep-alive` while the upstream is silent.

    Used as `async with`: the keep-alive timer lives exactly as long as the block, so a cancelled
    handler, a client that left and an upstream that failed all stop it.
    """

    __slots__ = ("response", "interval", "loop", "last", "_first_byte", "_timer", "_pending")

    def __init__(self, response: web.StreamResponse, interval: float, first_byte: Callable[[], None]) -> None:
        self.response = response
        self.interval = interval
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self._first_byte: Callable[[], None] | None = first_byte
        self._timer: asyncio.TimerHandle | None = None
        self._pending: asyncio.Future[None] | None = None

    async def __aenter__(self) -> SSEWriter:
        self._timer = self.loop.call_later(self.interval, self._tick)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()

    async def write(self, data: bytes) -> None:
        self.last = self.loop.time()
        if self._first_byte is not None:
            self._first_byte()
            self._first_byte = None
        try:
            await self.response.write(data)
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one too
            raise ClientGone from exc

    async def end(self, tail: bytes) -> None:
        """Write the stream's last frames and end the response; a client that left is no error."""
        try:
            await self.write(tail)
            await self.response.write_eof()
        except (ClientGone, ConnectionError):
            pass

    def _tick(self) -> None:
        idle = self.loop.time() - self.last
        if idle >= self.interval and (self._pending is None or self._pending.done()):
            self.last = self.loop.time()
            self._pending = asyncio.ensure_future(self._keepalive())
            idle = 0
        self._timer = self.loop.call_later(self.interval - idle, self._tick)

    async def _keepalive(self) -> None:
        try:
            await self.response.write(KEEPALIVE)
        except (ConnectionError, RuntimeError):
            pass  # the client is gone; the relay loop finds out on its next write
