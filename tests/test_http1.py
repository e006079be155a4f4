"""gymproxy.http1, the upstream client: its framing fed recorded replies split at every byte, and the
client against scripted servers on real sockets.

The recorded replies (tests/data/http1, see record.py there) are what uvicorn, vLLM's server,
writes. Each scripted server here writes exact bytes, so every framing rule is checked as it meets
the wire: Content-Length, chunked with extensions and trailers, bodies that end with the
connection, interim 1xx replies, each way a reply breaks, and bytes that arrive when no reply is
expected (which must close the connection, never answer the next request).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from yarl import URL

from gymproxy.http1 import (
    CONNECTING,
    HIGH_WATER,
    MAX_HEAD,
    BadReply,
    CannotConnect,
    Client,
    ConnectTimeout,
    ReadTimeout,
    Refused,
    Reply,
    ReplyTooLarge,
    _Connection,
)
from gymproxy.sse import DONE, SSEDecoder

from .conftest import has_ipv6_loopback
from .faults import connecting_to

RECORDED = Path(__file__).parent / "data" / "http1"

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Scripted:
    """A server running `serve` on each connection; counts connections and keeps what it read."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.connections = 0
        self.closed = 0  # connections the client closed (EOF seen by the server)
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    def url(self, path: str = "/v1/chat/completions") -> URL:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return URL(f"http://127.0.0.1:{port}{path}")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.serve(reader, writer)
            if await reader.read() == b"":
                self.closed += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed += 1
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request, head and Content-Length body, as bytes."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def send_slowly(writer: asyncio.StreamWriter, data: bytes, step: int = 1) -> None:
    """Write `data` a few bytes at a time, each piece on its own, to split every token."""
    for i in range(0, len(data), step):
        writer.write(data[i : i + step])
        await writer.drain()
        await asyncio.sleep(0)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


# --- framing, sans-IO: bytes fed to the parser as the connection would ------------------------------


class _Transport:
    """What a `_Connection` needs of a transport; records whether it was closed or paused."""

    def __init__(self) -> None:
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Fed:
    """One reply parsed from the given pieces, exactly as `data_received` would deliver them."""

    def __init__(self, pieces: list[bytes], *, eof: bool = False) -> None:
        self.client = Client(read_timeout=1.0)
        self.transport = _Transport()
        self.conn = _Connection(asyncio.get_running_loop(), ("http", "upstream", 80))
        self.conn.connection_made(self.transport)  # type: ignore[arg-type]
        self.reply = Reply(self.client, self.conn, URL("http://upstream/v1/chat/completions"))
        self.conn.reply = self.reply
        self.client.in_use += 1
        for piece in pieces:
            if piece:  # a transport never delivers an empty read
                self.conn.data_received(piece)
        if eof:
            self.conn.eof_received()

    async def body(self) -> bytes:
        await self.reply._read_head()
        return await self.reply.read()

    async def pieces(self) -> list[bytes]:
        await self.reply._read_head()
        return [data async for data in self.reply.iter_any()]


def recorded(name: str) -> list[tuple[str, bytes, bytes]]:
    """(id, the reply bytes uvicorn wrote, the body it framed) for both of uvicorn's HTTP writers."""
    body = (RECORDED / f"{name}.body").read_bytes()
    return [
        (f"{impl}-{name}", (RECORDED / f"uvicorn-{impl}-{name}.http").read_bytes(), body)
        for impl in ("httptools", "h11")
    ]


RECORDINGS = [case for name in ("chat", "stream", "overflow", "health") for case in recorded(name)]


@pytest.mark.parametrize(("raw", "body"), [case[1:] for case in RECORDINGS], ids=[case[0] for case in RECORDINGS])
async def test_recorded_replies_split_at_every_offset(raw: bytes, body: bytes) -> None:
    status = int(raw[9:12])
    for cut in range(len(raw) + 1):
        fed = Fed([raw[:cut], raw[cut:]])
        assert await fed.body() == body, cut
        assert fed.reply.status == status and fed.reply.headers["server"] == "uvicorn"
        fed.reply.release()
        assert fed.client.idle == 1 and not fed.transport.closed, cut  # clean framing: reusable


