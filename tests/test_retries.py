"""Retries over real sockets: what is re-sent to the next upstream, what never is, the budget, the breaker.

Two or three raw upstreams (tests/faults.py) behind one gymproxy. Each test pins the session to the
first with a cookie, makes that one misbehave, and checks who saw what, and when.
"""

from __future__ import annotations

import asyncio
import email.utils
import time

import aiohttp
import orjson
import pytest
from yarl import URL

from gymproxy.pinning import Signer
from gymproxy.retry import retry_after
from gymproxy.upstream import CLOSED

from .faults import (
    CHAT,
    Conn,
    RawRequest,
    RawUpstream,
    body_for,
    close_before_status,
    dies,
    eventually,
    fixed,
    good,
    only_if,
    reset_before_status,
    reset_mid_body,
    start_proxy,
    stream_then,
    trickle,
)
from .served import Served

SECRET = "test-secret"
SIGNER = Signer(SECRET.encode(), 3600)
BUSY = "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
PAUSED = "Generation is paused for a weight update; retry shortly"


def vllm_error(status: int, message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "Service Unavailable", "param": None, "code": status}})


@pytest.fixture
async def ups():
    upstreams = [await RawUpstream().start() for _ in range(3)]
    yield upstreams
    for upstream in upstreams:
        await upstream.close()


async def proxy(aiohttp_server, ups, **config):
    config.setdefault("pinning", {"secret": SECRET})
    config.setdefault("health", {"interval": 60})
    config.setdefault("retries", {"backoff_s": 0.01, "backoff_max_s": 0.02})
    return await start_proxy(aiohttp_server, [u.url for u in ups], **config)


async def ask(
    url: str, pin_on: RawUpstream, *, stream: bool = False, text: str = "hello"
) -> tuple[int, bytes, str | None]:
    """One chat request pinned (by cookie) to `pin_on`: status, body, and the new pin if one was set."""
    headers = {"Cookie": f"gymproxy_pin={SIGNER.sign(pin_on.url)}"}
    body = body_for(CHAT, stream=stream, text=text)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        async with session.post(url + CHAT, json=body, headers=headers) as r:
            morsel = r.cookies.get("gymproxy_pin")
            try:
                body = await r.read()
            except aiohttp.ClientError:
                body = b""
            return r.status, body, morsel.value if morsel is not None else None


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        return await r.text()


def poisoned(upstream: RawUpstream) -> list[bool]:
    """Whether each chat request `upstream` saw carrying the word "poison" came on a pooled connection."""
    return [r.reused for r in upstream.requests if r.path.endswith("/completions") and b"poison" in r.body]


# --- re-sent -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (dies("reset"), "reset"),
        (fixed(503, vllm_error(503, BUSY)), "busy"),
    ],
    ids=["died-reset", "busy-503"],
)
async def test_what_no_upstream_began_goes_to_the_next_and_the_pin_moves(aiohttp_server, ups, fault, reason):
    url, _ = await proxy(aiohttp_server, ups)
    a = ups[0]
    a.push(fault)
    status, body, pin = await ask(url, a)
    assert status == 200, body
    assert a.generations() == 1 and sum(u.generations() for u in ups[1:]) == 1
    assert pin is not None and (SIGNER.unsign(pin) or ("",))[0] not in (
        "",
        a.url,
    )  # the session moved; its cookie says where
    text = await metrics(url)
    assert f'gymproxy_retries_total{{reason="{reason}"}} 1' in text
    moved = "busy" if reason == "busy" else "down"
    assert f'gymproxy_pin_moves_total{{reason="{moved}"}} 1' in text


