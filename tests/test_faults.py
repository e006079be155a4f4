"""Fault injection: upstreams that refuse, reset, cut, garble, hang, trickle, close idle
connections or restart, against both endpoints, streamed and not.

For every fault the client gets either a clear OpenAI-style error (502/504 naming the upstream
URL, or the upstream's own status and message) or a correct answer; a stream that has started
ends with its terminal event; nothing hangs; no generation is sent upstream twice; and the next
ordinary request succeeds. Faults the fake vLLM cannot produce come from `faults.RawUpstream`, a
bare asyncio HTTP/1.1 server that misbehaves at a chosen byte.
"""

from __future__ import annotations

import asyncio

import pytest

from gymproxy.testing.fake_vllm import FakeVLLM, Script

from .faults import (
    ANSWER,
    CHAT,
    PATHS,
    RESPONSES,
    RawUpstream,
    acquired,
    body_for,
    check_answer,
    check_error,
    check_error_or_failed_stream,
    check_failed_stream,
    close_if_idle,
    cut_short,
    eventually,
    fixed,
    free_port,
    hang,
    reset_before_status,
    reset_mid_body,
    send,
    start_proxy,
    stream_then,
    survived,
    trickle,
    xfail_losses_do_not_count,  # noqa: F401 - autouse
)

KINDS = [(path, stream) for path in PATHS for stream in (False, True)]
KIND_IDS = [f"{'responses' if p == RESPONSES else 'chat'}-{'stream' if s else 'plain'}" for p, s in KINDS]
kinds = pytest.mark.parametrize(("path", "stream"), KINDS, ids=KIND_IDS)


@pytest.fixture
async def raw():
    upstream = await RawUpstream().start()
    yield upstream
    await upstream.close()


async def still_serves(url: str, path: str, stream: bool, **kwargs) -> None:
    """The ordinary request after a fault: a correct answer from the same gymproxy."""
    reply = await send(url, path, body_for(path, stream=stream), **kwargs)
    check_answer(reply, path, stream=stream)


async def no_connection_held(proxy) -> None:
    assert await eventually(lambda: acquired(proxy) == 0), "an upstream connection is still held"
    assert all(u.inflight == 0 for u in proxy.fleet.upstreams)


# --- connection refused --------------------------------------------------------------------------


@kinds
async def test_connection_refused_is_502_naming_the_url(aiohttp_server, path, stream):
    port = free_port()  # nothing listens here
    base = f"http://127.0.0.1:{port}/v1"
    url, proxy = await start_proxy(aiohttp_server, base, health={"interval": 0.5})
    reply = await send(url, path, body_for(path, stream=stream))
    # 502 naming the chat URL; a 503 naming the base URL if a health check ran first.
    check_error(reply, (502, 503), url=base)
    if reply.status == 502:
        assert f"{base}/chat/completions" in reply.json()["error"]["message"]
    fake = FakeVLLM()
    await aiohttp_server(fake.app, port=port)
    assert await eventually(lambda: proxy.fleet.upstreams[0].healthy, 5.0), "the health check never saw it back"
    await still_serves(url, path, stream)
    assert [r.path for r in fake.requests if r.path != "/v1/models"] == [CHAT]
    await no_connection_held(proxy)
    survived()


async def test_refused_upstream_back_is_served_at_once(aiohttp_server):
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    url, _ = await start_proxy(aiohttp_server, base)
    check_error(await send(url, CHAT, body_for(CHAT)), (502,), url=base)
    await aiohttp_server(FakeVLLM().app, port=port)
    reply = await send(url, CHAT, body_for(CHAT))
    check_answer(reply, CHAT, stream=False)


async def test_slow_health_checks_do_not_take_the_fleet_down(aiohttp_server):
    upstreams = [await RawUpstream(health_delay=1.0).start() for _ in range(2)]
    try:
        url, _ = await start_proxy(aiohttp_server, [u.url for u in upstreams], health={"interval": 0.2, "timeout": 0.3})
        await asyncio.sleep(0.8)  # a few rounds of health checks, each timing out
        for path, stream in KINDS:
            check_answer(await send(url, path, body_for(path, stream=stream)), path, stream=stream)
    finally:
        for upstream in upstreams:
            await upstream.close()


