"""Load: in-process, concurrent pinned multi-turn streaming sessions over several fake vLLMs, then a
burst of mixed requests, then clients that walk away mid-stream (see tests/loadrun.py); and on the
real `gymproxy serve` (tests/served.py), thousands of abandoned streams (nothing may stay behind),
thousands of stalled request bodies, and a connection storm.

Sized by GYMPROXY_LOAD_SESSIONS (default 200 concurrent sessions), GYMPROXY_LOAD_REQUESTS (2000
requests), GYMPROXY_LOAD_ABANDONED (2000 streams), GYMPROXY_LOAD_STALLED (10,000 connections) and
GYMPROXY_LOAD_STORM (5000 streams at once); `bench/soak.py` runs the in-process scenario at full
size. Deselect with `-m "not load"`.

`test_zz_summary` is the session summary of tests/test_faults.py, tests/test_hostile_*.py and this
module: pytest runs files in name order and this one last among them, so when it runs the
counters in tests/faults.py are complete. See its output with `-rA` (or `-s`).
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from gymproxy.testing.fake_vllm import FakeVLLM, Script

from .faults import STATS, enough_files, summary, survived
from .loadrun import run
from .served import Served

SESSIONS = int(os.environ.get("GYMPROXY_LOAD_SESSIONS", "200"))
REQUESTS = int(os.environ.get("GYMPROXY_LOAD_REQUESTS", "2000"))
ABANDONED = int(os.environ.get("GYMPROXY_LOAD_ABANDONED", "2000"))
STALLED = int(os.environ.get("GYMPROXY_LOAD_STALLED", "10000"))
STORM = int(os.environ.get("GYMPROXY_LOAD_STORM", "5000"))
FD_SLACK = 16
RSS_SLACK_MB = 64 + SESSIONS * 0.25  # CPython keeps freed arenas; a leak grows with the load


@pytest.mark.load
async def test_load_sessions_requests_and_abandoned_streams():
    abandon = max(10, SESSIONS // 10)
    # Health checks are kept out of the way: with every client, fake and gymproxy on one loop, a
    # slow /health answer marks all upstreams down (test_faults.py::test_slow_health_checks_do_not_take_the_fleet_down).
    # So is steering by pace: on that one loop a reply's time per token is which task ran first, and
    # an upstream's first 20 can look 3x slower than another's (tests of pace: test_routing, test_fleet).
    report = await run(
        sessions=SESSIONS,
        requests=REQUESTS,
        abandon=abandon,
        fd_slack=FD_SLACK,
        health={"interval": 3600},
        pinning={"pace": {"tolerance": None}},
    )
    STATS["lost"] += report.error_count
    survived(report.abandoned)
    details = "\n".join(report.lines())
    assert report.error_count == 0, details
    assert report.sessions_moved == 0, details  # every session stayed on one upstream
    assert report.sessions_short == 0, details
    assert all(report.spread), details  # and sessions went to every upstream
    assert report.upstream_generations == report.generations_expected, details  # nothing sent twice
    assert report.disconnects == abandon, details  # every walk-out reached the upstream
    assert report.acquired_after == 0 and report.inflight_after == 0, details
    assert report.fds[2] <= report.fds[0] + FD_SLACK, details
    assert report.rss[2] - report.rss[0] < RSS_SLACK_MB, details


# --- on the real `gymproxy serve` ------------------------------------------------------------------


def _request(path: str, *, stream: bool, close: bool = False) -> bytes:
    if path == "/v1/responses":
        body: dict = {"model": "m", "input": "hi", "stream": stream}
    else:
        body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    data = orjson.dumps(body)
    connection = "Connection: close\r\n" if close else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: gymproxy\r\nContent-Type: application/json\r\n{connection}"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _abandon(url: str, index: int) -> None:
    """A streaming request whose client leaves once the answer has started: half reset, half closed."""
    path = "/v1/responses" if index % 2 else "/v1/chat/completions"
    reader, writer = await _connect(url)
    writer.write(_request(path, stream=True))
    await asyncio.wait_for(reader.readuntil(b"w1"), 20)  # the answer is streaming
    if index % 4 < 2:
        writer.transport.abort()
    else:
        writer.close()


async def _settled(served: Served) -> dict:
    """The process's stats once it has no upstream request in flight."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(200):
            async with session.get(served.url + "/metrics") as response:
                lines = (await response.text()).splitlines()
            if all(line.endswith(" 0") for line in lines if line.startswith("gymproxy_upstream_inflight{")):
                break
            await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # closed connections reach connection_lost
    return await served.stats()


