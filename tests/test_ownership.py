"""`ownership`: a replica's process by pidfd, the owner of a connection's server end, a port's holder.

Another user's listener is run as uid 65534 when the tests run as root (else those checks skip).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gymproxy import ownership
from gymproxy.ownership import Owner, Process, holder, server_end, start_time

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
AS_ROOT = os.geteuid() == 0 and SYSTEM_PYTHON is not None
LISTEN = "import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\nprint(s.getsockname()[1], flush=True)\ntime.sleep(60)\n"


class Listener:
    """A process listening on a free loopback port (as `user`, or as this one)."""

    def __init__(self, user: int | None = None) -> None:
        python, who = sys.executable, {}
        if user is not None:
            assert SYSTEM_PYTHON is not None
            python, who = SYSTEM_PYTHON, {"user": user, "group": user, "extra_groups": []}
        self.process = subprocess.Popen([python, "-c", LISTEN], stdout=subprocess.PIPE, cwd="/", **who)
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.fixture
def stranger() -> Iterator[Listener]:
    if not AS_ROOT:
        pytest.skip("runs a process as another user (needs root and a python3)")
    listener = Listener(65534)
    yield listener
    listener.stop()


@pytest.fixture
def own() -> Iterator[Listener]:
    listener = Listener()
    yield listener
    listener.stop()


def test_a_process_is_alive_until_it_exits_and_a_pid_taken_again_is_not_it():
    child = subprocess.Popen(["sleep", "60"])
    try:
        start = start_time(child.pid)
        assert start is not None
        process = Process.of(child.pid)
        assert process is not None and process.alive() and process.start == start
        assert Process.of(child.pid, start + 1) is None  # another process that got the same pid
        other = Process.of(child.pid, start)
        assert other is not None and other.alive()
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not process.alive() and not other.alive()
        assert Process.of(child.pid, start) is None
        process.close()
        assert not process.alive()
    finally:
        child.kill()
        child.wait()


def test_the_server_end_of_a_connection_names_its_user(own: Listener, stranger: Listener):
    with socket.create_connection(("127.0.0.1", own.port)) as sock:
        assert server_end(sock) == (1, os.geteuid())  # ESTABLISHED, ours
    with socket.create_connection(("127.0.0.1", stranger.port)) as sock:
        assert server_end(sock) == (1, 65534)


def test_without_sock_diag_the_server_end_comes_from_proc(
    own: Listener, stranger: Listener, monkeypatch: pytest.MonkeyPatch
):
    def no_netlink(*_: object) -> tuple[int, int]:
        raise PermissionError("netlink refused")

    monkeypatch.setattr(ownership, "_diag", no_netlink)
    with socket.create_connection(("127.0.0.1", own.port)) as sock:
        assert server_end(sock) == (1, os.geteuid())
    with socket.create_connection(("127.0.0.1", stranger.port)) as sock:
        assert server_end(sock) == (1, 65534)


async def test_an_owner_lets_only_its_running_process_and_its_own_users_server_through(
    own: Listener, stranger: Listener
):
    owner = Owner("vllm-0")
    assert owner.before() == "vllm-0's process is not running" and owner.identity() is None
    owner.runs(Process.of(own.process.pid))
    assert owner.before() is None and owner.identity() == (own.process.pid, start_time(own.process.pid))
    for port, refused in (
        (own.port, None),
        (stranger.port, "the server on vllm-0's port is not vllm-0: it is uid 65534 (nobody)'s"),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert await owner.after(writer.get_extra_info("socket")) == refused
        finally:
            writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", own.port)
    own.stop()  # its process exits while the connection is open
    try:
        assert await owner.after(writer.get_extra_info("socket")) is not None
    finally:
        writer.close()
    assert owner.before() == "vllm-0's process is not running" and owner.identity() is None


def test_the_holder_of_a_port_is_named_with_its_process(stranger: Listener):
    named = holder(stranger.port)
    assert named.startswith(f"uid 65534 (nobody), pid {stranger.process.pid}: {SYSTEM_PYTHON} -c import socket")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert holder(port) == "a socket bound and not listening (the kernel does not say whose)"
        sock.listen()
        assert holder(port).startswith(f"{ownership.user(os.geteuid())}, pid {os.getpid()}: ")


async def test_where_the_socket_tables_cannot_be_read_the_process_alone_decides_and_that_is_said_once(
    own: Listener, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(ownership, "server_end", lambda sock: None)
    ownership._blind.cache_clear()
    owner = Owner("vllm-0")
    owner.runs(Process.of(own.process.pid))
    reader, writer = await asyncio.open_connection("127.0.0.1", own.port)
    try:
        for _ in range(3):
            assert await owner.after(writer.get_extra_info("socket")) is None
    finally:
        writer.close()
    assert caplog.text.count("the kernel's socket tables cannot be read here") == 1
    owner.runs(None)
    assert await owner.after(None) == "vllm-0's process is not running"


async def test_a_server_end_not_taken_yet_is_waited_for_and_then_refused(
    own: Listener, monkeypatch: pytest.MonkeyPatch
):
    # A request socket (TCP_NEW_SYN_RECV) shows uid 0 in sock_diag, whoever listens: never trusted.
    owner = Owner("vllm-0")
    owner.runs(Process.of(own.process.pid))
    answers = iter([(12, 0), (12, 0), (1, os.geteuid())])
    monkeypatch.setattr(ownership, "server_end", lambda sock: next(answers))
    assert await owner.after(object()) is None
    monkeypatch.setattr(ownership, "server_end", lambda sock: (12, os.geteuid()))
    assert await owner.after(object()) == "the server on vllm-0's port has not taken the connection"
