"""Mounting gymproxy: `setup(app, config, prefix=...)` into an existing aiohttp app, or `create_app(config)`.

Each route is bound to its `Proxy` by `routes.bind`, which also renders its errors, so gymproxy never
adds app-wide middleware and several instances can live in one app under different prefixes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web

from . import routes
from .config import Config
from .proxy import Proxy

log = logging.getLogger("gymproxy")

PROXIES: Final = web.AppKey("gymproxy.proxies", list[Proxy])
ROLLOUT_SCOPES = ("/ng-rollout/{rollout_id}", "/ng-rollout/{rollout_id}/training-token-capture")


def setup(app: web.Application, config: Config, *, prefix: str = "") -> Proxy:
    """Install gymproxy's routes under `prefix` and open its upstream client with the app.

    With `access.admin_port` set, /health and /metrics are left out: serve `admin_app(proxy)`
    on that port (`gymproxy serve` does). When the app shuts down, requests still in flight get
    `shutdown_grace_s` to finish, then are ended (streams with their terminal event).
    """
    if prefix and (not prefix.startswith("/") or prefix.endswith("/")):
        raise ValueError(f"gymproxy.setup: prefix {prefix!r} must start with '/' and not end with one")
    proxy = Proxy(config)
    grace: list[asyncio.TimerHandle] = []

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        await proxy.start()
        yield
        for timer in grace:
            timer.cancel()
        await proxy.close()

    async def draining(_: web.Application) -> None:
        """The app is shutting down (its listener has stopped): what still runs after the grace ends then."""
        seconds = config.shutdown_grace_s
        if proxy.fleet.client.in_use:
            log.info("shutting down: %d upstream requests in flight get %g s", proxy.fleet.client.in_use, seconds)
        grace.append(asyncio.get_running_loop().call_later(seconds, end))

    def end() -> None:
        proxy.end_requests()
        routes.end_waiting_bodies()

    app.cleanup_ctx.append(lifetime)
    app.on_shutdown.append(draining)
    app.setdefault(PROXIES, []).append(proxy)
    responses = routes.responses_native if config.is_responses_native else routes.responses
    api = [
        ("POST", "/v1/responses", responses),
        ("POST", "/v1/chat/completions", routes.chat_completions),
        ("POST", "/v1/completions", routes.relay("completions")),
        ("POST", "/tokenize", routes.relay("tokenize")),
        ("GET", "/v1/models", routes.models),
    ]
    table = []
    for method, path, route in api:
        bound = routes.bind(proxy, route, path)
        table.append(web.route(method, prefix + path, bound))
        # NeMo Gym's rollout-scoped URLs: the prefix only labels the rollout.
        for scope in ROLLOUT_SCOPES:
            table.append(web.route(method, prefix + scope + path, bound))
    if config.access.admin_port is None:
        table += _admin_routes(proxy, prefix)
    app.router.add_routes(table)
    return proxy


def admin_app(proxy: Proxy) -> web.Application:
    """/health and /metrics alone, for `access.admin_port`."""
    app = web.Application()
    app.router.add_routes(_admin_routes(proxy, ""))
    return app


def _admin_routes(proxy: Proxy, prefix: str) -> list[web.RouteDef]:
    admin = not proxy.config.access.admin_requires_key
    return [
        web.get(prefix + "/health", routes.bind(proxy, routes.health, "/health", open_route=admin)),
        web.get(prefix + "/metrics", routes.bind(proxy, routes.metrics, "/metrics", open_route=admin)),
    ]


def create_app(config: Config) -> web.Application:
    """A standalone app; it can also be mounted with `host.add_subapp("/llm", create_app(config))`."""
    limit = config.limits.max_header_size
    app = web.Application(
        client_max_size=config.max_body_size, handler_args={"max_field_size": limit, "max_line_size": limit}
    )
    setup(app, config)
    return app
