"""Mounting gymproxy: `setup(app, config, prefix=...)` into an existing aiohttp app, or `create_app(config)`.

Each route is bound to its `Proxy` and wrapped in `openai_errors`, so gymproxy never adds
app-wide middleware and several instances can live in one app under different prefixes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from aiohttp import web

from . import handlers
from .config import Config
from .errors import Handler, openai_errors
from .state import Proxy
from .upstream import TRACE, set_pin_cookie

PROXIES: Final = web.AppKey("gymproxy.proxies", list[Proxy])

BoundHandler = Callable[[Proxy, web.Request], Awaitable[web.StreamResponse]]


def setup(app: web.Application, config: Config, *, prefix: str = "") -> Proxy:
    """Install gymproxy's routes under `prefix` and open its upstream session with the app."""
    if prefix and (not prefix.startswith("/") or prefix.endswith("/")):
        raise ValueError(f"gymproxy.setup: prefix {prefix!r} must start with '/' and not end with one")
    proxy = Proxy(config)

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        await proxy.start()
        yield
        await proxy.close()

    app.cleanup_ctx.append(lifetime)
    app.setdefault(PROXIES, []).append(proxy)

    metrics = proxy.metrics
    loop_time = _loop_time

    def bind(handler: BoundHandler, route: str) -> Handler:
        async def bound(request: web.Request) -> web.StreamResponse:
            return await handler(proxy, request)

        bound.__name__ = handler.__name__
        rendered = openai_errors(bound)

        async def served(request: web.Request) -> web.StreamResponse:
            start = loop_time()
            request[TRACE] = (metrics, route, start)
            response = await rendered(request)
            if not response.prepared:
                set_pin_cookie(request, response)  # errors of a new session carry its cookie too
            metrics.requests[(route, response.status)] += 1
            metrics.duration.observe(route, loop_time() - start)
            return response

        served.__name__ = handler.__name__
        return served

    responses = handlers.responses_native if config.is_responses_native else handlers.responses
    app.router.add_routes(
        [
            web.post(f"{prefix}/v1/responses", bind(responses, "/v1/responses")),
            web.post(f"{prefix}/v1/chat/completions", bind(handlers.chat_completions, "/v1/chat/completions")),
            web.post(f"{prefix}/v1/completions", bind(handlers.relay("completions"), "/v1/completions")),
            web.post(f"{prefix}/tokenize", bind(handlers.relay("tokenize"), "/tokenize")),
            web.get(f"{prefix}/v1/models", bind(handlers.models, "/v1/models")),
            web.get(f"{prefix}/health", bind(handlers.health, "/health")),
            web.get(f"{prefix}/metrics", bind(handlers.metrics, "/metrics")),
        ]
    )
    return proxy


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def create_app(config: Config) -> web.Application:
    """A standalone app; it can also be mounted with `host.add_subapp("/llm", create_app(config))`."""
    app = web.Application(client_max_size=config.max_body_size, handler_args={"max_field_size": 16384})
    setup(app, config)
    return app