@pytest.mark.parametrize(("raw", "body"), [case[1:] for case in RECORDINGS], ids=[case[0] for case in RECORDINGS])
async def test_recorded_replies_one_byte_at_a_time(raw: bytes, body: bytes) -> None:
    fed = Fed([raw[i : i + 1] for i in range(len(raw))])
    pieces = await fed.pieces()
    assert b"".join(pieces) == body


async def test_a_recorded_stream_keeps_its_events_whatever_the_split() -> None:
    (_, raw, body), _ = recorded("stream")
    expected = SSEDecoder().feed(body)
    assert expected[-1] == DONE and len(expected) > 10
    for cut in range(len(raw) + 1):
        decoder = SSEDecoder()
        events = [event for piece in await Fed([raw[:cut], raw[cut:]]).pieces() for event in decoder.feed(piece)]
        assert events == expected, cut


def _cuts(size: int) -> range | list[int]:
    """Every offset of a short reply; for a long one, 2,000 spread over it."""
    return range(size + 1) if size <= 2000 else sorted({*range(0, size + 1, size // 2000), size})


def _refused(reply_bytes: bytes) -> str:
    """The BadReply message for `reply_bytes`, fed whole and split at every offset (always the same)."""
    messages = set()
    for cut in _cuts(len(reply_bytes)):
        fed = Fed([reply_bytes[:cut], reply_bytes[cut:]])
        assert fed.reply._error is not None, f"accepted when cut at {cut}"
        assert fed.transport.closed  # a connection whose framing broke never carries another reply
        messages.add(str(fed.reply._error))
    assert len(messages) == 1, messages
    return messages.pop()


GOOD_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    ("reply_bytes", "message"),
    [
        # Content-Length and Transfer-Encoding both present: a smuggling vector (RFC 9112 6.3).
        (GOOD_HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", "Content-Length"),
        (GOOD_HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n2\r\n{}\r\n0\r\n\r\n", "Content-Length"),
        ("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n{}".encode(), "Content-Length"),  # a digit to isdigit()
        (GOOD_HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "Content-Length"),
        (GOOD_HEAD + b"Content-Length: -1\r\n\r\n{}", "Content-Length"),
        (GOOD_HEAD + b"Content-Length: 99999999999999999999999\r\n\r\n{}", "Content-Length"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\n{}", "status"),
        (b"HTTP/1.1 2999999 OK\r\nContent-Length: 2\r\n\r\n{}", "status"),
        (b"HTTP/1.1 999 Nine\r\nContent-Length: 2\r\n\r\n{}", "outside 100-599"),
        (b"HTTP/1.1 099 OK\r\nContent-Length: 2\r\n\r\n{}", "outside 100-599"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "status"),
        (b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", "not HTTP/1.x"),
        (b"SPDY/3 200 OK\r\n\r\n", "not valid HTTP/1.1"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "switched protocols"),
        (GOOD_HEAD + b"Bad Name: x\r\nContent-Length: 2\r\n\r\n{}", "header"),  # not a token
        (GOOD_HEAD + b"Content-Length : 2\r\n\r\n{}", "header"),
        (GOOD_HEAD + b"no colon here\r\n\r\n", "header"),
        (GOOD_HEAD + b"X: a\x01b\r\nContent-Length: 2\r\n\r\n{}", "header value"),
        (GOOD_HEAD + b"X: a\r\n folded\r\nContent-Length: 2\r\n\r\n{}", "whitespace"),  # obsolete line folding
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}", "CR"),  # bare LF: refused at once, never a hang
        (GOOD_HEAD + b"Transfer-Encoding: gzip\r\n\r\n", "only chunked"),
        (GOOD_HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", "only chunked"),
        (GOOD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 40 + b"\r\n", "overflow"),
        (GOOD_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n", "chunk size"),
        (GOOD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n-2\r\nab\r\n", "chunk size"),
        (GOOD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n", "chunk size"),
        (GOOD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n\r\nab\r\n", "chunk size"),
        (GOOD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\nabXY", "after chunk data"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * (MAX_HEAD + 10) + b"\r\n\r\n", f"over {MAX_HEAD} bytes"),
        (
            b"HTTP/1.1 200 OK\r\n" + (b"X-Many: " + b"y" * 90 + b"\r\n") * (MAX_HEAD // 100 + 2),
            f"over {MAX_HEAD} bytes",
        ),
        # Surplus: bytes past the end of the reply, in the same read as the reply or after it.
        (GOOD_HEAD + b"Content-Length: 2\r\n\r\n{}" + GOOD_HEAD + b"Content-Length: 2\r\n\r\n[]", "after the end"),
        (GOOD_HEAD + b"Content-Length: 2\r\n\r\n{}xyz", "after the end"),
        (GOOD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n", "after the end"),
    ],
)
async def test_broken_framing_is_refused_whatever_the_split(reply_bytes: bytes, message: str) -> None:
    assert message in _refused(reply_bytes)


async def test_unbounded_trailers_and_size_lines_are_refused() -> None:
    chunked = GOOD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n"
    for tail in (
        b"0\r\n" + b"X-T: y\r\n" * (MAX_HEAD // 8),
        b"0\r\nX-T: " + b"y" * (MAX_HEAD + 10),
        b"0" * (MAX_HEAD + 10),
    ):
        fed = Fed([chunked, *(tail[i : i + 4096] for i in range(0, len(tail), 4096))])
        assert fed.reply._error is not None, tail[:20]
        assert f"{MAX_HEAD}" in str(fed.reply._error)


async def test_a_body_ended_by_the_connection_is_complete_only_on_a_clean_close() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n"
    fed = Fed([head, b'{"whole":', b"true}"], eof=True)
    assert await fed.body() == b'{"whole":true}'
    cut = Fed([head, b'{"whole":'])
    cut.conn.connection_lost(ConnectionResetError("reset"))
    with pytest.raises(BadReply, match="before the end of its reply"):
        await cut.body()


async def test_bytes_after_a_released_reply_close_the_connection() -> None:
    fed = Fed([ok(b"{}")])
    assert await fed.body() == b"{}"
    fed.reply.release()
    assert fed.client.idle == 1
    fed.conn.data_received(ok(b'{"late":1}'))  # idle in the pool: nobody asked for these bytes
    assert fed.transport.closed
    assert fed.client.idle == 0 and not fed.conn.reusable(time.monotonic(), 4.0)


# --- the client, on real sockets ---------------------------------------------------------------------


@pytest.fixture
async def new_client():
    """Makes clients (read timeout 5 s unless given) and closes them all after the test."""
    made: list[Client] = []

    def make(**options: Any) -> Client:
        made.append(Client(**{"connect_timeout": 2.0, "read_timeout": 5.0, **options}))
        return made[-1]

    yield make
    for c in made:
        await c.close()


@pytest.fixture
def client(new_client) -> Client:
    return new_client()


async def test_request_bytes_on_the_wire(client: Client) -> None:
    seen: list[bytes] = []

    async def serve(reader, writer):
        seen.append(await read_request(reader))
        writer.write(ok(b"{}"))

    async with Scripted(serve) as server:
        url = server.url("/v1/chat/completions?api-version=2")
        reply = await client.request(
            "POST", url, {"Content-Type": "application/json", "X-Request-Id": "r1"}, b'{"a":1}'
        )
        assert await reply.read() == b"{}"
        reply.release()
    port = url.port
    assert seen == [
        b"POST /v1/chat/completions?api-version=2 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"Content-Type: application/json\r\nX-Request-Id: r1\r\nContent-Length: 7\r\n\r\n"
        b'{"a":1}' % port
    ]


async def test_content_length_replies_reuse_one_connection(client: Client) -> None:
    async def serve(reader, writer):
        for i in range(3):
            await read_request(reader)
            await send_slowly(writer, ok(b'{"n":%d}' % i, b"X-Extra: a\r\nX-Extra: b\r\n"), step=7)

    async with Scripted(serve) as server:
        for i in range(3):
            reply = await client.request("POST", server.url(), {}, b"{}")
            assert (reply.status, reply.content_type) == (200, "application/json")
            assert reply.headers["x-extra"] == "a, b"
            assert await reply.read() == b'{"n":%d}' % i
            reply.release()
            assert client.in_use == 0 and client.idle == 1
        assert server.connections == 1


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"8;ext=1\r\ndata: a\n\r\n"
    b"10\r\ndata: bbbbbbbbb\n\r\n"
    b"0\r\nX-Trailer: t\r\n\r\n"
)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 1000])
async def test_chunked_body_split_anywhere(client: Client, step: int) -> None:
    async def serve(reader, writer):
        for _ in range(2):
            await read_request(reader)
            await send_slowly(writer, CHUNKED, step)

    async with Scripted(serve) as server:
        for _ in range(2):
            reply = await client.request("GET", server.url(), {})
            assert reply.content_type == "text/event-stream"
            assert await reply.read() == b"data: a\ndata: bbbbbbbbb\n"
            reply.release()
        assert server.connections == 1  # trailers read, so the connection was reusable


async def test_iter_any_yields_each_piece_as_it_arrives(client: Client) -> None:
    go_on = asyncio.Event()

    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await go_on.wait()  # the client must have the first piece before the second exists
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")

    async with Scripted(serve) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        pieces = []
        async for data in reply.iter_any():
            pieces.append(data)
            go_on.set()
        reply.release()
    assert pieces == [b"first", b"second"]


async def test_body_delimited_by_close_is_read_and_not_reused(client: Client) -> None:
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"whole":')
        await writer.drain()
        writer.write(b"true}")
        writer.close()

    async with Scripted(serve) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        assert await reply.read() == b'{"whole":true}'
        reply.release()
        assert client.idle == 0


async def test_interim_100_continue_is_skipped(client: Client) -> None:
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"[]"))

    async with Scripted(serve) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        assert (reply.status, await reply.read()) == (200, b"[]")
        reply.release()


async def test_no_content_reply_has_an_empty_body(client: Client) -> None:
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    async with Scripted(serve) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        assert (reply.status, await reply.read(), reply.content_type) == (204, b"", "application/octet-stream")
        reply.release()
        assert client.idle == 1


@pytest.mark.parametrize(
    ("reply_bytes", "message", "then_close"),
    [
        (b"", "closed the connection", True),
        (b"HTTP/1.1 200 OK\r\nContent-", "closed the connection", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n", "Content-Length", False),
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}", "CR", False),  # bare LF: once a hang
    ],
)
async def test_broken_heads_are_bad_replies(new_client, reply_bytes: bytes, message: str, then_close: bool) -> None:
    client = new_client(read_timeout=None)  # gymproxy's default: no read timeout may hide a hang

    async def serve(reader, writer):
        await read_request(reader)
        writer.write(reply_bytes)
        await writer.drain()
        if then_close:
            writer.close()
        else:
            await asyncio.sleep(30)  # the upstream keeps the connection open

    async with Scripted(serve) as server:
        with pytest.raises(BadReply, match=message):
            await asyncio.wait_for(client.request("POST", server.url(), {}, b"{}"), 5)
        assert client.in_use == 0 and client.idle == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"Content-Length: 100\r\n\r\nonly ten b", "before the end of its reply"),
        (b"Transfer-Encoding: chunked\r\n\r\n5\r\nab", "before the end of its reply"),
        (b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n", "chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n2\r\nabXY", "after chunk data"),
    ],
)
async def test_broken_bodies_are_bad_replies(client: Client, body: bytes, message: str) -> None:
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + body)
        await writer.drain()
        writer.close()

    async with Scripted(serve) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        with pytest.raises(BadReply, match=message):
            await reply.read()
        reply.release()
        assert client.in_use == 0 and client.idle == 0


async def test_a_large_body_is_read_whole_through_flow_control(client: Client) -> None:
    body = bytes(range(256)) * (4 * HIGH_WATER // 256)

    async def serve(reader, writer):
        await read_request(reader)
        writer.write(ok(body))
        await writer.drain()

    async with Scripted(serve) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        assert await reply.read() == body
        reply.release()
        assert client.idle == 1


def endless(status: int = 200, length: int | None = None) -> Serve:
    """A server that answers with a body that never ends (64 KiB at a time, for as long as it is read)."""

    async def serve(reader, writer):
        await read_request(reader)
        framing = b"Content-Length: %d" % length if length is not None else b"Transfer-Encoding: chunked"
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\n%s\r\n\r\n" % (status, framing))
        piece = b"x" * 65536
        if length is not None:
            await reader.read()  # the head alone: nothing of the body will be waited for
            return
        while True:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()

    return serve


@pytest.mark.parametrize(("status", "limit"), [(200, 3 * HIGH_WATER), (400, 10_000), (503, 10_000)])
async def test_a_body_past_the_limit_for_its_status_fails_and_closes(new_client, status: int, limit: int) -> None:
    client = new_client(max_reply=3 * HIGH_WATER, max_error_reply=10_000)
    async with Scripted(endless(status)) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        with pytest.raises(ReplyTooLarge) as caught:
            await reply.read()
        assert caught.value.limit == limit and caught.value.announced is None
        assert reply._received <= limit + HIGH_WATER  # never much more than the limit was held
        with pytest.raises(ReplyTooLarge):
            await reply.buffer()  # and it stays failed
        reply.release()
        assert client.idle == 0 and client.in_use == 0
        for _ in range(200):
            if server.closed:
                break
            await asyncio.sleep(0.01)
        assert server.closed == 1


async def test_a_content_length_over_the_limit_is_refused_before_the_body(new_client) -> None:
    client = new_client(max_reply=1_000_000, read_timeout=30.0)
    async with Scripted(endless(length=10**9)) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        started = time.monotonic()
        with pytest.raises(ReplyTooLarge) as caught:
            await reply.read()  # at once: the body is never waited for
        assert time.monotonic() - started < 1.0
        assert (caught.value.limit, caught.value.announced) == (1_000_000, 10**9)
        reply.release()
        assert client.idle == 0


async def test_a_limit_holds_a_body_read_piece_by_piece(client: Client) -> None:
    async with Scripted(endless()) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        reply.limit(200_000)
        got = 0
        with pytest.raises(ReplyTooLarge):
            async for piece in reply.iter_any():
                got += len(piece)
        assert got <= 200_000
        reply.release()


async def test_a_body_under_the_limit_is_read_whole_and_pooled(new_client) -> None:
    client = new_client(max_reply=1000, max_error_reply=10)
    body = b"y" * 1000

    async def serve(reader, writer):
        await read_request(reader)
        writer.write(ok(body))

    async with Scripted(serve) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        assert await reply.read() == body
        reply.release()
        assert client.idle == 1


async def test_an_unread_body_closes_its_connection(client: Client) -> None:
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()

    async with Scripted(serve) as server:
        reply = await client.request("POST", server.url(), {}, b"{}")
        reply.release()  # before the body ended: this is how a generation gets aborted
        assert client.idle == 0
        for _ in range(100):
            if server.closed:
                break
            await asyncio.sleep(0.01)
        assert server.closed == 1


async def test_connection_refused_is_cannot_connect(client: Client) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(CannotConnect, match=f"127.0.0.1:{port}"):
            await client.request("POST", URL(f"http://127.0.0.1:{port}/v1/models"), {}, b"{}")
    assert client.in_use == 0


class Gate:
    """A guard that answers what it is told to, and records what it was asked."""

    def __init__(self) -> None:
        self.refuse_before: str | None = None
        self.refuse_after: str | None = None
        self.asked: list[str] = []

    def before(self) -> str | None:
        self.asked.append("before")
        return self.refuse_before

    async def after(self, sock: Any) -> str | None:
        self.asked.append(f"after {sock.getpeername()[1]}")
        return self.refuse_after


async def test_a_guard_is_asked_before_and_after_each_new_connection_and_either_refusal_sends_nothing(
    client: Client,
) -> None:
    seen: list[bytes] = []

    async def serve(reader, writer):
        while True:
            seen.append(await read_request(reader))
            writer.write(ok(b"{}"))

    async with Scripted(serve) as server:
        url = server.url()
        gate = Gate()
        client.guard(url, gate)
        for _ in range(2):  # the second goes on the pooled connection: not asked again
            reply = await client.request("POST", url, {}, b"{}")
            assert await reply.read() == b"{}"
            reply.release()
        assert gate.asked == ["before", f"after {url.port}"] and server.connections == 1
        gate.refuse_before = "its process is not running"
        with pytest.raises(Refused, match=f"not connecting to 127.0.0.1:{url.port}: its process is not running"):
            await client.request("POST", url, {}, b"{}", fresh=True)
        assert server.connections == 1  # no connection was opened
        gate.refuse_before, gate.refuse_after = None, "the server is another user's"
        with pytest.raises(Refused, match="and sent nothing: the server is another user's"):
            await client.request("POST", url, {}, b"{}", fresh=True)
        for _ in range(100):
            if server.closed:
                break
            await asyncio.sleep(0.01)
        assert server.connections == 2 and server.closed == 1 and len(seen) == 2  # connected, and not a byte sent
        client.guard(url, None)
        reply = await client.request("POST", url, {}, b"{}", fresh=True)
        reply.release()
        assert len(gate.asked) == 5 and len(seen) == 3
    assert client.in_use == 0


async def test_silence_past_the_read_timeout(new_client) -> None:
    client = new_client(read_timeout=0.2)

    async def serve(reader, writer):
        await read_request(reader)
        await asyncio.sleep(2)

    async with Scripted(serve) as server:
        with pytest.raises(ReadTimeout) as caught:
            await client.request("POST", server.url(), {}, b"{}")
        assert isinstance(caught.value, asyncio.TimeoutError)  # what callers catch, on 3.10 too
        assert client.in_use == 0


async def test_header_line_breaks_are_refused_before_sending(client: Client) -> None:
    async def serve(reader, writer):
        await read_request(reader)

    async with Scripted(serve) as server:
        with pytest.raises(ValueError, match="line break"):
            await client.request("POST", server.url(), {"X-Bad": "a\r\nInjected: yes"}, b"{}")
        assert server.connections == 0


async def test_limit_holds_requests_until_a_connection_is_free(new_client) -> None:
    client = new_client(limit=1)
    open_now = peak = 0

    async def serve(reader, writer):
        nonlocal open_now, peak
        open_now += 1
        peak = max(peak, open_now)
        await read_request(reader)
        await asyncio.sleep(0.05)
        writer.write(ok(b"{}", b"Connection: close\r\n"))
        await writer.drain()
        open_now -= 1

    async def one(url: URL) -> bytes:
        reply = await client.request("POST", url, {}, b"{}")
        try:
            return await reply.read()
        finally:
            reply.release()

    async with Scripted(serve) as server:
        assert await asyncio.gather(*(one(server.url()) for _ in range(4))) == [b"{}"] * 4
        assert server.connections == 4  # `Connection: close` replies are never reused
    assert peak == 1


def unaccepting(backlog: int) -> socket.socket:
    """A listener that accepts nothing (yet): past its backlog, the kernel drops the SYNs that come."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(backlog)
    listener.setblocking(False)
    return listener


async def test_new_connections_to_one_host_open_a_few_at_a_time(new_client) -> None:
    """A burst of 100 requests to a host that accepts nothing yet (its backlog of 40 fills, then its
    kernel drops the SYNs): at most `CONNECTING` connections are ever opening (before, all 100 sent
    their SYN at once, and each was dropped again and again while the others retried with it). The
    rest wait their turn, past `connect_timeout` while the host takes connections; one asked with
    `first` goes ahead of them. Once the host accepts, every request is answered."""
    if connecting_to(1) is None:
        pytest.skip("needs Linux's /proc/net/tcp to see the connections opening")
    client = new_client(connect_timeout=4.0)
    listener = unaccepting(40)
    port = listener.getsockname()[1]
    url = URL(f"http://127.0.0.1:{port}/v1/models")
    done: list[str] = []

    async def one(name: str, first: bool = False) -> None:
        reply = await client.request("GET", url, {}, first=first)
        try:
            assert await reply.read() == b"{}"
        finally:
            reply.release()
        done.append(name)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"{}", b"Connection: close\r\n"))
        await writer.drain()
        writer.close()

    burst = [asyncio.ensure_future(one(f"r{i}")) for i in range(100)]
    await asyncio.sleep(0.3)
    ahead = asyncio.ensure_future(one("first", first=True))
    most = 0
    for _ in range(20):
        most = max(most, connecting_to(port) or 0)
        await asyncio.sleep(0.02)
    assert 0 < most <= CONNECTING, most
    server = await asyncio.start_server(serve, sock=listener)
    try:
        await asyncio.wait_for(asyncio.gather(*burst, ahead), 20)
    finally:
        server.close()
    assert len(done) == 101 and done.index("first") < 80, done.index("first")


async def test_waiting_to_connect_to_a_host_that_takes_nothing_times_out(new_client) -> None:
    """A host that takes no connection at all: the requests waiting their turn to open one end with
    a `ConnectTimeout` after `connect_timeout` with no progress, not one turn after another."""
    client = new_client(connect_timeout=0.5, read_timeout=0.5)
    listener = unaccepting(1)
    url = URL(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/models")
    started = time.monotonic()
    try:
        results = await asyncio.gather(*(client.request("GET", url, {}) for _ in range(100)), return_exceptions=True)
    finally:
        listener.close()
    assert time.monotonic() - started < 3
    unanswered = [r for r in results if isinstance(r, ReadTimeout)]  # the backlog's few, which the kernel took
    failures = [r for r in results if not isinstance(r, ReadTimeout)]
    assert len(unanswered) <= 2 and all(isinstance(f, ConnectTimeout) for f in failures), failures
    waited = [f for f in failures if isinstance(f, ConnectTimeout) and "waited its turn" in str(f)]
    assert waited and not any(f.crowded for f in waited)  # the host took nothing: it is not busy, it is down


async def test_idle_connections_close_after_keepalive(new_client) -> None:
    client = new_client(keepalive=0.2)

    async def serve(reader, writer):
        while True:
            await read_request(reader)
            writer.write(ok(b"{}"))

    async with Scripted(serve) as server:
        for _ in range(2):
            reply = await client.request("POST", server.url(), {}, b"{}")
            await reply.read()
            reply.release()
            await asyncio.sleep(0.5)
            assert client.idle == 0  # closed by the client, before the upstream could
        assert server.connections == 2


async def test_a_connection_the_upstream_closed_while_idle_is_not_reused(client: Client) -> None:
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(ok(b"{}"))
        await writer.drain()
        writer.close()  # keep-alive promised, then closed while idle

    async with Scripted(serve) as server:
        for _ in range(2):
            reply = await client.request("POST", server.url(), {}, b"{}")
            await reply.read()
            reply.release()
            await asyncio.sleep(0.05)
        assert server.connections == 2


@pytest.fixture
def certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1 (made with the openssl command line)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_https_upstream(certificate, new_client) -> None:
    cert, key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def serve(reader, writer):
        for _ in range(2):
            await read_request(reader)
            writer.write(ok(b'{"tls":true}'))

    server = await asyncio.start_server(lambda r, w: Scripted(serve)._handle(r, w), "127.0.0.1", 0, ssl=server_tls)
    url = URL(f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/models")
    trusting = new_client(tls=ssl.create_default_context(cafile=str(cert)))
    default = new_client()
    try:
        for _ in range(2):
            reply = await trusting.request("GET", url, {})
            assert await reply.read() == b'{"tls":true}'
            reply.release()
        assert trusting.idle == 1
        with pytest.raises(CannotConnect, match="CERTIFICATE_VERIFY_FAILED"):
            await default.request("GET", url, {})  # not in the system's trust store
    finally:
        server.close()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this host has no IPv6 loopback")
async def test_ipv6_upstreams_get_a_bracketed_host(client: Client) -> None:
    seen: list[bytes] = []

    async def serve(reader, writer):
        seen.append(await read_request(reader))
        writer.write(ok(b"{}"))

    server = await asyncio.start_server(lambda r, w: Scripted(serve)._handle(r, w), "::1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reply = await client.request("POST", URL(f"http://[::1]:{port}/v1/models"), {}, b"{}")
        assert await reply.read() == b"{}"
        reply.release()
    finally:
        server.close()
    assert seen[0].startswith(b"POST /v1/models HTTP/1.1\r\nHost: [::1]:%d\r\n" % port)


@pytest.mark.parametrize("first", ["clean", "cl+te"])
async def test_a_late_surplus_never_answers_the_next_request(client: Client, first: str) -> None:
    """The upstream (or a middlebox) sends more bytes 50 ms after its reply: the pooled connection
    must be dropped, so the next request gets its own answer from a new connection."""

    async def serve(reader, writer):
        await read_request(reader)
        if first == "clean":
            writer.write(ok(b'{"n":1}'))
        else:  # both framings: a smuggling attempt, refused
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(ok(b'{"stale":true}'))  # the answer to nobody
        await writer.drain()
        await asyncio.sleep(1)

    async def second(reader, writer):
        await read_request(reader)
        writer.write(ok(b'{"n":2}'))

    scripts = [serve, second]
    async with Scripted(lambda r, w: scripts.pop(0)(r, w)) as server:
        if first == "clean":
            reply = await client.request("POST", server.url(), {}, b"{}")
            assert await reply.read() == b'{"n":1}'
            reply.release()
            assert client.idle == 1
        else:
            with pytest.raises(BadReply, match="Content-Length"):
                await client.request("POST", server.url(), {}, b"{}")
        await asyncio.sleep(0.2)  # the surplus arrives on the idle (or already closed) connection
        assert client.idle == 0
        reply = await client.request("POST", server.url(), {}, b"{}")
        assert await reply.read() == b'{"n":2}'
        reply.release()
        assert server.connections == 2


async def test_bytes_the_loop_has_not_read_yet_keep_a_connection_from_reuse(client: Client) -> None:
    """Bytes can sit in the socket, unread by the event loop, when a pooled connection is taken for
    the next request: the pool looks at the socket itself before it reuses a connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    surplus_sent, go = threading.Event(), threading.Event()

    def read_one(conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += conn.recv(65536)

    def upstream() -> None:
        first, _ = listener.accept()
        read_one(first)
        first.sendall(ok(b'{"n":1}'))
        go.wait(5)
        first.sendall(ok(b'{"stale":true}'))
        surplus_sent.set()
        second, _ = listener.accept()
        read_one(second)
        second.sendall(ok(b'{"n":2}'))
        time.sleep(0.5)
        first.close()
        second.close()

    thread = threading.Thread(target=upstream, daemon=True)
    thread.start()
    url = URL(f"http://127.0.0.1:{port}/v1/chat/completions")
    try:
        reply = await client.request("POST", url, {}, b"{}")
        assert await reply.read() == b'{"n":1}'
        reply.release()
        go.set()
        # Block the loop: the surplus reaches this process's socket, but no callback reads it.
        assert surplus_sent.wait(5)
        time.sleep(0.1)
        reply = await client.request("POST", url, {}, b"{}")
        assert await reply.read() == b'{"n":2}'
        reply.release()
    finally:
        listener.close()
        thread.join(5)
