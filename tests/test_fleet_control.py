"""Fleet control for weight updates (`access.fleet_control`, control.py and pause.py): the pause
barrier, held requests, broadcasts, weight versions on replies, and the hostile cases: an engine that
never answers /pause, one that dies while paused, a resume that never comes, a flood while paused.

The engines are fake vLLMs in dev mode (`VLLM_SERVER_DEV_MODE=1`), which pause as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gymproxy.http1 import CONNECTING
from gymproxy.testing.fake_vllm import FakeVLLM, Script

from .faults import connecting_to, enough_files, eventually, start_proxy

CHAT = "/v1/chat/completions"
KEY = "sk-trainer"


def chat(text: str = "hi", *, stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "stream": stream}


async def engines(aiohttp_server: Any, n: int = 2, **options: Any) -> list[FakeVLLM]:
    fakes = []
    for _ in range(n):
        fake = FakeVLLM(dev_mode=True, **options)
        server = await aiohttp_server(fake.app)
        fake.url = str(server.make_url("/v1"))
        fakes.append(fake)
    return fakes


async def gymproxy_for(aiohttp_server: Any, fakes: list[FakeVLLM], **config: Any) -> tuple[str, Any]:
    config.setdefault("access", {"fleet_control": True})
    config.setdefault("pinning", {"secret": "s"})
    config.setdefault("health", {"interval": 60})
    return await start_proxy(aiohttp_server, [f.url for f in fakes], **config)


def generations(fake: FakeVLLM) -> int:
    """Generation requests the engine received (it records its control routes too)."""
    return sum(1 for r in fake.requests if r.path.endswith("/completions"))


async def post(session: aiohttp.ClientSession, url: str, body: Any = None, **kw: Any) -> tuple[int, Any, Any]:
    async with session.post(url, json=body, **kw) as r:
        data = await r.read()
        return r.status, orjson.loads(data) if data else None, r.headers


def two_streams(session: aiohttp.ClientSession, url: str) -> tuple[asyncio.Future[bytes], asyncio.Future[bytes]]:
    """A streamed /v1/responses and a streamed chat turn, under way: their whole bodies, once done."""

    async def read(path: str, body: dict[str, Any]) -> bytes:
        async with session.post(url + path, json=body) as r:
            return await r.read()

    responses = asyncio.ensure_future(read("/v1/responses", {"model": "m", "input": "r", "stream": True}))
    return responses, asyncio.ensure_future(read(CHAT, chat("c", stream=True)))


async def turn(session: aiohttp.ClientSession, url: str, text: str, **kw: Any) -> tuple[int, Any, Any]:
    return await post(session, url + CHAT, chat(text), **kw)


# --- access ---------------------------------------------------------------------------------------


async def test_fleet_routes_are_off_by_default_and_keyed_when_keys_are_set(aiohttp_server):
    fakes = await engines(aiohttp_server, 1)
    off, _ = await gymproxy_for(aiohttp_server, fakes, access={})
    keyed, _ = await gymproxy_for(aiohttp_server, fakes, access={"fleet_control": True, "api_keys": [KEY]})
    async with aiohttp.ClientSession() as session:
        status, body, _ = await post(session, off + "/fleet/pause")
        assert status == 403 and "access.fleet_control" in body["error"]["message"]
        for path in ("/fleet/pause", "/fleet/resume", "/fleet/broadcast/update_weight_version"):
            status, body, _ = await post(session, keyed + path)
            assert status == 401, path
        async with session.get(keyed + "/fleet/status") as r:
            assert r.status == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        status, body, _ = await post(session, keyed + "/fleet/pause?mode=sideways", headers=auth)
        assert status == 400 and body["error"]["param"] == "mode"
        status, body, _ = await post(session, keyed + "/fleet/broadcast/generate", headers=auth)
        assert status == 404 and body["error"]["param"] == "route"
        assert fakes[0].pause_mode is None  # none of it reached the engine


# --- the weight update, end to end ----------------------------------------------------------------


async def test_an_abort_update_loses_no_turn_and_every_reply_names_its_weights(aiohttp_server):
    """pause?mode=abort with whole replies in flight, a version broadcast, resume: each client gets one
    whole reply, sampled with the new weights; requests that came while paused were held, not sent."""
    fakes = await engines(aiohttp_server)
    url, proxy = await gymproxy_for(aiohttp_server, fakes)
    for fake in fakes:
        fake.push(*[Script(content=" ".join(["w"] * 40), chunk_delay=0.05)] * 3)
    async with aiohttp.ClientSession() as session:
        status, body, _ = await post(session, url + "/fleet/broadcast/update_weight_version", {"new_version": "1"})
        assert status == 200 and [e["status"] for e in body["engines"]] == [200, 200]
        flying = [asyncio.ensure_future(turn(session, url, f"in flight {i}")) for i in range(4)]
        assert await eventually(lambda: sum(generations(f) for f in fakes) >= 4)
        await asyncio.sleep(0.2)  # generating
        status, body, _ = await post(session, url + "/fleet/pause?mode=abort")
        assert status == 200 and body["paused"] is True, body
        late = [asyncio.ensure_future(turn(session, url, f"late {i}")) for i in range(3)]
        assert await eventually(lambda: proxy.fleet.holds.count == 3 + 4)  # the aborted ones wait too
        sent_while_paused = sum(generations(f) for f in fakes)
        status, body, _ = await post(session, url + "/fleet/broadcast/update_weight_version", {"new_version": "2"})
        assert status == 200
        async with session.get(url + "/fleet/status") as r:
            state = await r.json()
        assert state["paused"] and state["held"] == 7 and state["weight_version"] == "2"
        assert [e["paused"] for e in state["engines"]] == [True, True]
        await asyncio.sleep(0.1)
        assert sum(generations(f) for f in fakes) == sent_while_paused  # nothing was sent while paused
        status, body, _ = await post(session, url + "/fleet/resume")
        assert status == 200 and body["released"] == 7
        replies = await asyncio.gather(*flying, *late)
    for status, body, headers in replies:
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "stop", body  # never the aborted reply
        assert headers["X-Weight-Version"] == "2"
    # Every request the engines answered after the resume was sampled with version 2 alone.
    resent = [v for f in fakes for v in f.sampled_versions.values() if v and v[-1] == "2"]
    assert len(resent) == 7 and all(v == ["2"] for v in resent), resent
    text = proxy.render_metrics()
    assert 'gymproxy_retries_total{reason="abort"} 4' in text
    assert 'gymproxy_fleet_pause_seconds_count{mode="abort"} 1' in text
    assert 'gymproxy_replies_by_weight_version_total{version="2"} 7' in text


async def test_a_keep_pause_lets_streams_in_flight_finish_after_the_resume(aiohttp_server):
    fakes = await engines(aiohttp_server, 1)
    url, _ = await gymproxy_for(aiohttp_server, fakes)
    fakes[0].push(*[Script(content=" ".join(["k"] * 30), chunk_delay=0.05)] * 2)

    async def stream(session: aiohttp.ClientSession) -> tuple[bytes, str | None]:
        async with session.post(url + CHAT, json=chat("s", stream=True)) as r:
            return await r.read(), r.headers.get("X-Weight-Version")

    async with aiohttp.ClientSession() as session:
        await post(session, url + "/fleet/broadcast/update_weight_version", {"new_version": "7"})
        streams = [asyncio.ensure_future(stream(session)) for _ in range(2)]
        await asyncio.sleep(0.3)
        status, _, _ = await post(session, url + "/fleet/pause?mode=keep")
        assert status == 200 and fakes[0].pause_mode == "keep"
        await asyncio.sleep(0.3)
        assert not any(s.done() for s in streams)  # frozen, not cut
        await post(session, url + "/fleet/resume")
        done = await asyncio.wait_for(asyncio.gather(*streams), 10)
    for body, version in done:
        assert body.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"stop"' in body.replace(b" ", b"")
        assert version == "7"


# --- hostile cases --------------------------------------------------------------------------------


async def test_an_engine_that_never_answers_pause_fails_the_barrier_and_the_others_resume(aiohttp_server):
    fakes = await engines(aiohttp_server, 1)
    stuck = web.Application()

    async def never(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError

    stuck.router.add_route("*", "/{tail:.*}", never)
    silent = await aiohttp_server(stuck)
    silent_url = str(silent.make_url("/v1"))
    url, proxy = await start_proxy(
        aiohttp_server,
        [fakes[0].url, silent_url],
        access={"fleet_control": True},
        fleet_control={"pause_timeout_s": 0.5},
        health={"interval": 60},
    )
    async with aiohttp.ClientSession() as session:
        status, body, _ = await post(session, url + "/fleet/pause?mode=abort")
        assert status == 502 and body["error"]["code"] == "pause_failed"
        assert silent_url.removesuffix("/v1") in body["error"]["message"]
        by_url = {e["url"]: e for e in body["engines"]}
        assert "no answer from pause within 0.5 s" in by_url[silent_url.removesuffix("/v1") + "/v1"]["error"]
        assert by_url[fakes[0].url]["resumed"] is True
        assert fakes[0].pause_mode is None and not proxy.fleet.holds.paused  # never left half paused


async def test_a_resume_that_never_comes_ends_each_held_request_with_a_503_in_time(aiohttp_server):
    fakes = await engines(aiohttp_server, 1)
    url, proxy = await gymproxy_for(aiohttp_server, fakes, hold={"timeout_s": 0.5})
    async with aiohttp.ClientSession() as session:
        await post(session, url + "/fleet/pause")
        replies = await asyncio.wait_for(asyncio.gather(*(turn(session, url, "x") for _ in range(5))), 5)
    for status, body, headers in replies:
        assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "paused"
        assert "hold.timeout_s" in body["error"]["message"]
    assert proxy.fleet.holds.count == 0 and proxy.fleet.holds.bytes == 0  # nothing left held
    assert generations(fakes[0]) == 0


async def test_ten_thousand_requests_while_paused_hold_at_most_the_cap(aiohttp_server):
    """Past `hold.max_requests` a request is refused at once (503, Retry-After), so memory is
    bounded; the ones held are all answered once the fleet resumes."""
    fakes = await engines(aiohttp_server, 1)
    url, proxy = await gymproxy_for(aiohttp_server, fakes, hold={"max_requests": 100})
    holds = proxy.fleet.holds
    most = 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    connector = aiohttp.TCPConnector(limit=400)
    async with aiohttp.ClientSession(connector=connector) as session:
        await post(session, url + "/fleet/pause")

        async def one(i: int) -> int:
            nonlocal most
            async with session.post(url + CHAT, json=chat(f"flood {i}")) as r:
                await r.read()
                most = max(most, holds.count)
                assert r.status in (200, 503)
                if r.status == 503:
                    assert r.headers["Retry-After"] == "1"
                return r.status

        flood = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(10_000))))
        assert await eventually(lambda: holds.refused >= 9_900, seconds=120)
        await post(session, url + "/fleet/resume")
        statuses = await asyncio.wait_for(flood, 120)
    assert statuses.count(200) == 100 and statuses.count(503) == 9_900
    assert most <= 100 and holds.count == 0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 200, grown_mb


def counted(text: str, name: str, **labels: str) -> float:
    """The sum of metric `name`'s samples whose labels include `labels`, in a /metrics text."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def test_held_requests_leave_room_for_the_trainer_on_the_main_port(aiohttp_server, tmp_path):
    """`gymproxy serve` with few files (a cap of 136 client connections), paused, and 200 requests:
    held requests take half the cap at most, the rest get a 503 that closes their connection, and
    the trainer's /fleet/status, /health, /metrics and /fleet/resume all get in on the main port.
    (Before, the held requests filled the cap: the resume was refused, and every request ended 503.)"""
    from .served import Served

    fakes = await engines(aiohttp_server, 2)
    config = {
        "base_url": [f.url for f in fakes],
        "access": {"fleet_control": True},
        "pinning": {"secret": "s"},
        "hold": {"timeout_s": 60},
    }
    async with Served(tmp_path, config, open_files=400) as served:
        url = served.url
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as flood:
            assert (await post(flood, url + "/fleet/pause"))[0] == 200

            async def one(i: int) -> tuple[int, str, str]:
                async with flood.post(url + CHAT, json=chat(f"flood {i}")) as r:
                    body = await r.read()
                    return r.status, r.headers.get("Connection", ""), body.decode(errors="replace")

            replies = [asyncio.ensure_future(one(i)) for i in range(200)]
            assert await eventually(lambda: sum(r.done() for r in replies) >= 64, seconds=20)
            await asyncio.sleep(0.5)  # what is held is held
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as trainer:
                for path in ("/fleet/status", "/health", "/metrics"):
                    async with trainer.get(url + path) as r:
                        assert r.status == 200, (path, await r.text())
                        if path == "/metrics":
                            assert counted(await r.text(), "gymproxy_held_requests") == 68
                status, body, _ = await post(trainer, url + "/fleet/resume")
                assert status == 200 and body["released"] == 68, body
            done = await asyncio.wait_for(asyncio.gather(*replies), 30)
        assert "hold.max_requests (10000) lowered to 68" in served.log, served.log[-2000:]
    statuses = [r[0] for r in done]
    assert statuses.count(200) == 68 and statuses.count(503) == 132, statuses
    # Past the hold, a 503 that closes the connection; past the cap (the flood is larger), the listener's.
    refused = [text for status, connection, text in done if status == 503 and connection == "close"]
    full = [text for text in refused if "lowered to 68" in text and '"code":"paused"' in text]
    assert len(refused) == 132 and full and all(t in full or "limits.max_client_connections" in t for t in refused)


