"""`gymproxy serve`'s listeners: an aiohttp app on a socket of its own, with a cap on open client
connections that idle and half-sent connections cannot hold, and a deadline for request heads.

Each connection is, at any time, one of:

- fresh: accepted, nothing received yet;
- head: part of a request head received, its handler not started;
- busy: its handler runs (a request in progress);
- idle: between requests (kept alive), or dropping what is left of a body its handler did not read.

They are learnt from the bytes as they arrive (`_Counted`), from aiohttp making each request (the
`web.Server`'s request factory) and from the app's handler returning, and kept in one
insertion-ordered dict per state, oldest first, so that finding the oldest costs the same with ten
connections or ten thousand. Past the cap, a new connection takes the place of
(`ConnectionCap.make_room`), in this order: the connection idle longest (for `QUIET_S` at least),
the oldest incomplete head (none of whose bytes came in this turn of the loop), the oldest fresh
connection (silent for `QUIET_S`), a request body stalled for `STALLED_S`; failing all of them it
is answered 503 at once. A busy connection is never closed to make room, and none is whose
next bytes wait unread in the kernel. A head gets `header_timeout` seconds from its first byte (a
fresh connection: from its accept) to arrive whole, or it is answered 408 and closed (nginx's
`client_header_timeout`); one timer per listener, set for the oldest deadline, keeps that.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgspec
from aiohttp import web

log = logging.getLogger("gymproxy")

# An idle or fresh connection is closed to make room only once it has been quiet this long: one just
# answered may be sending its next request, one just accepted its first.
QUIET_S = 1.0
# At the cap, a request body silent this long is ended (408) to make room for a new connection.
STALLED_S = 1.0
SCAN = 4  # connections looked at per state when making room: the cost at the cap is bounded
REFUSED_LINGER_S = 1.0  # how long a refused connection is read (and discarded) before it is closed
REFUSED_LINGERING = 256  # at most this many (or the cap, if lower) refused connections linger at once
NOTICE_S = 60.0  # each kind of warning about the cap is logged at most this often

# A connection's states; those below BUSY are told about the bytes that arrive (`ConnectionCap.arrived`).
IDLE, FRESH, HEAD, DRAINING, BUSY, GONE = range(6)

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
Factory = Callable[[Any, Any, Any, Any, Any], web.BaseRequest]
EndStalled = Callable[[float], bool]  # ends (408) a request body stalled that long, if there is one


def reply(status: str, message: str, *, error_type: str, code: str | None, retry_after: bool = False) -> bytes:
    """A whole HTTP response with an OpenAI-style error body, written raw to a connection."""
    body = msgspec.json.encode({"error": {"message": message, "type": error_type, "param": None, "code": code}})
    retry = b"Retry-After: 1\r\n" if retry_after else b""
    head = b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n%sConnection: close\r\nContent-Length: %d\r\n\r\n"
    return head % (status.encode(), retry, len(body)) + body


class ConnectionCap:
    """Counts the open connections of one listener and keeps them under `limit`; its `protocol` is
    the protocol factory for `loop.create_server`. `setting` names the limit in the refusal, `what`
    names the connections in the log."""

    def __init__(
        self,
        server: web.Server,
        limit: int,
        *,
        header_timeout: float,
        setting: str = "limits.max_client_connections",
        what: str = "client connections",
        end_stalled: EndStalled | None = None,
    ) -> None:
        self.server = server
        self.limit = limit
        self.header_timeout = header_timeout
        self.what = what
        self.end_stalled = end_stalled
        self.loop = asyncio.get_running_loop()
        self.open = 0
        self.refused = self.evicted = self.timed_out = 0
        self.idle: dict[_Counted, None] = {}  # oldest first, as are the two below
        self.heads: dict[_Counted, None] = {}
        self.fresh: dict[_Counted, None] = {}
        self.lingering = 0  # refused connections still being read
        self._of: dict[object, _Counted] = {}  # each connection, by aiohttp's handler of it
        self._timer: asyncio.TimerHandle | None = None  # the next head deadline
        self._noted: dict[str, float] = {}
        self.refusal = reply(
            "503 Service Unavailable",
            f"gymproxy is at its limit of open {what} ({setting})",
            error_type="upstream_error",
            code=None,
            retry_after=True,
        )
        self._late = reply(
            "408 Request Timeout",
            f"the request head did not arrive within {header_timeout:g} s (limits.client_header_timeout)",
            error_type="invalid_request_error",
            code="request_timeout",
        )
        self._stalled = reply(
            "408 Request Timeout",
            f"the request head stalled while gymproxy was at its limit of open {what} ({setting})",
            error_type="invalid_request_error",
            code="request_timeout",
        )
        # Each connection's RequestHandler takes these two from the Server when it is made.
        server.request_factory = self._starting(server.request_factory)
        server.request_handler = self._observed(server.request_handler)

    def protocol(self) -> asyncio.Protocol:
        """A new connection: counted, or refused if it is past the cap and no room can be made."""
        if self.open >= self.limit and not self.make_room():
            self.refused += 1
            self._note("refused", "%d %s open: refusing more with 503", self.open, self.what)
            linger = self.lingering < min(REFUSED_LINGERING, self.limit)
            return _Refused(self, linger)
        self.open += 1
        return _Counted(self, self.server())

    def make_room(self) -> bool:
        """Close one connection that has no request in progress (or end a stalled body) for a new one."""
        now = self.loop.time()
        quiet = now - QUIET_S
        # A head is taken as soon as no byte of it came in this turn of the loop: a client's head
        # arrives in one piece, and one cut into a byte at a time has had its chance.
        victim = self._oldest(self.idle, quiet) or self._oldest(self.heads, now) or self._oldest(self.fresh, quiet)
        if victim is not None:
            self._close(victim, self._stalled if victim.state == HEAD else None)
        elif self.end_stalled is None or not self.end_stalled(STALLED_S):
            return False
        self.evicted += 1
        self._note(
            "evicted", "%d %s open: closing idle and stalled ones to make room for new ones", self.open, self.what
        )
        return True

    def close(self) -> None:
        """The listener is closed: no more head deadlines."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # --- a connection's state, as its bytes arrive and its handler runs ------------------------------

    def made(self, conn: _Counted) -> None:
        conn.state = FRESH
        conn.since = conn.last = self.loop.time()
        self.fresh[conn] = None
        self._of[conn.inner] = conn
        self._arm()

    def arrived(self, conn: _Counted) -> None:
        """Bytes came on a connection with no request in progress."""
        now = self.loop.time()
        state = conn.state
        if state == HEAD:
            conn.last = now
        elif state == DRAINING:
            if conn.payload is not None and conn.payload.is_eof():  # the unread body is over: idle
                del self.idle[conn]
                conn.payload = None
                self._enter(conn, IDLE, self.idle, now)
        else:  # the first bytes of a request head
            (self.idle if state == IDLE else self.fresh).pop(conn, None)
            conn.state = HEAD
            conn.since = conn.last = now
            self.heads[conn] = None
            if self._timer is None:
                self._arm()

    def lost(self, conn: _Counted) -> None:
        self._leave(conn)
        conn.state = GONE
        del self._of[conn.inner]
        self.open -= 1

    def _starting(self, factory: Factory) -> Factory:
        """aiohttp's request factory, which it calls as a request's handling begins (before the
        handler's task first runs): the connection has a request in progress from then on."""
        of, heads = self._of, self.heads

        def starting(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
            conn = of.get(protocol)
            if conn is not None:
                if conn.state == HEAD:
                    heads.pop(conn, None)
                    conn.state = BUSY
                elif conn.state != GONE:  # a pipelined request, whose head came while the one before it ran
                    self._leave(conn)
                    conn.state = BUSY
            return factory(message, payload, protocol, writer, task)

        return starting

    def _observed(self, handler: Handler) -> Handler:
        """The app's handler: when it returns, its connection is idle (or drops what is left of the body)."""
        of, idle, loop = self._of, self.idle, self.loop

        async def observed(request: web.BaseRequest) -> web.StreamResponse:
            try:
                return await handler(request)
            finally:
                conn = of.get(request.protocol)
                if conn is not None and conn.state == BUSY:  # still open
                    conn.since = conn.last = loop.time()
                    if request.content.is_eof():
                        conn.state = IDLE
                    else:
                        conn.state, conn.payload = DRAINING, request.content
                    idle[conn] = None

        return observed

    def _enter(self, conn: _Counted, state: int, queue: dict[_Counted, None], now: float) -> None:
        conn.state = state
        conn.since = conn.last = now
        queue[conn] = None

    def _leave(self, conn: _Counted) -> None:
        state = conn.state
        if state == HEAD:
            self.heads.pop(conn, None)
        elif state == FRESH:
            self.fresh.pop(conn, None)
        elif state == IDLE or state == DRAINING:
            self.idle.pop(conn, None)

    # --- making room, and the head deadline ---------------------------------------------------------

    def _oldest(self, queue: dict[_Counted, None], before: float) -> _Counted | None:
        """The oldest of (the first few in) `queue` silent since before `before`, with nothing unread
        and nothing left to write."""
        for conn, _ in zip(queue, range(SCAN), strict=False):
            if conn.last < before and not conn.transport.get_write_buffer_size() and not _unread(conn.transport):
                return conn
        return None

    def _close(self, conn: _Counted, answer: bytes | None) -> None:
        self._leave(conn)
        conn.state = GONE
        transport = conn.transport
        if answer is not None and not transport.is_closing():
            transport.write(answer)
        transport.close()

    def _arm(self) -> None:
        """Set the timer for the oldest head deadline, unless it is set."""
        if self._timer is None:
            deadline = min((next(iter(q)).since for q in (self.heads, self.fresh) if q), default=None)
            if deadline is not None:
                self._timer = self.loop.call_at(deadline + self.header_timeout, self._expire)

    def _expire(self) -> None:
        """Close the heads (and fresh connections) past their deadline: a head gets a 408."""
        self._timer = None
        due = self.loop.time() - self.header_timeout + 0.005  # a timer may fire a little early
        for queue, answer in ((self.heads, self._late), (self.fresh, None)):
            while queue and (conn := next(iter(queue))).since <= due:
                self.timed_out += 1
                self._close(conn, answer)
        self._arm()

    def _note(self, kind: str, message: str, *args: object) -> None:
        """Log `message` unless this kind was logged in the last `NOTICE_S` (a client cannot fill the log)."""
        now = self.loop.time()
        if now - self._noted.get(kind, float("-inf")) >= NOTICE_S:
            self._noted[kind] = now
            log.warning(message + " (logged at most once a minute)", *args)


def _unread(transport: asyncio.BaseTransport) -> int:
    """Bytes that arrived on the connection and wait in the kernel, not read yet (0 if unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return 0


class _Counted(asyncio.Protocol):
    """aiohttp's connection handler (`inner`), forwarded to, with the connection's state kept by its cap."""

    __slots__ = ("cap", "inner", "transport", "state", "since", "last", "payload")

    def __init__(self, cap: ConnectionCap, inner: Any) -> None:
        self.cap = cap
        self.inner = inner
        self.state = FRESH
        self.since = self.last = 0.0  # when it entered its state; when a byte of its head last came
        self.payload: Any = None  # the body a handler left unread, while it is dropped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not its subclasses
        self.cap.made(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)
        if self.state < BUSY:
            self.cap.arrived(self)

    def eof_received(self) -> bool | None:
        result: bool | None = self.inner.eof_received()
        return result

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cap.lost(self)
        self.inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """One connection past the cap: the 503 goes out at once, what the client sends is read and
    dropped (closing with unread bytes would reset the connection before it reads the 503), unless
    too many refused connections linger already: then it is closed at once."""

    def __init__(self, cap: ConnectionCap, linger: bool) -> None:
        self.cap = cap
        self.lingers = linger
        self.timer: asyncio.TimerHandle | None = None
        if linger:
            cap.lingering += 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = self.transport = cast(asyncio.Transport, transport)  # uvloop's are not its subclasses
        stream.write(self.cap.refusal)
        if stream.can_write_eof():
            stream.write_eof()
        if self.lingers:
            self.timer = self.cap.loop.call_later(REFUSED_LINGER_S, stream.close)
        else:
            stream.close()

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.lingers:
            self.cap.lingering -= 1
