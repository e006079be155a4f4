"""Access control, header hygiene, request ids, limits, the admin port and graceful shutdown."""

from __future__ import annotations

import asyncio
import base64

import aiohttp
import orjson
import pytest

from gymproxy.errors import LoopDetected
from gymproxy.proxy import MAX_HOPS, hop_chain
from gymproxy.testing.fake_vllm import Script

from .served import Served, free_port

SECRET_KEY = "sk-UPSTREAM-SECRET-123"
CHAT = {"messages": [{"role": "user", "content": "x"}]}


def last_generation(fake):
    return [r for r in fake.requests if r.path != "/v1/models"][-1]


def upstream_request_id(fake) -> str:
    return {k.lower(): v for k, v in last_generation(fake).headers.items()}["x-request-id"]


async def call(url: str, path: str = "/v1/chat/completions", body: dict | None = CHAT, **headers: str):
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        method = (
            session.post(url + path, json=body, headers=headers)
            if body is not None
            else session.get(url + path, headers=headers)
        )
        async with method as r:
            return r.status, r.headers, await r.read()


async def test_inbound_api_keys(start_proxy, fake_vllm, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nkey-from-file\n\n")
    url = await start_proxy(access={"api_keys": ["key-one"], "api_keys_file": str(keys)})
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "Basic key-one"},
        {"Authorization": "Bearer"},
    ):
        status, _, body = await call(url, **headers)
        assert status == 401, headers
        error = orjson.loads(body)["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert [r for r in fake_vllm.requests if r.path != "/v1/models"] == []
    for key in ("key-one", "key-from-file"):
        status, _, _ = await call(url, Authorization=f"Bearer {key}")
        assert status == 200
    status, _, _ = await call(url, "/health", None)
    assert status == 200  # probes need no key unless asked


async def test_admin_routes_can_require_a_key(start_proxy):
    url = await start_proxy(access={"api_keys": ["k"], "admin_requires_key": True})
    assert (await call(url, "/health", None))[0] == 401
    assert (await call(url, "/metrics", None))[0] == 401
    assert (await call(url, "/metrics", None, Authorization="Bearer k"))[0] == 200


async def test_upstream_key_never_leaks(start_proxy, fake_vllm, unused_tcp_port_factory):
    dead = f"http://127.0.0.1:{unused_tcp_port_factory()}/v1"
    url = await start_proxy(api_key=SECRET_KEY, base_url=[fake_vllm.url], health={"interval": 60})
    bodies = []
    fake_vllm.push(Script(status=500, error_message="boom"), Script(status=400, error_message="bad"))
    for _ in range(2):
        bodies.append((await call(url))[2])
    bodies.append((await call(url, "/metrics", None))[2])
    bodies.append((await call(url, "/health", None))[2])
    bodies.append((await call(url, "/v1/responses", {"model": "m", "input": "x", "stream": True}))[2])
    dead_url = await start_proxy(api_key=SECRET_KEY, base_url=[dead])
    bodies.append((await call(dead_url))[2])
    assert all(SECRET_KEY.encode() not in body for body in bodies)
    assert last_generation(fake_vllm).headers["Authorization"] == f"Bearer {SECRET_KEY}"


async def test_credentials_in_an_upstream_url_are_never_shown(fake_vllm, tmp_path, unused_tcp_port_factory):
    """`http://user:pass@host/v1`: basic auth upstream, and the URL without its user info everywhere
    else: the startup log, /health, /metrics, 502 and 503 bodies, and the pin cookie (which names
    its upstream)."""
    secret = "s3cret-PASSWORD"
    live = fake_vllm.url.replace("http://", f"http://gym:{secret}@")
    dead = f"http://gym:{secret}@127.0.0.1:{unused_tcp_port_factory()}/v1"
    seen: list[bytes] = []
    async with Served(tmp_path, {"base_url": [live, dead], "pinning": {"secret": "s"}}) as fleet:
        for path in ("/health", "/metrics"):
            seen.append((await call(fleet.url, path, None))[2])
        for i in range(6):  # new sessions on both upstreams: the dead one fails over to the live one
            status, headers, raw = await call(fleet.url, **{"X-Session-ID": f"session-{i}"})
            assert status == 200, raw
            seen.append(raw + headers.get("Set-Cookie", "").encode())
            pin = headers["Set-Cookie"].partition("=")[2].partition(";")[0]
            seen.append(base64.urlsafe_b64decode(pin.partition(".")[0] + "==="))  # the upstream it names
        seen.append((await call(fleet.url, "/metrics", None))[2])  # now with per-upstream counters
        fleet_log = fleet.log
    async with Served(tmp_path, {"base_url": [dead]}) as alone:
        status, _, raw = await call(alone.url)
        assert status == 502 and b"127.0.0.1" in raw
        seen.append(raw)
        alone_log = alone.log
    for text in (*seen, fleet_log.encode(), alone_log.encode()):
        assert secret.encode() not in text and b"gym:" not in text, text[:400]
    assert "upstream http://127.0.0.1:" in fleet_log  # the URLs are logged, just without credentials
    token = base64.b64encode(f"gym:{secret}".encode()).decode()
    assert last_generation(fake_vllm).headers["Authorization"] == f"Basic {token}"


async def test_client_headers_are_not_forwarded(start_proxy, fake_vllm):
    url = await start_proxy(api_key="upstream")
    hostile = {
        "Authorization": "Bearer client-secret",
        "Cookie": "gymproxy_pin=x; other=1",
        "Proxy-Authorization": "Basic abc",
        "X-Forwarded-For": "1.2.3.4",
        "TE": "trailers",
        "Upgrade": "h2c",
        "X-Custom": "leak",
    }
    status, _, _ = await call(url, **hostile)
    assert status == 200
    sent = {k.lower() for k in last_generation(fake_vllm).headers}
    assert sent <= {
        "host",
        "authorization",
        "content-type",
        "content-length",
        "x-request-id",
        "x-session-id",  # gymproxy's own: the session's id (never a client's header as it came)
        "x-gymproxy-hop",  # gymproxy's own: its instance id, for loop detection
        "accept",
        "accept-encoding",
        "user-agent",
    }
    assert last_generation(fake_vllm).headers["Authorization"] == "Bearer upstream"


async def test_request_id_is_passed_both_ways_or_minted(proxy_url, fake_vllm):
    status, headers, _ = await call(proxy_url, **{"X-Request-Id": "rollout-7.turn-3"})
    assert status == 200 and headers["X-Request-Id"] == "rollout-7.turn-3"
    assert upstream_request_id(fake_vllm) == "rollout-7.turn-3"
    for given in (None, "bad id with spaces", "x" * 500):
        extra = {} if given is None else {"X-Request-Id": given}
        status, headers, _ = await call(proxy_url, **extra)
        minted = headers["X-Request-Id"]
        assert minted != given and len(minted) == 32
        assert upstream_request_id(fake_vllm) == minted
    _, headers, _ = await call(
        proxy_url, "/v1/responses", {"model": "m", "input": "x", "stream": True}, **{"X-Request-Id": "s-1"}
    )
    assert headers["X-Request-Id"] == "s-1"
    status, headers, _ = await call(proxy_url, "/v1/responses", {"bad": 1}, **{"X-Request-Id": "e-1"})
    assert status == 400 and headers["X-Request-Id"] == "e-1"


@pytest.mark.parametrize("when_full, statuses", [("reject", [200, 503]), ("queue", [200, 200])])
async def test_per_upstream_cap(start_proxy, fake_vllm, when_full, statuses):
    url = await start_proxy(limits={"max_inflight_per_upstream": 1, "when_full": when_full})
    fake_vllm.push(Script(content="slow one", chunk_delay=0.3), Script(content="second"))
    first = asyncio.ensure_future(call(url))
    await asyncio.sleep(0.1)
    second = asyncio.ensure_future(call(url))
    results = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert [r[0] for r in results] == statuses
    if when_full == "reject":
        assert "cap" in orjson.loads(results[1][2])["error"]["message"]


async def test_oversized_headers_are_refused_cleanly(proxy_url):
    reader, writer = await asyncio.open_connection(*proxy_url.removeprefix("http://").split(":"))
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    await writer.wait_closed()
    assert line.split()[1] in (b"400", b"431")
    assert (await call(proxy_url, "/health", None))[0] == 200


# --- open admin changes, and a fleet that loops back to gymproxy (issue 21: M7 and its lows) ---------


async def test_open_admin_changes_on_a_public_host_refuse_to_start(fake_vllm, tmp_path):
    config = {"base_url": [fake_vllm.url], "host": "0.0.0.0", "access": {"admin_fleet_changes": True}}
    served = Served(tmp_path, config)
    served.start()
    assert await served.wait(20) == 2
    lines = served.log.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in served.log, served.log
    assert "access.admin_fleet_changes" in lines[0] and "access.api_keys" in lines[0] and "loopback" in lines[0]


async def test_open_admin_changes_on_loopback_start_with_a_warning(fake_vllm, tmp_path):
    config = {"base_url": [fake_vllm.url], "host": "127.0.0.1", "access": {"admin_fleet_changes": True}}
    async with Served(tmp_path, config) as served:
        assert (await call(served.url, "/admin/upstreams", None))[0] == 200
    assert "any local process that reaches 127.0.0.1 can change the upstreams" in served.log


async def test_an_upstream_that_is_gymproxy_itself_ends_in_one_508(tmp_path):
    """Its own address as an upstream: each request is refused on its first way back in, and the
    health checks (which carry the hop header too) mark that upstream down. With two workers the
    request may come back to the other one: they share the instance id."""
    port = free_port()
    config = {"port": port, "base_url": [f"http://127.0.0.1:{port}/v1"], "health": {"interval": 3600}}
    async with Served(tmp_path, config, "--workers", "2") as served:
        await until_logged(served, " listening on http://", 2)
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), timeout=timeout) as session:
            for _ in range(3):
                async with session.post(served.url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 508, await r.text()
            async with session.get(served.url + "/metrics") as r:
                metrics = await r.text()
    chat = [line for line in metrics.splitlines() if line.startswith('gymproxy_requests_total{route="/v1/chat')]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in chat) == 6, chat  # 3 from the client, 3 back round