# --- resets, cut bodies, garbage -----------------------------------------------------------------


@kinds
async def test_reset_before_the_status_line(aiohttp_server, raw, path, stream):
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    raw.push(reset_before_status)
    check_error(await send(url, path, body_for(path, stream=stream)), (502,), url=f"{raw.url}/chat/completions")
    assert raw.generations() == 1
    await still_serves(url, path, stream)
    assert raw.generations() == 2
    await no_connection_held(proxy)
    survived()


@kinds
async def test_reset_mid_body(aiohttp_server, raw, path, stream):
    """Non-streamed: Content-Length promises more, then RST. Streamed: half the events, then RST."""
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    raw.push(stream_then("reset") if stream else reset_mid_body)
    reply = await send(url, path, body_for(path, stream=stream))
    if stream:
        message = check_failed_stream(reply, path, url=raw.url)
        assert "mid-stream" in message
    else:
        check_error(reply, (502,), url=f"{raw.url}/chat/completions")
    assert raw.generations() == 1
    await still_serves(url, path, stream)
    assert raw.generations() == 2
    await no_connection_held(proxy)
    survived()


@kinds
async def test_body_cut_short(aiohttp_server, raw, path, stream):
    """A clean close (FIN) before the body is complete: short of Content-Length, or inside the
    chunked encoding of a stream."""
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    raw.push(stream_then("cut") if stream else cut_short)
    reply = await send(url, path, body_for(path, stream=stream))
    if stream:
        check_failed_stream(reply, path, url=raw.url)
    else:
        check_error(reply, (502,), url=f"{raw.url}/chat/completions")
    assert raw.generations() == 1
    await still_serves(url, path, stream)
    await no_connection_held(proxy)
    survived()


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
async def test_stream_ends_cleanly_without_done(aiohttp_server, raw, path):
    """A close-delimited event stream that simply stops (a valid HTTP end, no `[DONE]`)."""
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    raw.push(stream_then("eof"))
    reply = await send(url, path, body_for(path, stream=True))
    assert "[DONE]" in check_failed_stream(reply, path, url=raw.url)
    assert raw.generations() == 1
    await still_serves(url, path, True)
    await no_connection_held(proxy)
    survived()


GARBAGE = {
    "invalid-json": (b'{"id": "chatcmpl-1", "choices": [{"message": {"content": tru', "application/json"),
    "html": (b"<html><body><h1>502 Bad Gateway</h1>nginx</body></html>", "text/html"),
    "json-not-a-completion": (b'["not", "a", "completion"]', "application/json"),
}


@pytest.mark.parametrize(
    ("path", "garbage"),
    [(path, name) for path in PATHS for name in GARBAGE],
    ids=[f"{'responses' if p == RESPONSES else 'chat'}-{n}" for p in PATHS for n in GARBAGE],
)
async def test_garbage_200_is_a_502(aiohttp_server, raw, path, garbage):
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    raw.push(fixed(200, *GARBAGE[garbage]))
    check_error(await send(url, path, body_for(path)), (502,))
    assert raw.generations() == 1
    await still_serves(url, path, False)
    await no_connection_held(proxy)
    survived()


async def test_garbage_200_502_names_the_upstream(aiohttp_server, raw):
    url, _ = await start_proxy(aiohttp_server, raw.url)
    raw.push(fixed(200, *GARBAGE["html"]))
    check_error(await send(url, RESPONSES, body_for(RESPONSES)), (502,), url=raw.url)


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
@pytest.mark.parametrize("garbage", ["not-sse", "html", "json"])
async def test_garbage_stream(aiohttp_server, raw, path, garbage):
    """A streaming request answered 200 with a body that is no event stream, or a bad event."""
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    behaviour = {
        "not-sse": fixed(200, b"data: {not json\n\n", "text/event-stream"),
        "html": fixed(200, *GARBAGE["html"]),
        "json": fixed(200, b'{"id": "chatcmpl-1", "choices": []}'),
    }[garbage]
    raw.push(behaviour)
    reply = await send(url, path, body_for(path, stream=True))
    check_error_or_failed_stream(reply, path, stream=True, url=raw.url, statuses=(502,))
    assert raw.generations() == 1
    await still_serves(url, path, True)
    await no_connection_held(proxy)
    survived()