@contextlib.asynccontextmanager
async def accepting_slowly(fake: FakeVLLM, backlog: int, per_tick: int, tick: float) -> AsyncIterator[FakeVLLM]:
    """`fake` behind a listen backlog of `backlog`, accepting `per_tick` connections every `tick`
    seconds: a busy engine, whose kernel drops SYNs (retried by the client after 1 s, then 2 s more)
    while its accept queue is full."""
    runner = web.AppRunner(fake.app, handler_cancellation=True)
    await runner.setup()
    assert runner.server is not None
    server = runner.server
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(backlog)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def accept() -> None:
        while True:
            await asyncio.sleep(tick)
            for _ in range(per_tick):
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    break
                await loop.connect_accepted_socket(server, conn)

    task = asyncio.ensure_future(accept())
    fake.url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    try:
        yield fake
    finally:
        task.cancel()
        listener.close()
        await runner.cleanup()


async def test_a_resume_releases_hundreds_at_the_pace_the_engines_accept(tmp_path):
    """600 requests held for two busy engines (a listen backlog of 64, 32 accepts every 0.5 s), then
    one resume: gymproxy has at most `http1.CONNECTING` (32) connections opening to each engine at
    once (the rest wait their turn), none times out (`timeouts.connect` 5 s: a SYN the kernel drops
    at a full backlog is sent again after 1 s, then 2 s more), no breaker opens, and
    every request is answered 200. (Before, all 600 connects went at once: hundreds of SYNs to each
    engine, dropped at its full backlog and retried together: at scale, connect timeouts and
    breakers, as the red team saw with 9,904 requests.)"""
    from .served import Served

    enough_files(4000)
    if connecting_to(1) is None:
        pytest.skip("needs Linux's /proc/net/tcp to see the connections opening")
    async with contextlib.AsyncExitStack() as stack:
        fakes = [
            await stack.enter_async_context(accepting_slowly(FakeVLLM(dev_mode=True), 64, 32, 0.5)) for _ in range(2)
        ]
        ports = [int(f.url.rsplit(":", 1)[1].split("/")[0]) for f in fakes]
        config = {
            "base_url": [f.url for f in fakes],
            "access": {"fleet_control": True},
            "pinning": {"secret": "s"},
            "health": {"interval": 60},
            "timeouts": {"connect": 5.0},
            "hold": {"timeout_s": 120},
        }
        served = await stack.enter_async_context(Served(tmp_path, config))
        url = served.url
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=0)
        session = await stack.enter_async_context(aiohttp.ClientSession(connector=connector, timeout=timeout))
        assert (await post(session, url + "/fleet/pause"))[0] == 200

        async def one(i: int) -> int:
            async with session.post(url + CHAT, json=chat(f"held {i}"), headers={"X-Session-ID": f"h{i}"}) as r:
                await r.read()
                return r.status

        replies = [asyncio.ensure_future(one(i)) for i in range(600)]

        async def held() -> float:
            async with session.get(url + "/metrics") as r:
                return counted(await r.text(), "gymproxy_held_requests")

        for _ in range(300):
            if await held() == 600:
                break
            await asyncio.sleep(0.1)
        status, body, _ = await post(session, url + "/fleet/resume")
        assert status == 200 and body["released"] == 600
        most = [0, 0]
        while not all(r.done() for r in replies):
            most = [max(m, connecting_to(port) or 0) for m, port in zip(most, ports, strict=True)]
            await asyncio.sleep(0.05)
        statuses = await asyncio.gather(*replies)
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    assert max(most) <= CONNECTING, most
    assert statuses == [200] * 600, {s: statuses.count(s) for s in set(statuses)}
    timeouts = {k: counted(text, "gymproxy_retries_total", reason=k) for k in ("connect_timeout", "crowded")}
    assert timeouts == {"connect_timeout": 0, "crowded": 0}, timeouts
    assert counted(text, "gymproxy_upstream_breaker_opened_total") == 0
    assert sum(generations(f) for f in fakes) == 600


