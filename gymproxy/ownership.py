"""Who is behind a launched replica's port: its process (alive or not, by pidfd), the owner of the
server's end of a connection to it (the kernel's socket tables), and who holds a port.

A replica's port is a local port any local user may bind while the replica is down or dying (its
sockets close a few microseconds to milliseconds before its pidfd says it exited). So the fleet's
client asks an `Owner` before it opens a connection to the port (is the replica's process alive?)
and once it is open, before it writes a byte (does the server's end of this connection belong to
gymproxy's own user?): another user's process on the port is never sent a prompt or the replica's
key. gymproxy's own user is trusted (its processes can read the key in the replica's environment).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pwd
import select
import socket
import struct
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger("gymproxy")

# <linux/sock_diag.h>, <linux/inet_diag.h>, <linux/netlink.h>
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
NO_COOKIE = 0xFFFFFFFF
# TCP states in which the kernel's socket tables do not yet show the server's end as a socket of its
# own (a request socket: sock_diag reports uid 0 for it): the server has not taken the connection yet.
PENDING = frozenset({3, 12})  # TCP_SYN_RECV, TCP_NEW_SYN_RECV
LISTEN = 10
SETTLE_S = 0.002  # how often a pending server end is looked at again,
SETTLE_TRIES = 25  # ... and how many times before the connection is refused
SHOWN_COMMAND = 200  # characters of a port holder's command line in the log


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat's 22nd field); None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Process:
    """One process, which a recycled pid cannot pass for: a pidfd where Linux has them (5.3+), else
    its pid and start time."""

    __slots__ = ("pid", "start", "_fd", "_poll")

    def __init__(self, pid: int, start: int | None, fd: int | None) -> None:
        self.pid = pid
        self.start = start
        self._fd = fd
        self._poll: Any = None
        if fd is not None:
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)  # readable once it has exited

    @classmethod
    def of(cls, pid: int, start: int | None = None) -> Process | None:
        """A handle on process `pid`; None when it is gone or, with `start`, is not the one that
        started then (its pid was taken again)."""
        fd = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        except (AttributeError, OSError):
            pass  # no pidfds here: its start time tells it from a recycled pid
        began = start_time(pid)  # read after the pidfd opened: a pid taken again in between shows here
        if start is not None and began != start:
            if fd is not None:
                os.close(fd)
            return None
        return cls(pid, began, fd)

    def alive(self) -> bool:
        """Whether it has not exited (a zero-timeout poll of its pidfd: one syscall)."""
        if self._poll is not None:
            return not self._poll.poll(0)
        if self.start is not None:
            return start_time(self.pid) == self.start
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def close(self) -> None:
        """Let go of it: from now on it counts as exited."""
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._poll, self.start = None, None, -1


class Owner:
    """Who may be behind a launched replica's port (an `http1.Guard`): its process, while it runs,
    listening as gymproxy's own user. `launch.Launcher` keeps one per replica; a worker of
    `--workers N` makes its own from the pid and start time its parent writes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.process: Process | None = None
        self.uid = os.geteuid()

    def runs(self, process: Process | None) -> None:
        """Its process is now `process` (None: none runs)."""
        if self.process is not None and self.process is not process:
            self.process.close()
        self.process = process

    def identity(self) -> tuple[int, int | None] | None:
        """Its process's pid and start time (None where /proc does not say), for another process to
        find it by (`Process.of`); None while none runs."""
        process = self.process
        if process is None or not process.alive():
            return None
        return process.pid, process.start

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def before(self) -> str | None:
        """Why no connection to its port may be opened now (None: it may)."""
        return None if self.alive() else f"{self.name}'s process is not running"

    async def after(self, sock: Any) -> str | None:
        """Why nothing may be sent on `sock`, a new connection to its port (None: it may): the
        server's end must belong to gymproxy's user, and its process must still run."""
        found: tuple[int, int] | None = None
        for _ in range(SETTLE_TRIES if sock is not None else 0):
            try:
                found = server_end(sock)
            except OSError as exc:  # no peer any more (reset), or the tables cannot be read
                return f"the connection to {self.name}'s port failed at once ({exc})"
            if found is None or found[0] not in PENDING:
                break
            await asyncio.sleep(SETTLE_S)
        if found is not None and found[0] in PENDING:
            return f"the server on {self.name}'s port has not taken the connection"
        if found is None:
            _blind()
        elif found[1] != self.uid:
            return f"the server on {self.name}'s port is not {self.name}: it is {user(found[1])}'s"
        return self.before()


@functools.cache
def _blind() -> None:
    """Said once: the socket tables cannot be read here, so a replica's port is checked by its pidfd alone."""
    log.warning(
        "the kernel's socket tables cannot be read here (sock_diag, /proc/net/tcp): a connection to a "
        "launched replica's port is checked by the replica's process alone, not by who listens there"
    )