# --- silence and slowness ------------------------------------------------------------------------


@kinds
async def test_hanging_upstream_is_504_naming_the_url(aiohttp_server, raw, path, stream):
    url, proxy = await start_proxy(aiohttp_server, raw.url, timeouts={"read": 0.3})
    raw.push(hang)
    reply = await send(url, path, body_for(path, stream=stream), bound=5)
    check_error(reply, (504,), url=f"{raw.url}/chat/completions")
    assert reply.seconds < 3
    assert await eventually(lambda: raw.peer_closes == 1), "the hung upstream connection was never closed"
    assert raw.generations() == 1
    await still_serves(url, path, stream)
    await no_connection_held(proxy)
    survived()


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
async def test_stream_stalls_midway(aiohttp_server, raw, path):
    url, proxy = await start_proxy(aiohttp_server, raw.url, timeouts={"read": 0.3})
    raw.push(stream_then("stall"))
    reply = await send(url, path, body_for(path, stream=True), bound=5)
    assert "Timeout" in check_failed_stream(reply, path, url=raw.url)
    assert await eventually(lambda: raw.peer_closes == 1), "the stalled upstream connection was never closed"
    await still_serves(url, path, True)
    await no_connection_held(proxy)
    survived()


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
async def test_body_stalls_midway_is_504(aiohttp_server, raw, path):
    async def stall(conn, req):
        body = b'{"id": "chatcmpl-1", "object": "chat.completion", "choices": ['
        await conn.head(200, length=len(body) + 200)
        await conn.write(body)
        await conn.wait_closed_by_peer()
        return False

    url, proxy = await start_proxy(aiohttp_server, raw.url, timeouts={"read": 0.3})
    raw.push(stall)
    check_error(await send(url, path, body_for(path), bound=5), (504,), url=f"{raw.url}/chat/completions")
    assert await eventually(lambda: raw.peer_closes == 1)
    await still_serves(url, path, False)
    await no_connection_held(proxy)
    survived()


@kinds
async def test_slow_trickle_within_the_idle_timeout_succeeds(aiohttp_server, raw, path, stream):
    url, proxy = await start_proxy(aiohttp_server, raw.url, timeouts={"read": 0.3})
    raw.push(trickle(every=0.1, pieces=8))
    reply = await send(url, path, body_for(path, stream=stream))
    check_answer(reply, path, stream=stream, text=ANSWER)
    assert reply.seconds > 0.7  # longer than the read timeout: it is an idle timeout
    assert raw.generations() == 1
    await no_connection_held(proxy)
    survived()


# --- upstream error statuses ---------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503])
@pytest.mark.parametrize("body", ["json", "html", "empty"])
@kinds
async def test_upstream_error_status_kept_and_message_carried(aiohttp_server, raw, path, stream, status, body):
    payload, content_type = {
        "json": (
            b'{"error": {"message": "engine says %d", "type": "InternalServerError", "param": null, "code": %d}}'
            % (status, status),
            "application/json",
        ),
        "html": (b"<html><body>engine says %d</body></html>" % status, "text/html"),
        "empty": (b"", "text/plain"),
    }[body]
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    raw.push(fixed(status, payload, content_type))
    reply = await send(url, path, body_for(path, stream=stream))
    error = check_error(reply, (status,))
    if body != "empty":
        assert f"engine says {status}" in error["message"]
    assert raw.generations() == 1  # an upstream error is never retried
    await still_serves(url, path, stream)
    await no_connection_held(proxy)
    survived()


@pytest.mark.parametrize("status", [500, 502, 503])
@kinds
async def test_fake_vllm_error_envelopes(start_proxy, fake_vllm, path, stream, status):
    """The same through the fake vLLM's own envelopes, nested JSON and an HTML body."""
    url = await start_proxy()
    fake_vllm.push(
        Script(status=status, error_message=f"vLLM says {status}"),
        Script(status=status, error_body=b"<html>proxy in front of vLLM says %d</html>" % status),
    )
    first = check_error(await send(url, path, body_for(path, stream=stream)), (status,))
    second = check_error(await send(url, path, body_for(path, stream=stream)), (status,))
    assert first["message"] == f"vLLM says {status}"
    assert f"proxy in front of vLLM says {status}" in second["message"]
    await still_serves(url, path, stream)
    assert sum(1 for r in fake_vllm.requests if r.path == CHAT) == 3
    survived(2)


