"""The upstream hop's HTTP/1.1 client: keep-alive connections, replies framed by llhttp, streaming reads.

gymproxy talks to vLLM over plain HTTP/1.1 and needs little of a general client: no cookies,
redirects, proxies, compression or tracing. Doing only what it needs costs a fraction of the CPU of
aiohttp's ClientSession per request (measured in bench/), which is most of what a relay spends.
Replies are framed by `httptools.HttpResponseParser` (llhttp, strict mode), fed from `data_received`.

    client = Client(limit=0, keepalive=4.0, connect_timeout=10.0, read_timeout=None)
    reply = await client.request("POST", URL("http://gpu-1:8000/v1/chat/completions"), headers, body)
    try:
        body = await reply.read()          # or: async for data in reply.iter_any(): ...
    finally:
        reply.release()                    # back to the pool if the body was read whole, else closed

At most `CONNECTING` new connections are opened to one host at once, and none while one of them
has been opening for `STALLED_S`; the others wait their turn (`first`: at the front), for as long
as the host takes a connection every `connect_timeout` at least. A burst (thousands of requests a
resume releases at once, or a cold start) then arrives at the rate the host accepts, instead of
overflowing its listen backlog again and again: the kernel sends a dropped SYN again only after a
second, then two more, then four, and a host that is up looks down. A `ConnectTimeout` says
whether the host took another connection within `connect_timeout` of this one's start
(`crowded`): then it is up, and busy accepting.

Every failure is a `ClientError`: `CannotConnect` (the request was never sent), `ConnectTimeout` and
`ReadTimeout` (both also `TimeoutError`s), `BadReply` (the connection broke or the upstream broke
HTTP; `ReplyTooLarge` when its body passed the reader's limit), or the `Aborted` reason given to
`Reply.abort` or `Client.abort` (shutdown); `Refused` (a `CannotConnect`) when the address's
`Guard` would not have the connection (`Client.guard`). A connection is reused only after a reply that was
read to its end, framed cleanly, and followed by nothing: a byte that arrives on a connection with no
reply in progress closes it, so no reply is ever read as the answer to another request.

A body is counted as it arrives, whoever reads it: past the reply's limit (`Reply.limit`; `read`
applies the client's `max_reply`, or `max_error_reply` for an error status) the reply fails and its
connection is closed, so no more of it is ever held, and one whose Content-Length is over the
limit is refused before a byte of it is waited for.
"""

from __future__ import annotations

import asyncio
import collections
import select
import ssl
import sys
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol, cast

import httptools
from yarl import URL

MAX_HEAD = 64 * 1024  # status line and headers of one reply (trailers count too)
HIGH_WATER = 256 * 1024  # unread body bytes buffered before the upstream is asked to pause
# New connections opening at once to one host: well under the smallest listen backlog in use
# (aiohttp's 128; uvicorn, which vLLM runs on, takes 2048), and enough for a fast host.
CONNECTING = 32
# A connection opening for longer than this is likely waiting on a SYN its host dropped (its listen
# backlog was full; the kernel sends it again after a second): no new one starts until it is
# through, so the room the host makes goes to the SYNs sent again, not to newer ones that would
# have them dropped again.
STALLED_S = 0.5
NO_BODY_STATUSES = frozenset({204, 304})
_POLL = getattr(select, "poll", None)


class ClientError(Exception):
    """The upstream request failed; the message says how."""


class CannotConnect(ClientError):
    """No connection could be opened: the request was never sent."""


class Refused(CannotConnect):
    """The address's guard would not have the connection (`Client.guard`): nothing was sent."""


class Guard(Protocol):
    """Who may be behind an address (`Client.guard`; `ownership.Owner` is one): asked before a
    connection to it is opened, and once it is open, before anything is sent on it."""

    def before(self) -> str | None:
        """Why no connection may be opened now; None: it may."""

    async def after(self, sock: Any) -> str | None:
        """Why nothing may be sent on `sock`, the new connection; None: it may."""


