"""What only the shared store (`rollouts.redis_store`, on a real redis-server) has: a key layout no
rollout id can break out of, a Redis down at startup or gone mid-run and back, a full Redis, a
100,000-call rollout read without holding up the loop, and a password that never reaches a log or
an error. The contract both stores keep is in test_rollout_store.py."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gymproxy.capture import ROLLOUT_ID
from gymproxy.rollouts.record import Call
from gymproxy.rollouts.redis_store import RedisStore, shown
from gymproxy.rollouts.store import Bounds, Store, StoreError, open_store

from .faults import eventually
from .stores import RedisServer
from .test_rollout_store import done, make

PASSWORD = "hunter2-not-in-any-log"


Opener = Callable[..., Awaitable[Store]]


@pytest.fixture
async def opened() -> AsyncIterator[Opener]:
    """`await opened(url, **bounds)`: a started store, closed after the test, passed or not (an open
    socket left behind hangs uvloop's close)."""
    stores: list[Store] = []

    async def start(url: str, **bounds: float) -> Store:
        store = open_store(url, Bounds(**bounds))  # type: ignore[arg-type]
        stores.append(store)
        await store.start()
        return store

    yield start
    for store in stores:
        await store.close()


async def test_no_rollout_id_can_name_another_rollouts_keys(redis_server: RedisServer, opened: Opener) -> None:
    """Ids shaped like the layout's own parts each stay a rollout of their own, and every key holds
    the id it belongs to between braces, which no id can contain."""
    ids = ["x", "x:calls", "x:meta", "x}:meta", "gymproxy:open", "open", ":", "x:order:y", "updated"]
    valid = [i for i in ids if ROLLOUT_ID.fullmatch(i)]
    assert "x}:meta" not in valid and ROLLOUT_ID.fullmatch("{") is None
    store = await opened(redis_server.url())
    for n, rollout in enumerate(valid):
        call = make(n, rollout, n=3)
        store.begin(call)
        store.end(done(call))
    listed = [s.rollout_id for s in await store.list(after=None, limit=100)]
    assert listed == sorted(valid)
    assert await store.delete("x")
    for n, rollout in enumerate(valid[1:], 1):
        got = await store.get(rollout)
        assert got is not None and [c.prompt_token_ids for c in got.calls] == [[n, n + 1, n + 2]]
    from redis.asyncio import Redis

    client = Redis.from_url(redis_server.url())
    keys = sorted(k.decode() for k in await client.keys("*"))
    await client.aclose()
    layout = re.compile(r"gymproxy:\{([^{}]+)\}:(meta|calls|order|failed)")
    owners = {m.group(1) for k in keys if (m := layout.fullmatch(k))}
    assert owners == set(valid) - {"x"}
    assert {k for k in keys if not layout.fullmatch(k)} <= {"gymproxy:open", "gymproxy:frozen", "gymproxy:updated"}
    await store.close()


async def test_a_redis_down_at_startup_is_waited_for_and_no_message_shows_its_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, opened: Opener
) -> None:
    server = RedisServer(tmp_path / "redis", "--requirepass", PASSWORD)  # not started yet
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    caplog.set_level(logging.INFO, "gymproxy")
    store = await opened(url)  # gymproxy starts: capture waits for its store
    try:
        assert not store.available()
        calls = [make(i, n=3) for i in range(3)]
        for call in calls:
            assert store.begin(call)  # queued, not lost
            assert store.end(done(call))
        with pytest.raises(StoreError, match="unreachable") as raised:
            await store.get("r")
        assert PASSWORD not in str(raised.value) and f"127.0.0.1:{server.port}" in str(raised.value)
        server.start()
        assert await eventually(store.available, 10)
        got = await store.get("r")
        assert got is not None and [c.call_id for c in got.calls] == [c.call_id for c in calls]
        assert all(c.outcome == "ok" for c in got.calls)
    finally:
        await store.close()
        server.stop()
    assert "unreachable" in caplog.text and "reachable again" in caplog.text
    assert PASSWORD not in caplog.text
    wrong = RedisStore(f"redis://:wrong-{PASSWORD}@127.0.0.1:1/0", Bounds())
    assert PASSWORD not in wrong.shown and wrong.shown == "redis://127.0.0.1:1/0"
    assert shown(f"unix:///run/redis.sock?db=1&password={PASSWORD}") == "unix:///run/redis.sock"