async def test_two_gymproxies_chained_on_purpose_still_work(fake_vllm, tmp_path):
    async with Served(tmp_path, {"base_url": [fake_vllm.url]}) as inner:
        async with Served(tmp_path, {"base_url": [inner.url + "/v1"]}) as outer:
            for _ in range(3):
                assert (await call(outer.url))[0] == 200
    chat = [r for r in fake_vllm.requests if r.path == "/v1/chat/completions"]
    assert len(chat) == 3
    hops = [h.split(", ") for r in chat for name, h in r.headers.items() if name.lower() == "x-gymproxy-hop"]
    assert len(hops) == 3 and all(len(h) == 2 and h[0] != h[1] for h in hops), hops  # each appended its own


async def test_a_loop_through_two_gymproxies_ends_at_once(tmp_path):
    """A to B to A: each gymproxy appends its id to the hop header, so A finds its own on the way
    back in, whatever came between (before, B replaced it, and 3 requests made some 34,400 sends
    on each over 37 s)."""
    a, b = free_port(), free_port()
    health = {"interval": 3600}
    async with Served(tmp_path, {"port": a, "base_url": [f"http://127.0.0.1:{b}/v1"], "health": health}) as first:
        async with Served(tmp_path, {"port": b, "base_url": [f"http://127.0.0.1:{a}/v1"], "health": health}) as second:
            for _ in range(3):
                status, _, body = await call(first.url)
                assert status == 508 and "came back to a gymproxy it went through" in body.decode(), body
            chat = [await chat_requests(first.url), await chat_requests(second.url)]
    assert chat == [6, 3]  # A: 3 from the client, 3 back from B; B: 3 from A


