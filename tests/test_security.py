"""Access control, header hygiene, request ids, limits, the admin port and graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import orjson
import pytest

from gymproxy.testing.fake_vllm import Script

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


def test_open_file_limit_is_raised():
    import resource

    from gymproxy.server import raise_open_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = soft + 1 if hard == resource.RLIM_INFINITY or soft < hard else soft
    try:
        raise_open_files(target)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= target
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_serve_freezes_startup_objects_and_collects_cycles_rarely():
    import gc

    from gymproxy.server import GC_THRESHOLD, tune_gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 1000  # the modules gymproxy imported
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


# --- the CLI: admin port and graceful shutdown --------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            try:
                async with session.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never came up")


def _wait_exit(process: subprocess.Popen, timeout: float) -> str:
    """Its stderr once it has exited; killed if it has not within `timeout` seconds."""
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate(timeout=15)
    return stderr.decode()


async def test_admin_port_and_graceful_shutdown(fake_vllm, tmp_path):
    port, admin = _free_port(), _free_port()
    config = tmp_path / "c.yaml"
    config.write_text(
        f"base_url: {fake_vllm.url}\nport: {port}\naccess:\n  admin_port: {admin}\nshutdown_grace_s: 10\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "gymproxy", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        await _wait_up(f"http://127.0.0.1:{admin}/health")
        assert (await call(f"http://127.0.0.1:{admin}", "/health", None))[0] == 200
        assert (await call(f"http://127.0.0.1:{admin}", "/metrics", None))[0] == 200
        assert (await call(f"http://127.0.0.1:{port}", "/health", None))[0] == 404
        # A stream in flight when SIGTERM arrives still finishes.
        fake_vllm.push(Script(content="one two three four five six", chunk_delay=0.2))
        body = {"model": "m", "input": "x", "stream": True}
        stream = asyncio.ensure_future(call(f"http://127.0.0.1:{port}", "/v1/responses", body))
        await asyncio.sleep(0.4)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        status, _, raw = await asyncio.wait_for(stream, 20)
        assert status == 200
        assert b"event: response.completed" in raw and b"one two three four five six" in raw.replace(b'","', b"")
        assert time.monotonic() - started < 10
    finally:
        stderr = _wait_exit(process, 15)
    assert process.returncode == 0, stderr
    assert not os.path.exists(f"/proc/{process.pid}")


async def test_workers_finish_their_streams_on_sigterm(fake_vllm, tmp_path):
    """Each worker drains its own streams; one that stops first does not cut the others short.

    The streams have different lengths, so the two workers finish draining at different times.
    """
    port = _free_port()
    config = tmp_path / "c.yaml"
    config.write_text(f"base_url: {fake_vllm.url}\nport: {port}\nshutdown_grace_s: 10\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "gymproxy", "serve", "--config", str(config), "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        await _wait_up(f"http://127.0.0.1:{port}/health")
        await asyncio.sleep(1.0)  # the second worker is listening too
        texts = [" ".join(f"w{i}x{j}" for j in range(3 + 2 * i)) for i in range(8)]
        fake_vllm.push(*(Script(content=text, chunk_delay=0.15) for text in texts))
        body = {"model": "m", "input": "x", "stream": True}
        # One connection each (`call` opens a session per request): the kernel spreads them over both workers.
        streams = [asyncio.ensure_future(call(f"http://127.0.0.1:{port}", "/v1/responses", body)) for _ in texts]
        await asyncio.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        replies = await asyncio.wait_for(asyncio.gather(*streams), 30)
        finished = sorted(text for text in texts for _, _, raw in replies if orjson.dumps(text) in raw)
        assert [status for status, _, _ in replies] == [200] * len(texts)
        assert all(b"event: response.completed" in raw for _, _, raw in replies), replies
        assert finished == sorted(texts)
    finally:
        stderr = _wait_exit(process, 30)
    assert process.returncode == 0, stderr
