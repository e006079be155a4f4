"""The upstream hop's HTTP/1.1 client: keep-alive connections, Content-Length and chunked bodies, streaming reads.

gymproxy talks to vLLM over plain HTTP/1.1 and needs little of a general client: no cookies,
redirects, proxies, compression or tracing. Doing only what it needs costs a fraction of the CPU of
aiohttp's ClientSession per request (measured in bench/), which is most of what a relay spends.

    client = Client(limit=0, keepalive=4.0, connect_timeout=10.0, read_timeout=None)
    reply = await client.request("POST", URL("http://gpu-1:8000/v1/chat/completions"), headers, body)
    try:
        body = await reply.read()          # or: async for data in reply.iter_any(): ...
    finally:
        reply.release()                    # back to the pool if the body was read whole, else closed

Every failure is a `ClientError`: `CannotConnect` (the request was never sent), `ConnectTimeout` and
`ReadTimeout` (both also `TimeoutError`s), or `BadReply` (the connection broke or the upstream
broke HTTP). A reply whose body was not read to its end is never reused: its connection is closed,
which is also how a generation is aborted.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Mapping

from yarl import URL

MAX_HEAD = 64 * 1024  # status line and headers of one reply
HIGH_WATER = 256 * 1024  # unread bytes buffered before the upstream is asked to pause
NO_BODY_STATUSES = frozenset({204, 304})
_HEX = b"0123456789abcdefABCDEF"


class ClientError(Exception):
    """The upstream request failed; the message says how."""


class CannotConnect(ClientError):
    """No connection could be opened: the request was never sent."""


class ConnectTimeout(ClientError, asyncio.TimeoutError):
    """Opening the connection took longer than `connect_timeout`."""


class ReadTimeout(ClientError, asyncio.TimeoutError):
    """The upstream sent nothing for `read_timeout` seconds."""


class BadReply(ClientError):
    """The connection closed early, or the upstream's bytes are not HTTP/1.1 we can read."""


