"""A real `redis-server` for the shared store's tests: started on a free port in a temporary
directory, with no persistence (`--save '' --appendonly no`), never a system service. A test that
needs one and finds no `redis-server` binary is skipped, saying so (`.ci/run` installs Debian's).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

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
