"""The stores the tests run against: a real `redis-server` (started on a free port in a temporary
directory, with no persistence: `--save '' --appendonly no`, never a system service; a test that
needs one and finds no `redis-server` binary is skipped, saying so: `.ci/run` installs Debian's),
and `Backend`, one kind of store (SQLite or Redis) with a URL per name and a way to stall it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gymproxy.rollouts.store import Bounds, Store, open_store

from .served import free_port

MISSING = "redis-server is not installed (apt-get install redis-server; .ci/run does): the Redis store is not tested"


class RedisServer:
    """One `redis-server` process; `url(db)` names one of its databases."""

    def __init__(self, directory: Path, *args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            print(MISSING)
            pytest.skip(MISSING)
        self.binary = binary
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        command += ["--dir", str(self.directory), "--logfile", str(self.directory / "redis.log"), *self.args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.command("PING").startswith(("+PONG", "-NOAUTH")):  # up (with --requirepass: asks for it)
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise AssertionError(f"redis-server did not start:\n{log}")
            time.sleep(0.02)
        return self

    def command(self, *words: str) -> str:
        """One inline command; its reply's first line ("" when nobody answers)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                sock.sendall((" ".join(words) + "\r\n").encode())
                return sock.recv(65536).split(b"\r\n")[0].decode()
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGKILL: gone at once, as a crashed or rescheduled Redis is."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a stalled Redis)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)


class Backend:
    """One kind of store for the contract tests: a URL per name, and how to stall it."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.redis = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
        self.stores: list[Store] = []  # closed after the test, passed or not (an open socket hangs uvloop's close)
        self._dbs: dict[str, int] = {}

    def url(self, name: str = "r") -> str:
        if self.redis is None:
            return f"sqlite:///{self.tmp_path / name}.db"
        return self.redis.url(self._dbs.setdefault(name, len(self._dbs)))  # a database of its own

    async def opened(self, name: str = "r", **bounds: float) -> Store:
        store = open_store(self.url(name), Bounds(**bounds))  # type: ignore[arg-type]
        self.stores.append(store)
        await store.start()
        return store

    @contextlib.contextmanager
    def stalled(self, name: str = "r") -> Iterator[None]:
        """Nothing is written meanwhile: SQLite's writer waits on a lock (as on a stalled disk),
        redis-server is stopped (SIGSTOP: its connections stay open and silent)."""
        if self.redis is None:
            blocker = sqlite3.connect(self.tmp_path / f"{name}.db", isolation_level=None)
            blocker.execute("BEGIN EXCLUSIVE")
            try:
                yield
            finally:
                blocker.execute("ROLLBACK")
                blocker.close()
            return
        self.redis.pause()
        try:
            yield
        finally:
            self.redis.resume()

    async def close(self) -> None:
        if self.redis is not None:
            self.redis.resume()
        for store in self.stores:
            await store.close()
        if self.redis is not None:
            self.redis.stop()