class ConnectTimeout(ClientError, asyncio.TimeoutError):
    """Opening the connection took longer than `connect_timeout`. `crowded`: the host took another
    connection within `connect_timeout` of this one's start (it is up, and busy accepting)."""

    def __init__(self, message: str, *, crowded: bool = False) -> None:
        super().__init__(message)
        self.crowded = crowded


class ReadTimeout(ClientError, asyncio.TimeoutError):
    """The upstream sent nothing for `read_timeout` seconds."""


class BadReply(ClientError):
    """The connection closed early, or the upstream's bytes are not HTTP/1.1 we can read."""


class ReplyTooLarge(BadReply):
    """The reply's body is over the reader's limit (`Reply.limit`): the rest of it is never read.
    `announced` is its Content-Length when that is what was over."""

    def __init__(self, message: str, *, limit: int, announced: int | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.announced = announced


class NoReply(BadReply):
    """The connection closed (or was reset) before one byte of a reply came: vLLM, which aborts a
    request whose connection closes, is running nothing for it. `reused` when the connection came
    from the pool (it may have closed while idle, before our request reached it)."""

    def __init__(self, message: str, *, reset: bool, reused: bool) -> None:
        super().__init__(message)
        self.reset = reset
        self.reused = reused


class Aborted(ClientError):
    """The reply's owner gave up on it (`Reply.abort`); the message is the owner's reason."""


class _Surplus(Exception):
    """Raised inside the parser when a second message starts after the reply ended."""


class _Connection(asyncio.Protocol):
    """One TCP connection; its bytes go to the reply in progress, and to nobody while it is idle."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, str, int]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.poller: Any = None  # select.poll() on this socket, to see unread bytes before a reuse
        self.reply: Reply | None = None
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self.uses = 0  # requests sent on it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        sock = transport.get_extra_info("socket")
        if _POLL is not None and sock is not None:
            self.poller = _POLL()
            self.poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None:
            self.close()  # idle: these bytes answer no request of ours, and the framing is lost
        else:
            reply._feed(data)

    def eof_received(self) -> bool:
        self.closed = True
        if self.reply is not None:
            self.reply._ended(None)
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.reply is not None:
            self.reply._ended(exc)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def reusable(self, now: float, keepalive: float) -> bool:
        """Still open, idle for less than `keepalive`, and nothing arrived since the last reply."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        if now - self.idle_since >= keepalive:
            return False
        # Bytes (or the EOF) may sit in the socket that the loop has not read yet: poll for them, so a
        # late surplus of the last reply can never be read as the reply to the next request.
        return self.poller is None or not self.poller.poll(0)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Reply:
    """An upstream reply: status and headers at once, the body read whole or piece by piece.

    It is the parser's callback target: llhttp calls the `on_*` methods while `_feed` runs.
    """

    __slots__ = (
        "url",
        "status",
        "headers",
        "_client",
        "_conn",
        "_parser",
        "_timeout",
        "_pieces",
        "_size",
        "_received",
        "_limit",
        "_head_done",
        "_interim",
        "_complete",
        "_until_close",
        "_keep",
        "_error",
        "_waiter",
        "_head_size",
        "_stall",
        "_progress",
        "_started",
        "_reused",
    )

    def __init__(self, client: Client, conn: _Connection, url: URL) -> None:
        self.url = url
        self.status = 0
        self.headers: dict[str, str] = {}
        self._client = client
        self._conn: _Connection | None = conn
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._timeout = client.read_timeout
        self._pieces: list[bytes] = []
        self._size = 0  # of the body buffered and not yet read
        self._received = 0  # of the body so far
        self._limit = sys.maxsize  # of the body: past it the reply fails (`limit`)
        self._head_done = False
        self._interim = False
        self._complete = False
        self._until_close = False  # the body ends when the connection does
        self._keep = False
        self._error: ClientError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head_size = 0
        self._stall = 0  # bytes fed since the parser last made progress
        self._progress = False
        self._started = False  # a byte of the reply arrived
        self._reused = conn.uses > 1

    @property
    def content_type(self) -> str:
        """The media type, lowercase and without parameters (as aiohttp: octet-stream if none)."""
        value = self.headers.get("content-type")
        if not value:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    # --- the parser's callbacks (run inside _feed) ---------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            raise _Surplus

    def on_header(self, name: bytes, value: bytes) -> None:
        self._progress = True
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD:
            raise BadReply(f"the upstream's reply headers are over {MAX_HEAD} bytes")
        if self._head_done:
            return  # a trailer: counted, not kept
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key == "transfer-encoding" and text.strip().lower() != "chunked":
            raise BadReply(f"the upstream used Transfer-Encoding {text[:40]!r}; gymproxy reads only chunked")
        headers = self.headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        self._progress = True
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if parser.get_http_version() not in ("1.1", "1.0"):
            raise BadReply(f"the upstream answered HTTP/{parser.get_http_version()}, not HTTP/1.x")
        if not 100 <= status <= 599:
            raise BadReply(f"the upstream's status code {status} is outside 100-599")
        if status < 200:  # 100 Continue and other interim replies: the real one follows
            if status == 101:
                raise BadReply("the upstream switched protocols (101), which gymproxy never asks for")
            self._interim = True
            self.headers = {}
            self._head_size = 0
            return
        self.status = status
        self._keep = parser.should_keep_alive()
        headers = self.headers
        self._until_close = (
            status not in NO_BODY_STATUSES and "content-length" not in headers and "transfer-encoding" not in headers
        )
        self._head_done = True

    def on_body(self, body: bytes) -> None:
        self._progress = True
        self._pieces.append(body)
        self._size += len(body)
        self._received += len(body)

    def on_message_complete(self) -> None:
        self._progress = True
        if self._interim:
            self._interim = False
        else:
            self._complete = True

    # --- fed by the connection -----------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._started = True
        if self._error is not None:
            return
        if self._complete:
            self._fail(BadReply("the upstream sent bytes after the end of its reply"))
            return
        self._progress = False
        parser = self._parser
        assert parser is not None  # fed only while the connection is lent to this reply
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Surplus):
                self._fail(BadReply("the upstream sent bytes after the end of its reply"))
            elif isinstance(cause, BadReply):
                self._fail(cause)
            else:  # a bug in a callback above: still never a hang
                self._fail(BadReply(f"gymproxy could not read the upstream's reply ({cause!r})"))
        except httptools.HttpParserError as exc:
            if self._complete:
                self._fail(BadReply("the upstream sent bytes after the end of its reply"))
            else:
                self._fail(BadReply(f"the upstream's reply is not valid HTTP/1.1 ({exc})"))
        else:
            if self._progress:
                self._stall = 0
            else:
                self._stall += len(data)
                if self._stall > MAX_HEAD:
                    if self._head_done:
                        why = f"the upstream sent over {MAX_HEAD} bytes without ending a chunk size line or trailer"
                    else:
                        why = f"the upstream's reply headers are over {MAX_HEAD} bytes"
                    self._fail(BadReply(why))
                    return
            if self._received > self._limit:
                self._too_large(ReplyTooLarge(f"the upstream's reply is over {self._limit} bytes", limit=self._limit))
                return
            conn = self._conn
            if self._size > HIGH_WATER and conn is not None:
                conn.pause()
        self._wake()

    def _ended(self, exc: BaseException | None) -> None:
        """The connection ended (EOF or lost)."""
        if self._complete or self._error is not None:
            self._wake()
            return
        if self._head_done and self._until_close and exc is None:
            self._complete = True  # a body delimited by the connection closing
            self._wake()
            return
        why = f": {exc}" if exc else ""
        if not self._started:
            how = "reset" if exc else "closed"
            pooled = " (a pooled keep-alive connection)" if self._reused else ""
            self._fail(
                NoReply(
                    f"the upstream {how} the connection{pooled} before replying{why}",
                    reset=bool(exc),
                    reused=self._reused,
                )
            )
        elif self._head_done:
            self._fail(BadReply(f"the upstream closed the connection before the end of its reply{why}"))
        else:
            self._fail(BadReply(f"the upstream closed the connection{why}"))

    def _fail(self, error: ClientError) -> None:
        self._error = error
        conn = self._conn
        if conn is not None:
            conn.close()  # its framing is lost: it can never carry another reply
        self._wake()

    def _too_large(self, error: ReplyTooLarge) -> None:
        self._pieces.clear()  # what is buffered is no use any more, and none of it may be handed on
        self._size = 0
        self._fail(error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        """Until the connection delivers more (or ends, or the read timeout passes)."""
        conn = self._conn
        if conn is None:
            raise BadReply("the reply was already closed")
        conn.resume()  # the reader needs more than what is buffered
        loop = conn.loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(self._timeout, self._timed_out) if self._timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ReadTimeout("no bytes from the upstream within the read timeout"))

    # --- the owner's side ------------------------------------------------------------------------

    async def _read_head(self) -> None:
        while not self._head_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    def limit(self, size: int) -> None:
        """Fail the reply (`ReplyTooLarge`, the connection closed) once its body passes `size` bytes;
        raised at once when its Content-Length announces more, or more has arrived already."""
        self._limit = size
        if self._error is not None:
            return  # the reader raises that one
        error = None
        announced = self.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > size:
            error = ReplyTooLarge(
                f"the upstream's reply announces {int(announced)} bytes, over the limit of {size}",
                limit=size,
                announced=int(announced),
            )
        elif self._received > size:
            error = ReplyTooLarge(f"the upstream's reply is over {size} bytes", limit=size)
        if error is not None:
            self._too_large(error)
            raise error

    async def read(self) -> bytes:
        """The whole body, at most the client's `max_reply` bytes (`max_error_reply` when the status
        is 400 or more): past that, `ReplyTooLarge`."""
        client = self._client
        cap = client.max_error_reply if self.status >= 400 else client.max_reply
        if cap is not None:
            self.limit(cap)
        while not self._complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._error is not None:
            raise self._error
        pieces = self._pieces
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._size = 0
        return body

    async def buffer(self) -> bytes:
        """The whole body, kept: a later `read` or `iter_any` returns it again (to look at an error
        reply and still hand it on)."""
        body = await self.read()
        if body:
            self._pieces.append(body)
            self._size = len(body)
        return body

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each piece is whatever was received, de-chunked. A failure is
        raised after the pieces that came before it."""
        pieces = self._pieces
        while True:
            if pieces:
                data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                self._size = 0
                yield data
            elif self._error is not None:
                raise self._error
            elif self._complete:
                return
            else:
                await self._wait()

    def abort(self, reason: Aborted) -> None:
        """Give up on the reply: the connection is closed and the reader raises `reason`."""
        if self._error is None and self._conn is not None:
            self._fail(reason)

    def close(self) -> None:
        """Drop the connection (the upstream sees the client leave and stops generating)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.reply = None
            self._parser = None  # it holds our methods: a cycle that only the collector would free
            conn.close()
            self._client._returned(conn, self, reuse=False)

    def release(self) -> None:
        """Give the connection back: to the pool if the body was read to its end, else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.reply = None
            self._parser = None  # it holds our methods: a cycle that only the collector would free
            reuse = self._complete and self._keep and self._error is None and not self._pieces and not conn.closed
            if not reuse:
                conn.close()
            self._client._returned(conn, self, reuse=reuse)

    async def __aenter__(self) -> Reply:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.release()


class _Opening:
    """The connections being opened to one host: `CONNECTING` at most, the others wait in turn."""

    __slots__ = ("count", "waiting", "accepted", "started", "loop")

    def __init__(self) -> None:
        self.count = 0  # turns taken: connections opening
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()  # first come, first served
        self.accepted = float("-inf")  # loop time of the last connection the host took
        self.started: dict[object, float] = {}  # when each opening began, by its token
        self.loop = asyncio.get_running_loop()

    def free(self) -> bool:
        """Whether a new opening may start now."""
        if self.count >= CONNECTING:
            return False
        stalled = self.loop.time() - STALLED_S
        return not any(began < stalled for began in self.started.values())

    async def turn(self, token: object, timeout: float | None, first: bool) -> None:
        """Wait for this host's next opening (`done(token)` hands it on), or a `TimeoutError` once
        the host took no connection for `timeout` seconds; `first`: ahead of those waiting."""
        loop = self.loop
        if not self.waiting and self.free():
            self.count += 1
            self.started[token] = loop.time()
            return
        waiter = loop.create_future()
        if first:
            self.waiting.appendleft(waiter)
        else:
            self.waiting.append(waiter)  # one given up on is left there, and skipped
        try:
            since, wait = loop.time(), timeout
            while not (await asyncio.wait((waiter,), timeout=wait))[0]:
                if timeout is None or self.accepted <= since:
                    raise asyncio.TimeoutError  # stalled: no connection taken all that time
                since = self.accepted  # it moves: wait on, until a `timeout` with no progress
                wait = max(0.0, since + timeout - loop.time())
        except BaseException:
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():  # its turn came as it gave up: the next one takes it
                self.count -= 1
                self._hand_on()
            raise
        self.started[token] = loop.time()

    def done(self, token: object, *, opened: bool) -> None:
        """The opening of `token` ended (`opened`: with a connection): the next waiters' turn, as
        far as `free` allows."""
        del self.started[token]
        if opened:
            self.accepted = self.loop.time()
        self.count -= 1
        self._hand_on()

    def idle(self) -> bool:
        """Nothing opening, and nobody waiting to."""
        return not self.count and all(waiter.done() for waiter in self.waiting)

    def _hand_on(self) -> None:
        waiting = self.waiting
        while waiting and self.free():
            waiter = waiting.popleft()
            if not waiter.done():
                self.count += 1
                waiter.set_result(None)


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
        max_reply: int | None = None,
        max_error_reply: int | None = None,
    ) -> None:
        """`tls` verifies https upstreams (default: the system's trust store). `max_reply` and
        `max_error_reply` (None: no limit) cap the bodies `Reply.read` takes, for a status under
        400 and from 400 on."""
        self.limit = limit
        self.max_reply = max_reply
        self.max_error_reply = max_error_reply
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.in_use = 0  # connections lent to replies
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(limit) if limit else None
        self._sweeper: asyncio.TimerHandle | None = None
        self._tls = tls
        self._closed = False
        self._replies: set[Reply] = set()  # in progress: what `abort` ends
        self._aborted: Aborted | None = None
        self._opening: dict[tuple[str, str, int], _Opening] = {}  # by host, while any opens
        self._guards: dict[tuple[str, str, int], Guard] = {}

    async def request(
        self,
        method: str,
        url: URL,
        headers: Mapping[str, str],
        body: bytes | None = None,
        *,
        fresh: bool = False,
        first: bool = False,
    ) -> Reply:
        """Send one request and read the reply's status line and headers (`fresh`: on a new connection,
        not one from the pool; `first`: a new connection opens ahead of the others waiting to)."""
        if self._closed:
            raise CannotConnect("the client is closed")
        if self._aborted is not None:
            raise Aborted(str(self._aborted))
        if method == "HEAD":
            raise ValueError("gymproxy's upstream client does not send HEAD requests")
        head = _head(method, url, headers, body)
        if self._slots is not None:
            await self._slots.acquire()
        try:
            conn = await self._connection(url, fresh, first)
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        self.in_use += 1
        conn.uses += 1
        reply = Reply(self, conn, url)
        conn.reply = reply
        self._replies.add(reply)
        try:
            assert conn.transport is not None
            if body:
                conn.transport.writelines((head, body))
            else:
                conn.transport.write(head)
            await reply._read_head()
        except BaseException:
            reply.close()
            raise
        return reply

    async def _connection(self, url: URL, fresh: bool = False, first: bool = False) -> _Connection:
        key = self._key(url)
        idle = None if fresh else self._idle.get(key)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()  # the most recently used: the warmest
                if conn.reusable(now, self.keepalive):
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
        turns = self._opening.get(key)
        if turns is None:
            turns = self._opening[key] = _Opening()
        timeout = self.connect_timeout
        token = object()
        try:
            await turns.turn(token, timeout, first)
        except asyncio.TimeoutError:
            raise ConnectTimeout(
                f"could not connect to {host}:{port}: it took no new connection in {timeout:g} s, "
                "and this one waited its turn to open"
            ) from None
        started = loop.time()
        opened = False
        guard = self._guards.get(key)  # asked at its turn, just before it connects
        try:
            try:
                if guard is not None and (why := guard.before()) is not None:
                    raise Refused(f"not connecting to {host}:{port}: {why}")
                opening = loop.create_connection(lambda: _Connection(loop, key), host, port, ssl=tls)
                _, conn = await (opening if timeout is None else asyncio.wait_for(opening, timeout))
                opened = True
            finally:
                turns.done(token, opened=opened)
        except asyncio.TimeoutError:
            assert timeout is not None
            crowded = turns.accepted > started - timeout
            raise ConnectTimeout(
                f"could not connect to {host}:{port} within {timeout:g} s"
                + (" (it took another connection in that time: busy accepting)" if crowded else ""),
                crowded=crowded,
            ) from None
        except OSError as exc:  # refused, unreachable, name not found, TLS failures
            raise CannotConnect(f"cannot connect to {host}:{port}: {exc}") from exc
        finally:
            if turns.idle() and self._opening.get(key) is turns:
                del self._opening[key]
        if guard is not None:
            try:
                why = await guard.after(conn.transport.get_extra_info("socket") if conn.transport is not None else None)
            except BaseException:
                conn.close()
                raise
            if why is not None:
                conn.close()
                raise Refused(f"connected to {host}:{port}, and sent nothing: {why}")
        return conn

    def guard(self, url: URL, guard: Guard | None) -> None:
        """Ask `guard` before and after opening every connection to `url`'s host (scheme, host and
        port) from now on; None: no more. Pooled connections are not asked again: one that was the
        guard's to open stays with the server it reached."""
        if guard is None:
            self._guards.pop(self._key(url), None)
        else:
            self._guards[self._key(url)] = guard

    def abort(self, reason: Aborted) -> None:
        """End every reply in progress (a reader raises `reason`) and refuse new requests with it."""
        self._aborted = reason
        for reply in list(self._replies):
            reply.abort(reason)

    def _returned(self, conn: _Connection, reply: Reply, *, reuse: bool) -> None:
        self._replies.discard(reply)
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
            keep = [c for c in idle if not c.closed and now - c.idle_since < self.keepalive]
            for conn in idle:
                if conn not in keep:
                    conn.close()
            idle[:] = keep
            left = left or bool(keep)
        if left and not self._closed:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive / 2, self._sweep)

    @staticmethod
    def _key(url: URL) -> tuple[str, str, int]:
        return (url.scheme, url.raw_host or "", url.port or (443 if url.scheme == "https" else 80))

    def same_host(self, a: URL, b: URL) -> bool:
        """Whether `a` and `b` share connections (scheme, host and port)."""
        return self._key(a) == self._key(b)

    def close_idle(self, url: URL) -> None:
        """Close the pooled connections to `url`'s host (an upstream removed from the fleet)."""
        for conn in self._idle.pop(self._key(url), []):
            conn.close()

    @property
    def idle(self) -> int:
        """Open connections waiting in the pool (one that closed while idle is dropped when next met)."""
        return sum(not conn.closed for idle in self._idle.values() for conn in idle)

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
    if ":" in host:  # an IPv6 literal goes in brackets (RFC 9110 7.2)
        host = f"[{host}]"
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