@pytest.mark.load
async def test_streams_abandoned_under_serve_leave_nothing_behind(fake_vllm, tmp_path):
    """RSS, open files, live asyncio tasks and timers return to their baseline after thousands of
    clients walked away mid-stream (once, each left its keep-alive timer, and all it held, behind).

    The baseline is taken after a warm-up of 1000 such streams, 100 at a time as in the run (the
    first-use allocations, and the memory arenas of 100 streams at once); tasks and timers may differ
    by 2 (the pool's idle sweeper, a keep-alive timer of aiohttp's).
    """
    warm, batch = 1000, 100
    words = " ".join(f"w{i}" for i in range(40))
    fake_vllm.push(*(Script(content=words, chunk_delay=0.05) for _ in range(ABANDONED + warm)))
    config = {"base_url": fake_vllm.url, "health": {"interval": 3600}, "stream_keepalive_s": 1.0}
    async with Served(tmp_path, config) as served:

        async def abandon(first: int, count: int) -> None:
            for start in range(first, first + count, batch):
                await asyncio.gather(
                    *(_abandon(served.url, i) for i in range(start, min(start + batch, first + count)))
                )

        await abandon(0, warm)
        baseline = await _settled(served)
        started = time.monotonic()
        await abandon(warm, ABANDONED)
        seconds = time.monotonic() - started
        after = await _settled(served)
    survived(ABANDONED)
    report = f"baseline {baseline}, after {ABANDONED} abandoned streams ({seconds:.1f} s): {after}"
    print(report)
    assert len(fake_vllm.disconnects) >= ABANDONED + warm, report  # every walk-out aborted its generation
    assert after["rss_mb"] <= baseline["rss_mb"] * 1.05, report
    assert after["fds"] <= baseline["fds"] * 1.05 + 1, report
    assert after["tasks"] <= baseline["tasks"] * 1.05 + 2, report
    assert after["timers"] <= baseline["timers"] * 1.05 + 2, report


@pytest.mark.load
@pytest.mark.parametrize("open_files", [None, 8192], ids=["default-limit", "8192-files"])
async def test_stalled_request_bodies_do_not_stop_normal_requests(fake_vllm, tmp_path, open_files):
    """Thousands of connections send their request head, then nothing of the body (once they were
    kept for ever, and at the open-file limit nothing else was served and the upstream was marked
    down with 'Too many open files'). With 8192 files, the stalled connections outnumber them."""
    enough_files(STALLED + 1000)
    config = {"base_url": fake_vllm.url, "health": {"interval": 1}, "limits": {"open_files": open_files or 65536}}
    async with Served(tmp_path, config, open_files=open_files) as served:
        head = b"POST /v1/responses HTTP/1.1\r\nHost: gymproxy\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"

        async def stall() -> asyncio.StreamWriter:
            _, writer = await _connect(served.url)
            writer.write(head)
            return writer

        stalled: list[asyncio.StreamWriter] = []
        try:
            for start in range(0, STALLED, 500):
                stalled += await asyncio.gather(*(stall() for _ in range(min(500, STALLED - start))))
            await asyncio.sleep(1.5)
            started = time.monotonic()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                for i in range(20):
                    async with session.post(served.url + "/v1/responses", json={"model": "m", "input": f"n{i}"}) as r:
                        assert r.status == 200, await r.text()
                async with session.get(served.url + "/health") as r:
                    health = await r.json()
            seconds = time.monotonic() - started
        finally:
            for writer in stalled:
                writer.transport.abort()
    print(f"{STALLED} stalled bodies: 20 normal requests in {seconds:.2f} s")
    assert health["status"] == "ok" and all(u["healthy"] for u in health["upstreams"]), health
    assert seconds < 10
    assert "[Errno 24]" not in served.log and "Traceback" not in served.log, served.log[-3000:]  # EMFILE


@pytest.mark.load
async def test_a_connection_storm_of_streams_is_served(tmp_path):
    """Thousands of streaming requests arrive at once (once, with a listen backlog of 128, hundreds
    of them got no reply within a minute)."""
    enough_files(2 * STORM + 1000)
    # The fake vLLM gets the same storm from gymproxy: it needs a deep backlog too (aiohttp's test
    # server listens with 128).
    fake = FakeVLLM()
    runner = web.AppRunner(fake.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=8192)
    await site.start()
    upstream = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    async with Served(tmp_path, {"base_url": upstream, "health": {"interval": 3600}}) as served:
        go = asyncio.Event()

        async def one(i: int) -> bytes:
            await go.wait()
            reader, writer = await _connect(served.url)
            writer.write(_request("/v1/responses" if i % 2 else "/v1/chat/completions", stream=True, close=True))
            try:
                return await reader.read()
            finally:
                writer.close()

        tasks = [asyncio.ensure_future(one(i)) for i in range(STORM)]
        await asyncio.sleep(0)
        started = time.monotonic()
        go.set()
        replies = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        seconds = time.monotonic() - started
    ok = [
        r
        for r in replies
        if isinstance(r, bytes)
        and r.startswith(b"HTTP/1.1 200 ")
        and (b"event: response.completed" in r or b"data: [DONE]" in r)
    ]
    await runner.cleanup()
    print(f"connection storm: {len(ok)} of {STORM} streams answered in full in {seconds:.1f} s")
    assert len(ok) == STORM, [r for r in replies if r not in ok][:3]
    survived(STORM)


def test_zz_summary():
    print(summary())
    assert STATS["lost"] == 0, summary()
