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
PROBES = ("/healthz", "/livez", "/readyz")  # and `/`: liveness, as NeMo Gym's servers answer them


def setup(app: web.Application, config: Config, *, prefix: str = "") -> Proxy:
    """Install gymproxy's routes under `prefix` and open its upstream client with the app.

    With `access.admin_port` set, /health and /metrics are left out: serve `admin_app(proxy)`
    on that port (`gymproxy serve` does). When the app shuts down, requests still in flight get
    `shutdown_grace_s` to finish, then are ended (streams with their terminal event).

    The liveness probes /healthz, /livez and /readyz are added under `prefix` unless the app already
    routes that path; `GET {prefix}/` too, but only with a prefix: the root of a host app is the
    host's (`create_app` owns its app, so it answers `/` as well).
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
    openai, anthropic = routes.OPENAI, routes.ANTHROPIC
    api = [
        ("POST", "/v1/responses", responses, openai),
        ("POST", "/v1/chat/completions", routes.chat_completions, openai),
        ("POST", "/v1/completions", routes.relay("completions"), openai),
        ("POST", "/tokenize", routes.relay("tokenize"), openai),
        ("GET", "/v1/models", routes.models, openai),
    ]
    if config.anthropic_messages:
        api += [
            ("POST", "/v1/messages", routes.anthropic("messages"), anthropic),
            ("POST", "/v1/messages/count_tokens", routes.anthropic("count_tokens"), anthropic),
            ("GET", "/api/hello", routes.live, anthropic),  # Claude Code's HEAD before its first request
        ]
    table = []
    for method, path, route, dialect in api:
        # /api/hello is a reachability check, open like the liveness probes.
        bound = routes.bind(proxy, route, path, open_route=route is routes.live, dialect=dialect)
        table.append(web.route(method, prefix + path, bound))
        # NeMo Gym's rollout-scoped URLs: the prefix only labels the rollout.
        for scope in ROLLOUT_SCOPES:
            table.append(web.route(method, prefix + scope + path, bound))
    if config.access.admin_port is None:
        table += _admin_routes(proxy, prefix)
    table += _fleet_routes(proxy, prefix)
    table += _rollout_routes(proxy, prefix)
    table += _probes(proxy, prefix, app, ("/", *PROBES) if prefix else PROBES)
    app.router.add_routes(table)
    return proxy


def admin_app(proxy: Proxy) -> web.Application:
    """/health, /metrics, /admin/upstreams and /fleet/* alone, for `access.admin_port`."""
    app = web.Application()
    app.router.add_routes(_admin_routes(proxy, "") + _fleet_routes(proxy, "") + _probes(proxy, "", app, ("/", *PROBES)))
    return app


def _fleet_routes(proxy: Proxy, prefix: str) -> list[web.RouteDef]:
    """The weight-update controls: on the main port and on the admin port, never open while a key is set."""
    broadcast = prefix + "/fleet/broadcast/{route}"
    return [
        web.post(prefix + "/fleet/pause", routes.bind(proxy, routes.fleet_pause, "/fleet/pause")),
        web.post(prefix + "/fleet/resume", routes.bind(proxy, routes.fleet_resume, "/fleet/resume")),
        web.post(broadcast, routes.bind(proxy, routes.fleet_broadcast, "/fleet/broadcast/{route}")),
        web.get(broadcast, routes.bind(proxy, routes.fleet_broadcast, "/fleet/broadcast/{route}")),
        web.get(prefix + "/fleet/status", routes.bind(proxy, routes.fleet_status, "/fleet/status")),
    ]


def _rollout_routes(proxy: Proxy, prefix: str) -> list[web.RouteDef]:
    """The captured rollouts: prompts and tokens, so never open while a key is set."""
    one = prefix + "/v1/rollouts/{rollout_id}"
    return [
        web.get(prefix + "/v1/rollouts", routes.bind(proxy, routes.list_rollouts, "/v1/rollouts")),
        web.get(one, routes.bind(proxy, routes.get_rollout, "/v1/rollouts/{rollout_id}")),
        web.delete(one, routes.bind(proxy, routes.delete_rollout, "/v1/rollouts/{rollout_id}")),
        web.post(one + "/freeze", routes.bind(proxy, routes.freeze_rollout, "/v1/rollouts/{rollout_id}/freeze")),
    ]


def _admin_routes(proxy: Proxy, prefix: str) -> list[web.RouteDef]:
    admin = not proxy.config.access.admin_requires_key
    upstreams, one = prefix + "/admin/upstreams", prefix + "/admin/upstreams/{name:.+}"
    # A change of the fleet redirects traffic, so it is never open while any key is configured.
    return [
        web.get(prefix + "/health", routes.bind(proxy, routes.health, "/health", open_route=admin)),
        web.get(prefix + "/metrics", routes.bind(proxy, routes.metrics, "/metrics", open_route=admin)),
        web.get(upstreams, routes.bind(proxy, routes.list_upstreams, "/admin/upstreams", open_route=admin)),
        web.post(upstreams, routes.bind(proxy, routes.add_upstream, "/admin/upstreams")),
        web.post(one + "/drain", routes.bind(proxy, routes.drain_upstream, "/admin/upstreams/{name}/drain")),
        web.delete(one, routes.bind(proxy, routes.remove_upstream, "/admin/upstreams/{name}")),
    ]


def _probes(proxy: Proxy, prefix: str, app: web.Application, paths: tuple[str, ...]) -> list[web.RouteDef]:
    """Liveness routes, open like /health; a path `app` already routes is left to its owner."""
    live = {path: routes.bind(proxy, routes.live, path, open_route=True) for path in paths}
    return [web.get(prefix + path, handler) for path, handler in live.items() if not _routed(app, prefix + path)]


def _routed(app: web.Application, path: str) -> bool:
    """Whether `app` already answers GET `path` (gymproxy's route would never be reached)."""
    for resource in app.router.resources():
        if resource.canonical == path and any(route.method in ("GET", "*") for route in resource):
            return True
    return False


def create_app(config: Config) -> web.Application:
    """A standalone app; it can also be mounted with `host.add_subapp("/llm", create_app(config))`."""
    limit = config.limits.max_header_size
    app = web.Application(
        client_max_size=config.max_body_size, handler_args={"max_field_size": limit, "max_line_size": limit}
    )
    proxy = setup(app, config)
    app.router.add_routes(_probes(proxy, "", app, ("/",)))  # this app is gymproxy's own: so is its root
    return app