async def test_an_engine_paused_directly_holds_its_requests_and_opens_no_breaker(aiohttp_server):
    """The trainer pauses the engine itself (vLLM 0.33+ answers 503 "Generation is paused"): the
    request waits for that engine (its /is_paused polled) and is served there once it resumes; with
    `breaker.failures: 1`, no breaker opens and no session moves."""
    fakes = await engines(aiohttp_server, 2, paused_503=True)
    url, proxy = await gymproxy_for(aiohttp_server, fakes, access={}, breaker={"failures": 1}, hold={"poll_s": 0.05})
    async with aiohttp.ClientSession() as session:
        status, _, headers = await turn(session, url, "first")
        assert status == 200
        cookie = headers["Set-Cookie"].split(";")[0]
        pinned = next(f for f in fakes if generations(f))
        await pinned.pause("abort")
        waiting = asyncio.ensure_future(turn(session, url, "second", headers={"Cookie": cookie}))
        assert await eventually(lambda: proxy.fleet.engines.waiting(proxy.fleet.upstreams[fakes.index(pinned)]) == 1)
        await asyncio.sleep(0.3)
        assert not waiting.done()
        pinned.resume()
        status, body, _ = await asyncio.wait_for(waiting, 5)
    assert status == 200, body
    assert generations(pinned) >= 3  # 200, 503, 200
    assert sum(generations(f) for f in fakes) == generations(pinned)
    assert [u.breaker.opened for u in proxy.fleet.upstreams] == [0, 0]
    assert sum(proxy.fleet.pinner.moves.values()) == 0  # the session stayed on its engine