async def test_a_paused_engines_503_waits_for_that_engine_and_goes_there_again(aiohttp_server, ups):
    """vLLM's paused 503 (a trainer paused the engine for a weight update): the request is held and
    sent to the same engine again once it resumes (it has no /is_paused here: after `hold.poll_s`).
    The pin stays, and the breaker is not fed, even with `breaker.failures: 1`."""
    url, proxy_ = await proxy(aiohttp_server, ups, hold={"poll_s": 0.05}, breaker={"failures": 1})
    a = ups[0]
    a.push(fixed(503, vllm_error(503, PAUSED)), fixed(503, vllm_error(503, PAUSED)))
    status, body, pin = await ask(url, a)
    assert status == 200, body
    assert a.generations() == 3 and sum(u.generations() for u in ups[1:]) == 0
    assert pin is None  # the session stays where its prefix cache is
    text = await metrics(url)
    assert 'gymproxy_retries_total{reason="paused"} 2' in text
    assert sum(proxy_.fleet.pinner.moves.values()) == 0  # no session moved
    assert [u.breaker.opened for u in proxy_.fleet.upstreams] == [0, 0, 0]


async def test_an_upstream_at_its_cap_sends_the_session_to_the_next_at_once(aiohttp_server, ups):
    """`limits.when_full: reject`: an upstream at `max_inflight_per_upstream` saw nothing, so the
    request goes on to the next one (no backoff, no breaker failure); only when all are full is it 503."""
    url, proxy_ = await proxy(
        aiohttp_server, ups[:2], limits={"max_inflight_per_upstream": 1, "when_full": "reject"}, breaker={"failures": 1}
    )
    a, b = ups[0], ups[1]
    a.push(trickle(every=0.1, pieces=20))
    held = asyncio.ensure_future(ask(url, a))  # holds a's only slot for ~2 s
    await eventually(lambda: a.generations() == 1)
    status, body, pin = await ask(url, a)  # pinned to a, which is full
    assert status == 200, body
    assert (SIGNER.unsign(pin or "") or ("",))[0] == b.url and b.generations() == 1
    b.push(trickle(every=0.1, pieces=10))
    also = asyncio.ensure_future(ask(url, b))  # b's only slot too
    await eventually(lambda: b.generations() == 2)
    status, body, _ = await ask(url, a)
    assert status == 503 and b"cap" in body  # both full: the client hears it
    assert [r[0] for r in await asyncio.gather(held, also)] == [200, 200]
    text = await metrics(url)
    assert 'gymproxy_retries_total{reason="full"} 2' in text  # a to b, twice
    assert all(u.breaker.state == CLOSED for u in proxy_.fleet.upstreams)


async def test_a_pooled_connection_closed_with_no_reply_goes_once_more_to_the_same_upstream(aiohttp_server, ups):
    """A pooled connection closed with no reply is re-sent once to the same upstream on a new
    connection (its idle close may have crossed our request); a second drop, by an upstream still
    up, is the client's 502."""
    url, _ = await proxy(aiohttp_server, ups)
    a = ups[0]
    await ask(url, a)  # leaves a connection to `a` in the pool
    a.push(close_before_status)
    status, body, pin = await ask(url, a)
    assert status == 200 and pin is None, body
    assert a.generations() == 3 and sum(u.generations() for u in ups[1:]) == 0
    assert [r.reused for r in a.requests if r.path.endswith("/completions")][1:] == [True, False]
    a.push(close_before_status, close_before_status)  # the pool holds the connection that answered
    status, body, _ = await ask(url, a)
    assert status == 502 and f"{a.url}/chat/completions" in body.decode(), body
    assert a.generations() == 5 and sum(u.generations() for u in ups[1:]) == 0
    text = await metrics(url)
    assert 'gymproxy_retries_total{reason="stale"} 2' in text
    assert 'reason="closed"' not in text


async def test_an_upstream_killed_with_a_pooled_connection_has_the_request_sent_to_the_next(aiohttp_server, ups):
    """vLLM SIGKILLed mid-turn, as the real-vLLM suite does it: the pooled connection ends with a FIN
    (the same upstream is tried again on a new connection, which its dying process resets), and then
    the request goes to the next upstream: the re-send to the same upstream does not use up the
    one to another."""
    url, proxy_ = await proxy(aiohttp_server, ups)
    a = ups[0]
    await ask(url, a)  # leaves a connection to `a` in the pool
    a.push(close_before_status, dies("reset"))
    status, body, pin = await ask(url, a)
    assert status == 200, body
    assert a.generations() == 3 and sum(u.generations() for u in ups[1:]) == 1
    assert (SIGNER.unsign(pin or "") or ("",))[0] in (ups[1].url, ups[2].url)
    assert not proxy_.fleet.upstreams[0].healthy


