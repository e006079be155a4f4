"""The upstream vLLM fleet: which upstream serves a request, sending it there with failover, health.

The fleet never sees the client's request: callers pass the pin cookie's value, the session key and
the request id, and get back what was sent where (`Sent`), including the new pin to set. Every
failure to talk to an upstream becomes an `UpstreamError` (502) or `UpstreamTimeout` (504) whose
message names the URL that failed (never its credentials), so a wrong `base_url` is obvious at once.
A request is re-sent to the session's next upstream when no upstream began it: the connection was
refused, or vLLM answered its "busy" or "paused" 503. One that an upstream dropped after it was
written (closed or reset before one reply byte) goes again at most once: to the same upstream on a
new connection when a pooled one closed (the keep-alive race), or to the next when the upstream
that dropped it is gone; an upstream still up chose to drop it, and the client gets a 502 (a query
of death kills one engine, not the fleet, and opens no breaker). vLLM aborts a request whose
connection closes, so no generation ever runs twice at once. Each upstream keeps a circuit breaker
(`pinning.Breaker`) fed by the failures that may be re-sent, at most one per request (`Attempts`).

An upstream gymproxy launched itself (a `launch.py` replica) is `closed` while its owner says it is
not serving (loading, restarting, given up): nothing is sent to its port then, not a request and not
a health check, because any local process may have bound that port meanwhile. Only its owner
(`Fleet.ready`) opens it again; health checks and answers mark an open one down and up as usual.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import logging
import random
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from yarl import URL

from .config import Config, Retries, UpstreamSpec, upstream_specs
from .errors import (
    GymproxyError,
    NotConnected,
    NoUpstream,
    Saturated,
    Unavailable,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    describe,
)
from .http1 import Aborted, CannotConnect, Client, ClientError, ConnectTimeout, NoReply, Reply, ReplyTooLarge
from .metrics import Metrics, label
from .pinning import CLOSED, HALF_OPEN, OPEN, Breaker, Pace, Pinner, Signer, Tally

log = logging.getLogger("gymproxy")

JSON_HEADERS = {"Content-Type": "application/json"}
HEALTH_FAILURES = 2  # consecutive failed checks before an upstream is marked down
PROBE_TIMEOUT = 10.0
DRAIN_POLL_S = 0.1  # how often a removed upstream's in-flight count is looked at until it is 0

BREAKER = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half-open"}
Gauge = tuple[str, str, str, Callable[[], Iterable[tuple[str, float]]]]


def shown(url: str | URL) -> str:
    """A URL for messages, logs and metrics: without credentials or query string."""
    return str(URL(str(url)).with_user(None).with_query(None))


def upstream_name(spec: UpstreamSpec) -> str:
    """What pins, metrics and the admin routes call an upstream: its name, else its URL as shown."""
    return spec.name or shown(URL(spec.url.rstrip("/")))


class Change(NamedTuple):
    """What `Fleet.update` did, by upstream name."""

    added: list[str]
    removed: list[str]
    changed: list[str]


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
        "inflight",
        "healthy",
        "fresh",
        "failed_checks",
        "closed",
        "breaker",
        "meter",
        "tally",
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
        self.closed: str | None = None  # why its owner (the launcher) says it is not serving; see `Fleet.close`
        self.breaker = Breaker(self.url, failures=config.breaker.failures, cooldown=config.breaker.cooldown_s)
        self.meter = Pace(config.pinning.pace.window_s)
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

        self.urls = {
            "chat": url(base, "chat/completions"),
            "completions": url(base, "completions"),
            "responses": url(base, "responses"),
            "messages": url(base, "messages"),
            "count_tokens": url(base, "messages/count_tokens"),
            "models": url(base, "models"),
            "tokenize": url(root, "tokenize"),
            "health": url(root, "health"),
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
        """No request may go there now: its circuit breaker is open, or its owner closed it."""
        return self.closed is not None or self.breaker.blocked

    @property
    def pace(self) -> float | None:
        """Its recent seconds per generated token (`pinning.Pace`), None while not known."""
        return self.meter.value

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

    __slots__ = ("upstream", "reply", "pin", "started", "_held")

    def __init__(self, upstream: Upstream, reply: Reply, pin: str | None, started: float) -> None:
        self.upstream = upstream
        self.reply = reply
        self.pin = pin
        self.started = started  # time.monotonic() when it was sent
        self._held = True

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


class Fleet:
    """The upstreams of one gymproxy, the client all requests share, and the pinning rules."""

    client: Client  # opened by `open()` once a loop runs

    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.tally = Tally()  # requests in flight over every upstream (pass it to a new Upstream)
        self.upstreams = [Upstream(spec, config, self.tally) for spec in upstream_specs(config)]
        pinning = config.pinning
        secret = pinning.secret
        if secret is None:
            secret = secrets.token_hex(32)
            if len(self.upstreams) > 1:
                log.warning(
                    "no pin secret configured (pinning.secret or $%s): pins are signed with a random "
                    "key and do not carry over to other workers, replicas or restarts",
                    pinning.secret_env,
                )
        bound = pinning.load_bound
        self.pinner = Pinner(
            self.upstreams,
            Signer(secret.encode(), pinning.max_age),
            placement=pinning.placement,
            epsilon=bound.epsilon,
            slack=bound.slack,
            hysteresis=bound.hysteresis,
            pace_tolerance=pinning.pace.tolerance,
            moved_max=pinning.moved_keys,
            moved_ttl=pinning.moved_ttl_s,
            tally=self.tally,
        )
        self.retries: defaultdict[str, int] = defaultdict(int)  # re-sends, by reason
        self.health_checks: defaultdict[tuple[str, str], int] = defaultdict(int)  # (upstream, result) -> count
        self.drained: dict[str, Upstream] = {}  # drained on request: no new requests, still listed
        self.leaving: list[Upstream] = []  # removed: forgotten once their requests in flight are done
        self.added = 0  # upstreams added live
        self.removed = 0  # upstreams removed live
        self._tasks: set[asyncio.Task[None]] = set()
        self._opened = False

    def open(self) -> None:
        """Make the upstream client (it needs the running loop)."""
        timeouts, limits = self.config.timeouts, self.config.limits
        self.client = Client(
            limit=self.config.max_connections,
            keepalive=timeouts.keepalive,
            connect_timeout=timeouts.connect,
            read_timeout=timeouts.read,
            max_reply=limits.max_reply_size,
            max_error_reply=limits.max_error_reply_size,
        )
        self._opened = True

    def update(self, specs: Sequence[UpstreamSpec], *, drained: Collection[str] = ()) -> Change:
        """Make the fleet `specs`, matched by name (`upstream_name`); the ones named in `drained` are
        kept but take no new requests.

        A new upstream takes sessions once its first health check passes (checked at once). A
        removed or drained one takes no new requests (pins naming it re-pin; a keyed session's
        rendezvous order skips it) while its requests in flight finish; a removed one is then
        forgotten. A changed URL, key or weight is applied in place, so its pins stay.
        """
        wanted = {upstream_name(spec): spec for spec in specs}
        known = {u.name: u for u in self.upstreams} | self.drained
        change = Change([], [], [])
        active: list[Upstream] = []
        before, self.drained = self.drained, {}
        for name, spec in wanted.items():
            upstream = known.get(name)
            if upstream is None:
                upstream = Upstream(spec, self.config, self.tally)
                upstream.healthy, upstream.fresh = False, True
                change.added.append(name)
                log.info("upstream %s added: it takes sessions once its /health answers 200", upstream.url)
                self._spawn(self._check(upstream))
            elif upstream.spec != spec:
                upstream.configure(spec, self.config)
                change.changed.append(name)
                log.info("upstream %s changed in place (url, key or weight)", upstream.url)
            if name in drained:
                if name not in before:
                    log.info(
                        "upstream %s draining: %d requests in flight finish there", upstream.url, upstream.inflight
                    )
                self.drained[name] = upstream
            else:
                active.append(upstream)
        for name, upstream in known.items():
            if name not in wanted:
                change.removed.append(name)
                self.leaving.append(upstream)
                log.info("upstream %s removed: %d requests in flight finish there", upstream.url, upstream.inflight)
                self._spawn(self._forget(upstream))
        self.added += len(change.added)
        self.removed += len(change.removed)
        self.upstreams = active
        self.pinner.set_upstreams(active)
        if not active and (change.removed or self.drained):
            log.warning("the fleet has no upstream left: requests get 503 until one is added")
        return change

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        if not self._opened:  # not serving yet: the first round of health checks will look
            work.close()
            return
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forget(self, upstream: Upstream) -> None:
        while upstream.inflight:
            await asyncio.sleep(DRAIN_POLL_S)
        if upstream in self.leaving:
            self.leaving.remove(upstream)
        others = [u for u in self.known() if u is not upstream]
        if not any(self.client.same_host(u.urls["health"], upstream.urls["health"]) for u in others):
            self.client.close_idle(upstream.urls["health"])
        log.info("upstream %s drained and forgotten", upstream.url)

    def stop(self) -> None:
        """Cancel the fleet's own tasks (first health checks, drains): the app is closing."""
        for task in self._tasks:
            task.cancel()

    async def send(
        self,
        route: str,
        data: bytes | None = None,
        *,
        method: str = "POST",
        cookie: str | None = None,
        key: str | None = None,
        sid: str | None = None,
        session_id: str | None = None,
        request_id: str | None = None,
        query: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Sent:
        """Send to the session's upstream (by pin `cookie`, else session `key`, else placement) and read
        the reply's head, sending again what `Attempts` says may go again, where it says.

        Re-sent (within `retries`): a refused connection and vLLM's "busy" and "paused" 503s; and at
        most once, a request dropped before any reply byte: a pooled connection closed (to the same
        upstream, new connection), or a drop by an upstream found gone (to the next). Never re-sent:
        a drop by an upstream still up (502, and no breaker failure: it may be this request that it
        cannot take), anything that got a status line otherwise, and anything after this returns
        (the caller may have sent bytes to its client by then).

        `query` (already encoded) is added to the route's URL; `headers` go along, below the
        upstream's own (its key, `default_headers`), which they never replace. `session_id` goes as
        `X-Session-ID`; `sid` is the id a new pin carries (see `Pinner.pick`)."""
        extra = (query, headers, session_id)
        single = len(self.upstreams) == 1  # nothing to choose, so nothing to pin, and nowhere to retry
        loop = asyncio.get_running_loop()
        tries = Attempts(self.config.retries, single, loop.time())
        upstream: Upstream
        pin: str | None
        while True:
            if single:
                upstream, pin = self.upstreams[0], None
            elif not tries.here:
                chosen = self.pinner.pick(cookie, key, sid=sid, exclude=tuple(tries.tried), reason=tries.reason)
                upstream, pin = chosen.upstream, chosen.cookie
                upstream.breaker.admit()
            tries.here = False
            sent: Sent | None = None
            started = time.monotonic()
            try:
                reply = await self._attempt(upstream, route, data, method, request_id, *extra, fresh=tries.fresh)
            except UpstreamError as exc:
                kind = failure_kind(exc.__cause__)
                if kind is None:
                    upstream.breaker.abandon()
                    raise
                if kind in DROPPED:
                    if tries.again_here(kind):
                        self.retries[kind] += 1
                        continue
                    if single:
                        raise  # nowhere else to send it
                    if not await self._gone(upstream):
                        upstream.breaker.abandon()  # it answers: not failing, but refusing this input
                        raise UpstreamError(f"{exc}; not re-sent: {STILL_UP}") from exc.__cause__
                    if tries.resent:
                        tries.charge(upstream)
                        raise UpstreamError(f"{exc}; not re-sent: {RESENT}") from exc.__cause__
                error: GymproxyError = exc
            except Saturated:
                upstream.breaker.abandon()
                if not tries.full(upstream, len(self.upstreams)):
                    raise  # every upstream is at its cap
                self.retries["full"] += 1
                continue
            except BaseException:
                upstream.breaker.abandon()
                raise
            else:
                sent = Sent(upstream, reply, pin, started)
                try:
                    kind = await busy_kind(reply)
                except BaseException:
                    sent.close()
                    upstream.breaker.abandon()
                    raise
                if kind is None:
                    upstream.breaker.succeeded()
                    return sent
                error = UpstreamStatus(reply.status, f"upstream {upstream.url} answered {reply.status} ({kind})")
            wait = tries.failed(upstream, kind, len(self.upstreams), None if sent is None else sent.reply, loop.time())
            if wait is None:
                if sent is not None:
                    return sent  # vLLM's own 503 (and its Retry-After) goes to the client
                if not single and failure_kind(error.__cause__) in ("refused", "connect_timeout"):
                    names = ", ".join(dict.fromkeys(u.url for u in tries.failures))
                    raise NoUpstream(f"no upstream is reachable: {names} all refused the connection") from error
                raise error
            if sent is not None:
                await sent.reply.read()  # buffered: the connection goes back to the pool
                sent.release()
            self.retries[kind] += 1
            if wait > 0:
                await asyncio.sleep(wait)

    async def _gone(self, upstream: Upstream) -> bool:
        """Whether `upstream`, which just dropped a request, is gone (its process died): marked down,
        or its /health, asked on a new connection, gets no answer (refused, reset, or none within
        `health.timeout`). Any answer at all means the process is there and chose to drop it.

        A connect alone would not do: a dying process's connections may be reset a moment before
        its listener closes, and a connect in that moment still succeeds."""
        if not upstream.healthy:
            return True
        health = upstream.urls["health"]
        try:
            reply = await asyncio.wait_for(
                self.client.request("GET", health, upstream.headers, fresh=True), self.config.health.timeout
            )
        except Aborted:
            return True  # shutting down: the next send says so
        except CannotConnect as exc:
            self.mark(upstream, False, f"it dropped a request, then refused a connection: {describe(exc)}")
            return True
        except (ClientError, asyncio.TimeoutError) as exc:
            log.warning(
                "upstream %s dropped a request, then %s did not answer: %s", upstream.url, shown(health), describe(exc)
            )
            return True
        reply.close()
        return False

    async def call(
        self,
        upstream: Upstream,
        route: str,
        data: bytes,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> tuple[int, bytes]:
        """A follow-up call to the upstream a request already went to (e.g. /tokenize): status and body."""
        reply = await self._attempt(upstream, route, data, "POST", request_id, session_id=session_id)
        sent = Sent(upstream, reply, None, 0.0)
        try:
            return reply.status, await read(reply)
        except BaseException:
            sent.close()
            raise
        finally:
            sent.release()

    async def _attempt(
        self,
        upstream: Upstream,
        route: str,
        data: bytes | None,
        method: str,
        request_id: str | None,
        query: str | None = None,
        extra: Mapping[str, str] | None = None,
        session_id: str | None = None,
        *,
        fresh: bool = False,
    ) -> Reply:
        """One request holding an in-flight slot of `upstream` (given back if it fails); failures
        are counted and mapped to 502/504 naming the URL; a closed upstream is a 503, and nothing is sent."""
        if upstream.closed is not None:
            raise NoUpstream(f"upstream {upstream.url} is not serving: {upstream.closed}")
        url = upstream.urls[route]
        if query:
            url = URL(f"{url}{'&' if url.raw_query_string else '?'}{query}", encoded=True)
        headers = upstream.json_headers if data is not None else upstream.headers
        if extra:
            names = upstream.header_names
            if session_id is not None:
                names = names | {"x-session-id"}
            headers = {**{k: v for k, v in extra.items() if k.lower() not in names}, **headers}
        if request_id is not None:
            if session_id is not None:
                # vLLM attaches X-Session-ID to its KV events; a client's own is replaced by the session's.
                headers = {**headers, "X-Request-Id": request_id, "X-Session-ID": session_id}
            else:
                headers = {**headers, "X-Request-Id": request_id}
        elif session_id is not None:
            headers = {**headers, "X-Session-ID": session_id}
        await upstream.acquire()
        try:
            reply = await self.client.request(method, url, headers, data, fresh=fresh)
        except BaseException as exc:
            upstream.release()
            if not isinstance(exc, (ClientError, asyncio.TimeoutError)):
                raise
            self._count(upstream, 0)
            raise self._failure(upstream, url, exc) from exc
        self._count(upstream, reply.status)
        if not upstream.healthy:
            self.mark(upstream, True)  # it answered: whatever the last check said, it is up
            self._joined(upstream)
        return reply

    def _failure(self, upstream: Upstream, url: URL, exc: BaseException) -> GymproxyError:
        if isinstance(exc, Aborted):  # the client was stopped (shutdown): the reason is the message
            return Unavailable(str(exc))
        if isinstance(exc, CannotConnect):
            self.mark(upstream, False, f"cannot connect: {describe(exc)}")
            return NotConnected(f"cannot reach upstream {shown(url)}: {describe(exc)}")
        if isinstance(exc, asyncio.TimeoutError):
            return UpstreamTimeout(f"upstream {shown(url)} did not answer in time ({describe(exc)})")
        return UpstreamError(f"upstream {shown(url)} failed: {describe(exc)}")

    def _count(self, upstream: Upstream, status: int) -> None:
        self.metrics.upstream_requests[(upstream.name, status)] += 1

    def mark(self, upstream: Upstream, healthy: bool, why: str = "") -> None:
        """What a health check or an answer says of it; a closed upstream stays down whatever answers."""
        if healthy and upstream.closed is not None:
            return
        if upstream.healthy != healthy:
            upstream.healthy = healthy
            if healthy and upstream.fresh:
                log.info("upstream %s is healthy: it takes sessions now", upstream.url)
            elif healthy:
                log.info("upstream %s is healthy again", upstream.url)
            else:
                log.warning("upstream %s marked down: %s", upstream.url, why)

    async def check_health(self) -> None:
        """One round of `/health` checks on every upstream; no failure of one check escapes it."""
        await asyncio.gather(*(self._check(u) for u in self.upstreams))

    async def _check(self, upstream: Upstream) -> None:
        if upstream.closed is not None:  # its port may be anyone's now: nothing goes there (nor its key)
            self.health_checks[(upstream.name, "closed")] += 1
            return
        try:
            status, _ = await asyncio.wait_for(self._get(upstream, "health"), self.config.health.timeout)
            ok, why, result = status == 200, f"/health answered {status}", "ok" if status == 200 else "failed"
        except (ClientError, asyncio.TimeoutError) as exc:
            ok, why, result = False, f"/health failed: {describe(exc)}", "failed"
        except Exception as exc:  # a bug: logged and counted, and the next round runs as usual
            log.exception("health check of upstream %s failed unexpectedly", upstream.url)
            ok, why, result = False, f"/health check raised {describe(exc)}", "error"
        self.health_checks[(upstream.name, result)] += 1
        # One slow answer from a busy server is no outage: it takes HEALTH_FAILURES in a row.
        upstream.failed_checks = 0 if ok else upstream.failed_checks + 1
        if ok or upstream.failed_checks >= HEALTH_FAILURES:
            self.mark(upstream, ok, why)
        if ok:
            self._joined(upstream)

    def find(self, name: str) -> Upstream | None:
        """The upstream called `name` (serving, drained or on its way out), if any."""
        return next((u for u in self.known() if u.name == name), None)

    def close(self, upstream: Upstream, why: str) -> None:
        """Its owner says it is not serving (a launched replica that exited, or is not ready): it is
        down, nothing is sent to it (requests, health checks, the startup probe), and only `ready`
        opens it again, so a stranger that binds its port meanwhile gets nothing."""
        upstream.closed = why
        self.mark(upstream, False, why)

    def hold(self, upstream: Upstream, why: str) -> None:
        """Not ready yet (a launched replica loading its model): closed, and it takes no sessions
        until it is `ready`, then joins as an upstream added live."""
        upstream.closed, upstream.healthy, upstream.fresh = why, False, True

    def ready(self, upstream: Upstream) -> None:
        """Its owner says it serves (a launched replica came up, and proved the port is its own):
        open and healthy at once, and if it was held, it joins (`Pinner.joined`), so it gets its
        share of the sessions that started without it. A restarted one takes new sessions only."""
        upstream.closed = None
        upstream.failed_checks = 0
        self.mark(upstream, True)
        self._joined(upstream)

    def _joined(self, upstream: Upstream) -> None:
        """It is healthy: if it was added live, it takes sessions from now on."""
        if upstream.fresh:
            upstream.fresh = False
            self.pinner.joined(upstream.name)

    async def _get(self, upstream: Upstream, route: str) -> tuple[int, bytes]:
        """A GET of the fleet's own (health checks, the startup probe): status and body."""
        async with await self.client.request("GET", upstream.urls[route], upstream.headers) as reply:
            return reply.status, await reply.read()

    async def watch_health(self) -> None:
        """Check every `health.interval` seconds, for as long as the app runs."""
        while True:
            await asyncio.sleep(self.config.health.interval)
            await self.check_health()

    async def probe(self) -> None:
        """Log each upstream and whether its /v1/models answered, naming the URL tried."""
        for upstream in self.upstreams:
            if upstream.closed is not None:
                continue  # not serving yet: its owner reports it
            url = shown(upstream.urls["models"])
            try:
                status, body = await asyncio.wait_for(self._get(upstream, "models"), PROBE_TIMEOUT)
            except (ClientError, asyncio.TimeoutError) as exc:
                log.warning("upstream %s: %s is NOT answering: %s", upstream.url, url, describe(exc))
                continue
            except Exception as exc:  # a bug: logged, and the other upstreams are still probed
                log.exception("upstream %s: %s is NOT answering: the probe raised %s", upstream.url, url, describe(exc))
                continue
            if status == 200:
                log.info("upstream %s: %s answered 200", upstream.url, url)
            else:
                log.warning(
                    "upstream %s: %s answered %d: %s (is base_url right? it should end in /v1)",
                    upstream.url,
                    url,
                    status,
                    body[:200].decode(errors="replace"),
                )

    def known(self) -> list[Upstream]:
        """Every upstream still held: serving, drained, and removed ones with requests in flight."""
        return [*self.upstreams, *self.drained.values(), *self.leaving]

    def states(self) -> list[dict[str, Any]]:
        """Every upstream known, serving or on its way out: name, url, state, health, weight, in flight.

        state: `starting` (added, first health check not passed), `healthy`, `down`, `draining`
        (no new requests), `drained` (draining, none left in flight), `removing` (forgotten once
        its requests in flight end)."""

        def state(u: Upstream) -> str:
            if u.name in self.drained and self.drained[u.name] is u:
                return "draining" if u.inflight else "drained"
            if u in self.leaving:
                return "removing"
            return "starting" if u.fresh else "healthy" if u.healthy else "down"

        return [
            {
                "name": u.name,
                "url": u.url,
                "state": state(u),
                "healthy": u.healthy and u in self.upstreams,
                "weight": u.weight,
                "inflight": u.inflight,
                "breaker": BREAKER[u.breaker.state],
            }
            for u in self.known()
        ]

    def gauges(self) -> Iterable[Gauge]:
        yield (
            "gymproxy_upstream_inflight",
            "gauge",
            "Requests in flight, by upstream.",
            lambda: [(label(upstream=u.name), u.inflight) for u in self.known()],
        )
        yield (
            "gymproxy_upstream_pace_seconds",
            "gauge",
            "Recent seconds per generated token, by upstream (replies with usage; absent while not known).",
            lambda: [(label(upstream=u.name), pace) for u in self.upstreams if (pace := u.pace) is not None],
        )
        yield (
            "gymproxy_upstream_healthy",
            "gauge",
            "1 while the upstream is healthy.",
            lambda: [(label(upstream=u.name), int(u.healthy)) for u in self.upstreams],
        )
        yield (
            "gymproxy_health_checks_total",
            "counter",
            "Health checks, by upstream and result (ok, failed, error: the check itself broke; "
            "closed: not sent, its launcher says it is down).",
            lambda: [
                (label(upstream=name, result=result), n) for (name, result), n in sorted(self.health_checks.items())
            ],
        )
        yield (
            "gymproxy_upstreams_added_total",
            "counter",
            "Upstreams added while running (SIGHUP, admin routes, DNS discovery).",
            lambda: [("", self.added)],
        )
        yield (
            "gymproxy_upstreams_removed_total",
            "counter",
            "Upstreams removed while running (each drained first).",
            lambda: [("", self.removed)],
        )
        yield (
            "gymproxy_pins_created_total",
            "counter",
            "Sessions pinned for the first time.",
            lambda: [("", self.pinner.created)],
        )
        yield (
            "gymproxy_upstream_breaker",
            "gauge",
            "Circuit breaker state, by upstream: 0 closed, 1 open, 2 half-open (its probe is out).",
            lambda: [(label(upstream=u.name), u.breaker.state) for u in self.upstreams],
        )
        yield (
            "gymproxy_upstream_breaker_opened_total",
            "counter",
            "Times the upstream's circuit breaker opened.",
            lambda: [(label(upstream=u.name), u.breaker.opened) for u in self.upstreams],
        )
        yield (
            "gymproxy_retries_total",
            "counter",
            "Requests re-sent, by reason (refused, connect_timeout, reset, closed, stale, busy, paused, full).",
            lambda: [(label(reason=reason), n) for reason, n in sorted(self.retries.items())],
        )
        yield (
            "gymproxy_pin_moves_total",
            "counter",
            "Sessions moved off their upstream, by reason (down, breaker, busy, overloaded, slow, removed, joined).",
            lambda: [(label(reason=reason), n) for reason, n in self.pinner.moves.items()],
        )
        yield (
            "gymproxy_pins_repinned_total",
            "counter",
            "Pins replaced (invalid cookie or dead upstream).",
            lambda: [("", self.pinner.repinned)],
        )


DROPPED = frozenset({"stale", "closed", "reset"})  # `failure_kind`s of a request an upstream may have read
STILL_UP = "the upstream still answers its /health, so it may be this request that it cannot take"
RESENT = "it was already sent to another upstream after a dropped connection"


class Attempts:
    """The retry policy of one client request (`Fleet.send`): after each failure, whether it goes
    again, where (the same upstream or the session's next), and after how long.

    - What no upstream began goes to the next upstream: a refused connection or connect timeout,
      vLLM's busy and paused 503s (the round starts again once every upstream was busy), an
      upstream at its cap; within `retries.attempts` sends and `retries.deadline_s`, backing off
      when the same kind of failure repeats.
    - What an upstream dropped after it was written (`DROPPED`: closed or reset before a reply
      byte) may have been read, and may be what made it drop. A pooled connection closed so goes
      once to the same upstream on a new connection (the upstream's idle close may have crossed
      it); a drop goes to the next upstream once per request at most, and only when the one that
      dropped it is gone (`Fleet._gone`: an upstream killed mid-request drops its pooled connections
      and resets the new one). An upstream still up chose to drop that input (a query of death): it
      is not handed one more engine to kill, and, as for its 500s, its breaker is not fed. So a
      request reaches two upstreams at most after drops (the first one twice at most).
    - A request feeds one breaker failure at most, its first: however many upstreams it tries,
      one request can never open more than one breaker.
    """

    __slots__ = (
        "budget",
        "single",
        "deadline",
        "tried",
        "failures",
        "reason",
        "sends",
        "streak",
        "last_kind",
        "here",
        "fresh",
        "retried_here",
        "resent",
        "charged",
    )

    def __init__(self, budget: Retries, single: bool, now: float) -> None:
        self.budget = budget
        self.single = single  # one upstream: nowhere else to go, and no breaker
        self.deadline = now + budget.deadline_s  # loop time after which no send starts
        self.tried: list[Upstream] = []  # excluded from the next pick
        self.failures: list[Upstream] = []  # every upstream that failed it, for the message
        self.reason = "down"  # why the session moves, for `Pinner.pick`
        self.sends = 0  # failed sends counted against `retries.attempts`
        self.streak = 0  # failures of `last_kind` in a row
        self.last_kind = ""
        self.here = False  # the next send goes to the same upstream again
        self.fresh = False  # the next sends go on new connections
        self.retried_here = False  # its one send to the same upstream after a stale close is spent
        self.resent = False  # its one send to another upstream after a drop is spent
        self.charged = False  # its one breaker failure is spent

    def again_here(self, kind: str) -> bool:
        """A pooled connection closed with no reply (`stale`): once, to the same upstream on a new
        connection. Not counted against the budget."""
        if kind != "stale" or self.retried_here or self.resent:
            return False
        self.here = self.fresh = self.retried_here = True
        return True

    def full(self, upstream: Upstream, fleet: int) -> bool:
        """`upstream` is at its cap (`limits.when_full: reject`): it saw nothing, so the next is asked
        at once, with no backoff, no breaker failure and nothing off the budget; False when every
        one of the `fleet` upstreams is full."""
        if self.single or len(self.tried) + 1 >= fleet:
            return False
        self.tried.append(upstream)
        self.reason = "busy"
        return True

    def charge(self, upstream: Upstream) -> None:
        """The verdict on `upstream`'s breaker for a failure: the request's first counts, any later
        one leaves it as it was (a half-open probe is let go, `Breaker.abandon`)."""
        if self.single:
            return
        if self.charged:
            upstream.breaker.abandon()
        else:
            self.charged = True
            upstream.breaker.failed()

    def failed(self, upstream: Upstream, kind: str, fleet: int, reply: Reply | None, now: float) -> float | None:
        """After a failure that may go again (`kind` of `failure_kind` or `busy_kind`; `reply`: the
        503 when it is one): the seconds to wait before the next send, or None: the client hears it."""
        self.charge(upstream)
        self.failures.append(upstream)
        if upstream not in self.tried:
            self.tried.append(upstream)
        self.sends += 1
        if kind in DROPPED:
            self.resent = self.fresh = True
        connection = reply is None
        budget = self.budget
        done = self.single or self.sends >= budget.attempts
        if len(self.tried) >= fleet:
            if connection:
                done = True  # every upstream failed to take it: nothing left to try
            else:
                self.tried.clear()  # every one is busy: round again, after the backoff
        self.streak = self.streak + 1 if kind == self.last_kind else 1
        self.last_kind = kind
        wait = 0.0
        if self.streak > 1 and not done:  # the same failure again: back off (full jitter)
            wait = random.uniform(0.0, min(budget.backoff_max_s, budget.backoff_s * 2 ** (self.streak - 2)))
        if reply is not None:
            wait = max(wait, retry_after(reply.headers))
        if done or now + wait > self.deadline:
            return None
        self.reason = "down" if connection else "busy"
        return wait


def failure_kind(exc: BaseException | None) -> str | None:
    """How a request failed before any reply byte, or None (no retry). `refused` and
    `connect_timeout`: it was never sent. `stale`, `closed` and `reset` (`DROPPED`): it was
    written, and the connection ended; `Attempts` says what may go again."""
    if isinstance(exc, NoReply):
        # A pooled connection closed (a FIN, no reply): the upstream's idle close may have crossed
        # our request on the wire. A reset, or any close of a fresh connection, came after the
        # upstream had the request.
        if exc.reset:
            return "reset"
        return "stale" if exc.reused else "closed"
    if isinstance(exc, ConnectTimeout):
        return "connect_timeout"
    if isinstance(exc, CannotConnect):
        return "refused"
    return None


BUSY = b"Please try again later or on a different instance"  # vLLM's admission 503s end so


async def busy_kind(reply: Reply) -> str | None:
    """`busy` for vLLM's admission 503, `paused` for its paused-for-a-weight-update 503, else None.

    The body of a 503 is read and kept, so the caller still reads it when the reply is handed on
    (one over `limits.max_error_reply_size` is no busy 503: its reader gets the `ReplyTooLarge`)."""
    if reply.status != 503:
        return None
    try:
        body = await reply.buffer()
    except (ClientError, asyncio.TimeoutError):
        return None  # the reply broke: its reader sees that, and nothing is re-sent
    if BUSY in body:
        return "busy"
    if b"paused" in body.lower():
        return "paused"
    return None


def retry_after(headers: Mapping[str, str]) -> float:
    """`Retry-After` in seconds (a number or an HTTP date); 0 when absent or unreadable."""
    value = headers.get("retry-after")
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    return max(0.0, when.timestamp() - time.time())


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
