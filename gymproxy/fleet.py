"""The upstream vLLM fleet: which upstream serves a request, sending it there with failover, health.

The fleet never sees the client's request: callers pass the pin cookie's value, the session key and
the request id, and get back what was sent where (`Sent`), including the new pin to set. Every
failure to talk to an upstream becomes an `UpstreamError` (502) or `UpstreamTimeout` (504) whose
message names the URL that failed (never its credentials), so a wrong `base_url` is obvious at once.
A request is retried on another upstream only when the connection could not be opened, so the
request never reached vLLM and no generation is ever run twice.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from yarl import URL

from .config import Config, UpstreamSpec, upstream_specs
from .errors import (
    GymproxyError,
    NotConnected,
    NoUpstream,
    Saturated,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
    describe,
)
from .http1 import Aborted, CannotConnect, Client, ClientError, Reply
from .metrics import Metrics, label
from .pinning import Pinner, Signer

log = logging.getLogger("gymproxy")

JSON_HEADERS = {"Content-Type": "application/json"}
HEALTH_FAILURES = 2  # consecutive failed checks before an upstream is marked down
PROBE_TIMEOUT = 10.0

Gauge = tuple[str, str, str, Callable[[], Iterable[tuple[str, float]]]]


def shown(url: str | URL) -> str:
    """A URL for messages, logs and metrics: without credentials or query string."""
    return str(URL(str(url)).with_user(None).with_query(None))


class Upstream:
    """One vLLM server: its prebuilt URLs and headers, health, and in-flight count."""

    __slots__ = (
        "name",
        "url",
        "weight",
        "headers",
        "json_headers",
        "header_names",
        "urls",
        "inflight",
        "healthy",
        "failed_checks",
        "_slots",
        "_reject",
    )

    def __init__(self, spec: UpstreamSpec, config: Config) -> None:
        base = URL(spec.url.rstrip("/"))
        self.url = shown(base)  # what every message, log line, metric and /health shows
        self.name = spec.name or self.url
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
        self.inflight = 0
        self.healthy = True
        self.failed_checks = 0  # consecutive failed health checks
        cap = config.limits.max_inflight_per_upstream
        self._slots = asyncio.Semaphore(cap) if cap else None
        self._reject = config.limits.when_full == "reject"

    async def acquire(self) -> None:
        """Take an in-flight slot; past `limits.max_inflight_per_upstream`, wait or refuse (503)."""
        if self._slots is not None:
            if self._reject and self._slots.locked():
                raise Saturated(f"upstream {self.url} has {self.inflight} requests in flight, its configured cap")
            await self._slots.acquire()
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        if self._slots is not None:
            self._slots.release()

    def __repr__(self) -> str:  # never shows the api key
        return f"Upstream({self.url!r})"


class Sent:
    """A request sent to an upstream: where it went, the reply, and the new pin (None: keep the client's).

    It holds one of the upstream's in-flight slots until `release` (connection back to the pool if
    the reply was read whole) or `close` (connection dropped: vLLM aborts the generation).
    """

    __slots__ = ("upstream", "reply", "pin", "_held")

    def __init__(self, upstream: Upstream, reply: Reply, pin: str | None) -> None:
        self.upstream = upstream
        self.reply = reply
        self.pin = pin
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
        self.upstreams = [Upstream(spec, config) for spec in upstream_specs(config)]
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
        self.pinner = Pinner(self.upstreams, Signer(secret.encode(), pinning.max_age), placement=pinning.placement)
        self.health_checks: defaultdict[tuple[str, str], int] = defaultdict(int)  # (upstream, result) -> count

    def open(self) -> None:
        """Make the upstream client (it needs the running loop)."""
        timeouts = self.config.timeouts
        self.client = Client(
            limit=self.config.max_connections,
            keepalive=timeouts.keepalive,
            connect_timeout=timeouts.connect,
            read_timeout=timeouts.read,
        )

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
        the reply's head; an upstream that refuses the connection is skipped for the next one.

        `query` (already encoded) is added to the route's URL; `headers` go along, below the
        upstream's own (its key, `default_headers`), which they never replace. `session_id` goes as
        `X-Session-ID`; `sid` is the id a new pin carries (see `Pinner.pick`)."""
        extra = (query, headers, session_id)
        if len(self.upstreams) == 1:  # nothing to choose, so nothing to pin
            upstream = self.upstreams[0]
            return Sent(upstream, await self._attempt(upstream, route, data, method, request_id, *extra), None)
        tried: list[Upstream] = []
        while True:
            pin = self.pinner.pick(cookie, key, sid=sid, exclude=tuple(tried))
            try:
                reply = await self._attempt(pin.upstream, route, data, method, request_id, *extra)
            except NotConnected:
                # Never connected, so vLLM never saw the request: safe to try another upstream.
                tried.append(pin.upstream)
                if len(tried) == len(self.upstreams):
                    raise NoUpstream(
                        f"no upstream is reachable: {', '.join(u.url for u in tried)} all refused the connection"
                    ) from None
                continue
            return Sent(pin.upstream, reply, pin.cookie)

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
        sent = Sent(upstream, reply, None)
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
    ) -> Reply:
        """One request holding an in-flight slot of `upstream` (given back if it fails); failures
        are counted and mapped to 502/504 naming the URL."""
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
            reply = await self.client.request(method, url, headers, data)
        except BaseException as exc:
            upstream.release()
            if not isinstance(exc, (ClientError, asyncio.TimeoutError)):
                raise
            self._count(upstream, 0)
            raise self._failure(upstream, url, exc) from exc
        self._count(upstream, reply.status)
        if not upstream.healthy:
            self.mark(upstream, True)  # it answered: whatever the last check said, it is up
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
        if upstream.healthy != healthy:
            upstream.healthy = healthy
            if healthy:
                log.info("upstream %s is healthy again", upstream.url)
            else:
                log.warning("upstream %s marked down: %s", upstream.url, why)

    async def check_health(self) -> None:
        """One round of `/health` checks on every upstream; no failure of one check escapes it."""
        await asyncio.gather(*(self._check(u) for u in self.upstreams))

    async def _check(self, upstream: Upstream) -> None:
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

    def states(self) -> list[dict[str, Any]]:
        return [{"name": u.name, "url": u.url, "healthy": u.healthy, "inflight": u.inflight} for u in self.upstreams]

    def gauges(self) -> Iterable[Gauge]:
        yield (
            "gymproxy_upstream_inflight",
            "gauge",
            "Requests in flight, by upstream.",
            lambda: [(label(upstream=u.name), u.inflight) for u in self.upstreams],
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
            "Health checks, by upstream and result (ok, failed, error: the check itself broke).",
            lambda: [
                (label(upstream=name, result=result), n) for (name, result), n in sorted(self.health_checks.items())
            ],
        )
        yield (
            "gymproxy_pins_created_total",
            "counter",
            "Sessions pinned for the first time.",
            lambda: [("", self.pinner.created)],
        )
        yield (
            "gymproxy_pins_repinned_total",
            "counter",
            "Pins replaced (invalid cookie or dead upstream).",
            lambda: [("", self.pinner.repinned)],
        )


async def read(reply: Reply) -> bytes:
    """The whole body, with read failures mapped to 502/504 naming the upstream (503 when aborted)."""
    try:
        return await reply.read()
    except Aborted as exc:  # its owner gave up (shutdown): the reason is the message
        raise Unavailable(str(exc)) from exc
    except asyncio.TimeoutError as exc:
        raise UpstreamTimeout(f"upstream {shown(reply.url)} stopped sending its reply ({describe(exc)})") from exc
    except ClientError as exc:
        raise UpstreamError(f"upstream {shown(reply.url)} broke off its reply: {describe(exc)}") from exc