async def test_a_refused_connection_goes_to_the_next(aiohttp_server, ups):
    url, proxy_ = await proxy(aiohttp_server, ups)
    # After the health checker's first round: one that found it closed first would keep the request
    # from trying it at all.
    assert await eventually(lambda: sum(proxy_.fleet.health_checks.values()) >= len(ups))
    await ups[0].close()
    status, body, pin = await ask(url, ups[0])
    assert status == 200, body
    assert 'gymproxy_retries_total{reason="refused"} 1' in await metrics(url)


async def test_a_retry_starts_only_after_the_first_connection_closed(aiohttp_server, ups):
    """No generation twice in parallel: the second upstream hears of the request only once the
    first one's connection is gone (vLLM aborts a request whose connection closes)."""
    closed_at: list[float] = []
    arrived_at: list[float] = []

    async def reset_and_note(conn: Conn, req: RawRequest) -> bool:
        await dies("reset")(conn, req)
        closed_at.append(time.monotonic())
        return False

    async def note_and_answer(conn: Conn, req: RawRequest) -> bool:
        arrived_at.append(time.monotonic())
        return await good(conn, req)

    url, _ = await proxy(aiohttp_server, ups[:2])
    ups[0].push(reset_and_note)
    ups[1].push(note_and_answer)
    status, body, _ = await ask(url, ups[0])
    assert status == 200, body
    assert len(closed_at) == 1 and len(arrived_at) == 1 and arrived_at[0] > closed_at[0]


async def test_retry_after_is_honoured(aiohttp_server, ups):
    async def busy_for_a_while(conn: Conn, req: RawRequest) -> bool:
        body = vllm_error(503, BUSY)
        await conn.head(503, length=len(body), Retry_After="0.4")
        await conn.write(body)
        return True

    url, _ = await proxy(aiohttp_server, ups[:2])
    ups[0].push(busy_for_a_while)
    started = time.monotonic()
    status, _, _ = await ask(url, ups[0])
    assert status == 200 and time.monotonic() - started >= 0.4


def test_retry_after_reads_seconds_and_http_dates_and_ignores_the_rest():
    soon = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert retry_after({"retry-after": "2.5"}) == 2.5
    assert 28 <= retry_after({"retry-after": soon}) <= 30
    assert retry_after({"retry-after": email.utils.formatdate(time.time() - 60, usegmt=True)}) == 0.0  # past
    for junk in ("-3", "soon", "", "nan", "Mon, 99 Foo 2026 99:99:99 GMT"):
        assert retry_after({"retry-after": junk}) == 0.0, junk
    assert retry_after({}) == 0.0


async def test_a_retry_after_past_the_deadline_hands_on_vllms_503(aiohttp_server, ups):
    async def busy_for_long(conn: Conn, req: RawRequest) -> bool:
        body = vllm_error(503, BUSY)
        await conn.head(503, length=len(body), Retry_After="30")
        await conn.write(body)
        return True

    url, _ = await proxy(aiohttp_server, ups[:2], retries={"deadline_s": 1.0})
    ups[0].push(busy_for_long)
    started = time.monotonic()
    status, body, _ = await ask(url, ups[0])
    assert status == 503 and BUSY in body.decode() and time.monotonic() - started < 1.0
    assert ups[1].generations() == 0


# --- never re-sent -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "stream"),
    [
        (reset_mid_body, False),  # the status line came: vLLM may have generated it all
        (stream_then("reset"), True),  # mid-stream: bytes have gone to the client
        (fixed(400, vllm_error(400, "bad request")), False),
        (fixed(500, vllm_error(500, "Please try again later or on a different instance")), False),
        (fixed(503, vllm_error(503, "Service temporarily overloaded")), False),
    ],
    ids=["reset-after-status", "reset-mid-stream", "400", "500", "503-other-text"],
)
async def test_what_an_upstream_began_is_never_re_sent(aiohttp_server, ups, fault, stream):
    url, _ = await proxy(aiohttp_server, ups)
    ups[0].push(fault)
    status, body, _ = await ask(url, ups[0], stream=stream)
    assert ups[0].generations() == 1 and sum(u.generations() for u in ups[1:]) == 0
    if stream:
        assert status == 200 and b"fine" not in body.split(b"data: [DONE]")[-1]
    else:
        assert status != 200
    assert "gymproxy_retries_total{" not in await metrics(url)


