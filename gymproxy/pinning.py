"""Session pinning: which upstream serves a request, and the signed cookie that remembers it.

The cookie is the whole state. Its value names the upstream, the session's id, when it was issued,
and an HMAC-SHA256 over the three under a shared secret, so any worker process, any replica with the same
secret, or a restarted gymproxy routes it the same way, and no session table grows in memory.
A cookie that is forged, stale, malformed or names an upstream no longer configured is ignored
and the session is pinned afresh. Clients without a cookie jar (agent harnesses such as Codex CLI
and Claude Code never return one) key their session instead: with a session header
(`pinning.session_headers`), Responses' `prompt_cache_key`, or the body's `user`, in that order.
Those keys map to an upstream by rendezvous hashing, so adding or removing one upstream moves only
its own share of sessions.

Every session has an id, sent to vLLM as `X-Session-ID`: its key when it has one, else the id its
cookie carries, minted before its first request is sent (`new_session_id`) and kept when the pin
is re-signed for another upstream.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import random
import secrets
import struct
import time
from typing import Generic, Protocol, TypeVar

from .errors import NoUpstream

log = logging.getLogger("gymproxy")


VERIFIED_CACHE = 65536  # pins remembered as verified, per process


class Signer:
    """Signs and checks pin values `<name>.<sid>.<issued>.<mac>` (name and mac base64url, no padding).

    `sid` is the session's id (`new_session_id`). A pin in the older `<name>.<issued>.<mac>` form,
    from before pins carried one, is still valid: `unsign` gives it the sid "", and the pinner
    re-issues it in the new form for the same upstream.
    """

    def __init__(self, secret: bytes, max_age: float) -> None:
        self._secret = secret
        self.max_age = max_age
        self._verified: dict[str, tuple[str, str, int]] = {}  # pin -> (name, sid, issued): one HMAC per pin

    def sign(self, name: str, sid: str | None = None, *, issued: int | None = None) -> str:
        """A pin of session `sid` (a new id when None) to the upstream `name`; re-sign with the
        session's own sid when its pin moves, so the session keeps its id."""
        if sid is None:
            sid = new_session_id()
        if issued is None:
            issued = int(time.time())
        payload = f"{_b64(name.encode())}.{sid}.{issued}"
        return f"{payload}.{self._mac(payload)}"

    def unsign(self, value: str) -> tuple[str, str] | None:
        """(upstream name, session id) of a valid, fresh pin (sid "" for an older pin); None for anything else."""
        known = self._verified.get(value)
        if known is None:
            known = self._verify(value)
            if known is None:
                return None
            if len(self._verified) >= VERIFIED_CACHE:
                self._verified.clear()  # bounded: a cache, never a session table
            self._verified[value] = known
        name, sid, issued = known
        return (name, sid) if time.time() - issued <= self.max_age else None

    def _verify(self, value: str) -> tuple[str, str, int] | None:
        if not value.isascii():
            return None
        parts = value.split(".")
        if len(parts) == 4:
            encoded, sid, issued, mac = parts
            if not (sid and _SID_CHARS.issuperset(sid)):
                return None
        elif len(parts) == 3:  # the older form, without a session id
            (encoded, issued, mac), sid = parts, ""
        else:
            return None
        if not issued.isdigit() or not hmac.compare_digest(mac, self._mac(value[: -len(mac) - 1])):
            return None
        try:
            return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode(), sid, int(issued)
        except (ValueError, UnicodeDecodeError):
            return None

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self._secret, payload.encode(), hashlib.sha256).digest())


