"""gymproxy.server: what `gymproxy serve` does around the app, tested on the real command.

The listener (its backlog, the cap on client connections and the 503 past it), the request-body
idle timeout, and the drain at shutdown: requests in flight get `shutdown_grace_s`, and those still
running then end properly (a stream with its terminal event, a whole reply with a 503).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from gymproxy.listener import QUIET_S, REFUSED_LINGER_S
from gymproxy.testing.fake_vllm import Script

from .faults import eventually, sse_data
from .served import Served, free_port

WORDS = " ".join(f"w{i}" for i in range(60))


async def _raw(url: str, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    return reader, writer


SLOW_HEAD = b"POST /v1/responses HTTP/1.1\r\nHost: gymproxy\r\nX-Slow: "  # and then a byte at a time


async def _answered(
    url: str,
    request: bytes | None = None,
    *,
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None,
) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """A request (a Responses turn unless given), on a new connection unless given, answered in
    full; the answer's head, and the connection, left open (kept alive)."""
    if request is None:
        request = _post("/v1/responses", orjson.dumps({"model": "m", "input": "hi"}))
    if connection is None:
        reader, writer = await _raw(url, request)
    else:
        (reader, writer) = connection
        writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    assert length is not None, head
    await reader.readexactly(int(length[1]))
    return head, reader, writer


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (with nothing more to say) within a second."""
    return await _read_for(reader, 1.0) == b""


async def _read_for(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What the server sent until it closed the connection; None if it is still open after `seconds`."""
    try:
        return await asyncio.wait_for(reader.read(), seconds)
    except asyncio.TimeoutError:
        return None


def _generations(fake_vllm) -> int:
    return sum(seen.path in ("/v1/chat/completions", "/v1/completions") for seen in fake_vllm.requests)