def server_end(sock: Any) -> tuple[int, int] | None:
    """The TCP state and owner (uid) of the server's end of `sock`, a connected TCP socket, from the
    kernel's socket tables (sock_diag, else /proc/net/tcp); None where neither can tell.
    `FileNotFoundError` when that end is not there (it closed)."""
    local, remote = sock.getsockname(), sock.getpeername()
    try:
        return _diag(sock.family, local, remote)
    except FileNotFoundError:
        raise
    except (AttributeError, OSError):  # no sock_diag here (not Linux, or netlink refused)
        pass
    if not Path("/proc/net/tcp").exists():
        return None
    found = [(s.state, s.uid) for s in sockets(remote[1]) if s.remote_port == local[1]]
    if not found:
        raise FileNotFoundError("the server's end of the connection is gone")
    strangers = [pair for pair in found if pair[1] != os.geteuid()]
    return (strangers or found)[0]


def _diag(family: int, local: tuple[Any, ...], remote: tuple[Any, ...]) -> tuple[int, int]:
    """One exact sock_diag lookup of the socket at `remote` connected to `local` (FileNotFoundError: none)."""

    def packed(host: str) -> bytes:
        raw = socket.inet_pton(family, host)
        return raw + b"\0" * (16 - len(raw))

    sockid = (
        struct.pack("!HH", remote[1], local[1])
        + packed(remote[0])
        + packed(local[0])
        + struct.pack("=III", 0, NO_COOKIE, NO_COOKIE)
    )
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    message = struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + request
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as diag:
        diag.settimeout(1.0)
        diag.sendto(message, (0, 0))
        reply = diag.recv(4096)
    (kind,) = struct.unpack_from("=H", reply, 4)
    if kind == NLMSG_ERROR:
        (error,) = struct.unpack_from("=i", reply, 16)
        raise OSError(-error, os.strerror(-error))  # ENOENT (FileNotFoundError): no such socket
    # inet_diag_msg: family, state, timer, retrans (4 bytes), the socket id (48), expires, rqueue,
    # wqueue (12), uid, inode.
    (state,) = struct.unpack_from("=B", reply, 17)
    (uid,) = struct.unpack_from("=I", reply, 16 + 64)
    return state, uid


class Entry(NamedTuple):
    """One TCP socket of /proc/net/tcp or tcp6."""

    local_port: int
    remote_port: int
    state: int
    uid: int
    inode: str


def sockets(port: int) -> list[Entry]:
    """The TCP sockets (IPv4 and IPv6) whose local port is `port`, from /proc/net (empty if unreadable)."""
    found = []
    needle = f":{port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            text = Path(table).read_text()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            if needle not in line:
                continue
            # sl, local address, remote address, state, queues, timer, retransmits, uid, timeout, inode
            fields = line.split()
            if len(fields) > 9 and fields[1].endswith(needle.rstrip()):
                remote = int(fields[2].rpartition(":")[2], 16)
                found.append(Entry(port, remote, int(fields[3], 16), int(fields[7]), fields[9]))
    return found


def listeners(port: int) -> set[str] | None:
    """The inodes of the sockets listening on TCP `port`; None where /proc cannot tell."""
    if not Path("/proc/net/tcp").exists():
        return None
    return {s.inode for s in sockets(port) if s.state == LISTEN}


def holds_listener(pgid: int, port: int) -> bool | None:
    """Whether every socket listening on TCP `port` is held by a process of group `pgid`; None
    where /proc cannot tell (not Linux, or its tables are unreadable)."""
    listening = listeners(port)
    if listening is None:
        return None
    if not listening:
        return False
    held: set[str] = set()
    for pid in _pids():
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[2] != str(pgid):
                continue
        except (OSError, IndexError):
            continue  # gone
        held |= _socket_links(pid)
    return all(f"socket:[{inode}]" in held for inode in listening)


def holder(port: int) -> str:
    """Who holds TCP `port`, for the log: the user, and the process where /proc shows it (another
    user's open files are visible to root only). A socket only bound, not listening, shows nowhere."""
    entries = [s for s in sockets(port) if s.state == LISTEN] or sockets(port)
    if not entries:
        return "a socket bound and not listening (the kernel does not say whose)"
    uids = sorted({s.uid for s in entries})
    who = ", ".join(user(uid) for uid in uids)
    wanted = {f"socket:[{s.inode}]" for s in entries}
    for pid in _pids():
        if _socket_links(pid) & wanted:
            return f"{who}, pid {pid}: {_command(pid)}"
    return who


def user(uid: int) -> str:
    """`uid 65534 (nobody)`."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _pids() -> list[str]:
    try:
        return [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def _socket_links(pid: str) -> set[str]:
    """What process `pid`'s open files are (`socket:[inode]` for sockets); empty when not ours to read."""
    links: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return links
    for fd in fds:
        try:
            links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return links


def _command(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(its command line is not readable)"
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text[:SHOWN_COMMAND] + ("..." if len(text) > SHOWN_COMMAND else "")
