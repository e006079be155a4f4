"""One vLLM upstream as the fleet keeps it: its URLs and headers, health, in-flight count, circuit
breaker and pace; a request sent there (`Sent`), and reading its reply with failures named.

The circuit breaker and the pace describe one upstream, so they live here, beside it: the pick
(`pinning.Pinner`) reads them, the fleet feeds them.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import math
import time
from collections.abc import Callable

from yarl import URL

from .config import Config, UpstreamSpec
from .errors import Saturated, Unavailable, UpstreamError, UpstreamTimeout, describe
from .http1 import Aborted, ClientError, Guard, Reply, ReplyTooLarge

log = logging.getLogger("gymproxy")

JSON_HEADERS = {"Content-Type": "application/json"}
VERSIONS_KEPT = 16  # weight versions an upstream remembers, for replies that ran across changes


def shown(url: str | URL) -> str:
    """A URL for messages, logs and metrics: without credentials or query string."""
    return str(URL(str(url)).with_user(None).with_query(None))


def upstream_name(spec: UpstreamSpec) -> str:
    """What pins, metrics and the admin routes call an upstream: its name, else its URL as shown."""
    return spec.name or shown(URL(spec.url.rstrip("/")))


class Tally:
    """Requests in flight over the whole fleet, kept up by the upstreams themselves, so a pinned
    request's load check is O(1) however many upstreams there are."""

    __slots__ = ("inflight",)

    def __init__(self) -> None:
        self.inflight = 0