def _post(path: str, body: bytes, *, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (
        f"POST {path} HTTP/1.1\r\nHost: gymproxy\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    ).encode() + body


async def _first_bytes(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> tuple[int, bytes]:
    """A stream read to its end; the status and everything it sent."""
    async with session.post(url + path, json=body) as response:
        return response.status, await response.read()


# --- the drain at shutdown ---------------------------------------------------------------------------


async def test_streams_longer_than_the_grace_end_then_with_their_terminal_event(fake_vllm, tmp_path):
    config = {"base_url": fake_vllm.url, "shutdown_grace_s": 1.0, "stream_keepalive_s": 0.2}
    async with Served(tmp_path, config) as served:
        # Every reply takes 60 x 0.2 s = 12 s, far longer than the grace.
        fake_vllm.push(*(Script(content=WORDS, chunk_delay=0.2) for _ in range(5)))
        async with aiohttp.ClientSession() as session:
            streams = [
                asyncio.ensure_future(_first_bytes(session, served.url, path, body))
                for path, body in [
                    ("/v1/responses", {"model": "m", "input": "x", "stream": True}),
                    ("/v1/responses", {"model": "m", "input": "x", "stream": True}),
                    (
                        "/v1/chat/completions",
                        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
                    ),
                    (
                        "/v1/chat/completions",
                        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
                    ),
                    ("/v1/responses", {"model": "m", "input": "x"}),  # a whole reply in flight
                ]
            ]
            for _ in range(100):
                if len(fake_vllm.requests) >= 5 + 1:  # the five generations (and the startup probe)
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            stopped = time.monotonic()
            served.terminate()
            replies = await asyncio.wait_for(asyncio.gather(*streams), 10)
            ended = time.monotonic() - stopped
        code = await served.wait(10)
    assert code == 0, served.log[-2000:]
    assert 0.9 < ended < 3.0, ended  # at the grace, not twice the grace, not never
    for status, raw in replies[:2]:
        events = [orjson.loads(d) for d in sse_data(raw)]
        assert status == 200 and events[0]["type"] == "response.created"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.failed", events[-1]
        assert events[-1]["response"]["error"]["message"] == "gymproxy is shutting down"
        assert any(e["type"] == "response.output_text.delta" for e in events)  # it was streaming
    for status, raw in replies[2:4]:
        data = sse_data(raw)
        assert status == 200 and data[-1] == b"[DONE]"
        assert orjson.loads(data[-2])["error"]["message"] == "gymproxy is shutting down"
    status, raw = replies[4]
    assert status == 503 and orjson.loads(raw)["error"]["message"] == "gymproxy is shutting down"
    assert len(fake_vllm.disconnects) == 5  # every generation was aborted upstream


async def test_a_stream_that_finishes_within_the_grace_completes(fake_vllm, tmp_path):
    async with Served(tmp_path, {"base_url": fake_vllm.url, "shutdown_grace_s": 10}) as served:
        fake_vllm.push(Script(content="one two three four five six", chunk_delay=0.2))
        async with aiohttp.ClientSession() as session:
            stream = asyncio.ensure_future(
                _first_bytes(session, served.url, "/v1/responses", {"model": "m", "input": "x", "stream": True})
            )
            await asyncio.sleep(0.4)
            stopped = time.monotonic()
            served.terminate()
            status, raw = await asyncio.wait_for(stream, 10)
        assert await served.wait(10) == 0
    assert status == 200 and b"event: response.completed" in raw
    assert time.monotonic() - stopped < 5


async def test_a_body_still_arriving_at_the_end_of_the_grace_gets_a_408(fake_vllm, tmp_path):
    async with Served(tmp_path, {"base_url": fake_vllm.url, "shutdown_grace_s": 0.5}) as served:
        reader, writer = await _raw(served.url, _post("/v1/responses", b'{"model":', length=100))
        await asyncio.sleep(0.2)
        stopped = time.monotonic()
        served.terminate()
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert await served.wait(10) == 0
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b"shutting down" in reply
    assert time.monotonic() - stopped < 3


# --- the listener ----------------------------------------------------------------------------------


async def test_client_connections_past_the_cap_get_a_503_at_once(fake_vllm, tmp_path):
    config = {"base_url": fake_vllm.url, "limits": {"max_client_connections": 20}}
    async with Served(tmp_path, config) as served:
        fake_vllm.push(*(Script(hang=True) for _ in range(20)))  # a request in progress on each
        body = orjson.dumps({"model": "m", "input": "hi"})
        held = [await _raw(served.url, _post("/v1/responses", body)) for _ in range(20)]
        assert await eventually(lambda: _generations(fake_vllm) == 20)
        reader, writer = await _raw(served.url, _post("/v1/responses", body))
        reply = await asyncio.wait_for(reader.read(), 5)  # answered and closed at once
        writer.close()
        assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
        error = orjson.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert "max_client_connections" in error["message"]
        for _, w in held[:5]:
            w.close()
        assert await eventually(lambda: len(fake_vllm.disconnects) == 5)
        async with aiohttp.ClientSession() as session:
            async with session.post(served.url + "/v1/responses", data=body) as response:
                assert response.status == 200
        for _, w in held[5:]:
            w.close()
    assert served.log.count("refusing more with 503") == 1  # said once, not per connection


async def test_at_the_cap_request_heads_sent_a_byte_at_a_time_make_room_for_new_clients(fake_vllm, tmp_path):
    """Slowloris at the cap: 20 connections (the cap) send half a request head, then a byte now and
    then, and reconnect when closed. Each new client is answered at once (they got a 503 until the
    keep-alive timer closed the heads, 75 s later), and a head closed for it is told why (408)."""
    config = {"base_url": fake_vllm.url, "limits": {"max_client_connections": 20}}
    async with Served(tmp_path, config) as served:
        stop = asyncio.Event()
        told: list[bytes] = []

        async def slowloris() -> None:
            for _ in range(3):  # the first connection, and two more when closed
                reader, writer = await _raw(served.url, SLOW_HEAD)
                reply = asyncio.ensure_future(reader.read())
                while not stop.is_set() and not reply.done():
                    await asyncio.wait({reply}, timeout=0.2)
                    writer.write(b"x")
                writer.close()
                if not reply.done():
                    reply.cancel()
                    return
                told.append(b"reset" if reply.exception() else reply.result())

        attackers = [asyncio.ensure_future(slowloris()) for _ in range(20)]
        await asyncio.sleep(0.5)  # every head has begun to arrive
        answered = [await asyncio.wait_for(_answered(served.url), 5) for _ in range(10)]
        stop.set()
        await asyncio.wait_for(asyncio.gather(*attackers), 5)
        for _, _, writer in answered:
            writer.close()
    assert [head.split(b"\r\n")[0] for head, _, _ in answered] == [b"HTTP/1.1 200 OK"] * 10
    assert any(reply.startswith(b"HTTP/1.1 408 ") for reply in told), told
    # Closed for a newcomer (408), or, reconnecting while every other head had just sent a byte, refused.
    assert all(reply.startswith((b"HTTP/1.1 408 ", b"HTTP/1.1 503 ")) or reply == b"reset" for reply in told), told
    assert served.log.count("closing idle and stalled ones to make room") == 1  # said once


async def test_at_the_cap_idle_connections_make_room_for_new_clients(fake_vllm, tmp_path):
    """20 connections (the cap) stay open with no request in progress: 10 kept alive after a request,
    10 that never sent a byte (new clients got a 503 until the keep-alive timer closed them, 75 s
    later). Each new client is answered; the idle connections are closed for them first."""
    config = {"base_url": fake_vllm.url, "limits": {"max_client_connections": 20}}
    async with Served(tmp_path, config) as served:
        silent = [await _raw(served.url, b"") for _ in range(10)]
        idle = [await _answered(served.url) for _ in range(10)]  # (so the silent ones are accepted)
        await asyncio.sleep(QUIET_S + 0.3)  # quiet for long enough to be closed for a new client
        answered = [await asyncio.wait_for(_answered(served.url), 5) for _ in range(15)]
        closed = await asyncio.gather(
            *(_closed(reader) for _, reader, _ in idle + answered), *(_closed(r) for r, _ in silent)
        )
        for _, _, writer in idle + answered:
            writer.close()
        for _, writer in silent:
            writer.close()
    assert [head.split(b"\r\n")[0] for head, _, _ in answered] == [b"HTTP/1.1 200 OK"] * 15
    assert closed[:10] == [True] * 10  # the idle ones first, then 5 of the silent (or of the new ones)
    assert sum(closed) == 15, closed


async def test_a_request_head_that_does_not_arrive_in_time_gets_a_408(fake_vllm, tmp_path):
    """limits.client_header_timeout: a head sent a byte at a time is answered 408 and closed once it
    is that old (it lived until the keep-alive timer, 75 s), and a connection that sends nothing is
    closed; a connection kept alive between requests is not, even one whose last body was sent
    after its answer (aiohttp reads and drops it)."""
    config = {"base_url": fake_vllm.url, "limits": {"client_header_timeout": 0.5}}
    async with Served(tmp_path, config) as served:
        started = time.monotonic()
        slow, slow_writer = await _raw(served.url, SLOW_HEAD)
        reply = asyncio.ensure_future(slow.read())
        silent, silent_writer = await _raw(served.url, b"")
        _, kept, kept_writer = await _answered(served.url)
        # A 404 answered before its body: the rest of it comes after the answer.
        head, rest, rest_writer = await _answered(
            served.url, b"POST /nope HTTP/1.1\r\nHost: gymproxy\r\nContent-Length: 10\r\n\r\n12345"
        )
        assert head.startswith(b"HTTP/1.1 404 ")
        rest_writer.write(b"67890")
        for _ in range(50):
            await asyncio.wait({reply}, timeout=0.1)
            if reply.done():
                break
            slow_writer.write(b"x")
        waited = time.monotonic() - started
        assert reply.done(), "the head was not closed"
        assert reply.result().startswith(b"HTTP/1.1 408 "), reply.result()[:200]
        assert "client_header_timeout" in orjson.loads(reply.result().partition(b"\r\n\r\n")[2])["error"]["message"]
        assert 0.4 < waited < 2.0, waited
        assert await asyncio.wait_for(silent.read(), 5) == b""
        await asyncio.sleep(1.0 - (time.monotonic() - started))  # twice the head timeout since they were idle
        for reader, writer in ((kept, kept_writer), (rest, rest_writer)):
            head, _, _ = await asyncio.wait_for(_answered(served.url, connection=(reader, writer)), 5)
            assert head.startswith(b"HTTP/1.1 200 "), head
        for writer in (slow_writer, silent_writer, kept_writer, rest_writer):
            writer.close()
    assert "Traceback" not in served.log, served.log[-2000:]


async def test_at_the_cap_a_stalled_body_makes_room_for_a_new_client(fake_vllm, tmp_path):
    config = {"base_url": fake_vllm.url, "limits": {"max_client_connections": 20}}
    async with Served(tmp_path, config) as served:
        stalled = [await _raw(served.url, _post("/v1/responses", b'{"model":', length=100)) for _ in range(20)]
        await asyncio.sleep(1.2)  # silent for longer than the listener waits before it ends one
        body = orjson.dumps({"model": "m", "input": "hi"})
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.post(served.url + "/v1/responses", data=body) as response:
                    assert response.status == 200
        ended = []
        for reader, writer in stalled:
            try:
                ended.append(await asyncio.wait_for(reader.read(), 0.2))
            except asyncio.TimeoutError:
                pass
            writer.close()
    assert 1 <= len(ended) <= 4, len(ended)  # about one stalled body for each new connection
    assert all(reply.startswith(b"HTTP/1.1 408 ") for reply in ended), ended


async def test_a_request_body_that_stops_arriving_gets_a_408(fake_vllm, tmp_path):
    config = {"base_url": fake_vllm.url, "limits": {"client_body_timeout": 0.5}}
    async with Served(tmp_path, config) as served:
        started = time.monotonic()
        reader, writer = await _raw(served.url, _post("/v1/responses", b'{"model":', length=100))
        reply = await asyncio.wait_for(reader.read(), 5)  # the 408, then the connection closes
        waited = time.monotonic() - started
        writer.close()
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert "client_body_timeout" in orjson.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]
        assert 0.4 < waited < 3.0, waited
        # An idle timeout, not a limit on the whole upload: a body trickling in slowly is read.
        body = orjson.dumps({"model": "m", "input": "slowly"})
        reader, writer = await _raw(served.url, _post("/v1/responses", b"", length=len(body)))
        for i in range(0, len(body), 4):
            await asyncio.sleep(0.2)
            writer.write(body[i : i + 4])
        reply = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    assert "Traceback" not in served.log and "Unhandled" not in served.log, served.log[-2000:]


async def test_idle_connections_and_unfinished_heads_are_closed(fake_vllm, tmp_path):
    """A head that never completes (slowloris) and a kept-alive connection left idle are both closed
    after `limits.client_keepalive_timeout` (aiohttp's own runner, used alone, keeps them an hour)."""
    config = {"base_url": fake_vllm.url, "limits": {"client_keepalive_timeout": 0.5}}
    async with Served(tmp_path, config) as served:
        started = time.monotonic()
        slow, slow_writer = await _raw(served.url, b"POST /v1/responses HTTP/1.1\r\nHost: gymproxy\r\nX-Slow: ")
        body = orjson.dumps({"model": "m", "input": "hi"})
        idle, idle_writer = await _raw(served.url, _post("/v1/responses", body))
        assert (await asyncio.wait_for(idle.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200 ")
        assert await asyncio.wait_for(slow.read(), 5) == b""  # closed, with nothing to say
        await asyncio.wait_for(idle.read(), 5)  # the rest of the answer, then the close
        waited = time.monotonic() - started
        slow_writer.close()
        idle_writer.close()
    assert 0.4 < waited < 3.0, waited


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to read the listen backlog")
@pytest.mark.parametrize("backlog", [None, 1000], ids=["default", "set"])
async def test_the_listen_backlog_is_the_setting(fake_vllm, tmp_path, backlog):
    """Deep by default (4096; aiohttp's own 128 left a connection storm unanswered), and settable."""
    limits = {} if backlog is None else {"backlog": backlog}
    async with Served(tmp_path, {"base_url": fake_vllm.url, "limits": limits}) as served:
        _, writer = await _raw(served.url, b"")  # listening for certain (not only logged)
        writer.close()
        # For a listening socket, `ss` shows the backlog as Send-Q (the kernel caps it at somaxconn).
        lines = subprocess.run(["ss", "-ltnH", f"sport = :{served.port}"], capture_output=True, text=True).stdout
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(lines.split()[2]) == min(backlog or 4096, somaxconn), lines


async def _admin_up(session: aiohttp.ClientSession, admin: int) -> None:
    for _ in range(100):  # the admin site starts with the app, just after the main listener
        try:
            async with session.get(f"http://127.0.0.1:{admin}/health") as response:
                assert response.status == 200
                return
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    raise AssertionError("the admin port did not answer")


async def test_health_and_metrics_on_the_admin_port_only(fake_vllm, tmp_path):
    admin = free_port()
    async with Served(tmp_path, {"base_url": fake_vllm.url, "access": {"admin_port": admin}}) as served:
        async with aiohttp.ClientSession() as session:
            await _admin_up(session, admin)
            async with session.get(f"http://127.0.0.1:{admin}/metrics") as response:
                assert response.status == 200 and "gymproxy_requests_total" in await response.text()
            async with session.get(served.url + "/health") as response:
                assert response.status == 404


async def test_the_admin_port_is_capped_and_idle_connections_cannot_hold_it(fake_vllm, tmp_path):
    """`access.admin_port` is kept as the main port is, with a cap of its own (64): 300 connections
    to it that send nothing leave the process within its 256 files, and both ports keep answering
    (it kept each for an hour: 1,024 of them used every file and the main port stopped answering)."""
    admin = free_port()
    config = {"base_url": fake_vllm.url, "access": {"admin_port": admin}}
    async with Served(tmp_path, config, open_files=256) as served:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await _admin_up(session, admin)
            before = (await served.stats())["fds"]
            held = []
            try:
                for _ in range(300):
                    try:
                        held.append(await asyncio.wait_for(asyncio.open_connection("127.0.0.1", admin), 2))
                    except (OSError, asyncio.TimeoutError):
                        break  # the listen backlog is full: the process has stopped accepting
                assert len(held) == 300, served.log[-2000:]
                assert await eventually(lambda: "refusing more with 503" in served.log)  # the 64 are in
                await asyncio.sleep(max(QUIET_S, REFUSED_LINGER_S) + 0.3)  # quiet; the refused ones closed
                during = (await served.stats())["fds"]
                async with session.get(f"http://127.0.0.1:{admin}/health") as response:  # makes room
                    assert response.status == 200, served.log[-3000:]
                async with session.post(served.url + "/v1/responses", json={"model": "m", "input": "hi"}) as response:
                    assert response.status == 200
                replies = await asyncio.gather(*(_read_for(reader, 1.0) for reader, _ in held))
            finally:
                for _, writer in held:
                    writer.close()
    assert during <= before + 64 + 8, (before, during)
    # Each one past the cap is refused with a 503, unless it came when an earlier one had been silent
    # for `QUIET_S`: then that one was closed (nothing said) to make room for it. On a loaded machine
    # the 300 connects can take longer than that, so how many were closed is not fixed; one at least
    # was: the one that made room for /health.
    refused = sum(reply is not None and reply.startswith(b"HTTP/1.1 503 ") for reply in replies)
    closed, still_open = replies.count(b""), replies.count(None)
    assert still_open == 63 and closed >= 1, (still_open, closed)
    assert refused + closed + still_open == 300, replies  # nothing else was said to any of them
    assert served.log.count("connections to the admin port open: refusing more with 503") == 1


async def test_workers_finish_their_streams_on_sigterm(fake_vllm, tmp_path):
    """Each worker drains its own streams; one that stops first does not cut the others short.

    The streams have different lengths, so the two workers finish draining at different times.
    """
    async with Served(tmp_path, {"base_url": fake_vllm.url, "shutdown_grace_s": 10}, "--workers", "2") as served:
        await asyncio.sleep(1.0)  # the second worker is listening too
        texts = [" ".join(f"w{i}x{j}" for j in range(3 + 2 * i)) for i in range(8)]
        fake_vllm.push(*(Script(content=text, chunk_delay=0.15) for text in texts))
        body = {"model": "m", "input": "x", "stream": True}

        async def one() -> tuple[int, bytes]:
            # A connection each: the kernel spreads them over both workers.
            async with aiohttp.ClientSession() as session:
                return await _first_bytes(session, served.url, "/v1/responses", body)

        streams = [asyncio.ensure_future(one()) for _ in texts]
        await asyncio.sleep(0.3)
        served.terminate()
        replies = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert await served.wait(30) == 0, served.log[-2000:]
    finished = sorted(text for text in texts for _, raw in replies if orjson.dumps(text) in raw)
    assert [status for status, _ in replies] == [200] * len(texts)
    assert all(b"event: response.completed" in raw for _, raw in replies), replies
    assert finished == sorted(texts)


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


def test_the_default_connection_cap_leaves_half_the_file_descriptors(monkeypatch):
    import resource

    from gymproxy import build_config
    from gymproxy.server import connection_limit

    monkeypatch.setattr(resource, "getrlimit", lambda _: (20_000, 20_000))
    assert connection_limit(build_config({"base_url": "http://u/v1"}, environ={})) == 9_936
    capped = build_config({"base_url": "http://u/v1", "limits": {"max_client_connections": 7}}, environ={})
    assert connection_limit(capped) == 7


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


async def test_with_no_upstream_the_demo_fake_takes_what_agent_harnesses_send(tmp_path):
    """The Quick start: `gymproxy serve` alone answers a Claude Code-sized turn (a long system prompt,
    `max_tokens: 32000`) and a Codex-style Responses turn, through its bundled fake vLLM."""
    port = free_port()
    with (tmp_path / "serve.log").open("wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "gymproxy", "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 20
            while True:
                try:
                    async with session.get(url + "/healthz") as ready:
                        if ready.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert time.monotonic() < deadline and process.poll() is None, (tmp_path / "serve.log").read_text()
                await asyncio.sleep(0.1)
            system = "You are an agent. " * 4000  # ~16k words, as long as a harness's system prompt
            turn = {
                "model": "claude-sonnet-4-5",
                "max_tokens": 32000,
                "system": [{"type": "text", "text": system}],
                "messages": [{"role": "user", "content": "Say hello"}],
            }
            async with session.post(url + "/v1/messages?beta=true", json=turn) as reply:
                assert reply.status == 200, await reply.text()
                assert (await reply.json())["content"][0]["text"] == "echo: Say hello"
            codex = {
                "model": "m",
                "input": [{"role": "developer", "content": system}, {"role": "user", "content": "hi"}],
            }
            async with session.post(url + "/v1/responses", json=codex) as reply:
                assert reply.status == 200, await reply.text()
                assert (await reply.json())["status"] == "completed"
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0


async def test_every_scrape_of_two_workers_counts_every_request_once(fake_vllm, tmp_path):
    """Whichever worker the kernel hands a scrape to, it reads 20 after 20 requests (it read a
    random worker's own share: 7, 13, 13, 7, ...), and the per-upstream counts add up to it."""
    from prometheus_client.parser import text_string_to_metric_families

    upstreams = [{"url": fake_vllm.url, "name": "a"}, {"url": fake_vllm.url, "name": "b"}]
    async with Served(tmp_path, {"upstreams": upstreams}, "--workers", "2") as served:
        await asyncio.sleep(1.0)  # the second worker is listening too
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        # A connection each, and no cookie jar: the kernel spreads them over both workers.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as session:
            for _ in range(20):
                async with session.post(served.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200
                    await response.read()
            scrapes = []
            for _ in range(6):
                async with session.get(served.url + "/metrics") as response:
                    scrapes.append(await response.text())
    assert served.log.count(" listening on http://") == 2
    for text in scrapes:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

        def total(name: str, samples: list = samples, **labels: str) -> float:
            return sum(
                s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
            )

        assert total("gymproxy_requests_total", route="/v1/chat/completions", status="200") == 20, text
        assert total("gymproxy_request_duration_seconds_count", route="/v1/chat/completions") == 20
        by_upstream = [total("gymproxy_upstream_requests_total", upstream=name) for name in ("a", "b")]
        assert sum(by_upstream) == 20 and total("gymproxy_upstream_requests_total", status="200") == 20
        assert total("gymproxy_pins_created_total") == 20
        assert total("gymproxy_metrics_workers") == 2 and total("gymproxy_metrics_workers_missing") == 0
        assert total("gymproxy_upstream_inflight") == 0
        assert {s.labels.get("worker") for s in samples if s.name == "gymproxy_upstream_healthy"} == {"0", "1"}
