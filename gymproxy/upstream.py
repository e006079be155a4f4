"""The upstream vLLM servers: one shared `ClientSession`, their URLs, and how a call can fail.

Every failure to talk to an upstream becomes an `UpstreamError` (502) or `UpstreamTimeout` (504)
whose message names the URL that failed, so a wrong `base_url` is obvious at once.
"""

from __future__ import annotations

import asyncio
import io
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from yarl import URL

from .config import Config
from .errors import UpstreamError, UpstreamTimeout

log = logging.getLogger("gymproxy")

JSON_HEADERS = {"Content-Type": "application/json"}
LARGE_BODY = 1024 * 1024


class Upstream:
    """One vLLM server: its prebuilt URLs and request headers, and its in-flight count."""

    __slots__ = ("name", "base_url", "headers", "urls", "inflight")

    def __init__(self, base_url: str, config: Config, name: str | None = None) -> None:
        self.name = name or base_url
        self.base_url = base_url.rstrip("/")
        headers = dict(config.default_headers)
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        self.headers = headers
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

    def __repr__(self) -> str:  # never shows the api key
        return f"Upstream({self.base_url!r})"


class UpstreamPool:
    """The upstreams of one app and the session all requests to them share."""

    session: aiohttp.ClientSession  # opened by Proxy.start() once a loop runs

    def __init__(self, config: Config) -> None:
        self.config = config
        self.upstreams = [Upstream(url, config) for url in config.base_url]

    def pick(self) -> Upstream:
        """The upstream with the fewest requests in flight (ties at random)."""
        if len(self.upstreams) == 1:
            return self.upstreams[0]
        least = min(u.inflight for u in self.upstreams)
        return random.choice([u for u in self.upstreams if u.inflight == least])

    @asynccontextmanager
    async def request(
        self, upstream: Upstream, route: str, *, data: bytes | None = None, method: str = "POST"
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send one request; the response is released (and the connection closed if unread) on exit."""
        url = upstream.urls[route]
        headers = {**upstream.headers, **JSON_HEADERS} if data is not None else upstream.headers
        body: bytes | io.BytesIO | None = data
        if data is not None and len(data) > LARGE_BODY:
            body = io.BytesIO(data)  # aiohttp warns that large bytes bodies block the loop
        upstream.inflight += 1
        try:
            try:
                response = await self.session.request(method, url, data=body, headers=headers)
            except asyncio.TimeoutError as exc:
                raise UpstreamTimeout(f"upstream {_show(url)} did not answer in time ({_why(exc)})") from exc
            except aiohttp.ClientError as exc:
                raise UpstreamError(f"cannot reach upstream {_show(url)}: {_why(exc)}") from exc
            try:
                yield response
            finally:
                response.release()
        finally:
            upstream.inflight -= 1

    async def read(self, upstream: Upstream, response: aiohttp.ClientResponse) -> bytes:
        """The whole body, with read failures mapped to 502/504 naming the upstream."""
        try:
            return await response.read()
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout(f"upstream {_show(response.url)} stopped sending its reply ({_why(exc)})") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream {_show(response.url)} broke off its reply: {_why(exc)}") from exc

    async def call(self, upstream: Upstream, route: str, data: bytes | None = None, method: str = "POST") -> tuple[int, bytes]:
        """Send a request and read the whole reply: (status, body)."""
        async with self.request(upstream, route, data=data, method=method) as response:
            return response.status, await self.read(upstream, response)


def make_session(config: Config) -> aiohttp.ClientSession:
    """The one ClientSession of an app, tuned for thousands of long-running concurrent requests."""
    timeouts = config.timeouts
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=0,
        keepalive_timeout=timeouts.keepalive,
        ttl_dns_cache=300,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect, sock_read=timeouts.read),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=True,
    )


async def probe(pool: UpstreamPool) -> None:
    """Log each upstream and whether its /v1/models answered, naming the URL tried."""
    for upstream in pool.upstreams:
        url = _show(upstream.urls["models"])
        try:
            status, body = await asyncio.wait_for(pool.call(upstream, "models", method="GET"), timeout=10)
        except (UpstreamError, asyncio.TimeoutError) as exc:
            log.warning("upstream %s: %s is NOT answering: %s", upstream.base_url, url, exc)
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
