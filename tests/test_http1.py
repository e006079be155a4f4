"""gymproxy.http1, the upstream client, against scripted servers on real sockets.

Each server here writes exact bytes (split where a parser is most likely to trip), so every
framing rule is checked as it meets the wire: Content-Length, chunked with extensions and
trailers, bodies that end with the connection, interim 1xx replies, and each way a reply breaks.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from yarl import URL

from gymproxy.http1 import HIGH_WATER, BadReply, CannotConnect, Client, ReadTimeout

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
    ("reply_bytes", "message"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "HTTP/1.x status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n", "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "not chunked"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000, "over 65536 bytes"),
        (b"", "closed the connection"),
        (b"HTTP/1.1 200 OK\r\nContent-", "closed the connection"),
    ],
)
async def test_broken_heads_are_bad_replies(client: Client, reply_bytes: bytes, message: str) -> None:
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(reply_bytes)
        await writer.drain()
        writer.close()

    async with Scripted(serve) as server:
        with pytest.raises(BadReply, match=message):
            await client.request("POST", server.url(), {}, b"{}")
        assert client.in_use == 0 and client.idle == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"Content-Length: 100\r\n\r\nonly ten b", "closed the connection"),
        (b"Transfer-Encoding: chunked\r\n\r\n5\r\nab", "closed the connection"),
        (b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n", "malformed"),
        (b"Transfer-Encoding: chunked\r\n\r\n-2\r\nab\r\n", "malformed"),
        (b"Transfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n", "malformed"),
        (b"Transfer-Encoding: chunked\r\n\r\n\r\nab\r\n", "malformed"),
        (b"Transfer-Encoding: chunked\r\n\r\n2\r\nabXY", "no CRLF"),
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
