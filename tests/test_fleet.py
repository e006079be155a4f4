"""Several fake vLLMs behind one gymproxy: pinning, placement, failover, health, metrics, workers."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import re
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

import gymproxy
from gymproxy import build_config, create_app, health
from gymproxy.pinning import Signer
from gymproxy.testing.fake_vllm import FakeVLLM

from .conftest import has_ipv6_loopback

COOKIE = "gymproxy_pin"
SECRET = "test-secret"


@pytest.fixture
async def fleet(aiohttp_server):
    """Three fake vLLMs on their own ports: (fakes, servers)."""
    fakes = [FakeVLLM(model=f"m{i}") for i in range(3)]
    servers = [await aiohttp_server(fake.app) for fake in fakes]
    for fake, server in zip(fakes, servers, strict=True):
        fake.url = str(server.make_url("/v1"))
    return fakes, servers


async def start(aiohttp_server, urls, **config):
    config.setdefault("pinning", {"secret": SECRET})
    server = await aiohttp_server(create_app(build_config({"base_url": urls, **config}, environ={})))
    return str(server.make_url("")).rstrip("/")


def generations(fake: FakeVLLM) -> int:
    return sum(1 for r in fake.requests if r.path == "/v1/chat/completions")


async def ask(session: aiohttp.ClientSession, url: str, cookie: str | None = None, **headers) -> aiohttp.ClientResponse:
    if cookie is not None:
        headers["Cookie"] = f"{COOKIE}={cookie}"
    async with session.post(
        url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, headers=headers
    ) as r:
        await r.read()
        return r


def pinned_to(pin: str | None) -> str | None:
    """The upstream a pin names (None: not a valid pin)."""
    opened = Signer(SECRET.encode(), 3600).unsign(pin) if pin else None
    return opened[0] if opened is not None else None


def pin_of(response: aiohttp.ClientResponse) -> str | None:
    morsel = response.cookies.get(COOKIE)
    return morsel.value if morsel is not None else None


async def test_a_session_stays_on_one_upstream_and_sessions_spread(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [f.url for f in fakes], pinning={"secret": SECRET, "placement": "round_robin"})
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        pins = []
        for _ in range(6):
            first = await ask(session, url)
            pin = pin_of(first)
            assert pin is not None
            before = [generations(f) for f in fakes]
            for _ in range(4):
                later = await ask(session, url, pin)
                assert later.status == 200 and pin_of(later) is None  # a valid pin is not re-set
            moved = [generations(f) - b for f, b in zip(fakes, before, strict=True)]
            assert sorted(moved) == [0, 0, 4], moved
            pins.append(pinned_to(pin))
    assert len(set(pins)) == 3  # new sessions went to every upstream


async def test_forged_stale_malformed_and_unknown_cookies_are_repinned(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [f.url for f in fakes])
    signer = Signer(SECRET.encode(), 3600)
    bad = [
        Signer(b"other secret", 3600).sign(fakes[0].url),  # forged
        signer.sign(fakes[0].url, issued=int(time.time()) - 30 * 24 * 3600),  # stale
        "not-a-pin",  # malformed
        signer.sign("http://gone:1/v1"),  # an upstream no longer configured
    ]
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        for cookie in bad:
            response = await ask(session, url, cookie)
            assert response.status == 200
            new = pin_of(response)
            assert new is not None and new != cookie
            assert pinned_to(new) in [f.url for f in fakes]


async def test_cookie_set_on_errors_of_a_new_session(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [f.url for f in fakes])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        async with session.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "[[error:500]]"}]}
        ) as r:
            assert r.status == 500
            assert pin_of(r) is not None


async def test_session_header_and_user_field_map_consistently(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [f.url for f in fakes])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        for key in ("rollout-1", "rollout-2", "rollout-3", "rollout-4"):
            before = [generations(f) for f in fakes]
            for _ in range(3):
                await ask(session, url, **{"X-Session-ID": key})
            moved = [generations(f) - b for f, b in zip(fakes, before, strict=True)]
            assert sorted(moved) == [0, 0, 3]
        before = [generations(f) for f in fakes]
        for _ in range(3):
            async with session.post(url + "/v1/responses", json={"model": "m", "input": "x", "user": "agent-7"}) as r:
                assert r.status == 200
        moved = [generations(f) - b for f, b in zip(fakes, before, strict=True)]
        assert sorted(moved) == [0, 0, 3]


def test_rendezvous_moves_only_the_removed_share():
    from gymproxy.config import Config, UpstreamSpec
    from gymproxy.pinning import Pinner
    from gymproxy.upstream import Upstream

    config = build_config({"base_url": "http://a/v1"}, environ={})
    ups = [Upstream(UpstreamSpec(url=f"http://u{i}/v1"), config) for i in range(4)]
    signer = Signer(b"s", 3600)
    keys = [f"session-{i}" for i in range(2000)]
    full = {k: Pinner(ups, signer, placement="least_outstanding").pick(None, k).upstream.name for k in keys}
    three = {k: Pinner(ups[:3], signer, placement="least_outstanding").pick(None, k).upstream.name for k in keys}
    moved = [k for k in keys if full[k] != three[k]]
    assert all(full[k] == ups[3].name for k in moved)  # only the removed upstream's sessions moved
    assert 300 < len(moved) < 700  # about a quarter
    assert isinstance(config, Config)


async def test_adding_an_upstream_keeps_existing_pins(aiohttp_server, fleet):
    fakes, _ = fleet
    url_two = await start(aiohttp_server, [fakes[0].url, fakes[1].url])
    url_three = await start(aiohttp_server, [f.url for f in fakes])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        pins = [pin_of(await ask(session, url_two)) for _ in range(6)]
        for pin in pins:
            name = pinned_to(pin)
            target = next(f for f in fakes if f.url == name)
            before = generations(target)
            response = await ask(session, url_three, pin)  # another replica, one more upstream
            assert pin_of(response) is None
            assert generations(target) == before + 1


async def test_dead_upstream_fails_over_without_failed_requests(aiohttp_server, fleet):
    fakes, servers = fleet
    url = await start(aiohttp_server, [f.url for f in fakes], health={"interval": 60})
    signer = Signer(SECRET.encode(), 3600)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        pin = signer.sign(fakes[1].url)
        assert pin_of(await ask(session, url, pin)) is None
        await servers[1].close()  # kill the pinned upstream: connections are now refused
        statuses = []
        new_pin = None
        for _ in range(10):
            response = await ask(session, url, new_pin or pin)
            statuses.append(response.status)
            new_pin = pin_of(response) or new_pin
        assert statuses == [200] * 10
        assert new_pin is not None and pinned_to(new_pin) != fakes[1].url
        async with session.get(url + "/health") as r:
            body = await r.json()
            assert r.status == 200
            assert [u["healthy"] for u in body["upstreams"]] == [True, False, True]


async def test_all_upstreams_down_is_503_naming_them(aiohttp_server, fleet):
    fakes, servers = fleet
    url = await start(aiohttp_server, [f.url for f in fakes[:2]], health={"interval": 60})
    for server in servers[:2]:
        await server.close()
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        ) as r:
            body = await r.json()
            assert r.status in (502, 503)
        async with session.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        ) as r:
            body = await r.json()
            assert r.status == 503
            assert fakes[0].url in body["error"]["message"] and fakes[1].url in body["error"]["message"]
        async with session.get(url + "/health") as r:
            assert r.status == 503


async def test_health_checks_mark_down_and_back_up(aiohttp_server, fleet):
    fakes, servers = fleet
    url = await start(aiohttp_server, [fakes[0].url, fakes[1].url], health={"interval": 0.1, "timeout": 0.5})
    port = servers[1].port
    await servers[1].close()
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            async with session.get(url + "/health") as r:
                states = [u["healthy"] for u in (await r.json())["upstreams"]]
            if states == [True, False]:
                break
            await asyncio.sleep(0.05)
        assert states == [True, False]
        revived = aiohttp.web.AppRunner(fakes[1].app)
        await revived.setup()
        site = aiohttp.web.TCPSite(revived, "127.0.0.1", port)
        await site.start()
        try:
            for _ in range(50):
                async with session.get(url + "/health") as r:
                    states = [u["healthy"] for u in (await r.json())["upstreams"]]
                if states == [True, True]:
                    break
                await asyncio.sleep(0.05)
            assert states == [True, True]
        finally:
            await revived.cleanup()


async def test_a_health_check_that_raises_is_logged_counted_and_the_loop_goes_on(
    aiohttp_server, fleet, caplog, monkeypatch
):
    """Any exception of one check, even a gymproxy bug, is one failed check: the loop lives on."""
    fakes, _ = fleet
    cfg = build_config({"base_url": [f.url for f in fakes], "health": {"interval": 0.05, "timeout": 1.0}}, environ={})
    app = aiohttp.web.Application()
    proxy = gymproxy.setup(app, cfg)
    await aiohttp_server(app)
    fleet_ = proxy.fleet
    real_get, broken = health.get, fleet_.upstreams[0]
    calls = 0

    async def sometimes_broken(client, upstream, route, **kw):
        nonlocal calls
        if upstream is broken and route == "health" and calls < 3:
            calls += 1
            raise RuntimeError("a bug in one check")
        return await real_get(client, upstream, route, **kw)

    monkeypatch.setattr(health, "get", sometimes_broken)
    for _ in range(100):
        if fleet_.health_checks[(broken.name, "ok")] >= 2:
            break
        await asyncio.sleep(0.05)
    assert fleet_.health_checks[(broken.name, "error")] == 3
    assert fleet_.health_checks[(broken.name, "ok")] >= 2 and broken.healthy  # checked on, and back
    assert "health check of upstream" in caplog.text and "a bug in one check" in caplog.text
    text = proxy.metrics.render(fleet_.gauges())
    assert _metric(text, "gymproxy_health_checks_total", result="error") == 3


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this host has no IPv6 loopback")
async def test_an_ipv6_upstream_is_served(aiohttp_server):
    """An aiohttp upstream on [::1] answers gymproxy (it answered 500 to `Host: ::1:PORT`)."""
    fake = FakeVLLM()
    server = await aiohttp_server(fake.app, host="::1")
    url = await start(aiohttp_server, [f"http://[::1]:{server.port}/v1"])
    async with aiohttp.ClientSession() as session:
        assert (await ask(session, url)).status == 200
    assert fake.requests[-1].headers["Host"] == f"[::1]:{server.port}"


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"([a-z_]+)(\{[^}]*\})? (\S+)", line)
        assert match, line
        if match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


async def test_metrics_are_present_and_move(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [f.url for f in fakes[:2]])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        async with session.get(url + "/metrics") as r:
            before = await r.text()
            assert r.headers["Content-Type"].startswith("text/plain")
        pin = pin_of(await ask(session, url))
        await ask(session, url, pin)
        await ask(session, url, "forged")
        async with session.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "[[overflow]]"}]}
        ) as r:
            await r.read()
        async with session.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}) as r:
            await r.read()
        async with session.post(url + "/v1/responses", data=b"{bad") as r:
            await r.read()
        async with session.get(url + "/metrics") as r:
            after = await r.text()
    assert _metric(after, "gymproxy_requests_total", route="/v1/chat/completions", status="200") == 4
    assert _metric(after, "gymproxy_requests_total", route="/v1/responses", status="400") == 1
    assert _metric(after, "gymproxy_request_duration_seconds_count", route="/v1/chat/completions") == 4
    assert _metric(after, "gymproxy_stream_ttfb_seconds_count", route="/v1/responses") == 1
    assert _metric(after, "gymproxy_upstream_requests_total", status="200") == 4
    assert _metric(after, "gymproxy_upstream_requests_total", status="400") == 1
    assert _metric(after, "gymproxy_context_overflows_total") == 1
    assert _metric(after, "gymproxy_pins_created_total") == 3  # the bad JSON never reached pinning
    assert _metric(after, "gymproxy_pins_repinned_total") == 1
    assert _metric(after, "gymproxy_upstream_healthy") == 2
    assert _metric(after, "gymproxy_upstream_inflight") == 0
    for name in ("gymproxy_requests_total", "gymproxy_upstream_healthy", "gymproxy_pins_created_total"):
        assert f"# TYPE {name}" in before


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_two_workers_pin_the_same_cookie_the_same_way(fleet):
    fakes, _ = fleet
    port = _free_port()
    command = [sys.executable, "-m", "gymproxy", "serve", "--workers", "2", "--port", str(port)]
    for fake in fakes:
        command += ["--upstream", fake.url]
    env = {**os.environ, "GYMPROXY_PIN_SECRET": SECRET}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            for _ in range(100):
                try:
                    async with session.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            pins = [pin_of(await ask(session, url)) for _ in range(3)]
            for pin in pins:
                target = next(f for f in fakes if f.url == pinned_to(pin))
                before = generations(target)
                for _ in range(8):  # a new connection each time: the kernel spreads them over both workers
                    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as fresh:
                        response = await ask(fresh, url, pin)
                        assert response.status == 200 and pin_of(response) is None
                assert generations(target) == before + 8
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
            raise AssertionError(f"gymproxy did not stop within 30 s of SIGTERM:\n{stderr.decode()}") from None
    assert process.returncode == 0, stderr.decode()


# --- session keys that real harnesses send ------------------------------------------------------

CODEX, CLAUDE = "session-id", "X-Claude-Code-Session-Id"


def _keyed(kind: str, key: str) -> tuple[str, dict, dict]:
    """(path, body, headers) of one request of a cookie-less client keyed by `kind`."""
    responses = {"model": "m", "input": "x"}
    if kind == "prompt_cache_key":
        return "/v1/responses", {**responses, "prompt_cache_key": key}, {}
    if kind == "user":
        return "/v1/responses", {**responses, "user": key}, {}
    if kind == "metadata.user_id":
        return "/v1/messages", _message_body(metadata={"user_id": key}), {}
    if kind == CLAUDE:
        return "/v1/messages", _message_body(), {kind: key}
    if kind == CODEX:
        return "/v1/responses", responses, {kind: key}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, {kind: key}


def _message_body(**extra) -> dict:
    return {"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}], **extra}


def _served(fakes: list[FakeVLLM]) -> list[int]:
    paths = ("/v1/chat/completions", "/v1/messages")
    return [sum(1 for r in fake.requests if r.path in paths) for fake in fakes]


def _landing(key: str) -> str:
    """Which of the upstreams named a and b the rendezvous hash gives `key` (both healthy)."""
    from gymproxy.pinning import Pinner

    class Named:
        def __init__(self, name: str) -> None:
            self.name, self.url, self.weight, self.healthy, self.inflight = name, name, 1.0, True, 0
            self.blocked = False
            self.pace = None

    pinner = Pinner([Named("a"), Named("b")], Signer(b"s", 3600), placement="least_outstanding")
    return pinner.pick(None, key).upstream.name


async def _two_named(aiohttp_server, fleet, **config) -> tuple[list[FakeVLLM], str]:
    fakes = fleet[0][:2]
    upstreams = [{"name": name, "url": fake.url} for name, fake in zip("ab", fakes, strict=True)]
    return fakes, await start(aiohttp_server, [], upstreams=upstreams, **config)


async def _send(session: aiohttp.ClientSession, url: str, path: str, body: dict, headers: dict) -> None:
    async with session.post(url + path, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        assert pin_of(r) is not None  # a cookie is offered, and the client never returns it


@pytest.mark.parametrize("kind", ["X-Session-ID", CODEX, CLAUDE, "prompt_cache_key", "user", "metadata.user_id"])
async def test_a_keyed_client_without_cookies_stays_on_one_upstream(aiohttp_server, fleet, kind):
    fakes, url = await _two_named(aiohttp_server, fleet)
    keys = [f"{kind}-session-{i}" for i in range(8)]
    assert {_landing(key) for key in keys} == {"a", "b"}  # the sessions spread over both
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        for key in keys:
            before = _served(fakes)
            for _ in range(3):
                await _send(session, url, *_keyed(kind, key))
            moved = [after - b for after, b in zip(_served(fakes), before, strict=True)]
            assert moved == ([3, 0] if _landing(key) == "a" else [0, 3]), (key, moved)


async def test_the_older_session_header_key_still_keys_sessions(aiohttp_server, fleet):
    pinning = {"secret": SECRET, "session_header": "X-Rollout", "placement": "round_robin"}
    fakes, url = await _two_named(aiohttp_server, fleet, pinning=pinning)
    key = next(f"rollout-{i}" for i in range(100) if _landing(f"rollout-{i}") == "b")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        for _ in range(3):
            await _send(session, url, *_keyed("X-Rollout", key))
        assert _served(fakes) == [0, 3]
        # It names the one header: the default list is not read as well, so these are placed
        # round robin, not all on the session-id's upstream.
        codex = next(f"codex-{i}" for i in range(100) if _landing(f"codex-{i}") == "a")
        for _ in range(4):
            await _send(session, url, *_keyed(CODEX, codex))
        assert _served(fakes) == [2, 5]


async def test_session_key_precedence(aiohttp_server, fleet):
    """A valid cookie, then a session header, then prompt_cache_key, then user."""
    fakes, url = await _two_named(aiohttp_server, fleet)
    on_a = [f"k-{i}" for i in range(100) if _landing(f"k-{i}") == "a"][:3]
    on_b = [f"k-{i}" for i in range(100) if _landing(f"k-{i}") == "b"][:3]
    cases = [  # (headers, body fields, cookie's upstream) -> the upstream that must serve
        ({CODEX: on_a[0]}, {"prompt_cache_key": on_b[0], "user": on_b[1]}, None, "a"),
        ({}, {"prompt_cache_key": on_a[1], "user": on_b[2]}, None, "a"),
        ({"X-Session-ID": on_b[0], CODEX: on_a[2]}, {}, None, "b"),  # the list's order
        ({CODEX: on_a[0]}, {"prompt_cache_key": on_a[1]}, "b", "b"),
    ]
    signer = Signer(SECRET.encode(), 3600)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        for headers, fields, pinned, expected in cases:
            if pinned is not None:
                headers = {**headers, "Cookie": f"{COOKIE}={signer.sign(pinned)}"}
            before = _served(fakes)
            async with session.post(
                url + "/v1/responses", json={"model": "m", "input": "x", **fields}, headers=headers
            ) as r:
                assert r.status == 200
            moved = [after - b for after, b in zip(_served(fakes), before, strict=True)]
            assert moved == ([1, 0] if expected == "a" else [0, 1]), (headers, fields)


# --- session ids ----------------------------------------------------------------------------------


def session_ids(fakes: list[FakeVLLM]) -> list[str | None]:
    """The X-Session-ID of each generation the fakes saw, in order of arrival per fake."""
    return [
        {k.lower(): v for k, v in r.headers.items()}.get("x-session-id")
        for fake in fakes
        for r in fake.requests
        if r.path == "/v1/chat/completions"
    ]


def old_pin(name: str, secret: bytes = SECRET.encode()) -> str:
    """A pin as gymproxy signed them before pins carried a session id: `<name>.<issued>.<mac>`."""
    encoded = base64.urlsafe_b64encode(name.encode()).rstrip(b"=").decode()
    payload = f"{encoded}.{int(time.time())}"
    mac = base64.urlsafe_b64encode(hmac.new(secret, payload.encode(), hashlib.sha256).digest()).rstrip(b"=").decode()
    return f"{payload}.{mac}"


def test_a_pin_carries_its_session_id_and_an_old_pin_still_opens():
    signer = Signer(b"s", 3600)
    pin = signer.sign("http://a/v1", "abc_DEF-1")
    assert pin.count(".") == 3 and (signer.unsign(pin) or ())[:2] == ("http://a/v1", "abc_DEF-1")
    assert signer.unsign(signer.sign("b")) is not None and signer.unsign(signer.sign("b"))[1]  # a new id
    assert (signer.unsign(old_pin("http://a/v1", b"s")) or ())[:2] == ("http://a/v1", "")
    assert signer.unsign(old_pin("http://a/v1", b"other")) is None
    encoded, sid, issued, mac = pin.split(".")
    assert signer.unsign(f"{encoded}.other.{issued}.{mac}") is None  # the id is signed too
    assert signer.unsign(f"{encoded}.{issued}.{mac}") is None


async def test_a_cookie_session_keeps_one_session_id_from_its_first_request(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [f.url for f in fakes])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        first = pin_of(await ask(session, url))
        await ask(session, url, first)
        other = pin_of(await ask(session, url))
        await ask(session, url, other)
    assert first is not None and other is not None
    ids = session_ids(fakes)
    opened = [Signer(SECRET.encode(), 3600).unsign(pin) for pin in (first, other)]
    sids = [o[1] for o in opened if o is not None]
    assert len(set(sids)) == 2 and all(sids)  # two sessions, two ids
    assert sorted(ids) == sorted([sids[0], sids[0], sids[1], sids[1]])  # the first request carried it already


async def test_a_keyed_session_is_identified_by_its_key(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [f.url for f in fakes])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        for key in ("rollout-1", "rollout-1", "rollout-2"):
            await ask(session, url, **{"session-id": key})
        # A key from a body may hold anything: it goes upstream as a digest, never as raw line breaks.
        async with session.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "user": "a\r\nb"}
        ) as r:
            assert r.status == 200
    ids = session_ids(fakes)
    keyed = sorted(i for i in ids if i and not i.startswith("sha256-"))
    assert keyed == ["rollout-1", "rollout-1", "rollout-2"]
    assert sum(1 for i in ids if i and i.startswith("sha256-")) == 1


async def test_an_old_pin_routes_to_its_upstream_and_is_reissued_with_an_id(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [f.url for f in fakes])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        response = await ask(session, url, old_pin(fakes[2].url))
        new = pin_of(response)
        assert generations(fakes[2]) == 1 and new is not None
        assert pin_of(await ask(session, url, new)) is None  # the new pin stands
    opened = Signer(SECRET.encode(), 3600).unsign(new)
    assert opened is not None and opened[0] == fakes[2].url and opened[1]
    assert session_ids([fakes[2]]) == [opened[1], opened[1]]  # the old pin's request already had its id


async def test_a_moved_pin_keeps_its_session_id(aiohttp_server, fleet):
    fakes, servers = fleet
    url = await start(aiohttp_server, [f.url for f in fakes], health={"interval": 60})
    signer = Signer(SECRET.encode(), 3600)
    pin = signer.sign(fakes[1].url, "moving-session")
    await servers[1].close()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        moved = pin_of(await ask(session, url, pin))
    assert moved is not None and signer.unsign(moved) is not None
    assert signer.unsign(moved)[0] != fakes[1].url and signer.unsign(moved)[1] == "moving-session"
    assert session_ids(fakes) == ["moving-session"]


async def test_conversation_params_carry_the_session_id_when_configured(aiohttp_server, fleet):
    fakes, _ = fleet
    url = await start(aiohttp_server, [fakes[0].url], forward_session_id_as_conversation_id=True)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        await ask(session, url, **{"X-Session-ID": "s-1"})
        async with session.post(url + "/v1/responses", json={"model": "m", "input": "x", "user": "u-2"}) as r:
            assert r.status == 200
    bodies = [r.json for r in fakes[0].requests if r.path == "/v1/chat/completions"]
    assert [b["conversation_params"] for b in bodies] == [{"conversation_id": "s-1"}, {"conversation_id": "u-2"}]
    plain = await start(aiohttp_server, [fakes[1].url])
    async with aiohttp.ClientSession() as session:
        await ask(session, plain)
    assert "conversation_params" not in fakes[1].requests[-1].json


async def test_prompt_and_cached_tokens_are_counted_per_upstream(aiohttp_server, fake_vllm):
    """From the usage of every reply gymproxy reads: chat and Responses, whole and streamed (a chat
    stream only with the client's include_usage); a relayed route's reply is not read, so not counted."""
    from gymproxy.testing.fake_vllm import Script

    url = await start(aiohttp_server, [fake_vllm.url])
    usage = {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103}
    usage["prompt_tokens_details"] = {"cached_tokens": 64}
    fake_vllm.push(*(Script(content="ok", usage=usage) for _ in range(6)))
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    bodies = [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {**chat, "stream": True}),  # no usage chunk asked for: none to count
        ("/v1/responses", {"model": "m", "input": "x"}),
        ("/v1/responses", {"model": "m", "input": "x", "stream": True}),
        ("/v1/completions", {"model": "m", "prompt": "x"}),  # relayed
    ]
    async with aiohttp.ClientSession() as session:
        for path, body in bodies:
            async with session.post(url + path, json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    name = fake_vllm.url
    assert _metric(text, "gymproxy_upstream_prompt_tokens_total", upstream=name) == 400
    assert _metric(text, "gymproxy_upstream_cached_prompt_tokens_total", upstream=name) == 256


async def test_a_session_leaves_an_upstream_whose_pace_is_far_slower(aiohttp_server, fleet):
    """Pace is measured from real replies (time over usage.completion_tokens): a pinned session on an
    upstream ~10 ms a token slower moves, a new session avoids it, and /metrics shows both paces."""
    from gymproxy.testing.fake_vllm import Script

    fakes, _ = fleet
    fast, slow = fakes[0], fakes[1]
    url = await start(aiohttp_server, [fast.url, slow.url], health={"interval": 60})
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    fast.push(*(Script(content="a b c d e", usage=usage) for _ in range(30)))
    slow.push(*(Script(content="a b c d e", usage=usage, chunk_delay=0.01) for _ in range(30)))
    signer = Signer(SECRET.encode(), 3600)
    on_fast, on_slow = signer.sign(fast.url), signer.sign(slow.url)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        for _ in range(25):
            assert pin_of(await ask(session, url, on_fast)) is None
        await asyncio.sleep(0.3)  # the pinner's best pace is looked up again: the fast one's is known
        stayed, moved = 0, None
        while moved is None and stayed < 30:  # a pace is unknown until some 20 replies: till then it stays
            moved = pin_of(await ask(session, url, on_slow))
            stayed += moved is None
        assert 15 <= stayed <= 25 and pinned_to(moved) == fast.url
        assert pinned_to(pin_of(await ask(session, url))) == fast.url  # a new session avoids it too
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    assert generations(slow) == stayed
    assert _metric(text, "gymproxy_pin_moves_total", reason="slow") == 1
    fast_pace = _metric(text, "gymproxy_upstream_pace_seconds", upstream=fast.url)
    slow_pace = _metric(text, "gymproxy_upstream_pace_seconds", upstream=slow.url)
    assert 0 < fast_pace < 0.01 < slow_pace
