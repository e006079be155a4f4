"""The embedded rollout store: one SQLite file in WAL mode (standard library), written by one thread.

`begin` and `end` put a record on a bounded queue and return; the writer thread takes whatever is
queued and writes it in one transaction (a group commit: at once when idle, batched under load, so
a record is committed within milliseconds). `freeze` and `delete` go through the same queue, so a
freeze comes after every record this process queued before it. Reads use their own connection on
their own thread. The event loop never touches the file.

Several processes may share the file (`--workers`): each transaction takes the write lock
(`BEGIN IMMEDIATE`, waiting up to `BUSY_TIMEOUT_S`) and numbers calls from the rollout's row, so
`seq` stays unique. A freeze made by another process is seen by `admit` within `REFRESH_S`; a
call's records that reach a rollout frozen meanwhile are dropped in the transaction (counted), so
a snapshot never changes.

What SIGKILL can lose: the records still queued (not yet committed), at most the last batch;
every committed one is readable, and WAL keeps the file whole (`synchronous=NORMAL`: a power loss
may also lose the last commits). Bounds: a rollout not written for `max_age_s` is evicted, and
while the records' bytes exceed `max_bytes` the least recently written rollouts go first.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import msgspec

from .record import Call, Rollout, State, Summary
from .store import Bounds, Stats, StoreError

log = logging.getLogger("gymproxy")

BUSY_TIMEOUT_S: Final = 10.0
REFRESH_S: Final = 0.1  # frozen rollouts of other processes re-read this often
HOUSEKEEPING_S: Final = 1.0  # eviction and the open/frozen counts, at most this often
BATCH_MAX: Final = 5000  # records in one transaction at most

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL DEFAULT 'open',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    frozen_at REAL,
    refused INTEGER NOT NULL DEFAULT 0,
    last_seq INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS rollouts_updated ON rollouts (updated);
CREATE INDEX IF NOT EXISTS rollouts_frozen ON rollouts (frozen_at);
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT PRIMARY KEY,
    rollout TEXT NOT NULL,
    seq INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    data BLOB NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS calls_seq ON calls (rollout, seq);
"""

_ENCODE: Final = msgspec.msgpack.Encoder().encode
_DECODE: Final = msgspec.msgpack.Decoder(Call).decode

Op = tuple[str, Any, "Future[Any] | None"]  # (kind, payload, the future of an awaited op)