async def test_a_wrong_password_or_database_is_an_error_at_startup_that_hides_the_password(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis", "--requirepass", PASSWORD).start()
    try:
        for url in (
            f"redis://:not-{PASSWORD}@127.0.0.1:{server.port}/0",
            f"redis://:{PASSWORD}@127.0.0.1:{server.port}/99",
        ):
            store = RedisStore(url, Bounds())
            with pytest.raises(StoreError, match="refused gymproxy") as raised:
                await store.start()
            assert PASSWORD not in str(raised.value)
    finally:
        server.stop()


async def test_a_redis_that_goes_away_mid_run_and_comes_back(redis_server: RedisServer, opened: Opener) -> None:
    """Killed (its memory with it: it keeps nothing here) and started again on its port: the records
    queued meanwhile are written, reads fail at once while it is away, and writes go on after."""
    store = await opened(redis_server.url())
    try:
        before = make(0, "before", n=3)
        store.begin(before)
        store.end(done(before))
        assert await store.get("before") is not None
        redis_server.stop()
        during = [make(i, "during", n=3) for i in range(5)]
        for call in during:
            assert store.begin(call)
            assert store.end(done(call))
        assert await eventually(lambda: not store.available(), 10)
        began = time.monotonic()
        with pytest.raises(StoreError, match="unreachable"):
            await store.list(after=None, limit=10)
        assert time.monotonic() - began < 1
        redis_server.start()
        assert await eventually(store.available, 10)
        got = await store.get("during")
        assert got is not None and [c.call_id for c in got.calls] == [c.call_id for c in during]
        after = make(9, "after", n=3)
        store.begin(after)
        store.end(done(after))
        assert (await store.get("after")) is not None
        assert store.stats.failed == 0
    finally:
        await store.close()


async def test_closing_while_redis_is_down_counts_what_is_lost_and_does_not_hang(
    tmp_path: Path, opened: Opener
) -> None:
    server = RedisServer(tmp_path / "redis")  # never started
    store = await opened(server.url())
    for i in range(4):
        store.begin(make(i, n=3))
    began = time.monotonic()
    await store.close()
    assert time.monotonic() - began < 5
    assert store.stats.failed == 4


async def test_a_full_redis_refuses_records_counted_as_failed_and_no_call_is_torn(
    tmp_path: Path, opened: Opener
) -> None:
    server = RedisServer(tmp_path / "redis", "--maxmemory", "4mb", "--maxmemory-policy", "noeviction").start()
    store = await opened(server.url())
    try:
        sent: dict[str, Call] = {}
        for i in range(400):  # some 16 KB a record: Redis is full long before the end
            call = make(i, n=4000)
            sent[call.call_id] = call
            store.begin(call)
            store.end(done(call))
            if i % 20 == 19:
                await store.get("none")  # a barrier: written (or refused) by now
        await store.get("none")
        assert store.stats.failed > 0 and not store.available()
        got = await store.get("r")
        assert got is not None and got.calls
        for call in got.calls:  # each call in the rollout is whole, as sent
            assert call.prompt_token_ids == sent[call.call_id].prompt_token_ids and call.outcome == "ok"
        assert server.command("CONFIG", "SET", "maxmemory", "0") == "+OK"
        assert await eventually(store.available, 10)
        fresh = make(0, "fresh", n=3)
        store.begin(fresh)
        store.end(done(fresh))
        assert await store.get("fresh") is not None
    finally:
        await store.close()
        server.stop()


async def test_an_evicting_redis_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, opened: Opener
) -> None:
    server = RedisServer(tmp_path / "redis", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru").start()
    try:
        store = await opened(server.url())
        await store.close()
    finally:
        server.stop()
    assert "maxmemory-policy is allkeys-lru" in caplog.text


async def test_a_100000_call_rollout_is_written_and_read_without_holding_up_the_loop(
    redis_server: RedisServer, opened: Opener
) -> None:
    """Read a chunk of calls at a time, the loop free between chunks. The collector is held off while
    the loop is timed: its passes over 100,000 new calls pause any Python process (0.15 s alone,
    more inside a long test session), and that is not the store's doing."""
    store = await opened(redis_server.url())
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.005)
            worst = max(worst, time.monotonic() - before - 0.005)

    try:
        for i in range(100_000):
            call = Call(
                rollout_id="huge",
                call_id=f"c{i}",
                route="chat",
                started=time.time(),
                prompt_token_ids=[i],
                outcome="ok",
            )
            store.begin(call)
            if i % 20_000 == 19_999:
                await store.get("none")  # a barrier: the queue stays under its bound
        ticker = asyncio.ensure_future(tick())
        gc.disable()
        try:
            rollout = await store.get("huge")
            (summary,) = await store.list(after=None, limit=10)
        finally:
            gc.enable()
            ticker.cancel()
        assert rollout is not None
        calls = rollout.calls
        firsts = [c.prompt_token_ids for c in calls[:3]]
        count, last = len(calls), calls[-1].seq
        del rollout, calls
        assert count == 100_000 and firsts == [[0], [1], [2]] and last == 100_000
        assert summary.calls == 100_000 and summary.complete
        assert worst < 0.25, f"the loop stalled {worst:.3f} s"
        assert await store.delete("huge") and await store.get("huge") is None
    finally:
        await store.close()


async def test_without_redis_py_the_store_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)  # an import of it fails
    store = open_store("redis://127.0.0.1:1/0", Bounds())
    with pytest.raises(StoreError, match=r"pip install 'gymproxy\[redis\]'"):
        await store.start()