async def chat_requests(url: str) -> float:
    metrics = (await call(url, "/metrics", None))[2].decode()
    chat = [line for line in metrics.splitlines() if line.startswith('gymproxy_requests_total{route="/v1/chat')]
    return sum(float(line.rsplit(" ", 1)[1]) for line in chat)


def test_the_hop_header_is_appended_and_bounded():
    assert hop_chain([], "me") is None  # from no gymproxy: the upstream's own header, "me" alone, goes
    assert hop_chain(["a, b", "c"], "me") == "a, b, c, me"
    assert hop_chain(["a,, not an id!, " + "x" * 65 + ", b"], "me") == "a, b, me"  # not ids: dropped
    for given in (["me"], ["a, me, b"], ["a", " me "]):
        with pytest.raises(LoopDetected, match="came back to a gymproxy it went through"):
            hop_chain(given, "me")
    assert hop_chain([", ".join(f"g{i}" for i in range(MAX_HOPS - 1))], "me").endswith(", me")
    with pytest.raises(LoopDetected, match=f"came through {MAX_HOPS} gymproxies"):
        hop_chain([", ".join(f"g{i}" for i in range(MAX_HOPS))], "me")


async def until_logged(served: Served, text: str, count: int) -> None:
    for _ in range(400):
        if served.log.count(text) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{text!r} not logged {count} times:\n{served.log[-3000:]}")
