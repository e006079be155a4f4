"""The benchmarked servers as child processes, and their CPU time from the kernel's own accounting.

CPU time is utime + stime of /proc/<pid>/stat, which counts every thread of the process, read
before and after a measured window: what the load generator spends never enters it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time of `pids`, in seconds (a process that has exited counts 0)."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return total / CLOCK_TICKS


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (gymproxy's workers), found through the parent ids in /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def set_cpus(pids: Sequence[int], cpus: set[int]) -> None:
    """Run every thread of `pids` on `cpus` only (threads started later inherit it)."""
    for pid in pids:
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError:
            continue
        for tid in threads:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """One server process: started, waited for, measured and stopped by its own pid."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path, *, ready_path: str = "/health") -> None:
        self.name = name
        self.argv = argv
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []

    def start(self) -> None:
        # From the log directory, not the caller's: `python -m gymproxy` puts the working directory
        # first on sys.path, so started from a checkout every variant would run that checkout.
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.log_path.parent
            )

    def wait_ready(self, timeout: float = 30.0, *, processes: int = 1, marker: bytes | None = None) -> None:
        """Until `ready_path` answers 200 and, with `marker`, the log shows it `processes` times."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self._answers() and (marker is None or self.log_path.read_bytes().count(marker) >= processes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not get ready in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)
        if marker is not None:
            time.sleep(0.3)  # the last worker logged, then binds
        self.pids = [self.process.pid, *descendants(self.process.pid)]

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def cpu(self) -> float:
        return cpu_seconds(self.pids)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (gymproxy's parent passes it on to its workers), then SIGKILL what is left."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pid in self.pids[1:]:  # a worker its parent failed to stop
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
