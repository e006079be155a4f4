"""A live fleet: upstreams added, drained and removed while gymproxy serves (Fleet.update, SIGHUP,
the admin routes, DNS discovery), with what moves and what stays."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import aiohttp
import pytest

from gymproxy import build_config, create_app
from gymproxy.config import UpstreamSpec
from gymproxy.pinning import Pinner, Signer, _score
from gymproxy.plugin import PROXIES
from gymproxy.proxy import Proxy
from gymproxy.testing.fake_vllm import FakeVLLM, Script

from .test_fleet import SECRET, ask, generations, pin_of

KEY = "admin-key"


@pytest.fixture
async def fleet(aiohttp_server):
    """Four fake vLLMs on their own ports (three to start with, one to add)."""
    fakes = [FakeVLLM(model=f"m{i}") for i in range(4)]
    for fake in fakes:
        fake.url = str((await aiohttp_server(fake.app)).make_url("/v1"))
    return fakes


async def serve(aiohttp_server, **config: Any) -> tuple[str, Proxy]:
    config.setdefault("pinning", {"secret": SECRET})
    app = create_app(build_config(config, environ={}))
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), app[PROXIES][0]


async def until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def states(proxy: Proxy) -> dict[str, str]:
    return {s["name"]: s["state"] for s in proxy.fleet.states()}


def spec(fake: FakeVLLM, name: str | None = None, **fields: Any) -> UpstreamSpec:
    return UpstreamSpec(url=fake.url, name=name, **fields)


# --- Fleet.update ------------------------------------------------------------------------------------


async def test_a_new_upstream_takes_sessions_once_healthy_and_removed_pins_move(aiohttp_server, fleet):
    url, proxy = await serve(aiohttp_server, base_url=[f.url for f in fleet[:3]])
    signer = Signer(SECRET.encode(), 3600)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        pins = [pin_of(await ask(session, url)) for _ in range(30)]
        names = [opened[0] for p in pins if p and (opened := signer.unsign(p))]
        assert len(names) == 30 and set(names) == {f.url for f in fleet[:3]}
        await asyncio.sleep(1.05 - time.time() % 1)  # pins are issued in whole seconds: join in a later one
        change = proxy.fleet.update([spec(f) for f in (fleet[0], fleet[1], fleet[3])])
        assert change.added == [fleet[3].url] and change.removed == [fleet[2].url] and not change.changed
        await until(lambda: states(proxy)[fleet[3].url] == "healthy")  # its first check ran at once
        await until(lambda: fleet[2].url not in states(proxy))  # nothing in flight: forgotten
        serving = list(proxy.fleet.upstreams)
        joined = 0
        for pin, name in zip(pins, names, strict=True):
            response = await ask(session, url, pin)
            assert response.status == 200
            _, sid, _ = signer.unsign(pin) or ("", "", 0)
            now = signer.unsign(pin_of(response) or pin)
            assert now is not None and now[1] == sid  # the session keeps its id wherever it goes
            if name == fleet[2].url:
                assert now[0] in (fleet[0].url, fleet[1].url, fleet[3].url)
            elif max(serving, key=lambda u: _score(sid, u)).url == fleet[3].url:
                assert now[0] == fleet[3].url  # the new upstream is its first choice: it moves there
                joined += 1
            else:
                assert now[0] == name  # the others stay where they are
        assert joined == proxy.fleet.pinner.moves["joined"] and 0 < joined < 20
    assert proxy.fleet.added == 1 and proxy.fleet.removed == 1
    metrics = proxy.metrics.render(proxy.fleet.gauges())
    assert "gymproxy_upstreams_added_total 1" in metrics and "gymproxy_upstreams_removed_total 1" in metrics


async def test_a_new_upstream_that_is_not_healthy_takes_no_sessions(aiohttp_server, fleet):
    url, proxy = await serve(aiohttp_server, base_url=[fleet[0].url], health={"interval": 60})
    proxy.fleet.update([spec(fleet[0]), UpstreamSpec(url="http://127.0.0.1:9/v1", name="dead")])
    await asyncio.sleep(0.3)
    assert states(proxy) == {fleet[0].url: "healthy", "dead": "starting"}
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        for _ in range(10):
            assert (await ask(session, url)).status == 200
    assert generations(fleet[0]) == 10


async def test_weight_and_key_change_in_place_and_keep_their_pins(aiohttp_server, fleet):
    url, proxy = await serve(
        aiohttp_server, upstreams=[{"name": "a", "url": fleet[0].url}, {"name": "b", "url": fleet[1].url}]
    )
    before = proxy.fleet.upstreams[0]
    change = proxy.fleet.update([spec(fleet[0], "a", weight=3, api_key="k2"), spec(fleet[1], "b")])
    assert change.changed == ["a"] and not change.added and not change.removed
    assert proxy.fleet.upstreams[0] is before and before.weight == 3
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        assert (await ask(session, url, Signer(SECRET.encode(), 3600).sign("a"))).status == 200
    assert fleet[0].requests[-1].headers["Authorization"] == "Bearer k2"


def test_adding_one_upstream_moves_about_one_in_n_keyed_sessions():
    class Candidate:
        def __init__(self, name: str) -> None:
            self.name = self.url = name
            self.weight, self.healthy, self.inflight, self.blocked = 1.0, True, 0, False
            self.pace = None

    upstreams = [Candidate(f"vllm-{i}") for i in range(4)]
    pinner = Pinner(upstreams, Signer(b"s", 3600), placement="least_outstanding")
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4000)]
    before = {key: pinner.pick(None, key).upstream.name for key in keys}
    pinner.set_upstreams([*upstreams, Candidate("vllm-4")])
    after = {key: pinner.pick(None, key).upstream.name for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert all(after[key] == "vllm-4" for key in moved)  # moves go to the new one only
    assert 0.8 / 5 < len(moved) / len(keys) < 1.2 / 5  # its fair share: ~1/N
    pinner.set_upstreams(upstreams[1:])  # one removed: only its own sessions move
    removed = {key: pinner.pick(None, key).upstream.name for key in keys}
    assert all(removed[key] == before[key] for key in keys if before[key] != "vllm-0")


async def test_drain_lets_a_stream_in_flight_finish(aiohttp_server, fleet):
    url, proxy = await serve(aiohttp_server, base_url=[fleet[0].url])
    fleet[0].push(Script(content=" ".join(f"w{i}" for i in range(20)), chunk_delay=0.05))
    async with aiohttp.ClientSession() as session:
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
        async with session.post(url + "/v1/chat/completions", json=body) as streaming:
            first = await streaming.content.readany()
            proxy.fleet.update([spec(fleet[1])])
            assert states(proxy)[fleet[0].url] == "removing"
            rest = await streaming.read()
        assert streaming.status == 200 and b"[DONE]" in first + rest and b"w19" in first + rest
        await until(lambda: fleet[0].url not in states(proxy))
        await until(lambda: states(proxy)[fleet[1].url] == "healthy")
        assert (await ask(session, url)).status == 200
    assert generations(fleet[1]) == 1


# --- Proxy.reload (what SIGHUP applies) ----------------------------------------------------------------


async def test_reload_applies_the_upstreams_and_names_what_needs_a_restart(aiohttp_server, fleet, caplog):
    _, proxy = await serve(aiohttp_server, base_url=[fleet[0].url])
    caplog.set_level(logging.INFO, "gymproxy")
    new = build_config(
        {"base_url": [fleet[0].url, fleet[1].url], "stream_keepalive_s": 3, "pinning": {"secret": SECRET}}
    )
    assert proxy.reload(new) == ["stream_keepalive_s"]
    assert "stream_keepalive_s changed and needs a restart" in caplog.text
    assert list(states(proxy)) == [fleet[0].url, fleet[1].url]
    assert proxy.config.stream_keepalive_s == 15  # not applied


# --- the admin routes ----------------------------------------------------------------------------------


async def test_admin_changes_are_off_unless_enabled(aiohttp_server, fleet):
    url, _ = await serve(aiohttp_server, base_url=[fleet[0].url])
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/admin/upstreams") as r:
            assert r.status == 200 and [u["state"] for u in (await r.json())["upstreams"]] == ["healthy"]
        async with session.post(url + "/admin/upstreams", json={"url": fleet[1].url}) as r:
            assert r.status == 403 and "admin_fleet_changes" in (await r.json())["error"]["message"]


async def test_admin_routes_need_the_key_and_add_drain_remove(aiohttp_server, fleet):
    url, proxy = await serve(
        aiohttp_server, base_url=[fleet[0].url], access={"api_keys": [KEY], "admin_fleet_changes": True}
    )
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        async with session.post(url + "/admin/upstreams", json={"url": fleet[1].url, "name": "b"}) as r:
            assert r.status == 401
        async with session.delete(url + f"/admin/upstreams/{fleet[0].url}") as r:
            assert r.status == 401
        body = {"url": fleet[1].url, "name": "b", "weight": 2, "api_key": "upstream-key"}
        async with session.post(url + "/admin/upstreams", json=body, headers=auth) as r:
            assert r.status == 201
            listed = {u["name"]: u for u in (await r.json())["upstreams"]}
            assert listed["b"]["weight"] == 2 and listed["b"]["state"] in ("starting", "healthy")
            assert "upstream-key" not in await r.text()
        await until(lambda: states(proxy)["b"] == "healthy")
        async with session.post(url + "/admin/upstreams", json={"url": fleet[2].url, "name": "b"}, headers=auth) as r:
            assert r.status == 409 and (await r.json())["error"]["param"] == "name"
        async with session.post(url + "/admin/upstreams", json={"name": "c"}, headers=auth) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "url"
        async with session.post(url + "/admin/upstreams", json={"url": "ftp://x", "name": "c"}, headers=auth) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "url"
        async with session.post(url + "/admin/upstreams", json={"url": fleet[2].url, "weight": 0}, headers=auth) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "weight"
        async with session.post(url + "/admin/upstreams/nope/drain", headers=auth) as r:
            assert r.status == 404
        # Drained: listed, and no new request goes there.
        async with session.post(url + f"/admin/upstreams/{fleet[0].url}/drain", headers=auth) as r:
            assert r.status == 200
        assert states(proxy)[fleet[0].url] == "drained"
        before = generations(fleet[0])
        for _ in range(5):
            assert (await ask(session, url, **auth)).status == 200
        assert generations(fleet[0]) == before
        async with session.delete(url + "/admin/upstreams/b", headers=auth) as r:
            assert r.status == 200
        await until(lambda: "b" not in states(proxy))
        async with session.delete(url + "/admin/upstreams/b", headers=auth) as r:
            assert r.status == 404
        async with session.get(url + "/admin/upstreams", headers=auth) as r:
            assert [u["name"] for u in (await r.json())["upstreams"]] == [fleet[0].url]


# Refused admin changes: each is a 400 naming the field, and nothing is recorded (issue 21, M4).
BAD_ADDS = [
    ({"url": "http://127.0.0.1:99999/v1", "name": "bad"}, "url"),
    ({"url": "http://127.0.0.1:99999/v1"}, "url"),
    ({"url": "http://[zz::1]/v1", "name": "bad"}, "url"),
    ({"url": "http:///v1", "name": "bad"}, "url"),
    ({"url": "file:///etc/passwd"}, "url"),
    ({"url": "http://127.0.0.1:0/v1", "name": "bad"}, "url"),
    ({"url": "http://a b/v1", "name": "bad"}, "url"),
    ({"url": "http://127.0.0.1:8/v1#frag", "name": "bad"}, "url"),
    ({"url": "http://127.0.0.1:8/v1?api-version=1"}, "url"),
    ({"url": "GOOD", "name": "bad", "api_key": "k\r\nX-Injected: 1"}, "api_key"),
    ({"url": "GOOD", "name": "bad", "api_key": "k" * 5000}, "api_key"),
    ({"url": "GOOD", "name": "x" * 100_000}, "name"),
    ({"url": "GOOD", "name": 'a"b'}, "name"),
    ({"url": "GOOD", "name": "bad", "weight": 1e300}, "weight"),
    ({"url": "GOOD", "name": "bad", "weight": -1}, "weight"),
    ({"url": "GOOD", "name": "bad", "weight": "NaN"}, "weight"),
]


@pytest.mark.parametrize(("body", "field"), BAD_ADDS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_ADDS)])
async def test_a_bad_admin_change_is_a_400_that_changes_nothing(aiohttp_server, fleet, body, field):
    url, proxy = await serve(
        aiohttp_server, base_url=[fleet[0].url], access={"api_keys": [KEY], "admin_fleet_changes": True}
    )
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {k: fleet[1].url if v == "GOOD" else v for k, v in body.items()}
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:

        async def listed() -> list[str]:
            async with session.get(url + "/admin/upstreams", headers=auth) as r:
                assert r.status == 200
                return [u["name"] for u in (await r.json())["upstreams"]]

        before = await listed()
        async with session.post(url + "/admin/upstreams", json=body, headers=auth) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
            assert error["param"] == field and error["type"] == "invalid_request_error"
            assert len(error["message"]) < 400  # a huge value is not echoed back
        assert await listed() == before and proxy.overlay.changes.added == {}
        # Fleet management still works: an add, a reload, a removal.
        async with session.post(url + "/admin/upstreams", json={"url": fleet[2].url, "name": "c"}, headers=auth) as r:
            assert r.status == 201
        proxy.reload(build_config({"base_url": [fleet[0].url, fleet[3].url], "pinning": {"secret": SECRET}}))
        assert await listed() == [fleet[0].url, fleet[3].url, "c"]
        async with session.delete(url + "/admin/upstreams/c", headers=auth) as r:
            assert r.status == 200


async def test_an_admin_add_past_max_upstreams_is_a_409(aiohttp_server, fleet):
    url, proxy = await serve(
        aiohttp_server, base_url=[fleet[0].url], access={"admin_fleet_changes": True}, limits={"max_upstreams": 2}
    )
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/admin/upstreams", json={"url": fleet[1].url}) as r:
            assert r.status == 201
        async with session.post(url + "/admin/upstreams", json={"url": fleet[2].url}) as r:
            assert r.status == 409 and "limits.max_upstreams" in (await r.json())["error"]["message"]
        async with session.delete(url + f"/admin/upstreams/{fleet[1].url}") as r:
            assert r.status == 200
        await until(lambda: fleet[1].url not in states(proxy))
        async with session.post(url + "/admin/upstreams", json={"url": fleet[2].url}) as r:
            assert r.status == 201
    assert sorted(states(proxy)) == sorted([fleet[0].url, fleet[2].url])


def test_an_overlay_entry_that_cannot_be_built_is_skipped_and_the_rest_applies(tmp_path, caplog):
    """An overlay file written by an older gymproxy, which recorded a change it then failed to apply."""
    import msgspec

    path = tmp_path / "fleet.json"
    good = "http://127.0.0.1:8001/v1"
    path.write_bytes(
        msgspec.json.encode(
            {
                "added": {
                    "bad": {"url": "http://127.0.0.1:99999/v1", "name": "bad"},
                    "worse": {"url": "http://[zz::1]/v1", "name": "worse", "weight": 1e300},
                    "good": {"url": good, "name": "good"},
                },
                "drained": [],
                "removed": ["http://127.0.0.1:8000/v1"],
            }
        )
    )
    proxy = Proxy(build_config({"base_url": ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8002/v1"]}, environ={}))
    proxy.overlay.path = path
    caplog.set_level(logging.INFO, "gymproxy")
    proxy.reload(proxy.config)  # what a SIGHUP does
    assert sorted(u.name for u in proxy.fleet.upstreams) == sorted(["http://127.0.0.1:8002/v1", "good"])
    assert "upstream 'bad' cannot be used" in caplog.text and "upstream 'worse' cannot be used" in caplog.text
    # The next change writes the file without them.
    from gymproxy import overlay

    proxy.change(lambda c: overlay.drain(c, "good"))
    assert sorted(msgspec.json.decode(path.read_bytes())["added"]) == ["good"]


async def test_admin_changes_survive_a_reload(aiohttp_server, fleet):
    _, proxy = await serve(aiohttp_server, base_url=[fleet[0].url, fleet[1].url], access={"admin_fleet_changes": True})
    from gymproxy import overlay

    proxy.change(lambda c: overlay.add(c, "x", spec(fleet[2], "x")))
    proxy.change(lambda c: overlay.remove(c, fleet[0].url))
    proxy.reload(build_config({"base_url": [fleet[0].url, fleet[1].url, fleet[3].url], "pinning": {"secret": SECRET}}))
    assert sorted(n for n, s in states(proxy).items() if s != "removing") == sorted([fleet[1].url, fleet[3].url, "x"])


# --- DNS discovery ---------------------------------------------------------------------------------------


async def test_dns_discovery_follows_the_answers_and_keeps_the_last_set_on_failure(aiohttp_server, caplog):
    fake = FakeVLLM()
    # On every address, so 127.0.0.1 and 127.0.0.2 (loopback too, on Linux) both reach it.
    ports = [(await aiohttp_server(fake.app, host="0.0.0.0")).port]
    answers: list[Any] = [["127.0.0.1"]]

    async def resolve(host: str, port: int) -> list[str]:
        answer = answers[0]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    config = {"upstreams_dns": f"http://vllm.example:{ports[0]}/v1", "upstreams_dns_interval_s": 0.05}
    app = create_app(build_config({**config, "pinning": {"secret": SECRET}}, environ={}))
    proxy = app[PROXIES][0]
    proxy.resolve = resolve
    caplog.set_level(logging.INFO, "gymproxy")
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    first = f"127.0.0.1:{ports[0]}"
    assert list(states(proxy)) == [first]
    await until(lambda: states(proxy)[first] == "healthy")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        assert (await ask(session, url)).status == 200
        answers[0] = ["127.0.0.1", "127.0.0.2"]  # scaled up
        await until(lambda: states(proxy).get(f"127.0.0.2:{ports[0]}") == "healthy")
        answers[0] = OSError("Temporary failure in name resolution")
        await asyncio.sleep(0.3)
        assert len(states(proxy)) == 2  # the last set stays
        assert caplog.text.count("cannot resolve") == 1  # logged once, not every round
        answers[0] = []  # an empty answer is a failure too
        await asyncio.sleep(0.2)
        assert len(states(proxy)) == 2
        answers[0] = ["127.0.0.2"]  # scaled down
        await until(lambda: list(states(proxy)) == [f"127.0.0.2:{ports[0]}"])
        assert "resolves again" in caplog.text
        assert (await ask(session, url)).status == 200
    assert proxy.fleet.added == 2 and proxy.fleet.removed == 1  # the first answer's one counts as added


async def test_a_dns_resolution_that_never_answers_is_logged_and_following_goes_on(aiohttp_server, caplog):
    fake = FakeVLLM()
    port = (await aiohttp_server(fake.app)).port
    calls = []
    hang = asyncio.Event()  # never set: a resolver that never answers
    answer: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        if not answer:
            await hang.wait()
        return answer

    config = {"upstreams_dns": f"http://vllm.example:{port}/v1", "upstreams_dns_interval_s": 0.1}
    app = create_app(build_config({**config, "base_url": [], "pinning": {"secret": SECRET}}, environ={}))
    proxy = app[PROXIES][0]
    proxy.resolve = resolve
    caplog.set_level(logging.INFO, "gymproxy")
    await aiohttp_server(app)  # starts even though the first resolution hangs
    await until(lambda: len(calls) >= 4)  # each round gave up on its hung resolution and the next one ran
    assert "cannot resolve (no answer in 0.1 s)" in caplog.text
    assert states(proxy) == {}
    answer.append("127.0.0.1")
    await until(lambda: states(proxy).get(f"127.0.0.1:{port}") == "healthy")
    assert "resolves again" in caplog.text


async def test_dns_answers_past_max_upstreams_use_the_first_ones(aiohttp_server, caplog):
    port = (await aiohttp_server(FakeVLLM().app, host="0.0.0.0")).port  # 127.0.0.x all reach it
    addresses = [f"127.0.0.{i}" for i in range(1, 11)]

    async def resolve(host: str, port: int) -> list[str]:
        return addresses

    config = {"upstreams_dns": f"http://vllm.example:{port}/v1", "limits": {"max_upstreams": 4}}
    app = create_app(build_config({**config, "pinning": {"secret": SECRET}}, environ={}))
    proxy = app[PROXIES][0]
    proxy.resolve = resolve
    caplog.set_level(logging.INFO, "gymproxy")
    await aiohttp_server(app)
    assert list(states(proxy)) == [f"{a}:{port}" for a in addresses[:4]]
    assert caplog.text.count("10 upstreams wanted") == 1


def test_upstreams_in_the_file_past_max_upstreams_are_an_error():
    from gymproxy.config import ConfigError

    urls = [f"http://10.0.0.{i}:8000/v1" for i in range(5)]
    assert len(build_config({"base_url": urls, "limits": {"max_upstreams": 5}}, environ={}).base_url) == 5
    with pytest.raises(ConfigError, match="6 upstreams; limits.max_upstreams allows 5"):
        build_config({"base_url": urls, "upstreams": [{"url": "http://h/v1"}], "limits": {"max_upstreams": 5}})


def test_dns_target_forms():
    from gymproxy.config import ConfigError, DnsTarget, dns_target

    assert dns_target("vllm:8000") == DnsTarget("http", "vllm", 8000, "/v1")
    assert dns_target("https://vllm.ns.svc:443/v2") == DnsTarget("https", "vllm.ns.svc", 443, "/v2")
    from gymproxy.discovery import to_specs

    assert [s.url for s in to_specs(dns_target("v:1"), ["::1", "10.0.0.1"])] == [
        "http://[::1]:1/v1",
        "http://10.0.0.1:1/v1",
    ]
    for bad in ("vllm", "ftp://vllm:1", "http://vllm/v1", "vllm:99999"):
        with pytest.raises(ConfigError, match="upstreams_dns"):
            build_config({"upstreams_dns": bad}, environ={})


# --- on the real command: SIGHUP, and workers ---------------------------------------------------------


async def _keep_asking(url: str, statuses: list[int], stop: asyncio.Event) -> None:
    """One session after another, each asking twice (the second time with its pin), until `stop`."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        while not stop.is_set():
            first = await ask(session, url)
            statuses.append(first.status)
            statuses.append((await ask(session, url, pin_of(first))).status)