# --- late answers: an engine vLLM pauses (or resumes) after gymproxy gave up on the call ------------


def late(fake: FakeVLLM, route: str, *delays: float) -> asyncio.Event:
    """`route` (/pause or /resume) answers `delays[i]` seconds late the i-th time, and is carried out
    even when gymproxy gave up on it, as vLLM does (uvicorn does not stop a handler whose client left).
    The event is set each time a late one was carried out."""
    pending = list(delays)
    carried = asyncio.Event()

    @web.middleware
    async def answer_late(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != route or not pending:
            return await handler(request)
        delay = pending.pop(0)

        async def later() -> web.StreamResponse:
            await asyncio.sleep(delay)
            try:
                return await handler(request)
            finally:
                carried.set()

        return await asyncio.shield(asyncio.ensure_future(later()))

    fake.app.middlewares.append(answer_late)
    return carried


def stuck(fake: FakeVLLM) -> asyncio.Event:
    """Every request waits (and is carried out, even if its client left) until the event is set."""
    unstuck = asyncio.Event()

    @web.middleware
    async def wait(request: web.Request, handler: Any) -> web.StreamResponse:
        async def later() -> web.StreamResponse:
            await unstuck.wait()
            return await handler(request)

        return await asyncio.shield(asyncio.ensure_future(later()))

    fake.app.middlewares.append(wait)
    return unstuck


async def serving(aiohttp_server: Any, fake: FakeVLLM) -> FakeVLLM:
    server = await aiohttp_server(fake.app)
    fake.url = str(server.make_url("/v1"))
    return fake


async def late_engine(
    aiohttp_server: Any, route: str, *delays: float, **options: Any
) -> tuple[FakeVLLM, asyncio.Event]:
    """A dev-mode engine serving, whose `route` answers late (`late`), and the event `late` sets."""
    slow = FakeVLLM(dev_mode=True, **options)
    carried = late(slow, route, *delays)
    return await serving(aiohttp_server, slow), carried


async def status_of(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/fleet/status") as r:
        assert r.status == 200
        state: dict[str, Any] = await r.json()
        return state


async def test_an_engine_that_pauses_after_the_barrier_gave_up_is_resumed_once_it_answers(aiohttp_server):
    """The red team's case: one engine answers /pause 1 s late, past a 0.3 s barrier, and (as vLLM
    would) pauses all the same. It is not left paused while the fleet is not: gymproxy follows its
    /pause, resumes it once it answers, and /fleet/status says so meanwhile. Every session after is
    served at once (before, a third of them waited out `hold.timeout_s` for a 503)."""
    fakes = await engines(aiohttp_server, 2, paused_503=True)
    slow, paused_late = await late_engine(aiohttp_server, "/pause", 1.0, paused_503=True)
    fakes.insert(1, slow)
    url, proxy = await gymproxy_for(
        aiohttp_server, fakes, fleet_control={"pause_timeout_s": 0.3}, hold={"timeout_s": 3, "poll_s": 0.05}
    )
    async with aiohttp.ClientSession() as session:
        status, failed, _ = await post(session, url + "/fleet/pause?mode=abort")
        assert status == 502 and failed["error"]["code"] == "pause_failed"
        following = await status_of(session, url)
        await asyncio.wait_for(paused_late.wait(), 5)  # the engine paused after the barrier gave up
        assert await eventually(lambda: slow.pause_mode is None, seconds=3), "left paused"
        started = asyncio.get_running_loop().time()
        # 36 sessions: with 12, one engine in three got none of them in about 1 run in 130 (the
        # sessions' hashes depend on the engines' ports).
        sessions = [turn(session, url, f"s{i}", headers={"X-Session-ID": f"s{i}"}) for i in range(36)]
        replies = await asyncio.gather(*sessions)
        took = asyncio.get_running_loop().time() - started
        assert [r[0] for r in replies] == [200] * 36 and took < 2, (replies, took)
        assert generations(slow) > 0  # its share of the sessions was served there
        assert await eventually(lambda: not proxy.control.settle.names())
        settled = await status_of(session, url)
    by_url = {e["url"]: e for e in failed["engines"]}
    assert "followed" in by_url[slow.url]["pending"], by_url[slow.url]
    assert [by_url[f.url].get("resumed") for f in fakes] == [True, None, True]
    assert following["paused"] is False and following["unsettled"] == [proxy.fleet.upstreams[1].name]
    assert "still open" in following["engines"][1]["unsettled"]
    assert settled["unsettled"] == [] and [e["paused"] for e in settled["engines"]] == [False] * 3


async def test_a_second_pause_waits_for_the_late_one_and_the_engine_stays_paused_with_the_fleet(aiohttp_server):
    """A second /fleet/pause while the first's /pause to an engine is still open: the new /pause goes
    once the open one ended (never two at once), the barrier succeeds, and nothing resumes the engine."""
    fakes = await engines(aiohttp_server, 1)
    slow, _ = await late_engine(aiohttp_server, "/pause", 1.2)
    fakes.append(slow)
    url, proxy = await gymproxy_for(
        aiohttp_server, fakes, fleet_control={"pause_timeout_s": 0.8}, hold={"poll_s": 0.05}
    )
    async with aiohttp.ClientSession() as session:
        status, _, _ = await post(session, url + "/fleet/pause?mode=keep")
        assert status == 502
        status, body, _ = await post(session, url + "/fleet/pause?mode=keep")
        assert status == 200 and body["paused"] is True, body
        assert await eventually(lambda: not proxy.control.settle.names())
        await asyncio.sleep(0.5)
        assert [f.pause_mode for f in fakes] == ["keep", "keep"]  # the late /pause resumed nothing
        state = await status_of(session, url)
        assert state["paused"] and state["unsettled"] == [] and [e["paused"] for e in state["engines"]] == [True, True]
        status, _, _ = await post(session, url + "/fleet/resume")
        assert status == 200 and [f.pause_mode for f in fakes] == [None, None]


async def test_a_resume_while_a_late_pause_is_open_leaves_no_engine_paused(aiohttp_server):
    """/fleet/resume while a failed barrier's /pause is still open: that engine's /resume is not sent
    ahead of it (the late pause would land after it and stick); it is resumed once the pause ends."""
    fakes = await engines(aiohttp_server, 1)
    slow, paused_late = await late_engine(aiohttp_server, "/pause", 1.0)
    fakes.append(slow)
    url, proxy = await gymproxy_for(
        aiohttp_server, fakes, fleet_control={"pause_timeout_s": 0.3}, hold={"poll_s": 0.05}
    )
    async with aiohttp.ClientSession() as session:
        assert (await post(session, url + "/fleet/pause"))[0] == 502
        status, body, _ = await post(session, url + "/fleet/resume")
        await asyncio.wait_for(paused_late.wait(), 5)
        assert await eventually(lambda: slow.pause_mode is None, seconds=3), "left paused"
        await asyncio.sleep(0.3)
        assert slow.pause_mode is None and not proxy.fleet.holds.paused
    assert status == 502, body
    refused = next(e for e in body["engines"] if e["url"] == slow.url)
    assert "still open" in refused["error"] and refused["pending"], refused
    assert await eventually(lambda: not proxy.control.settle.names())


async def test_a_late_resume_never_lands_after_the_next_pause(aiohttp_server):
    """A /fleet/resume whose /resume to one engine answers late, then a /fleet/pause at once: the
    engine's /pause waits for its open /resume, so the fleet is paused with every engine in it
    (before, the late /resume landed after the /pause: that engine ran on while the fleet was paused)."""
    fakes = await engines(aiohttp_server, 1)
    slow, resumed_late = await late_engine(aiohttp_server, "/resume", 1.2)
    fakes.append(slow)
    url, proxy = await gymproxy_for(
        aiohttp_server, fakes, fleet_control={"pause_timeout_s": 0.8}, hold={"poll_s": 0.05}
    )
    async with aiohttp.ClientSession() as session:
        assert (await post(session, url + "/fleet/pause"))[0] == 200
        status, resumed, _ = await post(session, url + "/fleet/resume")
        assert status == 502
        status, body, _ = await post(session, url + "/fleet/pause")
        assert status == 200, body
        await asyncio.wait_for(resumed_late.wait(), 5)
        await asyncio.sleep(0.5)
        assert [f.pause_mode for f in fakes] == ["abort", "abort"], "an engine runs while the fleet is paused"
        state = await status_of(session, url)
        assert state["paused"] and [e["paused"] for e in state["engines"]] == [True, True]
    assert next(e for e in resumed["engines"] if e["url"] == slow.url)["pending"]
    assert await eventually(lambda: not proxy.control.settle.names())


async def test_an_engine_that_answers_nothing_for_a_while_is_resumed_once_it_answers(aiohttp_server):
    """An engine that answers nothing at all (not /pause, not /is_paused) past the barrier and past
    `fleet_control.follow_s`: gymproxy asks its /is_paused until it answers. When it comes back, the
    /pause it took long ago is carried out (it pauses), and gymproxy resumes it."""
    fakes = await engines(aiohttp_server, 1)
    slow = FakeVLLM(dev_mode=True)
    unstuck = stuck(slow)
    fakes.append(await serving(aiohttp_server, slow))
    url, proxy = await gymproxy_for(
        aiohttp_server,
        fakes,
        fleet_control={"pause_timeout_s": 0.3, "follow_s": 0.3},
        hold={"poll_s": 0.05},
        health={"interval": 0.5, "timeout": 0.2},
    )
    async with aiohttp.ClientSession() as session:
        status, body, _ = await post(session, url + "/fleet/pause")
        assert status == 502
        await asyncio.sleep(1.0)  # past follow_s: the /pause is closed, /is_paused asked
        state = await status_of(session, url)
        assert state["unsettled"] == [proxy.fleet.upstreams[1].name] and state["engines"][1]["paused"] is None
        assert slow.pause_mode is None
        unstuck.set()
        assert await eventually(lambda: not proxy.control.settle.names(), seconds=5)
        paths = [r.path for r in slow.requests]
        assert "/resume" in paths[paths.index("/pause") :], paths  # its old /pause was carried out, then undone
        assert [f.pause_mode for f in fakes] == [None, None] and not proxy.fleet.holds.paused


async def test_a_trainer_that_leaves_mid_barrier_does_not_leave_the_fleet_half_paused(aiohttp_server):
    """The trainer's client gives up on /fleet/pause before the barrier ends (its timeout is shorter):
    the barrier runs to its end all the same, so it fails and resumes the engine that paused
    (before, the handler was cancelled halfway: the gate stayed closed, one engine paused)."""
    fakes = await engines(aiohttp_server, 1)
    slow, _ = await late_engine(aiohttp_server, "/pause", 0.8)
    fakes.append(slow)
    url, proxy = await gymproxy_for(
        aiohttp_server, fakes, fleet_control={"pause_timeout_s": 0.4}, hold={"poll_s": 0.05}
    )
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            await post(session, url + "/fleet/pause", timeout=aiohttp.ClientTimeout(total=0.1))
        assert await eventually(lambda: not proxy.fleet.holds.paused, seconds=3)
        assert await eventually(
            lambda: [f.pause_mode for f in fakes] == [None, None] and not proxy.control.settle.names()
        )
        assert (await turn(session, url, "after"))[0] == 200


async def test_a_shutdown_with_an_engine_unsettled_exits_and_names_it(aiohttp_server, tmp_path):
    """`gymproxy serve` stopped while a failed barrier's /pause is still open: it exits at once (the
    followed call is closed), and its log names the engine that may be left paused."""
    from .served import Served

    fakes = await engines(aiohttp_server, 1)
    slow, _ = await late_engine(aiohttp_server, "/pause", 30.0)
    fakes.append(slow)
    config = {
        "base_url": [f.url for f in fakes],
        "access": {"fleet_control": True},
        "fleet_control": {"pause_timeout_s": 0.3},
        "shutdown_grace_s": 0.5,
    }
    async with Served(tmp_path, config) as served:
        async with aiohttp.ClientSession() as session:
            assert (await post(session, served.url + "/fleet/pause"))[0] == 502
        served.terminate()
        assert await served.wait(10) == 0
    text = served.log_path.read_text()
    assert f"stopping with upstream {slow.url} not settled" in text, text[-2000:]


async def test_min_weight_version_holds_a_request_until_its_engine_has_it(aiohttp_server):
    fakes = await engines(aiohttp_server, 1)
    url, _ = await gymproxy_for(aiohttp_server, fakes, hold={"timeout_s": 1.0})
    async with aiohttp.ClientSession() as session:
        await post(session, url + "/fleet/broadcast/update_weight_version", {"new_version": "4"})
        status, _, headers = await turn(session, url, "now", headers={"X-Min-Weight-Version": "3"})
        assert status == 200 and headers["X-Weight-Version"] == "4"
        waiting = asyncio.ensure_future(turn(session, url, "later", headers={"X-Min-Weight-Version": "5"}))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await post(session, url + "/fleet/broadcast/update_weight_version", {"new_version": "5"})
        status, _, headers = await asyncio.wait_for(waiting, 5)
        assert status == 200 and headers["X-Weight-Version"] == "5"
        status, body, _ = await turn(session, url, "never", headers={"X-Min-Weight-Version": "9"})
        assert status == 503 and "hold.timeout_s" in body["error"]["message"]
        status, body, _ = await turn(session, url, "bad", headers={"X-Min-Weight-Version": "a b"})
        assert status == 400 and body["error"]["param"] == "X-Min-Weight-Version"


async def test_an_engine_that_dies_while_paused_is_reported_and_its_sessions_go_on(aiohttp_server):
    fakes = await engines(aiohttp_server, 1)
    victim = FakeVLLM(dev_mode=True)
    runner = web.AppRunner(victim.app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    victim.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    url, proxy = await gymproxy_for(aiohttp_server, [*fakes, victim])
    async with aiohttp.ClientSession() as session:
        await post(session, url + "/fleet/pause")
        held = [asyncio.ensure_future(turn(session, url, f"held {i}")) for i in range(6)]
        assert await eventually(lambda: proxy.fleet.holds.count == 6)
        await runner.cleanup()  # the engine dies while paused
        status, body, _ = await post(session, url + "/fleet/resume")
        assert status == 502 and victim.url.removesuffix("/v1") in body["error"]["message"]
        replies = await asyncio.wait_for(asyncio.gather(*held), 10)
    assert [r[0] for r in replies] == [200] * 6, replies
    assert generations(fakes[0]) == 6


async def test_an_engine_added_while_paused_joins_paused(aiohttp_server):
    fakes = await engines(aiohttp_server, 2)
    url, proxy = await gymproxy_for(
        aiohttp_server, fakes[:1], access={"fleet_control": True, "admin_fleet_changes": True}
    )
    async with aiohttp.ClientSession() as session:
        await post(session, url + "/fleet/pause?mode=keep")
        status, _, _ = await post(session, url + "/admin/upstreams", {"url": fakes[1].url, "name": "late"})
        assert status == 201
        assert await eventually(lambda: fakes[1].pause_mode == "keep")
        await post(session, url + "/fleet/resume")
        assert fakes[1].pause_mode is None


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_a_pause_while_a_breaker_is_half_open_lets_its_probe_decide_after_the_resume(aiohttp_server, mode):
    fakes = await engines(aiohttp_server, 2)
    url, proxy = await gymproxy_for(aiohttp_server, fakes, breaker={"failures": 1, "cooldown_s": 0.2})
    breaker = proxy.fleet.upstreams[0].breaker
    breaker.failed()  # open
    await asyncio.sleep(0.3)  # cooled down: the next request to it is the half-open probe
    async with aiohttp.ClientSession() as session:
        await post(session, url + f"/fleet/pause?mode={mode}")
        held = [asyncio.ensure_future(turn(session, url, f"p{i}")) for i in range(4)]
        assert await eventually(lambda: proxy.fleet.holds.count == 4)
        await post(session, url + "/fleet/resume")
        replies = await asyncio.wait_for(asyncio.gather(*held), 10)
    assert [r[0] for r in replies] == [200] * 4
    assert not breaker.blocked  # the probe went, after the resume, and closed it


async def test_a_stream_an_abort_cuts_is_continued_once_the_fleet_resumes(aiohttp_server):
    """With fleet control, a stream under way when an abort pause cuts it is continued after the
    resume (a partial rollout): the same request, with the text so far as the final assistant
    message vLLM continues. The client sees one stream that ends as any other, with all the text."""
    fakes = await engines(aiohttp_server, 1)
    url, proxy = await gymproxy_for(aiohttp_server, fakes)
    words = " ".join(f"t{i}" for i in range(60))
    fakes[0].push(Script(content=words, chunk_delay=0.02), Script(content=words, chunk_delay=0.02))
    async with aiohttp.ClientSession() as session:
        responses, chats = two_streams(session, url)
        await fakes[0].scheduler.generating(2)
        await asyncio.sleep(0.3)  # some text is out
        await post(session, url + "/fleet/pause?mode=abort")
        await asyncio.sleep(0.2)
        assert not responses.done() and not chats.done()  # held, not ended
        await post(session, url + "/fleet/resume")
        streamed, chatted = await asyncio.wait_for(asyncio.gather(responses, chats), 20)
    last = [line for line in streamed.split(b"\n") if line.startswith(b"data: ")][-1]
    event = orjson.loads(last[6:])
    assert event["type"] == "response.completed", event
    continued = [r for r in fakes[0].requests if r.json and r.json.get("continue_final_message")]
    assert len(continued) == 2  # each stream was continued from where it was cut
    for request in continued:
        so_far = request.json["messages"][-1]
        assert so_far["role"] == "assistant" and words.startswith(so_far["content"].strip()) and so_far["content"]
    assert b'"finish_reason":"abort"' not in chatted.replace(b" ", b"")
    assert chatted.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"stop"' in chatted.replace(b" ", b"")
    assert 'gymproxy_retries_total{reason="abort"} 2' in proxy.render_metrics()


async def test_without_fleet_control_a_stream_an_abort_cuts_ends_saying_why(aiohttp_server):
    """The trainer paused the engine itself: a stream cannot be taken back, so it ends saying why:
    `response.incomplete` (reason "abort") on /v1/responses, `finish_reason: "abort"` on chat."""
    fakes = await engines(aiohttp_server, 1)
    url, _ = await gymproxy_for(aiohttp_server, fakes, access={})
    fakes[0].push(*[Script(content=" ".join(["c"] * 60), chunk_delay=0.05)] * 2)
    async with aiohttp.ClientSession() as session:
        responses, chats = two_streams(session, url)
        await fakes[0].scheduler.generating(2)
        await asyncio.sleep(0.2)
        await fakes[0].pause("abort")
        streamed, chatted = await asyncio.wait_for(asyncio.gather(responses, chats), 10)
        fakes[0].resume()
    last = [line for line in streamed.split(b"\n") if line.startswith(b"data: ")][-1]
    event = orjson.loads(last[6:])
    assert event["type"] == "response.incomplete", event
    assert event["response"]["incomplete_details"] == {"reason": "abort"}
    assert b'"finish_reason":"abort"' in chatted.replace(b" ", b"") and chatted.endswith(b"data: [DONE]\n\n")


async def test_the_fleet_routes_are_on_the_admin_port_too(aiohttp_server):
    """With `access.admin_port`, /health and /metrics move there; the fleet routes are on both ports."""
    from gymproxy.plugin import admin_app

    fakes = await engines(aiohttp_server, 1)
    url, proxy = await gymproxy_for(aiohttp_server, fakes, access={"fleet_control": True, "admin_port": 1})
    admin = await aiohttp_server(admin_app(proxy))
    async with aiohttp.ClientSession() as session:
        for root in (url, str(admin.make_url("")).rstrip("/")):
            async with session.get(root + "/fleet/status") as r:
                assert r.status == 200 and (await r.json())["paused"] is False


async def test_training_mode_token_fields_name_the_weights_too(aiohttp_server):
    fakes = await engines(aiohttp_server, 1)
    url, _ = await gymproxy_for(aiohttp_server, fakes, return_token_id_information=True)
    async with aiohttp.ClientSession() as session:
        await post(session, url + "/fleet/broadcast/update_weight_version", {"new_version": "11"})
        for stream in (False, True):
            async with session.post(url + "/v1/responses", json={"model": "m", "input": "t", "stream": stream}) as r:
                assert r.headers["X-Weight-Version"] == "11"
                raw = await r.read()
            if stream:
                last = [line for line in raw.split(b"\n") if line.startswith(b"data: ")][-1]
                response = orjson.loads(last[6:])["response"]
            else:
                response = orjson.loads(raw)
            item = response["output"][-1]
            assert item["weight_version"] == "11" and item["generation_token_ids"], item


async def test_requests_held_at_shutdown_get_a_503_within_the_grace(aiohttp_server, tmp_path):
    """`gymproxy serve`, paused, with requests held: SIGTERM ends each with a 503 once the shutdown
    grace is over (they would have waited `hold.timeout_s`, 300 s), and the process exits."""
    from .served import Served

    fakes = await engines(aiohttp_server, 1)
    config = {"base_url": fakes[0].url, "access": {"fleet_control": True}, "shutdown_grace_s": 0.5}
    async with Served(tmp_path, config) as served:
        async with aiohttp.ClientSession() as session:
            await post(session, served.url + "/fleet/pause")
            held = [asyncio.ensure_future(turn(session, served.url, f"h{i}")) for i in range(3)]
            async with session.get(served.url + "/fleet/status") as r:
                assert r.status == 200
            assert await eventually(lambda: fakes[0].pause_mode == "abort")
            await asyncio.sleep(0.3)  # the three are held
            served.terminate()
            replies = await asyncio.wait_for(asyncio.gather(*held), 10)
        assert await served.wait(10) == 0
    assert [r[0] for r in replies] == [503] * 3, replies
    assert generations(fakes[0]) == 0
