"""The worker processes of `gymproxy serve --workers N`: started, watched, replaced, and tied to
their parent's life.

Each worker gets one end of a socket pair, its `Lifeline`; the parent keeps the other end. Once the
worker listens, its event loop writes a byte to it every `BEAT_S` (the heartbeat) and reads it: end
of file means the parent is gone, however it went (SIGKILL included), and the worker stops as on
SIGTERM: its listener closes at once (a new gymproxy on the port gets every new connection), and
requests in flight get `shutdown_grace_s`. On Linux the worker also has the kernel send it a SIGTERM
when its parent dies (`PR_SET_PDEATHSIG`) until its loop watches the lifeline: that covers startup.

The parent (`Workers`) reads the heartbeats as it loops. A worker that has sent none for
`workers.heartbeat_timeout_s` (stopped, or its event loop hung) is killed: the kernel would keep
handing it its share of new connections, and nobody would answer them. A worker that exits or is
killed is started again under the same index (its metrics socket keeps its name) after a backoff,
within `workers.restart`'s limits; one past them is given up (logged, and missing from /metrics)
while the others serve on: stopping gymproxy would end every worker's requests, and the replicas it
launched, for one worker's sake. A worker of the first start that exits before it listens (a bad
config, a taken port), or the last one given up, stops gymproxy with an error (`WorkersFailed`).

The workers share a private runtime directory (`RuntimeDir`): the parent and every worker hold a
shared lock on its `lock` file. The parent removes it at exit; after a SIGKILL of the parent the
last worker out does (`leave`), and a directory left when every one of them was killed is removed
by the next gymproxy's startup `sweep` (its lock is held by nobody).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import fcntl
import logging
import math
import multiprocessing
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

from .config import Workers as Settings

log = logging.getLogger("gymproxy")

BEAT_S = 0.5  # a listening worker's heartbeat interval (`workers.heartbeat_timeout_s` is at least 1 s)
PREFIX = "gymproxy-run-"  # runtime directories are `<temp dir>/gymproxy-run-XXXXXXXX`
LOCK = "lock"
LEAVE_WAIT_S = 1.0  # how long the last worker of a killed parent tries to take the runtime directory
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class WorkersFailed(Exception):
    """The workers cannot go on: gymproxy stops them all and exits with this error."""


class Lifeline:
    """A worker's end of its link to the parent: made by `Workers`, handed to the worker at spawn."""

    def __init__(self, channel: socket.socket, parent: int, runtime: Path) -> None:
        self.channel = channel
        self.parent = parent
        self.runtime = runtime
        self.lost = False  # the parent is gone (its end of the lifeline closed)

    def bind(self) -> int:
        """In the worker, first: die with the parent; returns the held lock of the runtime directory."""
        die_with_parent(self.parent)
        return hold(self.runtime)

    def attach(self, stop: asyncio.Event) -> None:
        """Start the heartbeat on the running loop (call it once listening); `stop` is set when the
        parent is gone."""
        loop = asyncio.get_running_loop()
        self.channel.setblocking(False)
        loop.add_reader(self.channel.fileno(), self._readable, loop, stop)
        # From now on the loop hears of the parent's end at once: the kernel's SIGTERM, which comes
        # just after, could find the drain begun and asyncio's handler gone, and end the drain.
        _parent_death_signal(0)
        self._beat(loop, stop)

    def _beat(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        try:
            self.channel.send(b".")
        except BlockingIOError:  # the parent is not reading (stopped itself): it catches up later
            pass
        except OSError:
            self._lost(stop)
            return
        loop.call_later(BEAT_S, self._beat, loop, stop)

    def _readable(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        try:
            if self.channel.recv(64):
                return  # the parent sends nothing today
        except BlockingIOError:
            return
        except OSError:
            pass
        loop.remove_reader(self.channel.fileno())
        self._lost(stop)

    def _lost(self, stop: asyncio.Event) -> None:
        if not self.lost:
            self.lost = True
            log.warning("the parent process (pid %d) is gone: this worker stops", self.parent)
            stop.set()


# What a worker process runs: `serve(index, restarts, lifeline)`, with `restarts` the times its
# index was started again before; it returns once the worker has drained.
Serve = Callable[[int, int, Lifeline], None]


def die_with_parent(parent: int) -> None:
    """Ask the kernel for a SIGTERM when the parent dies (Linux); exit if it is already gone."""
    _parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request took effect
        raise SystemExit(f"gymproxy worker: the parent process (pid {parent}) is gone")


def _parent_death_signal(signum: int) -> None:
    """`PR_SET_PDEATHSIG` (0: none); elsewhere than on Linux the lifeline alone tells."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def _worker_main(serve: Serve, index: int, restarts: int, lifeline: Lifeline) -> None:
    lock = lifeline.bind()
    try:
        serve(index, restarts, lifeline)
    finally:
        # Not `os.getppid()`: the end of file comes before the kernel gives the worker a new parent.
        leave(lifeline.runtime, lock, wait=LEAVE_WAIT_S if lifeline.lost else 0.0)


class _Worker:
    """One worker index and the process that serves it now (None: between two)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: BaseProcess | None = None
        self.pid = 0
        self.channel: socket.socket | None = None
        self.beat: float | None = None  # when its last heartbeat came (None: not listening yet)
        self.starts = 0
        self.restarts: collections.deque[float] = collections.deque()  # when, within the window
        self.due = 0.0  # when to start it again (while `process` is None; inf: given up)
        self.reread = False  # a SIGHUP came before it listened: it gets one once it does


class Workers:
    """`count` worker processes running `serve`, watched through their heartbeats and replaced."""

    def __init__(self, count: int, serve: Serve, settings: Settings, runtime: Path) -> None:
        self.serve = serve
        self.settings = settings
        self.runtime = runtime
        self.stopping = False
        self.reloaded = False  # a SIGHUP was forwarded since the start
        self._context = multiprocessing.get_context("spawn")
        self._selector = selectors.DefaultSelector()
        self._workers = [_Worker(index) for index in range(count)]
        self._terminated: set[int] = set()

    def start(self) -> None:
        for worker in self._workers:
            self._start(worker)

    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.process is not None]

    def watch(self, timeout: float) -> None:
        """Take the heartbeats that come within `timeout`, then deal with every worker that exited,
        hung, or is due to start again. Raises `WorkersFailed` when they cannot go on."""
        for key, _ in self._selector.select(timeout):
            self._read(key.data)
        now = time.monotonic()
        for worker in self._workers:
            if self.stopping:
                return
            self._check(worker, now)

    def forward(self) -> None:
        """SIGHUP to every listening worker; one still starting (whose loop would not handle it yet)
        gets it once it listens."""
        self.reloaded = True
        for worker in self._workers:
            if worker.process is None or worker.beat is None:
                worker.reread = True
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGHUP)

    def terminate(self) -> None:
        """SIGTERM to every worker, once each (a second one would cut a worker's drain short)."""
        self.stopping = True
        for worker in self._workers:
            if worker.process is not None and worker.pid not in self._terminated and worker.process.is_alive():
                self._terminated.add(worker.pid)
                worker.process.terminate()

    def join(self, timeout: float) -> list[int | None]:
        """Wait for the workers to exit, killing those still running after `timeout`; their exit codes."""
        self.terminate()
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for worker in self._workers:
            if worker.process is None:
                continue
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.warning("worker %d (pid %d) did not stop in %g s: killing it", worker.index, worker.pid, timeout)
                worker.process.kill()
                worker.process.join()
            codes.append(worker.process.exitcode)
            self._close(worker)
        return codes

    def _start(self, worker: _Worker) -> None:
        ours, theirs = socket.socketpair()
        lifeline = Lifeline(theirs, os.getpid(), self.runtime)
        process = self._context.Process(
            target=_worker_main,
            args=(self.serve, worker.index, worker.starts, lifeline),
            name=f"gymproxy-worker-{worker.index}",
            daemon=True,
        )
        try:
            process.start()
        finally:
            theirs.close()  # the worker's own copy is its only one: its exit is our end of file
        ours.setblocking(False)
        self._selector.register(ours, selectors.EVENT_READ, worker)
        worker.process, worker.channel, worker.beat = process, ours, None
        worker.reread = self.reloaded  # it starts from the first config, which its siblings re-read
        worker.pid = process.pid or 0
        worker.starts += 1

    def _read(self, worker: _Worker) -> None:
        assert worker.channel is not None
        try:
            data = worker.channel.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # its end closed: it is exiting (`_check` sees it go)
            self._close(worker)
            return
        if worker.beat is None and worker.reread:
            worker.reread = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGHUP)
        worker.beat = time.monotonic()

    def _check(self, worker: _Worker, now: float) -> None:
        if worker.process is None:
            if now >= worker.due:
                self._start(worker)
        elif not worker.process.is_alive():
            self._replace(worker, f"exited with {_status(worker.process.exitcode)}", now)
        elif worker.beat is not None and now - worker.beat > self.settings.heartbeat_timeout_s:
            worker.process.kill()
            worker.process.join(5)
            self._replace(worker, f"sent no heartbeat for {now - worker.beat:.1f} s (stopped or hung): killed", now)

    def _replace(self, worker: _Worker, why: str, now: float) -> None:
        """Schedule the start of another process for `worker`, or raise `WorkersFailed`."""
        listened = worker.beat is not None
        self._close(worker)
        worker.process = None
        if worker.starts == 1 and not listened:
            raise WorkersFailed(f"worker {worker.index} (pid {worker.pid}) {why} before it listened")
        policy = self.settings.restart
        while worker.restarts and now - worker.restarts[0] > policy.window_s:
            worker.restarts.popleft()
        if len(worker.restarts) >= policy.attempts:
            given_up = f"given up after {len(worker.restarts)} restart(s) in {policy.window_s:g} s (workers.restart)"
            worker.due = math.inf
            serving = sum(w.due != math.inf for w in self._workers)
            if not serving:
                raise WorkersFailed(f"worker {worker.index} (pid {worker.pid}) {why}; {given_up}; no worker is left")
            log.error(
                "worker %d (pid %d) %s; %s: %d of %d workers serve on",
                worker.index,
                worker.pid,
                why,
                given_up,
                serving,
                len(self._workers),
            )
            return
        delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** len(worker.restarts))
        worker.restarts.append(now)
        worker.due = now + delay
        log.warning(
            "worker %d (pid %d) %s; starting another in %g s (restart %d of at most %d in %g s)",
            worker.index,
            worker.pid,
            why,
            delay,
            len(worker.restarts),
            policy.attempts,
            policy.window_s,
        )

    def _close(self, worker: _Worker) -> None:
        if worker.channel is not None:
            self._selector.unregister(worker.channel)
            worker.channel.close()
            worker.channel = None


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"status {code}"