async def test_sighup_adds_and_removes_upstreams_with_no_failed_request(fleet, tmp_path):
    import signal

    import yaml

    from .served import Served

    config: dict[str, Any] = {"base_url": [fleet[0].url, fleet[1].url], "pinning": {"secret": SECRET}}
    async with Served(tmp_path, config) as served:
        statuses: list[int] = []
        stop = asyncio.Event()
        askers = [asyncio.ensure_future(_keep_asking(served.url, statuses, stop)) for _ in range(4)]
        await until(lambda: len(statuses) > 20)
        served.config_path.write_text(yaml.safe_dump({**config, "base_url": [fleet[1].url, fleet[2].url]}))
        assert served.process is not None
        served.process.send_signal(signal.SIGHUP)
        await until(lambda: "fleet reloaded" in served.log)
        await asyncio.sleep(0.3)  # requests sent to the removed one just before the reload finish there
        before = generations(fleet[0])
        await until(lambda: generations(fleet[2]) > 5)  # the new one takes sessions
        await asyncio.sleep(0.3)
        assert generations(fleet[0]) == before  # the removed one takes none
        # An invalid file changes nothing: the fleet keeps serving.
        served.config_path.write_text("base_url: [http://x/v1]\nno_such_key: 1\n")
        served.process.send_signal(signal.SIGHUP)
        await until(lambda: "the new config is not used" in served.log)
        count = len(statuses)
        await until(lambda: len(statuses) > count + 20)
        stop.set()
        await asyncio.gather(*askers)
        async with aiohttp.ClientSession() as session, session.get(served.url + "/admin/upstreams") as r:
            assert [u["name"] for u in (await r.json())["upstreams"]] == [fleet[1].url, fleet[2].url]
        assert served.process.poll() is None  # no restart
    assert set(statuses) == {200}, sorted(set(statuses))
    assert "no_such_key" in served.log


