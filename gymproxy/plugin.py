"""Mounting gymproxy: `setup(app, config, prefix=...)` into an existing aiohttp app, or `create_app(config)`.

Each route is bound to its `Proxy` by `bind`, which also renders its errors, so gymproxy never adds
app-wide middleware and several instances can live in one app under different prefixes.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from aiohttp import web

from . import handlers
from .config import Config
from .errors import Handler, Unauthorized, render
from .ids import hex32
from .state import Proxy
from .upstream import REQUEST_ID, TRACE, stamp

PROXIES: Final = web.AppKey("gymproxy.proxies", list[Proxy])

BoundHandler = Callable[[Proxy, web.Request], Awaitable[web.StreamResponse]]


def setup(app: web.Application, config: Config, *, prefix: str = "") -> Proxy:
    """Install gymproxy's routes under `prefix` and open its upstream session with the app.

    With `access.admin_port` set, /health and /metrics are left out: serve `admin_app(proxy)`
    on that port (`gymproxy serve` does).
    """
    if prefix and (not prefix.startswith("/") or prefix.endswith("/")):
        raise ValueError(f"gymproxy.setup: prefix {prefix!r} must start with '/' and not end with one")
    proxy = Proxy(config)

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        await proxy.start()
        yield
        await proxy.close()

    app.cleanup_ctx.append(lifetime)
    app.setdefault(PROXIES, []).append(proxy)
    responses = handlers.responses_native if config.is_responses_native else handlers.responses
    api = [
        ("POST", "/v1/responses", responses),
        ("POST", "/v1/chat/completions", handlers.chat_completions),
        ("POST", "/v1/completions", handlers.relay("completions")),
        ("POST", "/tokenize", handlers.relay("tokenize")),
        ("GET", "/v1/models", handlers.models),
    ]
    routes = []
    for method, path, handler in api:
        bound = bind(proxy, handler, path)
        routes.append(web.route(method, prefix + path, bound))
        # NeMo Gym's rollout-scoped URLs: the prefix only labels the rollout.
        for scope in ROLLOUT_SCOPES:
            routes.append(web.route(method, prefix + scope + path, bound))
    if config.access.admin_port is None:
        routes += _admin_routes(proxy, prefix)
    app.router.add_routes(routes)
    return proxy


ROLLOUT_SCOPES = ("/ng-rollout/{rollout_id}", "/ng-rollout/{rollout_id}/training-token-capture")


def admin_app(proxy: Proxy) -> web.Application:
    """/health and /metrics alone, for `access.admin_port`."""
    app = web.Application()
    app.router.add_routes(_admin_routes(proxy, ""))
    return app


def _admin_routes(proxy: Proxy, prefix: str) -> list[web.RouteDef]:
    admin = not proxy.config.access.admin_requires_key
    return [
        web.get(prefix + "/health", bind(proxy, handlers.health, "/health", open_route=admin)),
        web.get(prefix + "/metrics", bind(proxy, handlers.metrics, "/metrics", open_route=admin)),
    ]


def bind(proxy: Proxy, handler: BoundHandler, route: str, *, open_route: bool = False) -> Handler:
    """A route handler: access check, request id, errors rendered, cookie and metrics recorded."""
    metrics = proxy.metrics
    keys = [key.encode() for key in proxy.config.access.api_keys] if not open_route else []
    refused = "a valid `Authorization: Bearer <key>` header is required"

    # One coroutine around the handler: every await of a request passes through each layer.
    async def served(request: web.Request) -> web.StreamResponse:
        start = _loop_time()
        request[REQUEST_ID] = _request_id(request)
        request[TRACE] = (metrics, route, start)
        try:
            if keys and not _authorized(request, keys):
                raise Unauthorized(refused)
            response = await handler(proxy, request)
        except Exception as exc:
            response = render(exc, request)
        if not response.prepared:
            stamp(request, response)  # errors of a new session carry its cookie too
        metrics.requests[(route, response.status)] += 1
        metrics.duration.observe(route, _loop_time() - start)
        return response

    served.__name__ = handler.__name__
    return served


def _authorized(request: web.Request, keys: list[bytes]) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    given = token.strip().encode()
    ok = False
    for key in keys:  # every key is compared, in constant time, so timing tells nothing
        ok |= hmac.compare_digest(given, key)
    return ok


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is sane, else a fresh one."""
    given = request.headers.get("X-Request-Id")
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return hex32()


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def create_app(config: Config) -> web.Application:
    """A standalone app; it can also be mounted with `host.add_subapp("/llm", create_app(config))`."""
    limit = config.limits.max_header_size
    app = web.Application(
        client_max_size=config.max_body_size, handler_args={"max_field_size": limit, "max_line_size": limit}
    )
    setup(app, config)
    return app