# --- the budget ----------------------------------------------------------------------------------


async def test_attempts_bound_the_retries_and_vllms_503_is_handed_on(aiohttp_server, ups):
    url, _ = await proxy(aiohttp_server, ups, retries={"attempts": 2, "backoff_s": 0.01})
    for upstream in ups:
        upstream.default = fixed(503, vllm_error(503, BUSY))
    status, body, _ = await ask(url, ups[0])
    assert status == 503 and BUSY in body.decode()
    assert sum(u.generations() for u in ups) == 2


async def test_backoff_between_failures_of_one_kind_is_bounded(aiohttp_server, ups, monkeypatch):
    import gymproxy.retry

    waits: list[float] = []

    def longest(low: float, high: float) -> float:
        waits.append(high)
        return high

    monkeypatch.setattr(gymproxy.retry.random, "uniform", longest)
    url, _ = await proxy(aiohttp_server, ups[:2], retries={"attempts": 5, "backoff_s": 0.05, "backoff_max_s": 0.15})
    for upstream in ups[:2]:
        upstream.default = fixed(503, vllm_error(503, BUSY))
    started = time.monotonic()
    status, _, _ = await ask(url, ups[0])
    assert status == 503
    # The first failure over to the next upstream is at once; then 0.05, 0.1, capped at 0.15.
    assert waits == [0.05, 0.1, 0.15]
    assert time.monotonic() - started >= 0.3
    assert sum(u.generations() for u in ups[:2]) == 5  # round again: every upstream was busy


async def test_the_deadline_bounds_the_retries(aiohttp_server, ups, monkeypatch):
    import gymproxy.retry

    # Jitter pinned to its maximum: with full jitter, 8 draws under 0.5 s in all happen 3% of the time.
    monkeypatch.setattr(gymproxy.retry.random, "uniform", lambda low, high: high)
    url, _ = await proxy(
        aiohttp_server, ups[:2], retries={"attempts": 50, "deadline_s": 0.5, "backoff_s": 0.2, "backoff_max_s": 0.2}
    )
    for upstream in ups[:2]:
        upstream.default = fixed(503, vllm_error(503, BUSY))
    started = time.monotonic()
    status, _, _ = await ask(url, ups[0])
    assert status == 503 and time.monotonic() - started < 1.5
    assert 2 <= sum(u.generations() for u in ups[:2]) <= 5  # 0.2 s apart after the first failover


# --- the breaker ---------------------------------------------------------------------------------


async def test_the_breaker_opens_probes_once_and_closes_or_reopens(aiohttp_server, ups):
    url, proxy_obj = await proxy(aiohttp_server, ups[:2], breaker={"failures": 2, "cooldown_s": 0.5})
    a, b = ups[:2]
    a.push(fixed(503, vllm_error(503, BUSY)), fixed(503, vllm_error(503, BUSY)))
    for _ in range(2):
        assert (await ask(url, a))[0] == 200
    assert a.generations() == 2
    assert 'gymproxy_upstream_breaker{upstream="' + a.url + '"} 1' in await metrics(url)
    # Open: a session pinned to `a` goes straight to `b`, and `a` hears nothing.
    status, _, pin = await ask(url, a)
    assert status == 200 and a.generations() == 2 and (SIGNER.unsign(pin or "") or ("",))[0] == b.url
    assert 'gymproxy_pin_moves_total{reason="breaker"} 1' in await metrics(url)
    # Cooldown over: one probe goes to `a`; it fails, so the breaker re-opens.
    await asyncio.sleep(0.6)
    a.push(fixed(503, vllm_error(503, BUSY)))
    assert (await ask(url, a))[0] == 200
    assert a.generations() == 3
    assert (await ask(url, a))[0] == 200 and a.generations() == 3  # open again
    # Next cooldown: the probe succeeds and the breaker closes.
    await asyncio.sleep(0.6)
    status, _, pin = await ask(url, a)
    assert status == 200 and a.generations() == 4 and pin is None
    assert 'gymproxy_upstream_breaker{upstream="' + a.url + '"} 0' in await metrics(url)
    assert 'gymproxy_upstream_breaker_opened_total{upstream="' + a.url + '"} 2' in await metrics(url)


