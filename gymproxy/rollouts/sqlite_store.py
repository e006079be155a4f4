"""The embedded rollout store: one SQLite file in WAL mode (standard library), written by one thread.

`begin` and `end` append a record to a bounded in-memory queue and return (no lock, no wake-up);
every `FLUSH_S` the writer thread takes what is queued and writes it in one transaction, one
upsert a record (a group commit: a record is committed within `FLUSH_S` plus the write). A call
whose end is queued by the time its start is written is written once. `freeze` and `delete` go
through the same queue and wake the writer, so a freeze comes after every record this process
queued before it. Reads use their own connection on their own thread. The event loop never
touches the file.

Several processes may share the file (`--workers`): each transaction takes the write lock
(`BEGIN IMMEDIATE`, waiting up to `BUSY_TIMEOUT_S`) and re-reads the rollouts frozen since its
last look inside it, so a call's records that reach a rollout another process froze are dropped
(counted): a snapshot never changes. Calls are numbered (`seq`) by when they started, ties in the
order their first records were committed (the table's rowid: `record.numbered`). `admit` sees another process's freeze
within `FLUSH_S`.

What SIGKILL can lose: the records still queued, at most `FLUSH_S` of them; every committed one
is readable, and WAL keeps the file whole (`synchronous=NORMAL`: a power loss may also lose the
last commits). Bounds: a rollout not written for `max_age_s` is evicted, and while the records'
bytes exceed `max_bytes` (counted as written, so a call written twice counts twice) the least
recently written rollouts go first.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from .record import Call, Rollout, State, Summary, decode_call, encode_call, numbered
from .store import Bounds, Stats, StoreError, queued

log = logging.getLogger("gymproxy")

BUSY_TIMEOUT_S: Final = 10.0
FLUSH_S: Final = 0.02  # the writer's batch window: records are committed at most this long after
HOUSEKEEPING_S: Final = 1.0  # eviction and the open/frozen counts, at most this often
BATCH_MAX: Final = 20_000  # records in one transaction at most

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL DEFAULT 'open',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    frozen_at REAL,
    refused INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS rollouts_updated ON rollouts (updated);
CREATE INDEX IF NOT EXISTS rollouts_frozen ON rollouts (frozen_at);
CREATE TABLE IF NOT EXISTS calls (
    ord INTEGER PRIMARY KEY,
    call_id TEXT NOT NULL UNIQUE,
    rollout TEXT NOT NULL,
    outcome TEXT NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_rollout ON calls (rollout, ord);
"""
UPSERT_CALL: Final = (
    "INSERT INTO calls (call_id, rollout, outcome, data) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (call_id) DO UPDATE SET outcome = excluded.outcome, data = excluded.data"
)
UPSERT_ROLLOUT: Final = (
    "INSERT INTO rollouts (id, created, updated, bytes) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (id) DO UPDATE SET updated = excluded.updated, bytes = bytes + excluded.bytes"
)


Op = tuple[str, Any, "Future[Any] | None"]  # (kind, payload, the future of an awaited op)


def path_of(url: str) -> Path:
    """`sqlite:///relative/path.db` (relative to the working directory) or `sqlite:////abs/path.db`."""
    rest = url.removeprefix("sqlite://")
    if not rest.startswith("/") or len(rest) < 2:
        raise StoreError(f"capture.store: {url!r} is not sqlite:///PATH")
    return Path(rest[1:])


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    try:
        _wal(db)
        db.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        db.close()
        raise
    return db


