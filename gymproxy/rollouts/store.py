"""The store capture writes to, as the rest of gymproxy sees it (`Store`), and `open_store`, which
picks the implementation from `capture.store`'s URL: `sqlite:///PATH` (`sqlite_store`, the
embedded default) or `redis://HOST:PORT/DB` (`redis_store`, shared by several processes).

Writes never wait: `begin` and `end` queue a record and return at once (False when it was not
taken: the queue is full or the store is down; the caller counts it). A store writes its queue in
batches off the event loop. Reads, `freeze` and `delete` are awaited.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import msgspec

from .record import Call, Rollout, State, Summary


class Bounds(msgspec.Struct, frozen=True, kw_only=True):
    """What a store keeps at most (`capture.*`)."""

    max_age_s: float = 86400.0  # a rollout not written for this long is evicted
    max_bytes: int = 1 << 30  # stored bytes in all (SQLite; Redis leaves it to its maxmemory)
    max_pending: int = 100_000  # records queued and not yet written; past it a write is not taken


class Stats:
    """What a store counts, read by /metrics."""

    __slots__ = (
        "recorded",
        "bytes",
        "failed",
        "dropped",
        "evicted_rollouts",
        "evicted_calls",
        "refused",
        "batch_seconds",
        "open",
        "frozen",
    )

    def __init__(self) -> None:
        self.recorded = 0  # call records written (starts and ends)
        self.bytes = 0  # bytes written
        self.failed = 0  # records a failed batch lost
        self.dropped = 0  # records not taken (queue full, store down) or refused (frozen rollout)
        self.evicted_rollouts = 0
        self.evicted_calls = 0
        self.refused = 0  # calls refused because their rollout was frozen
        self.batch_seconds: list[float] = []  # each batch's write time, drained by /metrics
        self.open = 0  # rollouts open and frozen, as last counted
        self.frozen = 0


class Store(Protocol):
    """A rollout store (see the module docstring)."""

    stats: Stats

    async def start(self) -> None:
        """Open the store and start its writer; raises `StoreError` when it cannot be opened."""

    def begin(self, call: Call) -> bool:
        """Queue a call's start record (outcome "in_flight")."""

    def end(self, call: Call) -> bool:
        """Queue a call's end record (the same `call_id`, its outcome, tokens and all)."""

    def available(self) -> bool:
        """Whether writes are being taken now (for `capture.required`)."""

    async def admit(self, rollout_id: str) -> bool:
        """False when the rollout is frozen (the call is refused; the store counts it)."""

    async def get(self, rollout_id: str) -> Rollout | None: ...

    async def list(self, *, after: str | None, limit: int, state: State | None = None) -> list[Summary]:
        """Rollouts ordered by id, those after `after` (a page's last id), at most `limit`."""

    async def freeze(self, rollout_id: str) -> Rollout | None:
        """Freeze atomically, after this process's queued writes; the frozen snapshot (None: unknown)."""

    async def delete(self, rollout_id: str) -> bool: ...

    async def close(self) -> None:
        """Write everything queued, then close (SIGTERM's flush)."""


def queued(pending: deque[Any], op: Any, bounds: Bounds, stats: Stats) -> bool:
    """Append a write to a store's queue, unless `bounds.max_pending` wait there already (then it
    is counted as dropped and False is returned)."""
    if len(pending) >= bounds.max_pending:
        stats.dropped += 1
        return False
    pending.append(op)
    return True


class StoreError(Exception):
    """A store that cannot be opened or reached; the message names it (never a password)."""


def open_store(url: str, bounds: Bounds) -> Store:
    """The store `url` names (not started yet)."""
    if url.startswith("sqlite://"):
        from .sqlite_store import SQLiteStore

        return SQLiteStore(url, bounds)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .redis_store import RedisStore  # the optional extra `redis`

        store: Store = RedisStore(url, bounds)
        return store
    scheme = url.partition("://")[0][:32]  # never the rest: it may hold a password
    raise StoreError(f"capture.store: {scheme!r} URLs are neither sqlite:///PATH nor redis://HOST:PORT/DB")
