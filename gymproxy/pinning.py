"""Session pinning: which upstream serves a request, and the signed cookie that remembers it.

The cookie is the whole state. Its value names the upstream, the session's id, when it was issued,
and an HMAC-SHA256 over the three under a shared secret, so any worker process, any replica with the same
secret, or a restarted gymproxy routes it the same way, and no session table grows in memory.
A cookie that is forged, stale, malformed or names an upstream no longer configured is ignored
and the session is pinned afresh. Clients without a cookie jar (agent harnesses such as Codex CLI
and Claude Code never return one) key their session instead: with a session header
(`pinning.session_headers`), Responses' `prompt_cache_key`, or the body's `user`, in that order.
Those keys map to an upstream by rendezvous hashing, so adding or removing one upstream moves only
its own share of sessions, under a load bound (see `Pinner`) so that no engine runs hot.

Every session has an id, sent to vLLM as `X-Session-ID`: its key when it has one, else the id its
cookie carries, minted before its first request is sent (`new_session_id`) and kept when the pin
is re-signed for another upstream.

Each upstream's circuit breaker (`Breaker`, at the end) keeps it out of the pick while it fails,
and its pace (`Pace`: seconds per generated token, as observed here) steers sessions off an engine
far slower than the fastest, which an in-flight count alone cannot see.
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
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from .errors import NoUpstream
from .upstream import Tally

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

    def unsign(self, value: str) -> tuple[str, str, int] | None:
        """(upstream name, session id, issued) of a valid, fresh pin (sid "" for an older pin); None
        for anything else."""
        known = self._verified.get(value)
        if known is None:
            known = self._verify(value)
            if known is None:
                return None
            if len(self._verified) >= VERIFIED_CACHE:
                self._verified.clear()  # bounded: a cache, never a session table
            self._verified[value] = known
        return known if time.time() - known[2] <= self.max_age else None

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


def minted_shape(value: str) -> bool:
    """Whether `value` could be an id `new_session_id` made (16 base64url characters)."""
    return len(value) == 16 and _SID_CHARS.issuperset(value)


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
    @property
    def blocked(self) -> bool: ...  # its circuit breaker is open
    @property
    def pace(self) -> float | None: ...  # recent seconds per generated token; None: not known


U = TypeVar("U", bound=Candidate)


MOVE_REASONS = ("down", "breaker", "busy", "overloaded", "slow", "removed", "joined")
PACE_REFRESH_S = 0.25  # how long the fleet's usual pace is reused before it is looked up again
PACE_NOISE_S = 0.002  # a pace at most this much over the usual (seconds a token) is never slow: timing noise


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
    """Chooses the upstream for each request; see the module docstring for the order of keys.

    Placement is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam): a new
    keyed session takes the first upstream in its rendezvous order whose in-flight count, this
    request included, is at most `max(share * (1 + epsilon), share + slack)`, where `share` is the
    upstream's weight share of everything in flight over the eligible upstreams. Upstreams whose
    pace is over the fleet's usual pace times `1 + pace_tolerance` take no new sessions while a
    faster one can (None: pace is not read). A session stays where it is unless its upstream is
    down, its breaker open, it answered "busy", it is over `bound * (1 + hysteresis)`, or its pace
    is over the usual times `(1 + pace_tolerance) * (1 + hysteresis)`; then it moves to its next
    choice. The usual pace is the lower median of the known ones (the best of two), so one
    upstream that counts more tokens than it makes cannot turn a larger fleet away from the rest.
    Cookie-less keyed sessions that moved are remembered in a size-capped, expiring map (`moved`),
    per process.
    """

    def __init__(
        self,
        upstreams: list[U],
        signer: Signer,
        *,
        placement: str,
        epsilon: float = 0.25,
        slack: float = 10.0,
        hysteresis: float = 0.5,
        pace_tolerance: float | None = 0.5,
        moved_max: int = 65536,
        moved_ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        tally: Tally | None = None,
    ) -> None:
        """`tally`: the fleet's in-flight total, if its upstreams keep one (else it is summed)."""
        self.signer = signer
        self.placement = placement
        self.epsilon = epsilon
        self.slack = slack
        self.hysteresis = hysteresis
        self.pace_tolerance = pace_tolerance
        self.moved_max = moved_max
        self.moved_ttl = moved_ttl
        self._clock = clock
        self._tally = tally
        self._next = 0
        self.created = 0
        self.repinned = 0
        self.moves = dict.fromkeys(MOVE_REASONS, 0)  # sessions moved off their upstream, by reason
        # cookie-less key -> (upstream name, expiry, when it was last checked against joins), in LRU order
        self.moved: dict[str, tuple[str, float, float]] = {}
        self._warned = False
        self.upstreams: list[U] = []
        self.by_name: dict[str, U] = {}
        self._weights = 1.0
        # upstream added live -> when it first took sessions, in whole seconds as pins are issued: a pin
        # issued in the same second is taken as issued after it (it is never moved twice)
        self._joins: dict[str, int] = {}
        self._last_join = 0
        self._usual_pace: float | None = None
        self._usual_pace_until = -math.inf
        self.set_upstreams(upstreams)

    def set_upstreams(self, upstreams: list[U]) -> None:
        """Route over `upstreams` from now on (the fleet changed); moved keys naming others are ignored."""
        self.upstreams = list(upstreams)
        self.by_name = {u.name: u for u in self.upstreams}
        self._weights = sum(u.weight for u in self.upstreams) or 1.0
        self._usual_pace_until = -math.inf
        self._joins = {name: at for name, at in self._joins.items() if name in self.by_name}
        self._last_join = max(self._joins.values(), default=0)

    def joined(self, name: str) -> None:
        """The upstream `name`, added live, takes sessions now: each pinned session whose first
        rendezvous choice it is moves there on its next request (as keyed sessions do at once), so
        a new engine gets its share of the sessions that were already running."""
        if name in self.by_name:
            self._joins[name] = self._last_join = int(time.time())

    def pick(
        self,
        cookie: str | None,
        session_key: str | None = None,
        *,
        sid: str | None = None,
        exclude: tuple[U, ...] = (),
        reason: str = "down",
    ) -> Pin[U]:
        """The session's upstream while it is fine; else its next choice, with the new pin to set.

        `exclude` are upstreams this request already failed on (`reason` says why: `down` or
        `busy`). A new pin carries the cookie's session id, else `sid` (the id the request was sent
        with), else a new one. Health marks are guesses: when none is marked healthy, every upstream
        not yet tried is a candidate, so a recovered server is used at once rather than after the
        next check.
        """
        if not self.upstreams:
            raise NoUpstream("no upstream is configured: the fleet is empty")
        home: U | None = None
        why: str | None = None
        old_format = False
        issued = 0
        pinned_sid: str | None = None  # the valid cookie's session id: its rendezvous key when it moves
        if cookie:
            opened = self.signer.unsign(cookie)
            if opened is not None:
                name, cookie_sid, issued = opened
                if cookie_sid:
                    sid = pinned_sid = cookie_sid  # the session keeps its id wherever its pin goes
                else:
                    old_format = True  # an older pin, without a session id: re-issued with one
                home = self.by_name.get(name)
                if home is None:
                    why = "removed"
            elif not self._warned:
                self._warned = True  # log once: a forged or stale cookie is the client's business
                log.info("ignoring an invalid, stale or unknown pin cookie; re-pinning (logged once)")
        keyed_only = home is None and why is None and bool(session_key)
        if keyed_only:
            assert session_key is not None
            home = self._remembered(session_key)
            if home is None:
                home = max(self.upstreams, key=lambda u: _score(session_key, u))
        if home is not None:
            why = reason if home in exclude else self._trouble(home)
            if why is None:
                if keyed_only or old_format:
                    return Pin(home, self.signer.sign(home.name, sid))
                if issued >= self._last_join:
                    return Pin(home, None)  # the common case: a valid pin on a fine upstream
                assert pinned_sid is not None  # an older pin (no sid) was re-issued above
                joiner = self._joiner(home, session_key or pinned_sid, issued)
                if joiner is None:  # re-signed as it is: checked once per session and join
                    return Pin(home, self.signer.sign(home.name, sid))
                self.moves["joined"] += 1
                self.repinned += 1
                return Pin(joiner, self.signer.sign(joiner.name, sid))
        leaving = (*exclude, home) if home is not None else exclude
        candidates = self._eligible(leaving)
        if not candidates:
            if home is not None and why == "overloaded":
                keep = cookie and not keyed_only and not old_format
                return Pin(home, None if keep else self.signer.sign(home.name, sid))
            raise NoUpstream(f"no upstream is reachable: {', '.join(u.url for u in self.upstreams)} all failed")
        order_key = session_key or pinned_sid or cookie
        upstream = self._bounded(order_key, candidates) if order_key else self._place(candidates)
        if why is not None:
            self.moves[why] += 1
            log.debug("session moved from %s to %s (%s)", home.name if home else "?", upstream.name, why)
        if cookie or exclude:
            self.repinned += 1
        else:
            self.created += 1
        if keyed_only:
            assert session_key is not None
            self._remember(session_key, upstream)
        return Pin(upstream, self.signer.sign(upstream.name, sid))

    def _joiner(self, home: U, key: str, issued: int) -> U | None:
        """The upstream added since the pin was issued that is now `key`'s first choice and fine, if any."""
        top = max(self.upstreams, key=lambda u: _score(key, u))
        if top is home or self._joins.get(top.name, 0) <= issued or self._trouble(top) is not None:
            return None
        return top

    def _trouble(self, upstream: U) -> str | None:
        """Why a session should leave `upstream` now, or None while it is fine. O(1) unless it looks overloaded."""
        if not upstream.healthy and any(u.healthy for u in self.upstreams):
            return "down"
        if upstream.blocked:
            return "breaker"
        if self.pace_tolerance is not None and self._slow(
            upstream, (1.0 + self.pace_tolerance) * (1.0 + self.hysteresis)
        ):
            return "slow"
        # Cheap first: the bound over the whole fleet. Only if that looks exceeded, the exact one.
        load = upstream.inflight + 1
        margin = 1.0 + self.hysteresis
        if load <= self.slack * margin:
            return None  # under the bound's floor, whatever the average
        tally = self._tally
        total = tally.inflight if tally is not None else sum(u.inflight for u in self.upstreams)
        if load <= self._bound(upstream, total + 1, self._weights) * margin:
            return None
        eligible = self._eligible(())
        if upstream not in eligible:
            return None
        total = sum(u.inflight for u in eligible) + 1
        weights = sum(u.weight for u in eligible)
        return "overloaded" if load > self._bound(upstream, total, weights) * margin else None

    def _slow(self, upstream: U, factor: float) -> bool:
        """Its pace is over the fleet's usual pace times `factor`, and more than noise over it (False
        while either is unknown)."""
        pace = upstream.pace
        if pace is None:
            return False
        now = self._clock()
        if now >= self._usual_pace_until:  # looked up at most every PACE_REFRESH_S: O(1) per request
            paces = sorted(p for u in self.upstreams if u.healthy and not u.blocked and (p := u.pace) is not None)
            self._usual_pace = paces[(len(paces) - 1) // 2] if paces else None
            self._usual_pace_until = now + PACE_REFRESH_S
        usual = self._usual_pace
        return usual is not None and pace > usual * factor and pace > usual + PACE_NOISE_S

    def _fast(self, candidates: list[U]) -> list[U]:
        """`candidates` without those far slower than the usual pace (all of them if none is fast)."""
        tolerance = self.pace_tolerance
        if tolerance is None or len(candidates) == 1:
            return candidates
        return [u for u in candidates if not self._slow(u, 1.0 + tolerance)] or candidates

    def _bound(self, upstream: U, total: int, weights: float) -> float:
        share = total * upstream.weight / weights
        return max(share * (1.0 + self.epsilon), share + self.slack)

    def _eligible(self, exclude: tuple[U, ...]) -> list[U]:
        candidates = [u for u in self.upstreams if u.healthy and not u.blocked and u not in exclude]
        if not candidates:  # health marks are guesses; an open breaker is not
            candidates = [u for u in self.upstreams if not u.blocked and u not in exclude]
        return candidates

    def _bounded(self, key: str, candidates: list[U]) -> U:
        """The first of `candidates` in `key`'s rendezvous order that is under its load bound and not slow."""
        candidates = self._fast(candidates)
        if len(candidates) == 1:
            return candidates[0]
        total = sum(u.inflight for u in candidates) + 1
        weights = sum(u.weight for u in candidates)
        order = sorted(candidates, key=lambda u: _score(key, u), reverse=True)
        for upstream in order:
            if upstream.inflight + 1 <= self._bound(upstream, total, weights):
                return upstream
        return min(order, key=lambda u: (u.inflight + 1) / u.weight)  # unreachable while shares sum to total

    def _remembered(self, key: str) -> U | None:
        """Where a cookie-less keyed session moved to, while that is fresh and still in the fleet, and
        no upstream that joined since is its first choice (then it goes there, as a pin would)."""
        entry = self.moved.pop(key, None)
        if entry is None:
            return None
        name, expires, since = entry
        upstream = self.by_name.get(name)
        now = self._clock()
        if upstream is None or now > expires:
            return None
        if since < self._last_join:
            first = max(self.upstreams, key=lambda u: _score(key, u))
            if self._joins.get(first.name, 0) > since:
                return None
            since = time.time()
        self.moved[key] = (name, now + self.moved_ttl, since)  # used: fresh again, and last in LRU order
        return upstream

    def _remember(self, key: str, upstream: U) -> None:
        self.moved.pop(key, None)
        if upstream is max(self.upstreams, key=lambda u: _score(key, u)):
            return  # back at its first choice: nothing to remember
        while len(self.moved) >= self.moved_max:
            del self.moved[next(iter(self.moved))]  # the least recently used
        self.moved[key] = (upstream.name, self._clock() + self.moved_ttl, time.time())

    def _place(self, healthy: list[U]) -> U:
        healthy = self._fast(healthy)
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