def _wal(db: sqlite3.Connection) -> None:
    """Put the file in WAL mode, waiting up to `BUSY_TIMEOUT_S` for the other processes opening it
    (`--workers` start together): SQLite answers "database is locked" to a journal-mode change at
    once, without its busy handler."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    pause = 0.001
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class SQLiteStore:
    """The `Store` of one SQLite file (see the module docstring)."""

    def __init__(self, url: str, bounds: Bounds) -> None:
        self.path = path_of(url)
        self.bounds = bounds
        self.stats = Stats()
        self._pending: deque[Op | None] = deque()  # appended by the loop, taken by the writer
        self._wake = threading.Event()  # an awaited op, or close: write now
        self._frozen: set[str] = set()
        self._failing = False
        self._thread: threading.Thread | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="gymproxy-rollouts-read")
        self._read_db: sqlite3.Connection | None = None
        self._logged: set[str] = set()

    # --- the event loop's side -------------------------------------------------------------------

    async def start(self) -> None:
        try:
            db = await asyncio.to_thread(self._open)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the rollout store {self.path}: {exc}") from exc
        self._thread = threading.Thread(target=self._write_loop, args=(db,), name="gymproxy-rollouts", daemon=True)
        self._thread.start()

    def begin(self, call: Call) -> bool:
        return queued(self._pending, ("begin", call, None), self.bounds, self.stats)

    def end(self, call: Call) -> bool:
        return queued(self._pending, ("end", call, None), self.bounds, self.stats)

    def available(self) -> bool:
        return not self._failing and len(self._pending) < self.bounds.max_pending

    async def admit(self, rollout_id: str) -> bool:
        if rollout_id not in self._frozen:
            return True
        self.stats.refused += 1
        queued(self._pending, ("refuse", rollout_id, None), self.bounds, self.stats)
        return False

    async def get(self, rollout_id: str) -> Rollout | None:
        await self._awaited("sync", "")  # what this process queued before is read back
        rollout: Rollout | None = await self._read(lambda db: _rollout(db, rollout_id))
        return rollout

    async def list(self, *, after: str | None, limit: int, state: State | None = None) -> builtins.list[Summary]:
        await self._awaited("sync", "")
        summaries: builtins.list[Summary] = await self._read(lambda db: _summaries(db, after, limit, state))
        return summaries

    async def freeze(self, rollout_id: str) -> Rollout | None:
        result: Rollout | None = await self._awaited("freeze", rollout_id)
        return result

    async def delete(self, rollout_id: str) -> bool:
        deleted: bool = await self._awaited("delete", rollout_id)
        return deleted

    async def close(self) -> None:
        thread = self._thread
        if thread is not None:
            self._pending.append(None)  # after every record queued: they are written
            self._wake.set()
            await asyncio.to_thread(thread.join)
            self._thread = None
        self._reader.shutdown(wait=False)

    async def _awaited(self, kind: str, rollout_id: str) -> Any:
        if self._thread is None:
            raise StoreError(f"the rollout store {self.path} is closed")
        future: Future[Any] = Future()
        self._pending.append((kind, rollout_id, future))  # past the bound too: it must go
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def _read(self, read: Callable[[sqlite3.Connection], Any]) -> Any:
        def run() -> Any:
            if self._read_db is None:
                self._read_db = connect(self.path)
            return read(self._read_db)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._reader, run)
        except sqlite3.Error as exc:
            raise StoreError(f"the rollout store {self.path} cannot be read: {exc}") from exc

    # --- the writer thread --------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = connect(self.path)
        db.executescript(f"BEGIN IMMEDIATE; {SCHEMA} COMMIT;")  # the write lock first: its wait is the busy handler's
        self._frozen = {row[0] for row in db.execute("SELECT id FROM rollouts WHERE state = 'frozen'")}
        return db

    def _write_loop(self, db: sqlite3.Connection) -> None:
        housekept = 0.0
        watermark = 0.0
        pending = self._pending
        stopping = False
        while not stopping:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            batch: builtins.list[Op] = []
            while pending and len(batch) < BATCH_MAX:
                op = pending.popleft()
                if op is None:
                    stopping = True
                    break
                batch.append(op)
            try:
                watermark = self._write(db, batch, watermark)
                now = time.monotonic()
                if now - housekept >= HOUSEKEEPING_S:
                    housekept = now
                    self._housekeeping(db)
            except sqlite3.Error as exc:
                self._log_once("housekeeping", f"rollout store {self.path}: housekeeping failed: {exc}")
            if pending and not stopping:
                self._wake.set()  # more than a batch waits
        db.close()

    def _write(self, db: sqlite3.Connection, batch: builtins.list[Op], watermark: float) -> float:
        """Write `batch` in one transaction (after re-reading the rollouts frozen meanwhile); the new
        frozen watermark."""
        started = time.monotonic()
        results: builtins.list[tuple[Future[Any], Any]] = []
        try:
            db.execute("BEGIN IMMEDIATE")
            frozen = self._frozen
            for rollout, frozen_at in db.execute(
                "SELECT id, frozen_at FROM rollouts WHERE frozen_at > ?", (watermark,)
            ):
                frozen.add(rollout)
                watermark = max(watermark, frozen_at)
            calls: builtins.list[tuple[str, str, str, bytes]] = []
            touched: dict[str, tuple[float, int]] = {}  # rollout: (created, bytes)
            now = time.time()
            for kind, payload, future in batch:
                if kind == "begin" or kind == "end":
                    call: Call = payload
                    rollout = call.rollout_id
                    if rollout in frozen:
                        self.stats.dropped += 1
                        continue
                    if kind == "begin" and call.outcome != "in_flight":
                        continue  # its end is queued: written once
                    data = encode_call(call)
                    calls.append((call.call_id, rollout, call.outcome, data))
                    created, size = touched.get(rollout, (call.started, 0))
                    touched[rollout] = (created, size + len(data))
                    continue
                if calls:  # what came before an op is written before it
                    self._flush(db, calls, touched, now)
                if kind == "refuse":
                    db.execute("UPDATE rollouts SET refused = refused + 1 WHERE id = ?", (payload,))
                elif kind == "freeze":
                    assert future is not None
                    frozen_id = self._freeze(db, payload, now)
                    results.append((future, frozen_id and _rollout(db, frozen_id)))
                elif kind == "delete":
                    assert future is not None
                    results.append((future, self._delete(db, payload)))
                elif kind == "sync":
                    assert future is not None
                    results.append((future, None))
            if calls:
                self._flush(db, calls, touched, now)
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            if db.in_transaction:
                db.rollback()
            self._failing = True
            self.stats.failed += sum(kind in ("begin", "end") for kind, _, _ in batch)
            self._log_once(type(exc).__name__, f"rollout store {self.path}: a batch was lost: {exc}")
            failure = StoreError(f"the rollout store {self.path} failed: {exc}")
            for _, _, future in batch:
                if future is not None:
                    future.set_exception(failure)
            return watermark
        self._failing = False
        if batch:
            self.stats.batch_seconds.append(time.monotonic() - started)
            if len(self.stats.batch_seconds) > 10_000:  # nobody scrapes: keep the newest
                del self.stats.batch_seconds[:5_000]
        for future, result in results:
            future.set_result(result)
        return watermark

    def _flush(
        self,
        db: sqlite3.Connection,
        calls: builtins.list[tuple[str, str, str, bytes]],
        touched: dict[str, tuple[float, int]],
        now: float,
    ) -> None:
        db.executemany(UPSERT_CALL, calls)
        db.executemany(UPSERT_ROLLOUT, [(rollout, created, now, size) for rollout, (created, size) in touched.items()])
        self.stats.recorded += len(calls)
        self.stats.bytes += sum(size for _, size in touched.values())
        calls.clear()
        touched.clear()

    def _freeze(self, db: sqlite3.Connection, rollout: str, now: float) -> str | None:
        done = db.execute(
            "UPDATE rollouts SET state = 'frozen', frozen_at = ? WHERE id = ? AND state = 'open'", (now, rollout)
        )
        if not done.rowcount and db.execute("SELECT 1 FROM rollouts WHERE id = ?", (rollout,)).fetchone() is None:
            return None
        self._frozen.add(rollout)
        return rollout

    def _delete(self, db: sqlite3.Connection, rollout: str) -> bool:
        db.execute("DELETE FROM calls WHERE rollout = ?", (rollout,))
        deleted = db.execute("DELETE FROM rollouts WHERE id = ?", (rollout,)).rowcount > 0
        self._frozen.discard(rollout)
        return deleted

    def _housekeeping(self, db: sqlite3.Connection) -> None:
        """Evict by age and by size, and count open and frozen rollouts."""
        bounds, stats = self.bounds, self.stats
        old = [
            row[0] for row in db.execute("SELECT id FROM rollouts WHERE updated < ?", (time.time() - bounds.max_age_s,))
        ]
        total = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM rollouts").fetchone()[0]
        if total > bounds.max_bytes:
            for rollout, size in db.execute("SELECT id, bytes FROM rollouts ORDER BY updated"):
                if total <= bounds.max_bytes:
                    break
                if rollout not in old:
                    old.append(rollout)
                total -= size
        if old:
            db.execute("BEGIN IMMEDIATE")
            for rollout in old:
                stats.evicted_calls += db.execute("DELETE FROM calls WHERE rollout = ?", (rollout,)).rowcount
                stats.evicted_rollouts += db.execute("DELETE FROM rollouts WHERE id = ?", (rollout,)).rowcount
                self._frozen.discard(rollout)
            db.execute("COMMIT")
        counts = dict(db.execute("SELECT state, COUNT(*) FROM rollouts GROUP BY state").fetchall())
        stats.open, stats.frozen = counts.get("open", 0), counts.get("frozen", 0)

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("%s (logged once)", message)


def _rollout(db: sqlite3.Connection, rollout: str) -> Rollout | None:
    row = db.execute(
        "SELECT state, created, updated, frozen_at, refused FROM rollouts WHERE id = ?", (rollout,)
    ).fetchone()
    if row is None:
        return None
    rows = db.execute("SELECT data FROM calls WHERE rollout = ? ORDER BY ord", (rollout,))
    calls = numbered([decode_call(data) for (data,) in rows])
    state, created, updated, frozen_at, refused = row
    return Rollout(
        rollout_id=rollout,
        state=state,
        created=created,
        updated=updated,
        frozen_at=frozen_at,
        refused=refused,
        calls=calls,
    )


def _summaries(db: sqlite3.Connection, after: str | None, limit: int, state: State | None) -> list[Summary]:
    where, args = ["id > ?"], [after or ""]
    if state is not None:
        where.append("state = ?")
        args.append(state)
    rows = db.execute(
        f"SELECT id, state, created, updated FROM rollouts WHERE {' AND '.join(where)} ORDER BY id LIMIT ?",  # noqa: S608
        (*args, limit),
    ).fetchall()
    summaries = []
    for rollout, row_state, created, updated in rows:
        calls, failed = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(outcome IN ('in_flight', 'error', 'cut')), 0) FROM calls WHERE rollout = ?",
            (rollout,),
        ).fetchone()
        summaries.append(
            Summary(
                rollout_id=rollout, state=row_state, created=created, updated=updated, calls=calls, complete=not failed
            )
        )
    return summaries
