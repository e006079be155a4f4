"""The rollout stores' contract, run against each (`rollouts.sqlite_store`, and `rollouts.redis_store`
on a real redis-server): exact records, seq, atomic freezes (two processes freezing and writing one
rollout at once), paging, several processes on one store, what SIGKILL keeps, a stalled store that
never blocks the loop, and the bounds; then SQLite's own file and size bound (Redis's own cases:
test_redis_store.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gymproxy.rollouts.record import Call
from gymproxy.rollouts.sqlite_store import SQLiteStore
from gymproxy.rollouts.store import Bounds, StoreError, open_store

from .faults import eventually
from .stores import Backend

WRITER = """
import asyncio, sys, time
from gymproxy.rollouts.record import Call
from gymproxy.rollouts.store import Bounds, open_store

async def main(url, name, n, report, pause):
    store = open_store(url, Bounds())
    await store.start()
    for i in range(n):
        call = Call(rollout_id="shared", call_id=f"{name}-{i}", route="chat", started=time.time(),
                    prompt_token_ids=list(range(i % 50)), generation_token_ids=[i], generation_log_probs=[-0.5])
        store.begin(call)
        call.outcome = "ok"
        store.end(call)
        if report and i % 50 == 49:
            await store.freeze(f"barrier-{name}-{i}")  # after every record queued before it: committed
            print(i, flush=True)
        await asyncio.sleep(pause)
    if not report:
        await store.close()

pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", pause))
"""
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}


def make(i: int, rollout: str = "r", n: int = 2000) -> Call:
    return Call(
        rollout_id=rollout,
        call_id=f"{rollout}-{i}",
        route="responses",
        started=time.time(),
        prompt_token_ids=list(range(i, i + n)),
        generation_token_ids=[7, 8, 9],
        generation_log_probs=[-0.1, -1e-9, -9999.0],
        usage={"prompt_tokens": n, "completion_tokens": 3},
    )


def done(call: Call, outcome: str = "ok") -> Call:
    call.outcome = outcome  # type: ignore[assignment]
    call.ended = time.time()
    call.finish_reason = "stop"
    return call


async def test_records_come_back_exactly_in_seq_order(backend: Backend) -> None:
    store = await backend.opened()
    calls = [make(i) for i in range(5)]
    for c in calls:
        assert store.begin(c)
    for c in calls:
        assert store.end(done(c))
    await store.close()
    again = await backend.opened()
    rollout = await again.get("r")
    assert rollout is not None and [c.seq for c in rollout.calls] == [1, 2, 3, 4, 5]
    for got, sent in zip(rollout.calls, calls, strict=True):
        assert got.prompt_token_ids == sent.prompt_token_ids and got.generation_log_probs == [-0.1, -1e-9, -9999.0]
        assert got.outcome == "ok" and got.usage == sent.usage
    assert (
        rollout.complete and again.stats.recorded == 0 and store.stats.recorded in (5, 10)
    )  # a start and its end may go as one
    await again.close()


async def test_a_call_is_numbered_by_its_start_and_its_end_replaces_it(backend: Backend) -> None:
    """Calls that end in another order than they began keep the order of their starts."""
    store = await backend.opened()
    calls = [make(i, n=3) for i in range(4)]
    for c in calls:
        store.begin(c)
    await store.freeze("other")  # a barrier: the starts are written
    for c in reversed(calls):
        store.end(done(c))
    rollout = await store.get("r")
    assert rollout is not None
    assert [(c.seq, c.call_id, c.outcome) for c in rollout.calls] == [(i + 1, f"r-{i}", "ok") for i in range(4)]
    await store.close()


async def test_a_freeze_is_atomic_and_later_records_are_refused(backend: Backend) -> None:
    store = await backend.opened()
    first, second = make(1), make(2)
    store.begin(first)
    store.end(done(first))
    store.begin(second)  # in flight at the freeze
    snapshot = await store.freeze("r")
    assert snapshot is not None and snapshot.state == "frozen" and snapshot.frozen_at
    assert [c.outcome for c in snapshot.calls] == ["ok", "in_flight"] and not snapshot.complete
    store.end(done(second))
    assert not await store.admit("r") and await store.admit("other")
    await store.freeze("r")  # a barrier: what came before it is written
    again = await store.get("r")
    assert again is not None and again.calls == snapshot.calls and again.refused == 1
    assert store.stats.refused == 1 and store.stats.dropped == 1
    assert await store.freeze("unknown") is None
    await store.close()


async def test_listing_pages_by_id_and_delete(backend: Backend) -> None:
    store = await backend.opened()
    for name in ("b", "a", "d", "c"):
        c = make(0, name, n=3)
        store.begin(c)
        store.end(done(c, "error" if name == "c" else "ok"))
    await store.freeze("d")
    page = await store.list(after=None, limit=2)
    assert [s.rollout_id for s in page] == ["a", "b"]
    page = await store.list(after="b", limit=2)
    assert [(s.rollout_id, s.calls, s.complete) for s in page] == [("c", 1, False), ("d", 1, True)]
    assert [s.rollout_id for s in await store.list(after=None, limit=10, state="frozen")] == ["d"]
    assert [s.rollout_id for s in await store.list(after="a", limit=10, state="open")] == ["b", "c"]
    assert await store.delete("d") and not await store.delete("d")
    assert await store.get("d") is None and await store.admit("d")
    await store.close()


async def test_two_processes_share_one_store_and_seqs_stay_unique(backend: Backend) -> None:
    url = backend.url("shared")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, url, name, "150", "0"], env=ENV) for name in ("w1", "w2")]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    store = await backend.opened("shared")
    rollout = await store.get("shared")
    assert rollout is not None
    assert sorted(c.seq for c in rollout.calls) == list(range(1, 301))
    assert {c.call_id for c in rollout.calls} == {f"w{w}-{i}" for w in (1, 2) for i in range(150)}
    assert all(c.outcome == "ok" for c in rollout.calls)
    await store.close()


async def test_two_processes_freezing_while_two_write_agree_and_nothing_is_added(backend: Backend) -> None:
    """Two writer processes keep adding calls to one rollout while two stores freeze it at once:
    both get the same snapshot, and it is what the rollout holds after the writers went on trying."""
    url = backend.url("shared")
    # A call every 2 ms each: still writing at the freeze, and the rollout stays small enough to read
    # back whole, however slowly this test's polls come on a loaded machine.
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, url, name, "1000000", "0", "0.002"], env=ENV)
        for name in ("w1", "w2")
    ]
    try:
        first, second = await backend.opened("shared"), await backend.opened("shared")

        async def written() -> int:
            summaries = [s for s in await first.list(after=None, limit=10) if s.rollout_id == "shared"]
            return summaries[0].calls if summaries else 0

        for _ in range(600):
            if await written() >= 200:
                break
            await asyncio.sleep(0.05)
        one, two = await asyncio.gather(first.freeze("shared"), second.freeze("shared"))
        assert all(proc.poll() is None for proc in procs), "a writer ended before the freeze"
        await asyncio.sleep(1)  # the writers go on: every record they send now is refused
        assert all(proc.poll() is None for proc in procs)
        after = await second.get("shared")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
    assert one is not None and two is not None and after is not None
    counts = [len(one.calls), len(two.calls), len(after.calls)]
    assert counts[0] == counts[1] == counts[2] >= 200, counts  # (a short message: the calls are thousands)
    assert one.calls == two.calls == after.calls and one.frozen_at == two.frozen_at == after.frozen_at
    assert [c.seq for c in after.calls] == list(range(1, len(after.calls) + 1))


async def test_after_sigkill_every_committed_call_is_readable(backend: Backend) -> None:
    url = backend.url("killed")
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, "k", "100000", "1"], env=ENV, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    committed = -1
    for line in proc.stdout:
        committed = int(line)
        if committed >= 499:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    if backend.kind == "sqlite":
        check = sqlite3.connect(backend.tmp_path / "killed.db")
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        check.close()
    store = await backend.opened("killed")
    rollout = await store.get("shared")
    assert rollout is not None
    ids = {c.call_id for c in rollout.calls}
    assert {f"k-{i}" for i in range(committed + 1)} <= ids  # every call committed before the kill
    assert sorted(c.seq for c in rollout.calls) == list(range(1, len(rollout.calls) + 1))
    assert all(c.generation_token_ids is not None for c in rollout.calls)  # no torn record
    await store.close()


async def test_a_stalled_store_never_blocks_the_loop(backend: Backend) -> None:
    store = await backend.opened()
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            worst = max(worst, time.monotonic() - before - 0.01)

    ticker = asyncio.ensure_future(tick())
    began = time.monotonic()
    with backend.stalled():
        for i in range(300):
            c = make(i, n=200)
            assert store.begin(c)
            assert store.end(done(c))
            assert await store.admit("r")  # asks Redis once, then not while it stalls
            await asyncio.sleep(0.01)
        spent = time.monotonic() - began
    rollout = await store.get("r")  # after every record queued before it
    assert rollout is not None and len(rollout.calls) == 300
    ticker.cancel()
    assert worst < 0.5, f"the loop stalled {worst:.3f} s"
    assert spent < 30
    assert store.stats.failed == 0
    await store.close()


async def test_a_full_queue_refuses_at_once_and_counts(backend: Backend) -> None:
    store = await backend.opened(max_pending=16)
    with backend.stalled():
        taken = sum(store.begin(make(i, n=1)) for i in range(100))
        assert taken < 100 and store.stats.dropped == 100 - taken and not store.available()
    assert await eventually(store.available, 20)
    await store.close()


async def test_eviction_by_age_is_counted(backend: Backend) -> None:
    store = await backend.opened(max_age_s=0.3)
    c = make(0, "old", n=10)
    store.begin(c)
    store.end(done(c))
    assert await eventually(lambda: store.stats.evicted_rollouts == 1, 10)
    assert await store.get("old") is None and store.stats.evicted_calls == 1
    assert await store.list(after=None, limit=10) == []
    await store.close()


# --- SQLite only ----------------------------------------------------------------------------------


async def test_sqlite_eviction_by_size_takes_the_oldest_first(tmp_path: Path) -> None:
    small = SQLiteStore(f"sqlite:///{tmp_path / 's.db'}", Bounds(max_bytes=50_000))
    await small.start()
    for i in range(20):  # about 6 KB a call (2,000 ids in msgpack): the oldest go
        c = make(0, f"r{i:02}")
        small.begin(c)
        small.end(done(c))
        await small.freeze(f"r{i:02}")  # committed in order, each its own update time
    assert await eventually(lambda: small.stats.evicted_rollouts > 0, 10)
    left = [s.rollout_id for s in await small.list(after=None, limit=100)]
    assert left and left == sorted(left) and left[-1] == "r19" and "r00" not in left
    await small.close()


async def test_a_store_that_cannot_be_opened_says_where(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    store = SQLiteStore(f"sqlite:///{tmp_path / 'file' / 'r.db'}", Bounds())
    with pytest.raises(StoreError, match="cannot open the rollout store"):
        await store.start()
    with pytest.raises(StoreError, match="sqlite:///PATH"):
        open_store("sqlite://nope.db", Bounds())
    with pytest.raises(StoreError, match="neither"):
        open_store("postgres://x", Bounds())


def test_workers_opening_a_new_sqlite_file_at_once_all_start(tmp_path: Path) -> None:
    # `--workers` open the store together; SQLite answers a journal-mode change "database is
    # locked" at once, without its busy handler, and a worker failing there stopped gymproxy (one
    # opener in ten failed before). Connections on threads contend as processes do, and start closer.
    failed: list[BaseException] = []

    def open_at(store: SQLiteStore, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            store._open().close()
        except BaseException as exc:
            failed.append(exc)

    for round_ in range(100):
        url = f"sqlite:///{tmp_path / f'r{round_}.db'}"
        barrier = threading.Barrier(6)
        threads = [threading.Thread(target=open_at, args=(SQLiteStore(url, Bounds()), barrier)) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not failed, failed[:3]