_SID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def new_session_id() -> str:
    """A fresh session id: 16 base64url characters (96 random bits)."""
    return secrets.token_urlsafe(12)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Candidate(Protocol):
    """What pinning reads of an upstream."""

    @property
    def name(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def inflight(self) -> int: ...


U = TypeVar("U", bound=Candidate)


class Pin(Generic[U]):
    """Where a request goes, and the new cookie value to set (None when the client's pin stands)."""

    __slots__ = ("upstream", "cookie")

    def __init__(self, upstream: U, cookie: str | None) -> None:
        self.upstream = upstream
        self.cookie = cookie


def read_cookie(header: str | None, name: str) -> str | None:
    """Our cookie's value from a `Cookie` header, without parsing every other cookie."""
    if not header or name not in header:
        return None
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"')
    return None


def cookie_header(name: str, value: str, max_age: float) -> str:
    """The `Set-Cookie` value for a pin."""
    # Built by hand: the value is base64url and digits, and http.cookies costs ~10 µs a response.
    return f"{name}={value}; Max-Age={int(max_age)}; Path=/; HttpOnly; SameSite=Lax"


class Pinner(Generic[U]):
    """Chooses the upstream for each request; see the module docstring for the order of keys."""

    def __init__(self, upstreams: list[U], signer: Signer, *, placement: str) -> None:
        self.upstreams = upstreams
        self.by_name = {u.name: u for u in upstreams}
        self.signer = signer
        self.placement = placement
        self._next = 0
        self.created = 0
        self.repinned = 0
        self._warned = False

    def pick(
        self,
        cookie: str | None,
        session_key: str | None = None,
        *,
        sid: str | None = None,
        exclude: tuple[U, ...] = (),
    ) -> Pin[U]:
        """The pinned upstream if the cookie is valid and its upstream healthy; else a new pin.

        A new pin carries the cookie's session id, else `sid` (the id the request was sent with),
        else a new one. Health marks are guesses: when none is marked healthy, every upstream not
        yet tried is a candidate, so a recovered server is used at once rather than after the next
        health check.
        """
        any_healthy = any(u.healthy for u in self.upstreams)
        opened = self.signer.unsign(cookie) if cookie else None
        if opened is not None and opened[1]:
            sid = opened[1]  # the session keeps its id wherever its pin goes
        if cookie and not exclude:
            upstream = self.by_name.get(opened[0]) if opened is not None else None
            if upstream is not None and (upstream.healthy or not any_healthy):
                # An older pin, without a session id, is re-issued with one.
                return Pin(upstream, None if opened and opened[1] else self.signer.sign(upstream.name, sid))
            if upstream is None and not self._warned:
                self._warned = True  # log once: a forged or stale cookie is the client's business
                log.info("ignoring an invalid, stale or unknown pin cookie; re-pinning (logged once)")
        if cookie or exclude:
            self.repinned += 1
        else:
            self.created += 1
        candidates = [u for u in self.upstreams if u.healthy and u not in exclude]
        if not candidates:
            candidates = [u for u in self.upstreams if u not in exclude]
        if not candidates:
            raise NoUpstream(f"no upstream is reachable: {', '.join(u.url for u in self.upstreams)} all failed")
        if session_key:
            upstream = max(candidates, key=lambda u: _score(session_key, u))
        else:
            upstream = self._place(candidates)
        return Pin(upstream, self.signer.sign(upstream.name, sid))

    def _place(self, healthy: list[U]) -> U:
        if len(healthy) == 1:
            return healthy[0]
        if self.placement == "round_robin":
            self._next += 1
            return healthy[self._next % len(healthy)]
        least = min(u.inflight for u in healthy)
        return random.choice([u for u in healthy if u.inflight == least])


def _score(key: str, upstream: Candidate) -> float:
    """Weighted rendezvous hashing: the highest score wins, and each upstream's share follows its weight."""
    # surrogateescape: a header's undecodable bytes still hash (to a stable upstream), never raise.
    digest = hashlib.sha256(f"{upstream.name}\x00{key}".encode("utf-8", "surrogateescape")).digest()
    (value,) = struct.unpack(">Q", digest[:8])
    unit = (value + 1) / 2.0**64  # in (0, 1]
    return -upstream.weight / math.log(unit) if unit < 1.0 else math.inf