def _workers_config(fleet: Any) -> dict[str, Any]:
    """`gymproxy serve --workers 2` in front of `fleet[0]`, admin changes on behind KEY."""
    return {
        "base_url": [fleet[0].url],
        "pinning": {"secret": SECRET},
        "access": {"api_keys": [KEY], "admin_fleet_changes": True},
    }


async def _names_seen(url: str) -> list[list[str]]:
    """What each of 12 new connections (spread over the workers by the kernel) lists."""
    seen = []
    auth = {"Authorization": f"Bearer {KEY}"}
    for _ in range(12):
        async with aiohttp.ClientSession() as fresh, fresh.get(url + "/admin/upstreams", headers=auth) as r:
            seen.append(sorted(u["name"] for u in (await r.json())["upstreams"] if u["state"] != "removing"))
    return seen


async def test_with_two_workers_an_admin_change_and_a_sighup_reach_both(fleet, tmp_path):
    import signal

    import yaml

    from .served import Served

    config = _workers_config(fleet)
    auth = {"Authorization": f"Bearer {KEY}"}

    async with Served(tmp_path, config, "--workers", "2") as served:
        await until(lambda: served.log.count(" listening on http://") == 2, 20)
        async with aiohttp.ClientSession() as session:
            body = {"url": fleet[1].url, "name": "added"}
            async with session.post(served.url + "/admin/upstreams", json=body, headers=auth) as r:
                assert r.status == 201
        await until(lambda: served.log.count(" added: ") == 2)  # once in each worker
        assert await _names_seen(served.url) == [sorted([fleet[0].url, "added"])] * 12
        async with aiohttp.ClientSession() as session:
            async with session.delete(served.url + f"/admin/upstreams/{fleet[0].url}", headers=auth) as r:
                assert r.status == 200
        await until(lambda: served.log.count(" drained and forgotten") == 2)
        assert await _names_seen(served.url) == [["added"]] * 12
        # A SIGHUP to the parent reaches every worker; the admin changes stay on top of the file.
        served.config_path.write_text(yaml.safe_dump({**config, "base_url": [fleet[0].url, fleet[2].url]}))
        assert served.process is not None
        served.process.send_signal(signal.SIGHUP)
        await until(lambda: served.log.count("fleet reloaded") >= 4)  # two from the admin changes' SIGHUPs too
        await until(lambda: served.log.count(f"upstream {fleet[2].url} added") == 2)
        assert await _names_seen(served.url) == [sorted(["added", fleet[2].url])] * 12