class _Connection(asyncio.Protocol):
    """One TCP connection: the bytes received and not yet consumed, and a waiter for more."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, str, int]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.lost: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.lost = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def consumed(self) -> None:
        """Bytes were taken from the buffer: let the upstream send again once it drains."""
        if self.paused and len(self.buffer) <= HIGH_WATER // 4 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    async def more(self, read_timeout: float | None) -> None:
        """Wait until bytes arrive or the connection ends (then BadReply)."""
        if self.paused and self.transport is not None:  # the reader needs more than what is buffered
            self.paused = False
            self.transport.resume_reading()
        if self.eof:
            why = f": {self.lost}" if self.lost else ""
            raise BadReply(f"the upstream closed the connection{why}")
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(read_timeout, self._timed_out) if read_timeout is not None else None
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ReadTimeout("no bytes from the upstream within the read timeout"))

    @property
    def usable(self) -> bool:
        return not self.eof and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.eof = True
        if self.transport is not None:
            self.transport.close()


class Reply:
    """An upstream reply: status and headers at once, the body read whole or piece by piece."""

    __slots__ = (
        "url",
        "status",
        "headers",
        "_client",
        "_conn",
        "_keep",
        "_left",
        "_chunked",
        "_chunk_state",
        "_done",
        "_timeout",
    )

    def __init__(self, client: Client, conn: _Connection, url: URL) -> None:
        self.url = url
        self._client = client
        self._conn: _Connection | None = conn
        self._timeout = client.read_timeout
        self.status = 0
        self.headers: dict[str, str] = {}

    @property
    def content_type(self) -> str:
        """The media type, lowercase and without parameters (as aiohttp: octet-stream if none)."""
        value = self.headers.get("content-type")
        if not value:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    async def _read_head(self, head_request: bool) -> None:
        conn = self._conn
        assert conn is not None
        buffer = conn.buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            while end < 0:
                if len(buffer) > MAX_HEAD:
                    raise BadReply(f"the upstream's reply headers are over {MAX_HEAD} bytes")
                await conn.more(self._timeout)
                end = buffer.find(b"\r\n\r\n")
            head = bytes(buffer[:end])
            del buffer[: end + 4]
            lines = head.split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            code = rest[:3]
            if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
                raise BadReply(f"the upstream's reply does not start with an HTTP/1.x status line: {lines[0][:80]!r}")
            status = int(code)
            if 100 <= status < 200:
                continue  # 100 Continue and other interim replies: the real one follows
            break
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise BadReply(f"the upstream sent a malformed header line: {line[:80]!r}")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        self.status = status
        self.headers = headers
        self._keep = version == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        self._chunked = False
        self._done = False
        self._left = -1  # bytes of body still to come; -1: until the connection closes
        if head_request or status in NO_BODY_STATUSES:
            self._left = 0
        elif "transfer-encoding" in headers:
            if headers["transfer-encoding"].lower() != "chunked":
                raise BadReply(f"the upstream used Transfer-Encoding {headers['transfer-encoding']!r}, not chunked")
            self._chunked = True
            self._chunk_state = 0  # 0: a size line is next; >0: data bytes left; -1: the CRLF after data
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise BadReply(f"the upstream sent an invalid Content-Length {length[:40]!r}")
            self._left = int(length)
        else:
            self._keep = False  # the body ends when the connection does
        if self._left == 0:
            self._done = True

    async def read(self) -> bytes:
        """The whole body."""
        conn = self._conn
        if conn is None:
            raise BadReply("the reply was already closed")
        left = self._left
        if not self._chunked and left >= 0:
            buffer = conn.buffer
            while len(buffer) < left:
                await conn.more(self._timeout)
            body = bytes(buffer[:left]) if len(buffer) > left else bytes(buffer)
            del buffer[:left]
            self._left = 0
            self._done = True
            conn.consumed()
            return body
        parts = [data async for data in self.iter_any()]
        return b"".join(parts)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each piece is whatever was received, de-chunked."""
        while not self._done:
            data = self._take()
            if data:
                yield data
            elif not self._done:
                conn = self._conn
                if conn is None:
                    raise BadReply("the reply was already closed")
                if self._left < 0 and not self._chunked and conn.eof and conn.lost is None:
                    self._done = True  # a body delimited by the connection closing
                    return
                await conn.more(self._timeout)

    def _take(self) -> bytes:
        """Body bytes available now (possibly none)."""
        conn = self._conn
        if conn is None:
            return b""
        buffer = conn.buffer
        if not buffer:
            return b""
        if self._chunked:
            data = self._dechunk(buffer)
        elif self._left < 0:
            data = bytes(buffer)
            buffer.clear()
        else:
            n = min(self._left, len(buffer))
            data = bytes(buffer[:n])
            del buffer[:n]
            self._left -= n
            self._done = self._left == 0
        conn.consumed()
        return data

    def _dechunk(self, buffer: bytearray) -> bytes:
        out: list[bytes] = []
        state = self._chunk_state
        while buffer:
            if state > 0:  # inside a chunk's data
                n = min(state, len(buffer))
                out.append(bytes(buffer[:n]))
                del buffer[:n]
                state -= n
                if state == 0:
                    state = -1
            elif state == -1:  # the CRLF that ends a chunk's data
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise BadReply("the upstream's chunked body is malformed (no CRLF after a chunk)")
                del buffer[:2]
                state = 0
            elif state == 0:  # a size line
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 1024:
                        raise BadReply("the upstream's chunked body is malformed (size line too long)")
                    break
                size_text = bytes(buffer[:end]).partition(b";")[0].strip()
                if not size_text or size_text.strip(_HEX):
                    raise BadReply(f"the upstream's chunked body is malformed (size {size_text[:20]!r})")
                size = int(size_text, 16)
                del buffer[: end + 2]
                if size and buffer[size : size + 2] == b"\r\n":  # the whole chunk is here (one SSE event, mostly)
                    out.append(bytes(buffer[:size]))
                    del buffer[: size + 2]
                    continue
                state = size if size > 0 else -2
            else:  # -2: trailers after the last chunk, up to an empty line
                end = buffer.find(b"\r\n")
                if end < 0:
                    break
                del buffer[: end + 2]
                if end == 0:
                    self._done = True
                    break
        self._chunk_state = state
        return b"".join(out) if len(out) != 1 else out[0]

    def close(self) -> None:
        """Drop the connection (the upstream sees the client leave and stops generating)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            self._client._returned(conn, reuse=False)

    def release(self) -> None:
        """Give the connection back: to the pool if the body was read to its end, else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            reuse = self._done and self._keep and not conn.buffer and conn.usable
            if not reuse:
                conn.close()
            self._client._returned(conn, reuse=reuse)

    async def __aenter__(self) -> Reply:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.release()


