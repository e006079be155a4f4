"""What any client can send, answered without harm, on `gymproxy serve` as installed: malformed
requests cost one log line, never a traceback each; `anthropic-*` headers that are not printable
ASCII, or too many of them, are a 400 naming the header; and a client's session key can never take
the id gymproxy minted for another (cookie) session, which vLLM would attribute its work to."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from gymproxy.testing.fake_vllm import FakeVLLM

from .served import Served

MALFORMED = [
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(200)) + b"\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 10\r\n"
    b"Content-Type: application/json\r\n\r\n0123456789",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
]


async def _raw(port: int, data: bytes) -> bytes:
    """Send `data` on a new connection and read what comes back until it closes (within 5 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_malformed_requests_cost_one_short_log_line(fake_vllm, tmp_path) -> None:
    async with Served(tmp_path, {"base_url": fake_vllm.url}) as served:
        for _ in range(5):
            for data in MALFORMED:
                reply = await _raw(served.port, data)
                assert reply.startswith((b"HTTP/1.0 4", b"HTTP/1.1 4")), (data[:60], reply[:200])
        async with aiohttp.ClientSession() as session, session.get(served.url + "/v1/models") as r:
            assert r.status == 200  # and it still serves
        log = served.log
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    lines = [line for line in log.splitlines() if "malformed request" in line]
    assert len(lines) == 1 and " INFO " in lines[0] and len(lines[0]) < 300, lines


async def _messages(url: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[str, object]]:
    """POST /v1/messages with raw header bytes (what a client's library may never send)."""
    body = orjson.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    head = b"".join(b"%s: %s\r\n" % pair for pair in headers)
    port = int(url.rsplit(":", 1)[1])
    request = (
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)
    )
    reply = await _raw(port, request)
    status = int(reply.split(b" ", 2)[1])
    return status, orjson.loads(reply.partition(b"\r\n\r\n")[2]) if status != 200 else {}


OK = [(b"anthropic-version", b"2023-06-01"), (b"anthropic-beta", b"a-1,b-2")]


async def test_a_non_ascii_anthropic_header_is_a_400_naming_it(fake_vllm, tmp_path) -> None:
    async with Served(tmp_path, {"base_url": fake_vllm.url}) as served:
        for value in ("\u20ac".encode(), "\u00e9".encode(), b"\xff\xfe"):
            status, body = await _messages(served.url, [(b"anthropic-beta", value)])
            assert status == 400 and body["type"] == "error", (value, status, body)
            assert "anthropic-beta" in body["error"]["message"], body  # type: ignore[index]
        status, _ = await _messages(served.url, OK)
        assert status == 200
        log = served.log
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    forwarded = [r.headers for r in fake_vllm.requests if r.path == "/v1/messages"]
    assert len(forwarded) == 1 and forwarded[0]["anthropic-beta"] == "a-1,b-2"


async def test_forwarded_anthropic_headers_are_bounded(fake_vllm, tmp_path) -> None:
    async with Served(tmp_path, {"base_url": fake_vllm.url}) as served:
        many = [(b"anthropic-x%d" % i, b"1") for i in range(40)]
        big = [(b"anthropic-beta", b"b" * 3000) for _ in range(3)]
        for headers in (many, big):
            status, body = await _messages(served.url, headers)
            assert status == 400 and body["type"] == "error", (status, body)
            assert "anthropic-* headers" in body["error"]["message"], body  # type: ignore[index]
        status, _ = await _messages(served.url, OK)
        assert status == 200
    assert len([r for r in fake_vllm.requests if r.path == "/v1/messages"]) == 1


async def test_a_client_key_cannot_take_a_cookie_sessions_id(aiohttp_server, tmp_path) -> None:
    fakes = [FakeVLLM(model="m"), FakeVLLM(model="m")]
    urls = [str((await aiohttp_server(fake.app)).make_url("/v1")) for fake in fakes]
    config = {"base_url": urls, "pinning": {"secret": "s"}, "forward_session_id_as_conversation_id": True}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    honest = "3f2c9a4e-1b7d-4c6e-9f0a-2d5b8e7c1a90"  # a harness's uuid goes on as it came
    async with Served(tmp_path, config) as served:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            async with session.post(served.url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200
                minted = r.cookies["gymproxy_pin"].value.split(".")[1]  # <name>.<session id>.<issued>.<mac>
            for key in (minted, honest):
                async with session.post(served.url + "/v1/chat/completions", json=chat, headers={"X-Session-ID": key}):
                    pass
    seen = [r for fake in fakes for r in fake.requests if r.path == "/v1/chat/completions"]
    ids = [(r.headers["X-Session-ID"], r.json["conversation_params"]["conversation_id"]) for r in seen]
    assert (minted, minted) in ids and (honest, honest) in ids, ids
    assert len(ids) == 3 and len({i for i, _ in ids}) == 3, ids  # the forged one got an id of its own
    forged = next(pair for pair in ids if pair[0] not in (minted, honest))
    assert forged[0].startswith("sha256-") and forged[0] == forged[1], forged
