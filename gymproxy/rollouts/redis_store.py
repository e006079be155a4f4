"""The shared rollout store: one Redis (`redis://HOST:PORT/DB`, `rediss://`, `unix://`; redis-py's
asyncio client, `pip install gymproxy[redis]`) for several gymproxy processes (`--workers`, replicas
behind one Service) whose calls of one rollout land anywhere. Keys and scripts: `redis_scripts`.

`begin` and `end` append a record to a bounded in-memory queue and return, as the SQLite store's
do. Every `FLUSH_S` a writer task on the event loop sends what is queued as one pipeline, one
script a rollout (a call's start and end written together when its end is queued by then), and
never waits for anything but Redis's answer. A rollout's calls are numbered (`seq`) by when they
started, ties in the order their first records reached Redis (`record.numbered`). `freeze` and `delete` go through the same queue, so a freeze
comes after every record this process queued before it; the freeze is a script, and the write
script refuses every record of a frozen rollout, so once a freeze returns no process adds a call.
`admit` refuses a rollout it has seen frozen, and otherwise asks Redis (within `ADMIT_S`).

Redis unreachable (down at startup, gone mid-run, or silent for `TIMEOUT_S`): `available()` is
False, records wait in the queue (up to `capture.max_pending`, past it they are not taken) and are
written once a ping answers again; reads, freezes and deletes fail at once (503). A script Redis
refuses (maxmemory with noeviction: OOM; a read-only replica) loses its records (counted failed).

What SIGKILL of gymproxy loses: the records still queued (at most `FLUSH_S` of them) and a pipeline
in flight; what Redis acknowledged is Redis's to keep (`appendonly yes` for its own crashes). Bounds:
a rollout not written for `max_age_s` is evicted (counted) and its keys expire a minute later even
with no gymproxy running; `max_bytes` is Redis's `maxmemory`. The URL's password never reaches a log
or an error message (`shown`).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import math
import time
import urllib.parse
from collections import deque
from typing import TYPE_CHECKING, Any, Final

from . import redis_scripts as lua
from .record import FAILED, Call, Rollout, State, Summary, decode_call, encode_call, numbered
from .redis_scripts import FROZEN, OPEN, PROBE, UPDATED, Keys
from .store import Bounds, Stats, StoreError, queued

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("gymproxy")

FLUSH_S: Final = 0.02  # the writer's batch window
HOUSEKEEPING_S: Final = 1.0  # eviction by age and the open/frozen counts, at most this often
BATCH_MAX: Final = 20_000  # records taken from the queue at once
SCRIPT_BYTES: Final = 1 << 20  # records in one script call at most (and PIPELINE_BYTES in one pipeline)
PIPELINE_BYTES: Final = 8 << 20
TIMEOUT_S: Final = 10.0  # a Redis that does not answer for this long is down
CONNECT_S: Final = 2.0
ADMIT_S: Final = 0.2  # admit's question to Redis; unanswered, the call goes on (its records are checked anyway)
BACKOFF_S: Final = (0.1, 2.0)  # the first and the longest wait between pings of a Redis that is down
POOL_SIZE: Final = 16  # connections to Redis per process
READ_CHUNK: Final = 256  # calls read at once
EVICT_MAX: Final = 1000  # rollouts evicted per housekeeping round at most
FROZEN_CACHE: Final = 65_536  # frozen ids remembered
TTL_GRACE_S: Final = 60.0  # keys outlive max_age_s by this: gymproxy's own eviction counts them first
TTL_MAX_S: Final = 10 * 365 * 86400.0

Op = tuple[str, Any, "asyncio.Future[Any] | None"]  # (kind, payload, the future of an awaited op)
Record = tuple[str, bool, bytes]  # (call_id, failed, data)


def shown(url: str) -> str:
    """A store URL for logs and errors: no user, password or query (`unix://` takes one there)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"
    except ValueError:
        return "the capture.store URL"