async def test_with_two_workers_a_bad_admin_change_poisons_neither(fleet, tmp_path):
    """The refused change is not written to the workers' shared overlay: later changes, DELETEs and
    SIGHUPs still work in both workers (before, every one of them was a 500 from then on)."""
    import signal

    from .served import Served

    config = _workers_config(fleet)
    auth = {"Authorization": f"Bearer {KEY}"}

    async with Served(tmp_path, config, "--workers", "2") as served:
        await until(lambda: served.log.count(" listening on http://") == 2, 20)
        async with aiohttp.ClientSession() as session:
            for bad in ("http://127.0.0.1:99999/v1", "http://[zz::1]/v1", "http:///v1"):
                body = {"url": bad, "name": "bad"}
                async with session.post(served.url + "/admin/upstreams", json=body, headers=auth) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "url"
            body = {"url": fleet[1].url, "name": "added"}
            async with session.post(served.url + "/admin/upstreams", json=body, headers=auth) as r:
                assert r.status == 201
        await until(lambda: served.log.count(" added: ") == 2)  # once in each worker
        assert await _names_seen(served.url) == [sorted([fleet[0].url, "added"])] * 12
        assert served.process is not None
        served.process.send_signal(signal.SIGHUP)
        await until(lambda: served.log.count("fleet reloaded") >= 4)  # the admin change's SIGHUP, then this one
        async with aiohttp.ClientSession() as session:
            async with session.delete(served.url + "/admin/upstreams/added", headers=auth) as r:
                assert r.status == 200
        await until(lambda: served.log.count(" drained and forgotten") == 2)
        assert await _names_seen(served.url) == [[fleet[0].url]] * 12
    assert "Exception in callback" not in served.log and "Traceback" not in served.log