# --- drops: a query of death kills one engine, not the fleet -----------------------------------------


@pytest.mark.parametrize("pooled", [False, True], ids=["fresh", "pooled"])
@pytest.mark.parametrize("fault", [close_before_status, reset_before_status], ids=["closed", "reset"])
async def test_an_upstream_still_up_that_drops_a_request_is_not_sent_it_again(aiohttp_server, ups, fault, pooled):
    """It read the request and dropped it, and it still takes connections: it chose to (an input it
    cannot take). The client gets a 502 naming it; no other upstream sees the request. A pooled
    connection closed may have been the keep-alive race: that one goes once more to the same upstream."""
    url, proxy_ = await proxy(aiohttp_server, ups)
    for upstream in ups:
        upstream.default = only_if(b"poison", fault)
    assert (await ask(url, ups[0]))[0] == 200  # leaves its connection in the pool
    if not pooled:
        proxy_.fleet.client.close_idle(URL(ups[0].url))
    status, body, pin = await ask(url, ups[0], text="poison")
    assert status == 502, body
    message = orjson.loads(body)["error"]["message"]
    assert f"{ups[0].url}/chat/completions" in message and "not re-sent" in message, message
    expected = [True, False] if pooled and fault is close_before_status else [pooled]
    assert poisoned(ups[0]) == expected
    assert poisoned(ups[1]) == poisoned(ups[2]) == []
    assert pin is None and all(u.healthy for u in proxy_.fleet.upstreams)  # nobody moved, nothing marked down
    status, _, pin = await ask(url, ups[0])  # and it serves the next request
    assert status == 200 and pin is None


async def test_poison_requests_open_no_breaker_and_the_fleet_serves_on(aiohttp_server, ups):
    """Five requests that make their upstream drop the connection, on a session pinned to each
    upstream in turn (a client can start sessions at will): an upstream that still answers is not
    failing, so no breaker opens, and every other session is still served, none with a 503."""
    url, proxy_ = await proxy(aiohttp_server, ups, breaker={"failures": 5, "cooldown_s": 30})
    for upstream in ups:
        upstream.default = only_if(b"poison", close_before_status)
    for upstream in ups:
        for _ in range(5):
            status, body, _ = await ask(url, upstream, text="poison")
            assert status == 502 and f"{upstream.url}/chat/completions" in body.decode(), body
    others = await asyncio.gather(*(ask(url, u) for u in ups for _ in range(4)))
    assert [status for status, _, _ in others] == [200] * 12, others
    assert [u.breaker.state for u in proxy_.fleet.upstreams] == [CLOSED] * 3
    assert all(5 <= len(poisoned(u)) <= 10 for u in ups)  # twice at most each: the keep-alive race


async def test_served_poison_requests_leave_the_fleet_serving(ups, tmp_path):
    """The red team's attack on `gymproxy serve`: requests that make their upstream drop the
    connection, five on one session, then five on a session pinned to each of the others; then
    twelve other sessions (four pinned to each upstream)."""
    for upstream in ups:
        upstream.default = only_if(b"poison", close_before_status)
    config = {"base_url": [u.url for u in ups], "pinning": {"secret": SECRET}, "health": {"interval": 60}}
    async with Served(tmp_path, config) as served:
        poison = [(u, await ask(served.url, u, text="poison")) for u in ups for _ in range(5)]
        others = await asyncio.gather(*(ask(served.url, u) for u in ups for _ in range(4)))
        text = await metrics(served.url)
    assert [status for status, _, _ in others] == [200] * 12, others
    for upstream, (status, body, _) in poison:
        assert status == 502 and f"{upstream.url}/chat/completions" in body.decode(), body
    opened = [line for line in text.splitlines() if line.startswith("gymproxy_upstream_breaker_opened_total{")]
    assert len(opened) == 3 and all(line.endswith(" 0") for line in opened), opened
    assert all(5 <= len(poisoned(u)) <= 10 for u in ups)