class Upstream:
    """One vLLM server: its prebuilt URLs and headers, health, and in-flight count."""

    __slots__ = (
        "name",
        "spec",
        "url",
        "weight",
        "headers",
        "json_headers",
        "header_names",
        "urls",
        "root",
        "inflight",
        "healthy",
        "fresh",
        "failed_checks",
        "answered",
        "closed",
        "owner",
        "breaker",
        "meter",
        "tally",
        "version",
        "version_seq",
        "versions",
        "version_changed",
        "stale",
        "_slots",
        "_reject",
    )

    def __init__(self, spec: UpstreamSpec, config: Config, tally: Tally | None = None) -> None:
        """`tally`: the fleet's in-flight total, which this upstream's requests count in too."""
        self.configure(spec, config)
        self.name = upstream_name(spec)
        self.inflight = 0
        self.tally = tally if tally is not None else Tally()
        self.healthy = True
        self.fresh = False  # added live and not yet seen healthy: takes no sessions while others can
        self.failed_checks = 0  # consecutive failed health checks
        self.answered = False  # it has answered once (a health check, a request): see `Fleet._check`
        self.closed: str | None = None  # why its owner (the launcher) says it is not serving; see `Fleet.close`
        self.owner: Guard | None = None  # who may be behind its port (a launched replica's); see `Fleet.own`
        self.breaker = Breaker(self.url, failures=config.breaker.failures, cooldown=config.breaker.cooldown_s)
        self.meter = Pace(config.pinning.pace.window_s)
        self.version: str | None = None  # its weight version, once known (`set_version`)
        self.version_seq = 0  # how many times it changed
        self.versions: collections.deque[str | None] = collections.deque([None], maxlen=VERSIONS_KEPT)
        self.version_changed = asyncio.Event()  # set (and replaced) at each change
        self.stale = False  # its weight version is not the fleet's (`control.Control`): it takes no requests
        cap = config.limits.max_inflight_per_upstream
        self._slots = asyncio.Semaphore(cap) if cap else None
        self._reject = config.limits.when_full == "reject"

    def configure(self, spec: UpstreamSpec, config: Config) -> None:
        """Take `spec`'s URL, key and weight (at creation, and when a reload changes them in place)."""
        self.spec = spec
        base = URL(spec.url.rstrip("/"))
        self.url = shown(base)  # what every message, log line, metric and /health shows
        self.weight = spec.weight
        headers = dict(config.default_headers)
        api_key = spec.api_key or config.api_key
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        elif base.user is not None:  # credentials in the URL mean HTTP basic auth, as curl reads them
            token = base64.b64encode(f"{base.user}:{base.password or ''}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        self.headers = headers
        self.json_headers = {**headers, **JSON_HEADERS}
        self.header_names = frozenset(name.lower() for name in self.json_headers)  # a client's never replace them
        base = base.with_user(None)
        root = base.parent if base.name == "v1" else base
        query = dict(config.default_query)

        def url(at: URL, path: str) -> URL:
            joined = at / path
            return joined.with_query(query) if query else joined

        self.root = root  # vLLM's own routes (/health, /pause, ...) hang off it
        self.urls = {
            "chat": url(base, "chat/completions"),
            "completions": url(base, "completions"),
            "responses": url(base, "responses"),
            "messages": url(base, "messages"),
            "count_tokens": url(base, "messages/count_tokens"),
            "models": url(base, "models"),
            "tokenize": url(root, "tokenize"),
            "health": url(root, "health"),
            "is_paused": url(root, "is_paused"),
            "weight_info": url(root, "weight_info"),
        }

    async def acquire(self) -> None:
        """Take an in-flight slot; past `limits.max_inflight_per_upstream`, wait or refuse (503)."""
        if self._slots is not None:
            if self._reject and self._slots.locked():
                raise Saturated(f"upstream {self.url} has {self.inflight} requests in flight, its configured cap")
            await self._slots.acquire()
        self.inflight += 1
        self.tally.inflight += 1

    @property
    def blocked(self) -> bool:
        """No request may go there now: its circuit breaker is open, its owner closed it, or its
        weights are not the fleet's."""
        return self.closed is not None or self.stale or self.breaker.blocked

    @property
    def pace(self) -> float | None:
        """Its recent seconds per generated token (`pinning.Pace`), None while not known."""
        return self.meter.value

    def set_version(self, version: str | None) -> None:
        """Its weight version is `version` (from a broadcast, or its /weight_info)."""
        if version == self.version:
            return
        self.version = version
        self.version_seq += 1
        self.versions.append(version)
        changed, self.version_changed = self.version_changed, asyncio.Event()
        changed.set()

    def versions_since(self, seq: int) -> str | None:
        """The weight versions it had since its `version_seq` was `seq`, oldest first and
        comma-separated (`X-Weight-Version`); None while none is known."""
        if seq == self.version_seq:
            return self.version
        back = min(self.version_seq - seq, len(self.versions) - 1)
        names = [v for v in list(self.versions)[-back - 1 :] if v is not None]
        return ",".join(dict.fromkeys(names)) or None

    def release(self) -> None:
        self.inflight -= 1
        self.tally.inflight -= 1
        if self._slots is not None:
            self._slots.release()

    def __repr__(self) -> str:  # never shows the api key
        return f"Upstream({self.url!r})"


class Sent:
    """A request sent to an upstream: where it went, the reply, and the new pin (None: keep the client's).

    It holds one of the upstream's in-flight slots until `release` (connection back to the pool if
    the reply was read whole) or `close` (connection dropped: vLLM aborts the generation).
    """

    __slots__ = ("upstream", "reply", "pin", "started", "seq", "_held")

    def __init__(self, upstream: Upstream, reply: Reply, pin: str | None, started: float) -> None:
        self.upstream = upstream
        self.reply = reply
        self.pin = pin
        self.started = started  # time.monotonic() when it was sent
        self.seq = upstream.version_seq  # its engine's weight version when it was sent
        self._held = True

    def versions(self) -> str | None:
        """The weight versions its engine had from the send until now (`X-Weight-Version`)."""
        upstream = self.upstream
        return upstream.version if self.seq == upstream.version_seq else upstream.versions_since(self.seq)

    def release(self) -> None:
        self.reply.release()
        self._give_back()

    def close(self) -> None:
        self.reply.close()
        self._give_back()

    def _give_back(self) -> None:
        if self._held:
            self._held = False
            self.upstream.release()


async def read(reply: Reply) -> bytes:
    """The whole body, with read failures mapped to 502/504 naming the upstream (503 when aborted)."""
    try:
        return await reply.read()
    except ReplyTooLarge as exc:
        raise too_large(reply, exc) from exc
    except Aborted as exc:  # its owner gave up (shutdown): the reason is the message
        raise Unavailable(str(exc)) from exc
    except asyncio.TimeoutError as exc:
        raise UpstreamTimeout(f"upstream {shown(reply.url)} stopped sending its reply ({describe(exc)})") from exc
    except ClientError as exc:
        raise UpstreamError(f"upstream {shown(reply.url)} broke off its reply: {describe(exc)}") from exc


def too_large(reply: Reply, exc: ReplyTooLarge) -> UpstreamError:
    """A reply over its limit (`Reply.limit`) as a 502 naming the upstream, the limit and its key."""
    key = "limits.max_error_reply_size" if reply.status >= 400 else "limits.max_reply_size"
    if exc.announced is not None:
        size = f"of {exc.announced} bytes, over the limit of {exc.limit}"
    else:
        size = f"over the limit of {exc.limit} bytes"
    return UpstreamError(f"upstream {shown(reply.url)} answered {reply.status} with a body {size} ({key})")


# --- circuit breakers ---------------------------------------------------------------------------------
# A per-upstream circuit breaker: after `failures` failures in a row, stop sending for `cooldown` seconds.
#
#     closed ──(N failures in a row)──> open ──(cooldown over: one request let through)──> half-open
#       ^                                 ^                                                  │
#       └──────────(the probe succeeds)───┼──────────────────────────────────────────────────┤
#                                         └────────────(the probe fails)─────────────────────┘
#
# What counts as a failure is the fleet's business (connection-level failures and vLLM's "busy" and
# "paused" 503s); `Breaker` only keeps the state, which the pick reads (`blocked`). It is O(1) and allocation-free, so the common case
# (closed) costs one comparison per request.

CLOSED, OPEN, HALF_OPEN = 0, 1, 2  # also the values of the `gymproxy_upstream_breaker` gauge


class Breaker:
    """The breaker of one upstream (`name` is for the log)."""

    __slots__ = ("name", "failures", "cooldown", "state", "streak", "opened_at", "opened", "_clock")

    def __init__(
        self, name: str, *, failures: int, cooldown: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.failures = failures
        self.cooldown = cooldown
        self.state = CLOSED
        self.streak = 0  # failures in a row
        self.opened_at = 0.0
        self.opened = 0  # times it opened (a counter)
        self._clock = clock

    @property
    def blocked(self) -> bool:
        """True while no request may go: open and cooling down, or half-open with its probe out."""
        if self.state == CLOSED:
            return False
        if self.state == HALF_OPEN:
            return True
        return self._clock() - self.opened_at < self.cooldown

    def admit(self) -> None:
        """A request is about to go: once the cooldown is over, it is the half-open probe."""
        if self.state == OPEN and not self.blocked:
            self.state = HALF_OPEN

    def succeeded(self) -> None:
        self.streak = 0
        if self.state != CLOSED:
            self.state = CLOSED
            log.info("upstream %s: circuit breaker closed (the probe succeeded)", self.name)

    def failed(self) -> None:
        self.streak += 1
        if self.state == HALF_OPEN or (self.state == CLOSED and self.streak >= self.failures):
            self.state = OPEN
            self.opened_at = self._clock()
            self.opened += 1
            log.warning(
                "upstream %s: circuit breaker open for %g s after %d failures in a row",
                self.name,
                self.cooldown,
                self.streak,
            )

    def abandon(self) -> None:
        """The probe ended without a verdict (cancelled, timed out): the next request probes again."""
        if self.state == HALF_OPEN:
            self.state = OPEN  # opened_at is over a cooldown ago: not blocked


# --- pace ----------------------------------------------------------------------------------------------
# An upstream's pace: seconds per generated token over its recent replies (time from sending to the
# reply's end, over `usage.completion_tokens`), the ratio of two sums that decay with a time
# constant of `window` seconds. It grows with the engine's batch and with a weaker or throttled
# GPU, which is what an in-flight count cannot tell apart. It is unknown (None) until `PACE_MIN`
# replies are in, and again after `3 * window` without one (the next reply starts afresh): the pick
# then reads only in-flight counts, so an engine no session reaches any more is soon measured anew.
# Known, it stays known while replies come, however few: an engine steered off keeps its pace.

PACE_MIN = 20  # replies before a pace is trusted: a few are noise, not a slow engine


class Pace:
    """The pace of one upstream."""

    __slots__ = ("window", "seconds", "tokens", "replies", "at", "_clock")

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.seconds = 0.0
        self.tokens = 0.0
        self.replies = 0  # since it was last unknown
        self.at = -math.inf  # when the last reply was observed
        self._clock = clock

    def observe(self, seconds: float, tokens: int) -> None:
        """A reply that took `seconds` and generated `tokens` (at least one)."""
        now = self._clock()
        idle = now - self.at
        if idle > 3.0 * self.window:  # stale (or the first): start afresh
            self.seconds = self.tokens = 0.0
            self.replies = 0
            decay = 0.0
        else:
            decay = math.exp(-idle / self.window)
        self.seconds = self.seconds * decay + seconds
        self.tokens = self.tokens * decay + tokens
        self.replies += 1
        self.at = now

    @property
    def value(self) -> float | None:
        """Seconds per token, or None while not known (too few replies, or none for a while)."""
        if self.replies < PACE_MIN or self._clock() - self.at > 3.0 * self.window:
            return None
        return self.seconds / self.tokens