class RuntimeDir:
    """The workers' private directory (mode 0700), with the shared lock its maker holds on it."""

    def __init__(self, path: Path, lock: int) -> None:
        self.path = path
        self.lock = lock

    @classmethod
    def make(cls, root: str | Path | None = None) -> RuntimeDir:
        """Sweep the stale ones, then make a new one in `root` (the temp directory) and hold it."""
        root = Path(root or tempfile.gettempdir())
        sweep(root)
        path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
        # Locked under another name first: a sweep only opens `lock`, and finds it held.
        fresh = os.open(path / f"{LOCK}.new", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fresh, fcntl.LOCK_SH)
        os.rename(path / f"{LOCK}.new", path / LOCK)
        return cls(path, fresh)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self.lock)


def hold(path: Path) -> int:
    """A shared lock on runtime directory `path` (a worker's); exits if its owners are all gone."""
    try:
        lock = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SystemExit(f"gymproxy worker: the runtime directory {path} is gone ({exc})") from None
    fcntl.flock(lock, fcntl.LOCK_SH)
    return lock


def leave(path: Path, lock: int, *, wait: float = 0.0) -> None:
    """Let go of runtime directory `path`, removing it if nobody else holds it (the parent was killed).
    `wait`: how long to keep trying, for a parent just gone (the kernel may release its lock a moment
    after its end of the lifeline)."""
    # Unlocked first: two workers that converted their shared locks at once could both fail.
    fcntl.flock(lock, fcntl.LOCK_UN)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # the parent, or another worker, is still there: it removes it
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.05)
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(lock)


def sweep(root: str | Path) -> None:
    """Remove the runtime directories in `root` that nobody holds (left by a gymproxy killed with all
    its workers). Only this user's, only those whose `lock` nobody holds: a live gymproxy's is safe."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            lock = os.open(os.path.join(entry.path, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no lock file: not one of ours, or one being made
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its gymproxy runs
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
            log.info("removed %s, the runtime directory of a gymproxy that was killed", entry.path)
        finally:
            os.close(lock)
