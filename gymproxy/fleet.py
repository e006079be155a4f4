"""The upstream vLLM fleet: which upstream serves a request, and sending it there.

The fleet never sees the client's request: callers pass the pin cookie's value, the session key and
the request id, and get back what was sent where (`Sent`), including the new pin to set. Every
failure to talk to an upstream becomes an `UpstreamError` (502) or `UpstreamTimeout` (504) whose
message names the URL that failed (never its credentials), so a wrong `base_url` is obvious at once.
What happens after a failed send (send again, move, hold, give up) is `retry.Attempts`' decision;
`Fleet.send` carries it out. While the fleet is paused for a weight update (`Holds`), requests wait
before they are sent; one that a paused engine refused waits for that engine (`Engines`).

An upstream gymproxy launched itself (a `launch.py` replica) is `closed` while its owner says it is
not serving (loading, restarting, given up): nothing is sent to its port then, not a request and not
a health check, because any local process may have bound that port meanwhile. Only its owner
(`Fleet.ready`) opens it again; health checks and answers mark an open one down and up as usual.
Its owner's notice comes some milliseconds after the replica dies, so the client also asks the
replica's `ownership.Owner` before and after opening any connection to its port (`Fleet.own`): one
whose process has exited, or whose server is another user's, is refused before a byte is sent, and
a request it dropped when it died goes to another upstream, not to its port again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from yarl import URL

from . import health
from .config import Config, UpstreamSpec, upstream_specs
from .errors import (
    GymproxyError,
    NotConnected,
    NotReady,
    NoUpstream,
    Saturated,
    Unavailable,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    describe,
)
from .http1 import Aborted, CannotConnect, Client, ClientError, Guard, Reply
from .metrics import Metrics, label
from .pause import Engines, Holds
from .pinning import Pinner, Signer
from .retry import (
    ABANDON,
    ANSWER,
    DROPPED,
    FAIL,
    GIVE_UP,
    HERE,
    HOLD,
    PROBE,
    Attempts,
    Decision,
    busy_kind,
    failure_kind,
    retry_after,
)
from .upstream import CLOSED, HALF_OPEN, OPEN, Sent, Tally, Upstream, read, shown, upstream_name

log = logging.getLogger("gymproxy")

GENERATING = frozenset({"chat", "completions", "responses", "messages"})  # routes held while the fleet is paused
HOP_HEADER = "X-Gymproxy-Hop"  # the gymproxies a request passed through (`proxy.hop_chain`)
HEALTH_FAILURES = 2  # consecutive failed checks before an upstream is marked down
DRAIN_POLL_S = 0.1  # how often a removed upstream's in-flight count is looked at until it is 0

BREAKER = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half-open"}
Gauge = tuple[str, str, str, Callable[[], Iterable[tuple[str, float]]]]


class Change(NamedTuple):
    """What `Fleet.update` did, by upstream name."""

    added: list[str]
    removed: list[str]
    changed: list[str]


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
        self.holds = Holds(config.hold, metrics.pauses)  # requests held while the fleet or an engine is paused
        self.engines = Engines(self.holds, self._is_paused)
        self.joining: Callable[[Upstream], None] | None = None  # told when an upstream turns healthy

    def own(self, upstream: Upstream, owner: Guard) -> None:
        """`owner` says who may be behind the upstream's port (a launched replica's `ownership.Owner`):
        every connection the fleet opens there, for any purpose, asks it first (`Client.guard`)."""
        upstream.owner = owner
        if self._opened:
            self.client.guard(upstream.root, owner)

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
        for upstream in self.known():
            if upstream.owner is not None:
                self.client.guard(upstream.root, upstream.owner)

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
                self._configure(upstream, spec)
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

    def _configure(self, upstream: Upstream, spec: UpstreamSpec) -> None:
        """A new URL, key or weight for a known upstream; its owner (if any) guards its new address."""
        if upstream.owner is not None and self._opened:
            self.client.guard(upstream.root, None)
            self.client.close_idle(upstream.root)
        upstream.configure(spec, self.config)
        if upstream.owner is not None and self._opened:
            self.client.guard(upstream.root, upstream.owner)

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
        """Cancel the fleet's own tasks (first health checks, drains, pause polls): the app is closing."""
        for task in self._tasks:
            task.cancel()
        self.engines.stop()

    def end_holds(self, why: str) -> None:
        """Shutting down: every request held (paused fleet, paused engine, weight version) gets a 503."""
        self.holds.end(why)
        self.engines.resume_all()
        for upstream in self.known():
            upstream.version_changed.set()

    async def _is_paused(self, upstream: Upstream) -> bool | None:
        return await health.is_paused(self.client, upstream, self.config.health.timeout)

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
        min_version: str | None = None,
        hops: str | None = None,
    ) -> Sent:
        """Send to the session's upstream (by pin `cookie`, else session `key`, else placement) and read
        the reply's head, doing after each failure what `Attempts` decides (see `retry.py`).

        Never re-sent: anything that got a status line other than vLLM's busy and paused 503s, and
        anything after this returns (the caller may have sent bytes to its client by then). While
        the fleet is paused, it waits (`Holds`) before it is sent; with `min_version`, until its
        upstream's weight version is at least that (`version_at_least`).

        `query` (already encoded) is added to the route's URL; `headers` go along, below the
        upstream's own (its key, `default_headers`), which they never replace. `session_id` goes as
        `X-Session-ID`; `sid` is the id a new pin carries (see `Pinner.pick`). `hops` replaces the
        upstream's own `X-Gymproxy-Hop` (this gymproxy's id) for a request that came through others."""
        if self.upstreams and all(u.closed is not None for u in self.upstreams):
            raise self._not_ready()
        extra = (query, headers, session_id, hops)
        loop = asyncio.get_running_loop()
        holds = self.holds
        single = len(self.upstreams) == 1  # nothing to choose, so nothing to pin, and nowhere to retry
        tries = Attempts(self.config.retries, single, loop.time(), self.config.hold.timeout_s)
        size = len(data) if data is not None else 0
        upstream: Upstream
        pin: str | None
        while True:
            if holds.paused and route in GENERATING:  # /v1/models and /tokenize are answered while paused
                await holds.wait(holds.gate, tries.hold_until, size, "the fleet is paused for a weight update")
            if single:
                upstream, pin = self.upstreams[0], None
            elif not tries.here:
                chosen = self.pinner.pick(cookie, key, sid=sid, exclude=tuple(tries.tried), reason=tries.reason)
                upstream, pin = chosen.upstream, chosen.cookie
                upstream.breaker.admit()
            if min_version is not None and not version_at_least(upstream.version, min_version):
                upstream.breaker.abandon()
                what = f"the engine {upstream.url} has weight version {upstream.version}, not {min_version} yet"
                await holds.wait(upstream.version_changed, tries.hold_until, size, what)
                tries.here = True
                continue
            sent: Sent | None = None
            started = time.monotonic()
            try:
                reply = await self._attempt(upstream, route, data, method, request_id, *extra, fresh=tries.fresh)
            except UpstreamError as exc:
                kind = failure_kind(exc.__cause__)
                if kind is None:
                    upstream.breaker.abandon()
                    raise
                error: GymproxyError = exc
                gone = self._exited(upstream) if kind in DROPPED else None
                decision = tries.decide(upstream, kind, fleet=len(self.upstreams), now=loop.time(), gone=gone)
                if decision.action == PROBE:
                    decision = tries.decide(
                        upstream, kind, fleet=len(self.upstreams), now=loop.time(), gone=await self._gone(upstream)
                    )
            except Saturated as exc:
                error, kind = exc, "full"
                decision = tries.decide(upstream, kind, fleet=len(self.upstreams), now=loop.time())
            except BaseException:
                upstream.breaker.abandon()
                raise
            else:
                sent = Sent(upstream, reply, pin, started)
                try:
                    busy = await busy_kind(reply)
                except BaseException:
                    sent.close()
                    upstream.breaker.abandon()
                    raise
                if busy is None:
                    upstream.breaker.succeeded()
                    return sent
                kind = busy
                error = UpstreamStatus(reply.status, f"upstream {upstream.url} answered {reply.status} ({kind})")
                wait = retry_after(reply.headers)
                decision = tries.decide(upstream, kind, fleet=len(self.upstreams), now=loop.time(), retry_after=wait)
            _apply(upstream, decision)
            action = decision.action
            if action == ANSWER and sent is not None:
                return sent  # vLLM's own 503 (and its Retry-After) goes to the client
            if action in (ANSWER, GIVE_UP):
                raise self._given_up(error, decision, tries)
            if sent is not None:
                await sent.reply.read()  # buffered: the connection goes back to the pool
                sent.release()
            self.retries[kind] += 1
            if action == HOLD:
                await self.engines.resumed(upstream, tries.hold_until, size)
            elif action != HERE and decision.wait > 0:
                await asyncio.sleep(decision.wait)

    def _not_ready(self) -> NotReady:
        """Nothing to send to: every upstream is closed by its owner (launched replicas loading or
        restarting). Answered at once, with Retry-After, naming each and why."""
        why = "; ".join(f"upstream {u.url} is not serving: {u.closed}" for u in self.upstreams)
        return NotReady(f"no upstream is ready yet ({why}); see /health, and retry in a while")

    def _given_up(self, error: GymproxyError, decision: Decision, tries: Attempts) -> GymproxyError:
        """The error the client hears when `decision` ends the request."""
        if decision.why:
            dropped = UpstreamError(f"{error}; not re-sent: {decision.why}")
            dropped.__cause__ = error.__cause__
            return dropped
        if not tries.single and failure_kind(error.__cause__) in ("refused", "connect_timeout"):
            names = ", ".join(dict.fromkeys(u.url for u in tries.failures))
            failure = NoUpstream(f"no upstream is reachable: {names} all refused the connection")
            failure.__cause__ = error
            return failure
        return error

    def _exited(self, upstream: Upstream) -> bool | None:
        """True when the upstream is a launched replica whose process has exited (it is marked
        down at once); None when that is not known (it may still be exiting: ask `_gone`)."""
        why = None if upstream.owner is None else upstream.owner.before()
        if why is None:
            return None
        self.mark(upstream, False, why)
        return True

    async def _gone(self, upstream: Upstream) -> bool:
        """Whether `upstream`, which just dropped a request, is gone (`health.gone`); marked down
        counts as gone."""
        if not upstream.healthy:
            return True
        gone, why = await health.gone(self.client, upstream, self.config.health.timeout)
        if why is not None:
            self.mark(upstream, False, why)
        return gone

    async def call(
        self,
        upstream: Upstream,
        route: str,
        data: bytes,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        hops: str | None = None,
    ) -> tuple[int, bytes]:
        """A follow-up call to the upstream a request already went to (e.g. /tokenize): status and body."""
        reply = await self._attempt(upstream, route, data, "POST", request_id, session_id=session_id, hops=hops)
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
        hops: str | None = None,
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
        if hops is not None:
            headers = {**headers, HOP_HEADER: hops}
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
        upstream.answered = True
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
            if healthy and self.joining is not None:
                self.joining(upstream)
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
        ok, why, result = await health.check(self.client, upstream, self.config.health.timeout)
        self.health_checks[(upstream.name, result)] += 1
        # One slow answer from a busy server is no outage: it takes HEALTH_FAILURES in a row. One
        # that never answered (a vLLM still loading its model) is down at its first failed check,
        # so /health does not call gymproxy ready before any upstream has answered.
        upstream.failed_checks = 0 if ok else upstream.failed_checks + 1
        if ok or upstream.failed_checks >= HEALTH_FAILURES or not upstream.answered:
            self.mark(upstream, ok, why)
        upstream.answered = upstream.answered or ok
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

    async def watch_health(self) -> None:
        """Check at once, then every `health.interval` seconds, for as long as the app runs."""
        while True:
            await self.check_health()
            await asyncio.sleep(self.config.health.interval)

    async def probe(self) -> None:
        """Log each upstream and whether its /v1/models answered, naming the URL tried."""
        await health.probe(self.client, self.upstreams)

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
            "gymproxy_upstream_breaker_state",
            "gauge",
            "The upstream's circuit breaker state: 1 on its state's series (closed, open, half-open), 0 on the others.",
            lambda: [
                (label(upstream=u.name, state=name), int(u.breaker.state == state))
                for u in self.upstreams
                for state, name in BREAKER.items()
            ],
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
            "Requests re-sent, by reason (refused, connect_timeout, crowded: a connect timeout while the upstream took "
            "others, reset, closed, stale, busy, full; paused: "
            "held for a paused engine and sent there again; abort: a whole reply a pause cut, sent again).",
            lambda: [(label(reason=reason), n) for reason, n in sorted(self.retries.items())],
        )
        yield (
            "gymproxy_pin_moves_total",
            "counter",
            "Sessions moved off their upstream, by reason (down, breaker, busy, overloaded, slow, removed, joined).",
            lambda: [(label(reason=reason), n) for reason, n in self.pinner.moves.items()],
        )
        holds = self.holds
        yield (
            "gymproxy_held_requests",
            "gauge",
            "Requests held now: the fleet is paused, their engine is, or they wait for a weight version.",
            lambda: [("", holds.count)],
        )
        yield (
            "gymproxy_held_total",
            "counter",
            "Requests held, by what became of the hold: held (every one), released (by /fleet/resume), "
            "expired (past hold.timeout_s, 503), refused (past hold.max_requests or hold.max_bytes, 503).",
            lambda: [
                (label(outcome="held"), holds.held),
                (label(outcome="released"), holds.released),
                (label(outcome="expired"), holds.expired),
                (label(outcome="refused"), holds.refused),
            ],
        )
        yield (
            "gymproxy_fleet_paused",
            "gauge",
            "1 while the fleet is paused by /fleet/pause.",
            lambda: [("", int(holds.paused))],
        )
        yield (
            "gymproxy_upstream_stale",
            "gauge",
            "1 while the upstream's weight version is not the fleet's (it takes no requests).",
            lambda: [(label(upstream=u.name), int(u.stale)) for u in self.upstreams],
        )
        yield (
            "gymproxy_pins_repinned_total",
            "counter",
            "Pins replaced (invalid cookie or dead upstream).",
            lambda: [("", self.pinner.repinned)],
        )


def _apply(upstream: Upstream, decision: Decision) -> None:
    """The decision's verdict on the upstream's circuit breaker."""
    if decision.breaker == FAIL:
        upstream.breaker.failed()
    elif decision.breaker == ABANDON:
        upstream.breaker.abandon()


def version_at_least(version: str | None, least: str) -> bool:
    """Whether weight `version` is at least `least`: as numbers when both are integers (training
    steps), else only when they are equal (vLLM's versions are strings, with no order of their own)."""
    if version is None:
        return False
    if version == least:
        return True
    try:
        return int(version) >= int(least)
    except ValueError:
        return False
