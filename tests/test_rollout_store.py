"""The embedded rollout store (`rollouts.sqlite_store`): exact records, seq, atomic freezes, paging,
several processes on one file, what SIGKILL keeps, a stalled disk that never blocks the loop, and
the bounds."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gymproxy.rollouts.record import Call
from gymproxy.rollouts.sqlite_store import SQLiteStore
from gymproxy.rollouts.store import Bounds, StoreError, open_store

from .faults import eventually

WRITER = """
import asyncio, sys, time
from gymproxy.rollouts.record import Call
from gymproxy.rollouts.store import Bounds, open_store

async def main(url, name, n, report):
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
        await asyncio.sleep(0)
    if not report:
        await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"))
"""


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


async def opened(path: Path, **bounds: float) -> SQLiteStore:
    store = SQLiteStore(f"sqlite:///{path}", Bounds(**bounds))  # type: ignore[arg-type]
    await store.start()
    return store


def done(call: Call, outcome: str = "ok") -> Call:
    call.outcome = outcome  # type: ignore[assignment]
    call.ended = time.time()
    call.finish_reason = "stop"
    return call


async def test_records_come_back_exactly_in_seq_order(tmp_path: Path) -> None:
    store = await opened(tmp_path / "r.db")
    calls = [make(i) for i in range(5)]
    for c in calls:
        assert store.begin(c)
    for c in calls:
        assert store.end(done(c))
    await store.close()
    again = await opened(tmp_path / "r.db")
    rollout = await again.get("r")
    assert rollout is not None and [c.seq for c in rollout.calls] == [1, 2, 3, 4, 5]
    for got, sent in zip(rollout.calls, calls, strict=True):
        assert got.prompt_token_ids == sent.prompt_token_ids and got.generation_log_probs == [-0.1, -1e-9, -9999.0]
        assert got.outcome == "ok" and got.usage == sent.usage
    assert (
        rollout.complete and again.stats.recorded == 0 and store.stats.recorded in (5, 10)
    )  # a start and its end may go as one
    await again.close()


async def test_a_freeze_is_atomic_and_later_records_are_refused(tmp_path: Path) -> None:
    store = await opened(tmp_path / "r.db")
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


async def test_listing_pages_by_id_and_delete(tmp_path: Path) -> None:
    store = await opened(tmp_path / "r.db")
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
    assert await store.delete("d") and not await store.delete("d")
    assert await store.get("d") is None and await store.admit("d")
    await store.close()


async def test_two_processes_share_one_file_and_seqs_stay_unique(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, url, name, "150", "0"], env=env) for name in ("w1", "w2")]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    store = open_store(url, Bounds())
    await store.start()
    rollout = await store.get("shared")
    assert rollout is not None
    assert sorted(c.seq for c in rollout.calls) == list(range(1, 301))
    assert {c.call_id for c in rollout.calls} == {f"w{w}-{i}" for w in (1, 2) for i in range(150)}
    assert all(c.outcome == "ok" for c in rollout.calls)
    await store.close()


async def test_after_sigkill_every_committed_call_is_readable(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'killed.db'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, "k", "100000", "1"], env=env, stdout=subprocess.PIPE, text=True
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
    check = sqlite3.connect(tmp_path / "killed.db")
    assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()
    store = open_store(url, Bounds())
    await store.start()
    rollout = await store.get("shared")
    assert rollout is not None
    ids = {c.call_id for c in rollout.calls}
    assert {f"k-{i}" for i in range(committed + 1)} <= ids  # every call committed before the kill
    assert sorted(c.seq for c in rollout.calls) == list(range(1, len(rollout.calls) + 1))
    assert all(c.generation_token_ids is not None for c in rollout.calls)  # no torn record
    await store.close()


async def test_a_stalled_file_never_blocks_the_loop(tmp_path: Path) -> None:
    store = await opened(tmp_path / "r.db")
    blocker = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # the writer now waits on the lock, as on a stalled disk
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            worst = max(worst, time.monotonic() - before - 0.01)

    ticker = asyncio.ensure_future(tick())
    began = time.monotonic()
    for i in range(300):
        c = make(i, n=200)
        assert store.begin(c)
        assert store.end(done(c))
        await asyncio.sleep(0.01)
    spent = time.monotonic() - began
    blocker.execute("ROLLBACK")
    blocker.close()
    rollout = await store.get("r")  # after every record queued before it
    assert rollout is not None and len(rollout.calls) == 300
    ticker.cancel()
    assert worst < 0.5, f"the loop stalled {worst:.3f} s"
    assert spent < 30
    await store.close()


async def test_a_full_queue_refuses_at_once_and_counts(tmp_path: Path) -> None:
    store = await opened(tmp_path / "r.db", max_pending=16)
    blocker = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    taken = sum(store.begin(make(i, n=1)) for i in range(100))
    assert taken < 100 and store.stats.dropped == 100 - taken and not store.available()
    blocker.execute("ROLLBACK")
    blocker.close()
    assert await eventually(store.available, 20)
    await store.close()


async def test_eviction_by_age_and_by_size_is_counted(tmp_path: Path) -> None:
    store = await opened(tmp_path / "r.db", max_age_s=0.3)
    c = make(0, "old", n=10)
    store.begin(c)
    store.end(done(c))
    assert await eventually(lambda: store.stats.evicted_rollouts == 1, 10)
    assert await store.get("old") is None and store.stats.evicted_calls == 1
    await store.close()
    small = await opened(tmp_path / "s.db", max_bytes=50_000)
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