# --- keep-alive against an upstream that closes idle connections after 1 s -----------------------


async def _twice_with_a_pause(url: str) -> None:
    first = await asyncio.gather(*(send(url, p, body_for(p, stream=s)) for p, s in KINDS))
    for reply, (p, s) in zip(first, KINDS, strict=True):
        check_answer(reply, p, stream=s, text=ANSWER)
    await asyncio.sleep(1.5)
    second = await asyncio.gather(*(send(url, p, body_for(p, stream=s)) for p, s in KINDS))
    for reply, (p, s) in zip(second, KINDS, strict=True):
        check_answer(reply, p, stream=s, text=ANSWER)


@pytest.mark.parametrize("keepalive", [0.5, None], ids=["keepalive-0.5", "keepalive-default"])
async def test_upstream_closing_idle_connections(aiohttp_server, keepalive):
    """The upstream closes connections idle for 1 s (a FIN, as uvicorn does). gymproxy must not
    send the next request down a closed connection, whether its own keep-alive is shorter (0.5 s)
    or longer (the 4 s default: aiohttp sees the FIN and drops the connection from its pool)."""
    upstream = await RawUpstream(idle_close=1.0).start()
    try:
        timeouts = {"keepalive": keepalive} if keepalive else {}
        url, proxy = await start_proxy(aiohttp_server, upstream.url, timeouts=timeouts)
        await _twice_with_a_pause(url)
        assert upstream.generations() == 8
        if keepalive is None:
            assert upstream.idle_closes >= 1  # the upstream, not gymproxy, closed them
        await no_connection_held(proxy)
        survived()
    finally:
        await upstream.close()


@pytest.mark.parametrize("keepalive", [0.5, None], ids=["keepalive-0.5", "keepalive-default"])
async def test_keepalive_race_on_a_reused_connection(aiohttp_server, keepalive):
    """The racy form: the upstream's idle close crosses the next request on the wire, so the
    request arrives and the connection closes with no reply. With the default keep-alive (above
    the upstream's idle limit) that happens, and gymproxy re-sends it once on a fresh connection."""
    upstream = await RawUpstream(default=close_if_idle(1.0)).start()
    try:
        timeouts = {"keepalive": keepalive} if keepalive else {}
        url, proxy = await start_proxy(aiohttp_server, upstream.url, timeouts=timeouts)
        await _twice_with_a_pause(url)
        await no_connection_held(proxy)
        survived()
    finally:
        await upstream.close()


# --- the upstream restarts with requests in flight -----------------------------------------------


async def test_upstream_restart_with_requests_in_flight(aiohttp_server):
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    before = FakeVLLM()
    server = await aiohttp_server(before.app, port=port, shutdown_timeout=0.2)
    url, proxy = await start_proxy(aiohttp_server, base, health={"interval": 0.3})
    slow = Script(content=" ".join(["token"] * 100), chunk_delay=0.05)
    before.push(*[slow] * len(KINDS))
    inflight = [asyncio.ensure_future(send(url, p, body_for(p, stream=s))) for p, s in KINDS]
    assert await eventually(lambda: sum(r.path == CHAT for r in before.requests) == len(KINDS))
    await asyncio.sleep(0.3)  # the streams are under way
    await server.close()  # the upstream goes away with four generations in flight

    for reply, (p, s) in zip(await asyncio.gather(*inflight), KINDS, strict=True):
        check_error_or_failed_stream(reply, p, stream=s, url=base)

    # While it is down: refused, or already marked down.
    down = await send(url, CHAT, body_for(CHAT))
    check_error(down, (502, 503), url=base)

    after = FakeVLLM()
    await aiohttp_server(after.app, port=port)
    assert await eventually(lambda: proxy.fleet.upstreams[0].healthy, 5.0)
    for p, s in KINDS:
        await still_serves(url, p, s)
    assert sum(r.path == CHAT for r in before.requests) == len(KINDS)  # nothing was replayed
    assert sum(r.path == CHAT for r in after.requests) == len(KINDS)
    await no_connection_held(proxy)
    survived(len(KINDS) + 1)