class Client:
    """Keep-alive connections per host, at most `limit` at once (0: no limit)."""

    def __init__(
        self,
        *,
        limit: int = 0,
        keepalive: float = 4.0,
        connect_timeout: float | None = 10.0,
        read_timeout: float | None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls` verifies https upstreams (default: the system's trust store)."""
        self.limit = limit
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.in_use = 0  # connections lent to replies
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(limit) if limit else None
        self._sweeper: asyncio.TimerHandle | None = None
        self._tls = tls
        self._closed = False

    async def request(
        self,
        method: str,
        url: URL,
        headers: Mapping[str, str],
        body: bytes | None = None,
    ) -> Reply:
        """Send one request and read the reply's status line and headers."""
        if self._closed:
            raise CannotConnect("the client is closed")
        head = _head(method, url, headers, body)
        if self._slots is not None:
            await self._slots.acquire()
        try:
            conn = await self._connection(url)
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        self.in_use += 1
        reply = Reply(self, conn, url)
        try:
            assert conn.transport is not None
            if body:
                conn.transport.writelines((head, body))
            else:
                conn.transport.write(head)
            await reply._read_head(method == "HEAD")
        except BaseException:
            reply.close()
            raise
        return reply

    async def _connection(self, url: URL) -> _Connection:
        key = (url.scheme, url.raw_host or "", url.port or (443 if url.scheme == "https" else 80))
        idle = self._idle.get(key)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()  # the most recently used: the warmest
                if conn.usable and now - conn.idle_since < self.keepalive:
                    return conn
                conn.close()
        loop = asyncio.get_running_loop()
        scheme, host, port = key
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        elif scheme != "http":
            raise CannotConnect(f"unsupported URL scheme {scheme!r} (http or https)")
        opening = loop.create_connection(lambda: _Connection(loop, key), host, port, ssl=tls)
        try:
            if self.connect_timeout is None:
                _, conn = await opening
            else:
                _, conn = await asyncio.wait_for(opening, self.connect_timeout)
        except asyncio.TimeoutError:
            raise ConnectTimeout(f"could not connect to {host}:{port} within {self.connect_timeout:g} s") from None
        except OSError as exc:  # refused, unreachable, name not found, TLS failures
            raise CannotConnect(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _returned(self, conn: _Connection, *, reuse: bool) -> None:
        self.in_use -= 1
        if self._slots is not None:
            self._slots.release()
        if reuse and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.key, []).append(conn)
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().call_later(self.keepalive, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle for `keepalive` seconds, before the upstream closes them under us."""
        self._sweeper = None
        now = time.monotonic()
        left = False
        for idle in self._idle.values():
            keep = [c for c in idle if c.usable and now - c.idle_since < self.keepalive]
            for conn in idle:
                if conn not in keep:
                    conn.close()
            idle[:] = keep
            left = left or bool(keep)
        if left and not self._closed:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive / 2, self._sweep)

    @property
    def idle(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _head(method: str, url: URL, headers: Mapping[str, str], body: bytes | None) -> bytes:
    """The request line and headers, refusing CR or LF in any name or value (header injection)."""
    host = url.raw_host or ""
    if url.port is not None and not url.is_default_port():
        host = f"{host}:{url.port}"
    lines = [f"{method} {url.raw_path_qs or '/'} HTTP/1.1\r\nHost: {host}\r\n"]
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body) if body else 0}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