def path_of(url: str) -> Path:
    """`sqlite:///relative/path.db` (relative to the working directory) or `sqlite:////abs/path.db`."""
    rest = url.removeprefix("sqlite://")
    if not rest.startswith("/") or len(rest) < 2:
        raise StoreError(f"capture.store: {url!r} is not sqlite:///PATH")
    return Path(rest[1:])


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class SQLiteStore:
    """The `Store` of one SQLite file (see the module docstring)."""

    def __init__(self, url: str, bounds: Bounds) -> None:
        self.path = path_of(url)
        self.bounds = bounds
        self.stats = Stats()
        self._queue: queue.Queue[Op | None] = queue.Queue(bounds.max_pending)
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
        return self._put(("begin", call, None))

    def end(self, call: Call) -> bool:
        return self._put(("end", call, None))

    def available(self) -> bool:
        return not self._failing and not self._queue.full()

    async def admit(self, rollout_id: str) -> bool:
        if rollout_id not in self._frozen:
            return True
        self.stats.refused += 1
        self._put(("refuse", rollout_id, None))
        return False

    async def get(self, rollout_id: str) -> Rollout | None:
        rollout: Rollout | None = await self._read(lambda db: _rollout(db, rollout_id))
        return rollout

    async def list(self, *, after: str | None, limit: int, state: State | None = None) -> list[Summary]:
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
            await asyncio.to_thread(self._queue.put, None)  # after every record queued: they are written
            await asyncio.to_thread(thread.join)
            self._thread = None
        self._reader.shutdown(wait=False)

    def _put(self, op: Op) -> bool:
        try:
            self._queue.put_nowait(op)
        except queue.Full:
            self.stats.dropped += 1
            return False
        return True

    async def _awaited(self, kind: str, rollout_id: str) -> Any:
        future: Future[Any] = Future()
        await asyncio.to_thread(self._queue.put, (kind, rollout_id, future))  # waits for room: it must go
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
        db.executescript(SCHEMA)
        self._frozen = {row[0] for row in db.execute("SELECT id FROM rollouts WHERE state = 'frozen'")}
        return db

    def _write_loop(self, db: sqlite3.Connection) -> None:
        refreshed = housekept = 0.0
        watermark = 0.0
        stopping = False
        while not stopping:
            batch: list[Op] = []
            try:
                first = self._queue.get(timeout=REFRESH_S)
            except queue.Empty:
                pass  # no record: the periodic work only
            else:
                if first is None:
                    stopping = True
                else:
                    batch.append(first)
                while batch and len(batch) < BATCH_MAX:
                    try:
                        op = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if op is None:
                        stopping = True
                        break
                    batch.append(op)
            if batch:
                self._write(db, batch)
            now = time.monotonic()
            try:
                if now - refreshed >= REFRESH_S:
                    refreshed = now
                    watermark = self._refresh_frozen(db, watermark)
                if now - housekept >= HOUSEKEEPING_S:
                    housekept = now
                    self._housekeeping(db)
            except sqlite3.Error as exc:
                self._log_once("housekeeping", f"rollout store {self.path}: housekeeping failed: {exc}")
        db.close()

    def _write(self, db: sqlite3.Connection, batch: builtins.list[Op]) -> None:
        started = time.monotonic()
        results: builtins.list[tuple[Future[Any], Any]] = []
        records = written = 0
        try:
            db.execute("BEGIN IMMEDIATE")
            for kind, payload, future in batch:
                if kind == "begin" or kind == "end":
                    size = self._record(db, payload, start=kind == "begin")
                    if size:
                        records += 1
                        written += size
                elif kind == "refuse":
                    db.execute("UPDATE rollouts SET refused = refused + 1 WHERE id = ?", (payload,))
                elif kind == "freeze":
                    assert future is not None
                    results.append((future, self._freeze(db, payload)))
                elif kind == "delete":
                    assert future is not None
                    results.append((future, self._delete(db, payload)))
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
            return
        self._failing = False
        stats = self.stats
        stats.recorded += records
        stats.bytes += written
        stats.batch_seconds.append(time.monotonic() - started)
        if len(stats.batch_seconds) > 10_000:  # nobody scrapes: keep the newest
            del stats.batch_seconds[:5_000]
        for future, result in results:
            if isinstance(result, str):  # a frozen id: seen by this process's admit from now on
                self._frozen.add(result)
            future.set_result(result if not isinstance(result, str) else _rollout(db, result))

    def _record(self, db: sqlite3.Connection, call: Call, *, start: bool) -> int:
        """Write one record; its size, or 0 when it was dropped (its rollout is frozen)."""
        rollout = call.rollout_id
        now = time.time()
        row = db.execute("SELECT state, last_seq FROM rollouts WHERE id = ?", (rollout,)).fetchone()
        if row is None:
            db.execute("INSERT INTO rollouts (id, created, updated) VALUES (?, ?, ?)", (rollout, call.started, now))
            state, last = "open", 0
        else:
            state, last = row
        if state == "frozen":
            self.stats.dropped += 1
            return 0
        existing = (
            None
            if start
            else db.execute("SELECT seq, length(data) FROM calls WHERE call_id = ?", (call.call_id,)).fetchone()
        )
        if existing is None:
            call.seq = last + 1
            data = _ENCODE(call)
            db.execute(
                "INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?, ?)",
                (call.call_id, rollout, call.seq, call.outcome, data),
            )
            db.execute(
                "UPDATE rollouts SET last_seq = ?, updated = ?, bytes = bytes + ? WHERE id = ?",
                (call.seq, now, len(data), rollout),
            )
        else:
            call.seq = existing[0]
            data = _ENCODE(call)
            db.execute("UPDATE calls SET outcome = ?, data = ? WHERE call_id = ?", (call.outcome, data, call.call_id))
            db.execute(
                "UPDATE rollouts SET updated = ?, bytes = bytes + ? WHERE id = ?",
                (now, len(data) - existing[1], rollout),
            )
        return len(data)

    def _freeze(self, db: sqlite3.Connection, rollout: str) -> str | None:
        done = db.execute(
            "UPDATE rollouts SET state = 'frozen', frozen_at = ? WHERE id = ? AND state = 'open'",
            (time.time(), rollout),
        )
        if done.rowcount:
            return rollout
        known = db.execute("SELECT 1 FROM rollouts WHERE id = ?", (rollout,)).fetchone()
        return rollout if known else None

    def _delete(self, db: sqlite3.Connection, rollout: str) -> bool:
        db.execute("DELETE FROM calls WHERE rollout = ?", (rollout,))
        deleted = db.execute("DELETE FROM rollouts WHERE id = ?", (rollout,)).rowcount > 0
        self._frozen.discard(rollout)
        return deleted

    def _refresh_frozen(self, db: sqlite3.Connection, watermark: float) -> float:
        """Rollouts other processes froze since `watermark` join this process's frozen set."""
        for rollout, frozen_at in db.execute("SELECT id, frozen_at FROM rollouts WHERE frozen_at > ?", (watermark,)):
            self._frozen.add(rollout)
            watermark = max(watermark, frozen_at)
        return watermark

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
    calls = [
        _DECODE(data) for (data,) in db.execute("SELECT data FROM calls WHERE rollout = ? ORDER BY seq", (rollout,))
    ]
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
