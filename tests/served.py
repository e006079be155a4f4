"""`gymproxy serve` in a subprocess, for the tests of what only the command does (the listener, the
drain at shutdown, workers) and for leak checks of the process itself.

`Served` writes a flat config, starts `python tests/serve_probe.py serve --config ...` (the command
exactly as installed, plus a SIGUSR1 hook that reports what the process holds), waits for its
listening line, and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

PROBE = Path(__file__).with_name("serve_probe.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def alive(pid: int) -> bool:
    """Running or stopped (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


class Served:
    """One `gymproxy serve` process; `url` is its root."""

    def __init__(self, tmp_path: Path, config: dict[str, Any], *args: str, open_files: int | None = None) -> None:
        self.port = int(config.setdefault("port", free_port()))
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = tmp_path / f"gymproxy-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.stats_path = tmp_path / f"stats-{self.port}.json"
        self.log_path = tmp_path / f"gymproxy-{self.port}.log"
        self.args = args
        self.open_files = open_files  # the process's own RLIMIT_NOFILE (soft and hard), if given
        self.process: subprocess.Popen[bytes] | None = None

    async def __aenter__(self) -> Served:
        self.start()
        await self.wait_listening()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    def start(self) -> None:
        env = {**os.environ, "GYMPROXY_STATS": str(self.stats_path)}
        limit = self.open_files

        def limited() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(PROBE), "serve", "--config", str(self.config_path), *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=limited,
            )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_listening(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while " listening on http://" not in self.log:
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"gymproxy serve did not start:\n{self.log[-3000:]}")
            await asyncio.sleep(0.05)

    async def stats(self) -> dict[str, Any]:
        """RSS (MB), the peak RSS since the last call (MB), open files, live asyncio tasks and timer
        handles, as the process reports them."""
        assert self.process is not None
        self.stats_path.unlink(missing_ok=True)
        self.process.send_signal(signal.SIGUSR1)
        for _ in range(400):
            if self.stats_path.exists():
                try:
                    stats: dict[str, Any] = json.loads(self.stats_path.read_text())
                    return stats
                except json.JSONDecodeError:
                    pass  # being written
            await asyncio.sleep(0.025)
        raise AssertionError("gymproxy serve did not report its stats")

    def terminate(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    async def wait(self, timeout: float) -> int:
        """The exit code; the process is killed (and the test fails) if it has not exited in time.
        It waits without blocking the loop: the test's own servers (a fake vLLM) keep running."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while (code := self.process.poll()) is None:
            if time.monotonic() > deadline:
                self.process.kill()
                self.process.wait(15)
                raise AssertionError(f"gymproxy serve did not exit within {timeout} s:\n{self.log[-3000:]}")
            await asyncio.sleep(0.02)
        return code

    async def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.terminate()
            await self.wait(60)
