"""The admin routes' changes to the fleet (upstreams added, drained, removed), kept on top of the
config file's upstreams, so a SIGHUP that re-reads the file does not undo them.

With `gymproxy serve --workers N` each worker has its own fleet: the overlay then lives in a file
(in a private directory the parent makes), written under a lock by the worker that took the change
and re-read by every worker when the parent forwards it a SIGHUP. Without a file it is in memory.
Upstream api keys in it are written to that file (mode 0600, in a 0700 directory).

An added upstream is checked (`config.check_upstream`) before it is recorded; one in the file that
fails the check (written by an older gymproxy) is skipped and logged, and the rest applies.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec

from .config import BadUpstream, UpstreamSpec, check_upstream

log = logging.getLogger("gymproxy")


class Changes(msgspec.Struct, kw_only=True):
    """Admin changes by upstream name; a later change of one name replaces its earlier one."""

    added: dict[str, UpstreamSpec] = {}
    drained: list[str] = []
    removed: list[str] = []


class _Stored(msgspec.Struct, kw_only=True):
    """`Changes` as the file holds them: each added upstream still to be checked on its own."""

    added: dict[str, msgspec.Raw] = {}
    drained: list[str] = []
    removed: list[str] = []


class Overlay:
    """The admin changes, and the file that shares them between workers (None: in memory only)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.changes = Changes()

    def load(self) -> None:
        """Re-read the file (a missing or empty one means no changes; one that does not decode
        keeps the changes last read, logged)."""
        if self.path is None:
            return
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        try:
            stored = msgspec.json.decode(data, type=_Stored) if data else _Stored()
        except msgspec.DecodeError as exc:
            log.error("admin changes in %s cannot be read (%s): keeping the last ones read", self.path, exc)
            return
        self.changes = Changes(added=_usable(stored.added), drained=stored.drained, removed=stored.removed)

    @contextlib.contextmanager
    def editing(self) -> Iterator[Changes]:
        """The current changes, to edit; written back at the end, under a lock other workers respect."""
        if self.path is None:
            with self._undone_on_error():
                yield self.changes
            return
        lock = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.load()
            with self._undone_on_error():
                yield self.changes
            temporary = self.path.with_name(self.path.name + ".new")
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(msgspec.json.encode(self.changes))
            os.replace(temporary, self.path)
        finally:
            os.close(lock)  # and the lock with it

    @contextlib.contextmanager
    def _undone_on_error(self) -> Iterator[None]:
        """An edit that raises (or whose application does) leaves the changes as they were, unwritten."""
        before = copy.deepcopy(self.changes)
        try:
            yield
        except BaseException:
            self.changes = before
            raise

    def apply(self, specs: dict[str, UpstreamSpec]) -> tuple[list[UpstreamSpec], set[str]]:
        """The wanted upstreams (`specs` by name, with the changes applied) and the names drained."""
        wanted = {**specs, **self.changes.added}
        for name in self.changes.removed:
            wanted.pop(name, None)
        return list(wanted.values()), set(self.changes.drained)


def add(changes: Changes, name: str, spec: UpstreamSpec) -> None:
    changes.added[name] = spec
    _clear(changes, name)


def drain(changes: Changes, name: str) -> None:
    if name not in changes.drained:
        changes.drained.append(name)


def remove(changes: Changes, name: str) -> None:
    changes.added.pop(name, None)
    _clear(changes, name)
    changes.removed.append(name)


def _clear(changes: Changes, name: str) -> None:
    changes.drained = [n for n in changes.drained if n != name]
    changes.removed = [n for n in changes.removed if n != name]


def _usable(added: dict[str, msgspec.Raw]) -> dict[str, UpstreamSpec]:
    """The added upstreams that decode and pass `check_upstream`; the others are logged and left out."""
    usable = {}
    for name, raw in added.items():
        try:
            spec = msgspec.json.decode(raw, type=UpstreamSpec)
            check_upstream(spec)
        except (msgspec.ValidationError, BadUpstream) as exc:
            log.warning("admin change skipped: upstream %r cannot be used (%s)", name[:200], exc)
            continue
        usable[name] = spec
    return usable