class RedisStore:
    """The `Store` of one Redis (see the module docstring)."""

    def __init__(self, url: str, bounds: Bounds) -> None:
        self.url = url
        self.shown = shown(url)
        self.bounds = bounds
        self.stats = Stats()
        self._secrets = _passwords(url)
        self._ttl_ms = int(min(bounds.max_age_s + TTL_GRACE_S, TTL_MAX_S) * 1000)
        self._pending: deque[Op] = deque()
        self._wake = asyncio.Event()
        self._frozen: dict[str, None] = {}  # ids this process has seen frozen, oldest first
        self._down = False  # unreachable: records wait, awaited ops fail
        self._failing = False  # Redis refused the last records (OOM, read-only)
        self._slow = False  # an admit went unanswered: admits ask no more until a batch is written
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._client: Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._logged: set[str] = set()

    # --- the event loop's side -------------------------------------------------------------------

    async def start(self) -> None:
        try:
            from redis.asyncio import BlockingConnectionPool, Redis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import AuthenticationError, AuthorizationError, RedisError, ResponseError
        except ImportError as exc:
            raise StoreError(f"{self.shown} needs redis-py: pip install 'gymproxy[redis]'") from exc
        try:
            pool = BlockingConnectionPool.from_url(
                self.url,
                max_connections=POOL_SIZE,
                timeout=TIMEOUT_S,
                socket_timeout=TIMEOUT_S,
                socket_connect_timeout=CONNECT_S,
                retry=Retry(NoBackoff(), 0),
            )
        except (ValueError, TypeError) as exc:
            raise StoreError(f"{self.shown} is not a Redis URL ({self._scrub(exc)})") from None
        client = self._client = Redis.from_pool(pool)
        self._scripts = {
            name: client.register_script(getattr(lua, name)) for name in ("WRITE", "FREEZE", "REFUSE", "DROP", "READ")
        }
        try:
            await client.ping()
            await self._check_policy()
        except (AuthenticationError, AuthorizationError, ResponseError) as exc:
            await client.aclose()
            raise StoreError(f"{self.shown} refused gymproxy: {self._scrub(exc)}") from None
        except (RedisError, OSError) as exc:
            self._went_down(exc)  # capture waits for it; the proxy serves meanwhile
        self._task = asyncio.ensure_future(self._write_loop())

    def begin(self, call: Call) -> bool:
        return queued(self._pending, ("begin", call, None), self.bounds, self.stats)

    def end(self, call: Call) -> bool:
        return queued(self._pending, ("end", call, None), self.bounds, self.stats)

    def available(self) -> bool:
        return not self._down and not self._failing and len(self._pending) < self.bounds.max_pending

    async def admit(self, rollout_id: str) -> bool:
        if rollout_id not in self._frozen and not await self._frozen_in_redis(rollout_id):
            return True
        self.stats.refused += 1
        queued(self._pending, ("refuse", rollout_id, None), self.bounds, self.stats)
        return False

    async def get(self, rollout_id: str) -> Rollout | None:
        await self._awaited("sync", "")  # what this process queued before is read back
        return await self._read(rollout_id)

    async def list(self, *, after: str | None, limit: int, state: State | None = None) -> builtins.list[Summary]:
        await self._awaited("sync", "")
        try:
            return await self._summaries(after, limit, state)
        except Exception as exc:
            raise self._error("cannot be read", exc) from None

    async def freeze(self, rollout_id: str) -> Rollout | None:
        if not await self._awaited("freeze", rollout_id):
            return None
        return await self._read(rollout_id)  # frozen: it no longer changes

    async def delete(self, rollout_id: str) -> bool:
        deleted: bool = await self._awaited("delete", rollout_id)
        return deleted

    async def close(self) -> None:
        task, self._task = self._task, None
        self._closing = True
        self._wake.set()
        if task is not None:
            await task
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _awaited(self, kind: str, rollout_id: str) -> Any:
        if self._task is None:
            raise StoreError(f"the rollout store {self.shown} is closed")
        if self._down:
            raise StoreError(f"the rollout store {self.shown} is unreachable")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((kind, rollout_id, future))  # past the bound too: it must go
        self._wake.set()
        return await future

    async def _frozen_in_redis(self, rollout_id: str) -> bool:
        if self._down or self._slow or self._client is None:
            return False
        try:
            state = await asyncio.wait_for(self._client.hget(Keys.of(rollout_id).meta, "state"), ADMIT_S)
        except asyncio.TimeoutError:
            self._slow = True
            return False
        except Exception:  # unreachable or refusing: the writer finds out and says so
            return False
        if state == b"frozen":
            self._remember(rollout_id)
            return True
        return False

    def _remember(self, rollout_id: str) -> None:
        frozen = self._frozen
        frozen[rollout_id] = None
        if len(frozen) > FROZEN_CACHE:
            del frozen[next(iter(frozen))]

    # --- reads -----------------------------------------------------------------------------------

    async def _read(self, rollout_id: str) -> Rollout | None:
        assert self._client is not None
        client, keys = self._client, Keys.of(rollout_id)
        try:
            meta = await client.hgetall(keys.meta)
            if not meta or b"created" not in meta:
                return None
            calls: builtins.list[Call] = []
            read, start = self._scripts["READ"], 0
            while True:  # a 100,000-call rollout is read in steps, the loop free between them
                records = await read(keys=[keys.calls, keys.order], args=[start, start + READ_CHUNK - 1])
                calls += await asyncio.to_thread(_decoded, records)
                if len(records) < READ_CHUNK:
                    break
                start += READ_CHUNK
        except Exception as exc:
            raise self._error("cannot be read", exc) from None
        numbered(calls)
        frozen_at = meta.get(b"frozen_at")
        return Rollout(
            rollout_id=rollout_id,
            state="frozen" if meta.get(b"state") == b"frozen" else "open",
            created=float(meta[b"created"]),
            updated=float(meta.get(b"updated", meta[b"created"])),
            frozen_at=None if frozen_at is None else float(frozen_at),
            refused=int(meta.get(b"refused", 0)),
            calls=calls,
        )

    async def _summaries(self, after: str | None, limit: int, state: State | None) -> builtins.list[Summary]:
        assert self._client is not None
        client = self._client
        indexes = [OPEN, FROZEN] if state is None else [OPEN if state == "open" else FROZEN]
        summaries: builtins.list[Summary] = []
        while len(summaries) < limit:
            start = f"({after}" if after else "-"
            want = limit - len(summaries)
            ids = sorted({i for index in indexes for i in await client.zrangebylex(index, start, "+", 0, want)})[:want]
            if not ids:
                break
            pipe = client.pipeline(transaction=False)
            for rollout in ids:
                keys = Keys.of(_text(rollout))
                pipe.hmget(keys.meta, ["state", "created", "updated"])
                pipe.hlen(keys.calls)
                pipe.scard(keys.failed)
            found = await pipe.execute()
            for n, rollout in enumerate(ids):
                (row_state, created, updated), calls, failed = found[3 * n : 3 * n + 3]
                if created is None:
                    continue  # expired with no gymproxy to evict it: housekeeping drops it from the index
                summaries.append(
                    Summary(
                        rollout_id=_text(rollout),
                        state="frozen" if row_state == b"frozen" else "open",
                        created=float(created),
                        updated=float(updated or created),
                        calls=calls,
                        complete=not failed,
                    )
                )
            after = _text(ids[-1])
            if len(ids) < want:
                break
        return summaries

    # --- the writer task -------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        pending = self._pending
        housekept = 0.0
        backoff = BACKOFF_S[0]
        while True:
            await self._nap(FLUSH_S if not self._down else backoff)
            if self._down:
                if not await self._ping():
                    if self._closing:
                        self._give_up()
                        return
                    backoff = min(backoff * 2, BACKOFF_S[1])
                    continue
                backoff = BACKOFF_S[0]
            batch = [pending.popleft() for _ in range(min(len(pending), BATCH_MAX))]
            if batch:
                await self._write(batch)
            if not self._down and time.monotonic() - housekept >= HOUSEKEEPING_S:
                housekept = time.monotonic()
                await self._housekeeping()
            if self._closing and not pending:
                return
            if pending:
                self._wake.set()  # more than a batch waits, or what came during the write

    async def _nap(self, seconds: float) -> None:
        """Until `seconds` have passed or `_wake` is set (an awaited op, close). Not `wait_for`, which
        before Python 3.12 may swallow the task's cancellation when its timeout fires with it."""
        timer = asyncio.get_running_loop().call_later(seconds, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()
            self._wake.clear()

    async def _write(self, batch: builtins.list[Op]) -> None:
        """Send `batch` in order: its records a pipeline at a time, each op after the records before it.
        Unreachable: what is not yet written goes back to the head of the queue."""
        started = time.monotonic()
        groups: dict[str, builtins.list[Record]] = {}
        whole: set[str] = set()  # calls written whole from their start record: their end goes unsent
        done = 0  # batch[:done] is written
        try:
            for index, (kind, payload, future) in enumerate(batch):
                if kind == "begin" or kind == "end":
                    call: Call = payload
                    if kind == "end" and call.call_id in whole:
                        continue
                    if kind == "begin" and call.outcome != "in_flight":
                        whole.add(call.call_id)  # ended while queued: its end is queued after it
                    groups.setdefault(call.rollout_id, []).append(
                        (call.call_id, call.outcome in FAILED, encode_call(call))
                    )
                    continue
                if groups:
                    await self._send(groups)
                    groups = {}
                    done = index
                result = await self._op(kind, payload)
                done = index + 1
                if future is not None and not future.done():
                    future.set_result(result)
            if groups:
                await self._send(groups)
            done = len(batch)
        except Exception as exc:
            if not _unreachable(exc):
                self._failing = True
                self.stats.failed += sum(kind in ("begin", "end") for kind, _, _ in batch[done:])
                self._log_once(type(exc).__name__, f"rollout store {self.shown}: a batch was lost: {self._scrub(exc)}")
                failure: StoreError = self._error("failed", exc)
                for _, _, future in batch[done:]:
                    if future is not None and not future.done():
                        future.set_exception(failure)
                return
            self._went_down(exc)
            rest = batch[done:]
            failure = self._error("is unreachable", exc)
            for _, _, future in rest:
                if future is not None and not future.done():
                    future.set_exception(failure)
            self._pending.extendleft(reversed([op for op in rest if op[2] is None]))  # records wait
            return
        self._slow = False
        self.stats.batch_seconds.append(time.monotonic() - started)
        if len(self.stats.batch_seconds) > 10_000:  # nobody scrapes: keep the newest
            del self.stats.batch_seconds[:5_000]

    async def _send(self, groups: dict[str, builtins.list[Record]]) -> None:
        """One script call a rollout (split past `SCRIPT_BYTES`), pipelined `PIPELINE_BYTES` at a time."""
        assert self._client is not None
        write = self._scripts["WRITE"]
        now = time.time()
        calls: builtins.list[tuple[str, builtins.list[Record]]] = []
        for rollout, records in groups.items():
            chunk: builtins.list[Record] = []
            size = 0
            for record in records:
                if chunk and size + len(record[2]) > SCRIPT_BYTES:
                    calls.append((rollout, chunk))
                    chunk, size = [], 0
                chunk.append(record)
                size += len(record[2])
            calls.append((rollout, chunk))
        refused = False
        while calls:
            pipe = self._client.pipeline(transaction=False)
            sent: builtins.list[tuple[str, builtins.list[Record]]] = []
            size = 0
            while calls and (not sent or size < PIPELINE_BYTES):
                rollout, chunk = calls.pop(0)
                keys = Keys.of(rollout)
                args: builtins.list[Any] = [rollout, repr(now), self._ttl_ms, repr(now)]
                for call_id, failed, data in chunk:
                    args += (call_id, b"1" if failed else b"0", data)
                    size += len(data)
                await write(keys=[*keys, OPEN, UPDATED], args=args, client=pipe)
                sent.append((rollout, chunk))
            results = await pipe.execute(raise_on_error=False)
            for (rollout, chunk), result in zip(sent, results, strict=True):
                if isinstance(result, Exception):
                    if _unreachable(result):
                        raise result
                    refused = True
                    self.stats.failed += len(chunk)
                    self._log_once(type(result).__name__, f"rollout store {self.shown} refused records: {result}")
                elif result == 1:
                    self.stats.recorded += len(chunk)
                    self.stats.bytes += sum(len(data) for _, _, data in chunk)
                else:
                    self.stats.dropped += len(chunk)  # its rollout was frozen, maybe by another process
                    self._remember(rollout)
        self._failing = refused

    async def _op(self, kind: str, rollout: str) -> Any:
        scripts = self._scripts
        if kind == "freeze":
            if not await scripts["FREEZE"](
                keys=[Keys.of(rollout).meta, OPEN, FROZEN], args=[rollout, repr(time.time())]
            ):
                return False
            self._remember(rollout)
            return True
        if kind == "delete":
            existed, _ = await scripts["DROP"](keys=[*Keys.of(rollout), OPEN, FROZEN, UPDATED], args=[rollout, ""])
            self._frozen.pop(rollout, None)
            return existed == 1
        if kind == "refuse":
            await scripts["REFUSE"](keys=[Keys.of(rollout).meta])
        return None  # "sync": what came before it is written

    async def _housekeeping(self) -> None:
        """Evict by age, count open and frozen rollouts, and learn whether a full Redis takes writes again."""
        assert self._client is not None
        client, stats = self._client, self.stats
        if self._failing:
            try:
                await client.set(PROBE, b"1", px=10_000)
                self._failing = False
            except Exception:
                return
        try:
            if math.isfinite(self.bounds.max_age_s):
                cutoff = time.time() - self.bounds.max_age_s
                old = await client.zrangebyscore(UPDATED, "-inf", f"({cutoff!r}", start=0, num=EVICT_MAX)
                drop = self._scripts["DROP"]
                for rollout in old:
                    name = _text(rollout)
                    existed, calls = await drop(keys=[*Keys.of(name), OPEN, FROZEN, UPDATED], args=[name, repr(cutoff)])
                    if existed == 1:
                        stats.evicted_rollouts += 1
                        stats.evicted_calls += calls
                        self._frozen.pop(name, None)
            stats.open, stats.frozen = await client.zcard(OPEN), await client.zcard(FROZEN)
        except Exception as exc:
            if not _unreachable(exc):
                self._log_once("housekeeping", f"rollout store {self.shown}: housekeeping failed: {self._scrub(exc)}")

    async def _ping(self) -> bool:
        assert self._client is not None
        try:
            await self._client.ping()
        except Exception:
            return False
        self._down = False
        log.warning(
            "rollout store %s is reachable again: %d records queued are written", self.shown, len(self._pending)
        )
        return True

    async def _check_policy(self) -> None:
        """A Redis that evicts keys under memory pressure may take part of a rollout: say so."""
        assert self._client is not None
        try:
            policy = (await self._client.info("memory")).get("maxmemory_policy", "noeviction")
        except Exception:
            return  # INFO may be off in a managed Redis
        if policy != "noeviction":
            log.warning(
                "rollout store %s: maxmemory-policy is %s, so Redis may evict part of a rollout when full; "
                "use noeviction (a full Redis then refuses writes, counted as not recorded)",
                self.shown,
                policy,
            )

    def _went_down(self, exc: BaseException) -> None:
        if not self._down:
            self._down = True
            log.warning(
                "rollout store %s is unreachable (%s): records wait in the queue (up to %d) until it answers",
                self.shown,
                self._scrub(exc),
                self.bounds.max_pending,
            )

    def _give_up(self) -> None:
        """Closing with Redis down: what is queued is lost, and counted."""
        lost = sum(op[0] in ("begin", "end") for op in self._pending)
        self.stats.failed += lost
        self._pending.clear()
        if lost:
            log.error("rollout store %s is unreachable at shutdown: %d records are lost", self.shown, lost)

    def _error(self, what: str, exc: BaseException) -> StoreError:
        if isinstance(exc, StoreError):
            return exc
        return StoreError(f"the rollout store {self.shown} {what}: {self._scrub(exc)}")

    def _scrub(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("%s (logged once)", message)


def _unreachable(exc: BaseException) -> bool:
    """A connection that broke or a Redis that did not answer (not one that refused)."""
    from redis.exceptions import ConnectionError, TimeoutError

    return isinstance(exc, ConnectionError | TimeoutError | OSError | asyncio.TimeoutError)


def _passwords(url: str) -> tuple[str, ...]:
    """The URL's password (in its user part, or in the query of a `unix://` URL) as written and
    unquoted, to scrub from messages."""
    try:
        parts = urllib.parse.urlsplit(url)
        found = parts.password or urllib.parse.parse_qs(parts.query).get("password", [""])[0]
    except ValueError:
        return ()
    return tuple({found, urllib.parse.unquote(found)} - {""})


def _text(value: Any) -> str:
    """An id as Redis gives it back (bytes: the client does not decode)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _decoded(records: builtins.list[Any]) -> builtins.list[Call]:
    return [decode_call(record) for record in records if record is not None]
