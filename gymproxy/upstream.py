"""The upstream vLLM fleet: one shared HTTP client (`http1.Client`), pinning, health, and failover.

Every failure to talk to an upstream becomes an `UpstreamError` (502) or `UpstreamTimeout` (504)
whose message names the URL that failed, so a wrong `base_url` is obvious at once. A request is
retried on another upstream only when the connection could not be opened, so the request never
reached vLLM and no generation is ever run twice.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Iterable
from typing import Any

from aiohttp import web
from yarl import URL

from .config import Config, UpstreamSpec, upstream_specs
from .errors import GymproxyError, NoUpstream, UpstreamError, UpstreamTimeout
from .http1 import CannotConnect, Client, ClientError, Reply
from .metrics import Metrics
from .pinning import Pinner, Signer

log = logging.getLogger("gymproxy")

JSON_HEADERS = {"Content-Type": "application/json"}
HEALTH_FAILURES = 2  # consecutive failed checks before an upstream is marked down
# Per-request storage: typed keys where aiohttp has them (3.14+), plain strings before that.
_RequestKey: Any = getattr(web, "RequestKey", None)
PIN: Any = _RequestKey("gymproxy.pin", tuple) if _RequestKey else "gymproxy.pin"  # (cookie name, value, max age)
TRACE: Any = _RequestKey("gymproxy.trace", tuple) if _RequestKey else "gymproxy.trace"  # (metrics, route, start)
REQUEST_ID: Any = _RequestKey("gymproxy.request_id", str) if _RequestKey else "gymproxy.request_id"


class Saturated(GymproxyError):
    """The upstream is at its configured concurrency cap and `when_full` is `reject` (503)."""

    status = 503
    type = "upstream_error"


class NotConnected(UpstreamError):
    """The connection to the upstream could not be opened: the request was never sent."""


class Upstream:
    """One vLLM server: its prebuilt URLs and headers, health, and in-flight count."""

    __slots__ = (
        "name",
        "base_url",
        "weight",
        "headers",
        "json_headers",
        "urls",
        "inflight",
        "healthy",
        "failed_checks",
        "_slots",
        "_reject",
    )

    def __init__(self, spec: UpstreamSpec, config: Config) -> None:
        self.name = spec.name or spec.url
        self.base_url = spec.url.rstrip("/")
        self.weight = spec.weight
        headers = dict(config.default_headers)
        api_key = spec.api_key or config.api_key
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.headers = headers
        self.json_headers = {**headers, **JSON_HEADERS}
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        query = dict(config.default_query)

        def url(base: str, path: str) -> URL:
            return URL(f"{base}/{path}").with_query(query) if query else URL(f"{base}/{path}")

        self.urls = {
            "chat": url(self.base_url, "chat/completions"),
            "completions": url(self.base_url, "completions"),
            "responses": url(self.base_url, "responses"),
            "models": url(self.base_url, "models"),
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
                raise Saturated(f"upstream {self.base_url} has {self.inflight} requests in flight, its configured cap")
            await self._slots.acquire()
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        if self._slots is not None:
            self._slots.release()

    def __repr__(self) -> str:  # never shows the api key
        return f"Upstream({self.base_url!r})"


class UpstreamPool:
    """The upstreams of one gymproxy, the client all requests share, and the pinning rules."""

    client: Client  # opened by Proxy.start() once a loop runs

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
        self.cookie_name = pinning.cookie_name
        self.session_header = pinning.session_header

    def request(
        self,
        request: web.Request,
        route: str,
        data: bytes | None = None,
        *,
        method: str = "POST",
        key: str | None = None,
    ) -> Exchange:
        """`async with pool.request(...) as (upstream, response)`: send to the request's pinned
        upstream; the upstream response is closed on exit if unread, and its slot given back."""
        return Exchange(self._send(request, route, data, method, key))

    async def call(
        self,
        request: web.Request,
        route: str,
        data: bytes | None = None,
        *,
        method: str = "POST",
        key: str | None = None,
    ) -> tuple[Upstream, int, bytes]:
        """Send a request and read the whole reply: (upstream, status, body); a 200 must be JSON."""
        upstream, response = await self._send(request, route, data, method, key)
        try:
            body = await read(response)
            if response.status == 200 and response.content_type != "application/json":
                raise UpstreamError(
                    f"the upstream {_show(response.url)} answered 200 with {response.content_type or 'no content type'}"
                    ", not JSON"
                )
            return upstream, response.status, body
        except BaseException:
            response.close()
            raise
        finally:
            response.release()
            upstream.release()

    async def call_upstream(
        self, request: web.Request, upstream: Upstream, route: str, data: bytes
    ) -> tuple[int, bytes]:
        """A follow-up call to the upstream a request already went to (e.g. /tokenize)."""
        response = await self._attempt(request, upstream, route, data, "POST")
        try:
            async with response:
                return response.status, await read(response)
        finally:
            upstream.release()

    async def _send(
        self, request: web.Request, route: str, data: bytes | None, method: str, key: str | None
    ) -> tuple[Upstream, Reply]:
        if len(self.upstreams) == 1:  # nothing to choose, so nothing to pin
            upstream = self.upstreams[0]
            return upstream, await self._attempt(request, upstream, route, data, method)
        session_key = request.headers.get(self.session_header) or key
        cookie = pin_cookie(request.headers.get("Cookie"), self.cookie_name)
        tried: list[Upstream] = []
        while True:
            pin = self.pinner.pick(cookie, session_key, exclude=tuple(tried))
            if pin.cookie is not None:
                request[PIN] = (self.cookie_name, pin.cookie, self.config.pinning.max_age)
            try:
                return pin.upstream, await self._attempt(request, pin.upstream, route, data, method)
            except NotConnected:
                # Never connected, so vLLM never saw the request: safe to try another upstream.
                tried.append(pin.upstream)
                if len(tried) == len(self.upstreams):
                    raise NoUpstream(
                        f"no upstream is reachable: {', '.join(u.base_url for u in tried)} all refused the connection"
                    ) from None

    async def _attempt(
        self, request: web.Request, upstream: Upstream, route: str, data: bytes | None, method: str
    ) -> Reply:
        """One request holding an in-flight slot of `upstream` (given back if it fails); failures
        are counted and mapped to 502/504 naming the URL."""
        url = upstream.urls[route]
        headers = (upstream.json_headers if data is not None else upstream.headers).copy()
        request_id = request.get(REQUEST_ID)
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        await upstream.acquire()
        try:
            response = await self.client.request(method, url, headers, data)
        except BaseException as exc:
            upstream.release()
            if not isinstance(exc, (ClientError, asyncio.TimeoutError)):
                raise
            self._count(upstream, 0)
            raise self._failure(upstream, url, exc) from exc
        self._count(upstream, response.status)
        if not upstream.healthy:
            self.mark(upstream, True)  # it answered: whatever the last check said, it is up
        return response

    def _failure(self, upstream: Upstream, url: URL, exc: BaseException) -> UpstreamError:
        if isinstance(exc, CannotConnect):
            self.mark(upstream, False, f"cannot connect: {_why(exc)}")
            return NotConnected(f"cannot reach upstream {_show(url)}: {_why(exc)}")
        if isinstance(exc, asyncio.TimeoutError):
            return UpstreamTimeout(f"upstream {_show(url)} did not answer in time ({_why(exc)})")
        return UpstreamError(f"upstream {_show(url)} failed: {_why(exc)}")

    def _count(self, upstream: Upstream, status: int) -> None:
        self.metrics.upstream_requests[(upstream.name, status)] += 1

    def mark(self, upstream: Upstream, healthy: bool, why: str = "") -> None:
        if upstream.healthy != healthy:
            upstream.healthy = healthy
            if healthy:
                log.info("upstream %s is healthy again", upstream.base_url)
            else:
                log.warning("upstream %s marked down: %s", upstream.base_url, why)

    async def check_health(self) -> None:
        """One round of `/health` checks on every upstream."""

        async def check(upstream: Upstream) -> None:
            try:
                status, _ = await asyncio.wait_for(self.get(upstream, "health"), self.config.health.timeout)
                ok, why = status == 200, f"/health answered {status}"
            except (ClientError, asyncio.TimeoutError) as exc:
                ok, why = False, f"/health failed: {_why(exc)}"
            # One slow answer from a busy server is no outage: it takes HEALTH_FAILURES in a row.
            upstream.failed_checks = 0 if ok else upstream.failed_checks + 1
            if ok or upstream.failed_checks >= HEALTH_FAILURES:
                self.mark(upstream, ok, why)

        await asyncio.gather(*(check(u) for u in self.upstreams))

    async def get(self, upstream: Upstream, route: str) -> tuple[int, bytes]:
        """A GET of the pool's own (health checks, the startup probe): status and body."""
        async with await self.client.request("GET", upstream.urls[route], upstream.headers) as reply:
            return reply.status, await reply.read()

    async def watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health.interval)
            await self.check_health()

    def states(self) -> list[dict[str, Any]]:
        return [
            {"name": u.name, "url": u.base_url, "healthy": u.healthy, "inflight": u.inflight} for u in self.upstreams
        ]

    def gauges(self) -> Iterable[tuple[str, str, str, Any]]:
        yield (
            "gymproxy_upstream_inflight",
            "gauge",
            "Requests in flight, by upstream.",
            lambda: [(f'{{upstream="{u.name}"}}', u.inflight) for u in self.upstreams],
        )
        yield (
            "gymproxy_upstream_healthy",
            "gauge",
            "1 while the upstream is healthy.",
            lambda: [(f'{{upstream="{u.name}"}}', int(u.healthy)) for u in self.upstreams],
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


async def read(response: Reply) -> bytes:
    """The whole body, with read failures mapped to 502/504 naming the upstream."""
    try:
        return await response.read()
    except asyncio.TimeoutError as exc:
        raise UpstreamTimeout(f"upstream {_show(response.url)} stopped sending its reply ({_why(exc)})") from exc
    except ClientError as exc:
        raise UpstreamError(f"upstream {_show(response.url)} broke off its reply: {_why(exc)}") from exc


class Exchange:
    """The async context of `UpstreamPool.request` (a class: cheaper than @asynccontextmanager)."""

    __slots__ = ("_sending", "_upstream", "_response")

    def __init__(self, sending: Awaitable[tuple[Upstream, Reply]]) -> None:
        self._sending = sending

    async def __aenter__(self) -> tuple[Upstream, Reply]:
        self._upstream, self._response = pair = await self._sending
        return pair

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self._response.close()  # the client left or we failed: make vLLM stop generating
        self._response.release()
        self._upstream.release()


def stamp(request: web.Request, response: web.StreamResponse) -> None:
    """The headers every response carries: the request id, and a new session's pin cookie.
    Call before the response is prepared."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id
    pin = request.get(PIN)
    if pin is not None:
        name, value, max_age = pin
        # Built by hand: the value is base64url and digits, and http.cookies costs ~10 µs a response.
        response.headers.add("Set-Cookie", f"{name}={value}; Max-Age={int(max_age)}; Path=/; HttpOnly; SameSite=Lax")


def pin_cookie(header: str | None, name: str) -> str | None:
    """Our cookie's value from a `Cookie` header, without parsing every other cookie."""
    if not header or name not in header:
        return None
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"')
    return None


def make_client(config: Config) -> Client:
    """The one upstream client of an app, for thousands of long-running concurrent requests."""
    timeouts = config.timeouts
    return Client(
        limit=config.max_connections,
        keepalive=timeouts.keepalive,
        connect_timeout=timeouts.connect,
        read_timeout=timeouts.read,
    )


async def probe(pool: UpstreamPool) -> None:
    """Log each upstream and whether its /v1/models answered, naming the URL tried."""
    for upstream in pool.upstreams:
        url = _show(upstream.urls["models"])
        try:
            status, body = await asyncio.wait_for(pool.get(upstream, "models"), 10)
        except (ClientError, asyncio.TimeoutError) as exc:
            log.warning("upstream %s: %s is NOT answering: %s", upstream.base_url, url, _why(exc))
            continue
        if status == 200:
            log.info("upstream %s: %s answered 200", upstream.base_url, url)
        else:
            log.warning(
                "upstream %s: %s answered %d: %s (is base_url right? it should end in /v1)",
                upstream.base_url,
                url,
                status,
                body[:200].decode(errors="replace"),
            )


def _show(url: Any) -> str:
    """A URL for messages: without query string or credentials."""
    return str(URL(str(url)).with_query(None).with_user(None))


def _why(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