@pytest.mark.parametrize("how", ["reset", "close"])
async def test_an_upstream_that_dies_with_the_request_has_it_re_sent_once(aiohttp_server, ups, how):
    """Its listener is gone (the connect is refused): the process died, so the request goes to the
    next upstream and the client gets its answer; the dead one is marked down."""
    url, proxy_ = await proxy(aiohttp_server, ups)
    a = ups[0]
    a.push(dies(how))
    status, body, pin = await ask(url, a)
    assert status == 200, body
    assert a.generations() == 1 and sum(u.generations() for u in ups[1:]) == 1
    assert (SIGNER.unsign(pin or "") or ("",))[0] in (ups[1].url, ups[2].url)
    assert not proxy_.fleet.upstreams[0].healthy
    assert [u.breaker.streak for u in proxy_.fleet.upstreams] == [1, 0, 0]  # a dead one's drop is a failure


async def test_an_upstream_whose_connections_go_before_its_listener_is_found_dead(aiohttp_server, ups):
    """A killed process's connections may be reset a moment before its listener closes: a connect
    then still succeeds, but nothing answers on it. Its /health is what tells."""

    async def dying(conn: Conn, req: RawRequest) -> bool:
        conn.owner.health = gone
        conn.reset()
        return False

    async def gone(conn: Conn, req: RawRequest) -> bool:  # accepted by the kernel, never answered
        await asyncio.sleep(0.05)
        conn.owner.stop_listening()
        conn.reset()
        return False

    url, _ = await proxy(aiohttp_server, ups)
    a = ups[0]
    a.push(dying)
    status, body, pin = await ask(url, a)
    assert status == 200, body
    assert a.generations() == 1 and sum(u.generations() for u in ups[1:]) == 1
    assert (SIGNER.unsign(pin or "") or ("",))[0] in (ups[1].url, ups[2].url)


async def test_a_request_that_kills_every_upstream_it_reaches_kills_two_at_most(aiohttp_server, ups):
    """Re-sent once after a drop at most: a query of death that kills its engine (and the one it is
    re-sent to, thought to have died of something else) never reaches a third."""
    url, _ = await proxy(aiohttp_server, ups)
    for upstream in ups:
        upstream.default = only_if(b"deadly", dies("reset"))
    status, body, _ = await ask(url, ups[0], text="deadly")
    assert status == 502 and "not re-sent" in body.decode(), body
    assert sorted(u.generations() for u in ups) == [0, 1, 1]


async def test_busy_503s_from_the_whole_fleet_feed_one_breaker(aiohttp_server, ups):
    """vLLM's busy 503 is re-sent (vLLM did not start it), but one request, however many rounds of
    the fleet it makes, counts one breaker failure: the first upstream's."""
    url, proxy_ = await proxy(
        aiohttp_server, ups, retries={"attempts": 6, "backoff_s": 0.01}, breaker={"failures": 2, "cooldown_s": 30}
    )
    for upstream in ups:
        upstream.default = fixed(503, vllm_error(503, BUSY))
    status, body, _ = await ask(url, ups[0])
    assert status == 503 and BUSY in body.decode()
    assert [u.generations() for u in ups] == [2, 2, 2]  # twice round the fleet
    breakers = [u.breaker for u in proxy_.fleet.upstreams]
    assert [b.state for b in breakers] == [CLOSED] * 3 and [b.streak for b in breakers] == [1, 0, 0]
    status, _, _ = await ask(url, ups[1])  # another session's request: its own upstream's failure
    assert status == 503 and [b.streak for b in breakers] == [1, 1, 0]
