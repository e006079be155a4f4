"""gymproxy in front of an upstream that breaks HTTP/1.1 on purpose (a raw-socket server).

Every broken reply ends in a 502 naming the upstream, promptly (gymproxy's default read timeout is
none, so a parser that waits for more is a hang); no client ever gets another request's answer,
whatever the upstream sends after a reply; and the health loop survives any reply to a check.
"""

from __future__ import annotations

import asyncio

import pytest

from .faults import (
    CHAT,
    PATHS,
    RESPONSES,
    Conn,
    RawRequest,
    RawUpstream,
    body_for,
    check_answer,
    check_error,
    chunk_frames,
    completion,
    eventually,
    free_port,
    meta,
    send,
    start_proxy,
    survived,
    xfail_losses_do_not_count,  # noqa: F401  (autouse)
)

BOUND = 10.0  # seconds: a broken reply must be refused well within this


def answer_for(req: RawRequest) -> str:
    """Each request's own answer names the request id gymproxy forwarded."""
    return f"the answer to {req.headers.get('X-Request-Id', '?')}"


async def own_answer(conn: Conn, req: RawRequest) -> bool:
    if req.stream:
        await conn.head(200, "text/event-stream")
        for frame in chunk_frames(answer_for(req)):
            await conn.chunk(frame)
        await conn.end_chunks()
    else:
        body = completion(answer_for(req))
        await conn.head(200, length=len(body))
        await conn.write(body)
    return True


def head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")  # as a raw byte reaches the parser


JSON_200 = ("HTTP/1.1 200 OK", "Content-Type: application/json")
# A valid answer in every broken reply: a parser lenient about the framing would pass it on as a 200.
BODY = completion("an answer from a reply that breaks HTTP")
LENGTH = f"Content-Length: {len(BODY)}"
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)

# Replies that break HTTP/1.1 framing, each written whole; the upstream then keeps the connection open.
BROKEN = {
    "content-length and chunked": head(*JSON_200, LENGTH, "Transfer-Encoding: chunked") + CHUNKED,
    "content-length superscript two": head(*JSON_200, "Content-Length: \u00b2") + BODY,
    "negative content-length": head(*JSON_200, "Content-Length: -1") + BODY,
    "two content-lengths": head(*JSON_200, LENGTH, f"Content-Length: {len(BODY) + 1}") + BODY,
    "status 2000": head("HTTP/1.1 2000 OK", "Content-Type: application/json", LENGTH) + BODY,
    "status 2999999": head("HTTP/1.1 2999999 OK", "Content-Type: application/json", LENGTH) + BODY,
    "status 999": head("HTTP/1.1 999 OK", "Content-Type: application/json", LENGTH) + BODY,
    "bare LF": b"HTTP/1.1 200 OK\nContent-Type: application/json\n%s\n\n" % LENGTH.encode() + BODY,
    "header name not a token": head(*JSON_200, "Bad Name: x", LENGTH) + BODY,
    "huge head": head(*JSON_200, "X-Huge: " + "y" * 70_000, LENGTH) + BODY,
    "chunk size overflow": head(*JSON_200, "Transfer-Encoding: chunked") + b"f" * 40 + b"\r\n" + BODY,
    "surplus in the same read": head(*JSON_200, LENGTH) + BODY + head(*JSON_200, LENGTH) + BODY,
}


def broken(reply: bytes):
    async def behave(conn: Conn, req: RawRequest) -> bool:
        await conn.write(reply)
        await conn.wait_closed_by_peer()  # the upstream never closes: gymproxy must
        return False

    return behave


@pytest.fixture
async def raw():
    upstream = await RawUpstream(default=own_answer).start()
    yield upstream
    await upstream.close()


async def _own_answers(url: str, path: str, stream: bool, count: int) -> None:
    for i in range(count):
        rid = f"req-{path[4:8]}-{int(stream)}-{i}"
        reply = await send(url, path, body_for(path, stream=stream), headers={"X-Request-Id": rid}, bound=BOUND)
        check_answer(reply, path, stream=stream, text=f"the answer to {rid}")


@pytest.mark.parametrize("case", list(BROKEN))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
async def test_broken_framing_is_a_502_naming_the_upstream(aiohttp_server, raw, path, stream, case):
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    raw.push(broken(BROKEN[case]))
    reply = await send(url, path, body_for(path, stream=stream), bound=BOUND)
    check_error(reply, (502,), url=raw.url)
    await _own_answers(url, path, stream, 3)  # and the next requests get their own answers
    assert proxy.fleet.client.in_use == 0
    survived()


@pytest.mark.parametrize("first", ["clean reply", "content-length and chunked"])
async def test_bytes_after_a_reply_never_answer_another_request(aiohttp_server, raw, first):
    """The upstream sends a stale reply 50 ms after each reply, on the same connection (once, every
    following client on that connection got the previous client's answer)."""

    def then_stale(reply_of):
        async def behave(conn: Conn, req: RawRequest) -> bool:
            await reply_of(conn, req)
            await asyncio.sleep(0.05)
            stale = completion("a stale answer for nobody")
            await conn.write(head(*JSON_200, f"Content-Length: {len(stale)}") + stale)
            return True

        return behave

    async def both_framings(conn: Conn, req: RawRequest) -> bool:
        await conn.write(BROKEN["content-length and chunked"])
        return True

    # No health checks: each request meets the pooled connection the stale reply arrived on.
    url, proxy = await start_proxy(aiohttp_server, raw.url, health={"interval": 3600})
    raw.default = then_stale(own_answer if first == "clean reply" else both_framings)
    for i in range(8):
        rid = f"seq-{i}"
        reply = await send(url, CHAT, body_for(CHAT), headers={"X-Request-Id": rid}, bound=BOUND)
        if first == "clean reply":
            check_answer(reply, CHAT, stream=False, text=f"the answer to {rid}")
        else:
            check_error(reply, (502,), url=raw.url)
        await asyncio.sleep(0.1)  # the stale reply arrives while the connection sits in the pool
    survived(8)


@pytest.mark.parametrize("case", list(BROKEN))
async def test_the_health_loop_survives_any_reply_and_brings_an_upstream_back(aiohttp_server, fake_vllm, case):
    """An upstream that was down comes back, first with /health replies that break HTTP, then good
    ones: it must be marked healthy and get requests again (once, a `Content-Length: ²` reply ended
    the health loop for good, and the upstream stayed down)."""
    port = free_port()
    back = RawUpstream(default=own_answer, health=broken(BROKEN[case]))
    url, proxy = await start_proxy(
        aiohttp_server,
        [f"http://127.0.0.1:{port}/v1", fake_vllm.url],
        health={"interval": 0.05, "timeout": 1.0},
        pinning={"secret": "s"},
    )
    ours = proxy.fleet.upstreams[0]
    try:
        assert await eventually(lambda: not ours.healthy, 5), "the refused upstream was never marked down"
        await back.start(port)
        name = ours.name
        assert await eventually(lambda: proxy.fleet.health_checks[(name, "failed")] >= 3, 5)
        assert not ours.healthy
        back.health = meta
        assert await eventually(lambda: ours.healthy, 5), "the health loop stopped: the upstream stayed down"
        before = back.generations()
        for i in range(20):  # new sessions are spread over both upstreams again
            reply = await send(url, RESPONSES, body_for(RESPONSES), headers={"X-Session-ID": f"s{i}"}, bound=BOUND)
            assert reply.status == 200, reply.raw[:300]
        assert back.generations() > before
    finally:
        await back.close()
