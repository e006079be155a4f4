"""One mounted gymproxy while it runs: its config made into rules once, the fleet, metrics, and the
end of its upstream requests when a shutdown's grace is over (plugin.py keeps the time).

Every upstream request carries `X-Gymproxy-Hop`: the ids of the gymproxies it came through, then
this instance's own (`hop_chain`). A request that arrives with this instance's id among them has
come back round (an upstream URL that leads to gymproxy itself, directly or through other
gymproxies) and is refused at once (`routes.bind`, 508), where it would otherwise multiply until
something gave out; so is one that came through `MAX_HOPS` of them. The id is random per process
unless `$GYMPROXY_INSTANCE` gives one: `serve --workers N` sets it for its workers, so they are one
instance; give every replica behind one Service the same to catch a loop through that Service too.
Instances chained on purpose have different ids and pass.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import msgspec

from . import discovery, tasks
from .capture import Capture
from .config import Config, ConfigError, UpstreamSpec, dns_target, upstream_specs
from .control import Control
from .convert import boundary, completions
from .convert.request import RequestReader
from .errors import LoopDetected
from .fleet import HOP_HEADER, Change, Fleet, Gauge
from .http1 import Aborted
from .metrics import Metrics, label
from .overlay import Changes, Overlay
from .peers import Peers
from .rollouts.store import StoreError
from .templates import ChatTemplate
from .upstream import upstream_name

log = logging.getLogger("gymproxy")

R = TypeVar("R", bound=msgspec.Struct)
SHUTTING_DOWN = "gymproxy is shutting down"
# What a reload applies live; any other key it changes is logged as needing a restart.
LIVE_KEYS = ("base_url", "upstreams", "upstreams_dns", "upstreams_dns_interval_s")
RESOLVE_TIMEOUT_S = 5.0  # an `upstreams_dns` round without an answer by then (or by the next) has failed
INSTANCE_ENV = "GYMPROXY_INSTANCE"
_INSTANCE = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_HOPS = 16  # gymproxies a request may come through: more is taken for a loop
LOOP = f"this request came back to a gymproxy it went through ({HOP_HEADER}): an upstream URL leads back to it"


def instance_id(environ: Mapping[str, str] = os.environ) -> str:
    """This gymproxy's id in `X-Gymproxy-Hop`: `$GYMPROXY_INSTANCE` when it is a sane token, else random."""
    given = environ.get(INSTANCE_ENV, "")
    if _INSTANCE.fullmatch(given):
        return given
    if given:
        log.warning("$%s is not 1 to 64 letters, digits, `.`, `_` or `-`: using a random instance id", INSTANCE_ENV)
    return secrets.token_hex(8)


def hop_chain(values: list[str], instance: str) -> str | None:
    """The `X-Gymproxy-Hop` a request goes upstream with: the ids it arrived with (the header's
    values, comma-separated; what is not an instance id is dropped), then `instance`. None when it
    arrived with none: the upstream's own header, `instance` alone, goes. Raises `LoopDetected` when
    `instance` is among them, whatever came between, or when `MAX_HOPS` are there already."""
    if not values:
        return None
    hops = [hop for value in values for part in value.split(",") if _INSTANCE.fullmatch(hop := part.strip())]
    if instance in hops:
        raise LoopDetected(LOOP)
    if len(hops) >= MAX_HOPS:
        raise LoopDetected(f"this request came through {len(hops)} gymproxies ({HOP_HEADER}); {MAX_HOPS} at most")
    return ", ".join([*hops, instance])


def rules(kind: type[R], config: Config) -> R:
    """A `convert` rules object: the config keys it names, and nothing else of the config."""
    values: dict[str, Any] = {name: getattr(config, name) for name in kind.__struct_fields__}
    return kind(**values)


class Proxy:
    """One gymproxy instance; its routes are bound to it, so several can share one app."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.instance = instance_id()
        # The hop header is one more header every upstream request carries, prebuilt with the others.
        hop = {**config.default_headers, HOP_HEADER: self.instance}
        self.fleet = Fleet(msgspec.structs.replace(config, default_headers=hop), self.metrics)
        self.boundary = boundary.Boundary(rules(boundary.Rules, config))
        self.requests = RequestReader(drop_unknown_fields=config.unknown_fields == "drop")
        self.completions = rules(completions.Rules, config) if config.use_completions_api else None
        # The completions backend's chat template, loaded once; a bad tokenizer fails at startup.
        self.template = (
            ChatTemplate.load(config.tokenizer or config.model or "", trust_remote_code=config.trust_remote_code)
            if config.render_chat_template
            else None
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.overlay = Overlay()  # the admin routes' changes (`gymproxy serve --workers` gives it a file)
        self.notify: Callable[[], None] | None = None  # tells the other workers the overlay changed
        self.resolve: discovery.Resolve = discovery.resolve  # for `upstreams_dns` (tests inject their own)
        self.discovered: list[UpstreamSpec] = []
        self._dns_failure: str | None = None
        self._capped: int | None = None  # how many upstreams were wanted when last over the cap
        self.peers: Peers | None = None  # the sibling workers of `gymproxy serve --workers N`
        self.replicas: Callable[[], list[dict[str, Any]]] | None = None  # launched vLLMs' states, for /health
        self.control = Control(self.fleet, config) if config.access.fleet_control else None  # /fleet/*
        self.capture = Capture(config.capture) if config.capture.enabled else None  # rollouts' calls recorded
        # Whether the upstreams' vLLM merges a captured Messages call's inline system messages into the
        # leading one (`routes.captured_messages`): learnt from them once, when first needed.
        self.merge_inline_system: bool | None = None
        self.connections: Callable[[], int] | None = None  # open client connections (`gymproxy serve`'s listener)
        self.placed: dict[str, str] = {}  # launched replicas' URLs now, by name (`place`)

    async def start(self) -> None:
        """Open the upstream client, log what each upstream says, and start the health checks."""
        self.fleet.open()
        if self.capture is not None:
            try:
                await self.capture.start()
            except StoreError as exc:
                raise ConfigError(f"config: capture.store: {exc}") from exc
        access = self.config.access
        if access.admin_fleet_changes and not access.api_keys:  # on a loopback host (config refuses others)
            log.warning(
                "access.admin_fleet_changes is on and no access.api_keys are set: any local process "
                "that reaches %s can change the upstreams",
                self.config.host,
            )
        self.overlay.load()
        await self.discover()  # bounded (RESOLVE_TIMEOUT_S); later rounds retry
        self.apply()
        if self.control is not None:
            self.control.start()
        self._tasks = [
            asyncio.ensure_future(self.fleet.probe()),
            asyncio.ensure_future(self.fleet.watch_health()),
            asyncio.ensure_future(self.follow_dns()),
        ]

    def apply(self) -> Change:
        """Make the fleet what the config, DNS discovery, the launcher (`place`) and the admin changes say together."""
        specs = {upstream_name(spec): spec for spec in [*upstream_specs(self.config), *self.discovered]}
        for name, url in self.placed.items():
            if name in specs and specs[name].url != url:
                specs[name] = msgspec.structs.replace(specs[name], url=url)
        wanted, drained = self.overlay.apply(specs)
        most = self.config.limits.max_upstreams
        if len(wanted) > most:
            if self._capped != len(wanted):  # logged once per new count
                log.warning(
                    "%d upstreams wanted (config, upstreams_dns and admin changes): the first %d are used "
                    "(limits.max_upstreams)",
                    len(wanted),
                    most,
                )
            self._capped = len(wanted)
            wanted = wanted[:most]
        else:
            self._capped = None
        return self.fleet.update(wanted, drained=drained)

    def place(self, name: str, url: str) -> None:
        """Launched replica `name` is at `url` now (it moved to a fresh port: its own was taken): its
        upstream follows, changed in place, so the sessions pinned to it stay, and a reload, a DNS
        round or an admin change keeps it there."""
        if self.placed.get(name) != url:
            self.placed[name] = url
            self.apply()

    def reload(self, config: Config) -> list[str]:
        """Apply a re-read config live: its upstreams (`LIVE_KEYS`), with the admin changes on top.
        Returns (and logs) the other keys it changes, which need a restart to take effect."""
        later = [
            key
            for key in Config.__struct_fields__
            if key not in LIVE_KEYS and getattr(config, key) != getattr(self.config, key)
        ]
        if later:
            log.warning(
                "config reloaded: %s changed and needs a restart; applying the upstreams only", ", ".join(later)
            )
        self.config = msgspec.structs.replace(self.config, **{key: getattr(config, key) for key in LIVE_KEYS})
        if self.config.upstreams_dns is None:
            self.discovered = []
        self.overlay.load()
        change = self.apply()
        log.info(
            "fleet reloaded: %d upstreams; added %s, removed %s, changed %s",
            len(self.fleet.upstreams),
            change.added or "none",
            change.removed or "none",
            change.changed or "none",
        )
        return later

    def change(self, edit: Callable[[Changes], None]) -> Change:
        """An admin change: recorded in the overlay, applied here, and announced to the other workers.
        One that cannot be applied is not recorded (the caller checked it: this is a backstop)."""
        with self.overlay.editing() as changes:
            edit(changes)
            change = self.apply()
        if self.notify is not None:
            self.notify()
        return change

    async def discover(self) -> None:
        """Resolve `upstreams_dns` once; on failure, or no answer within `RESOLVE_TIMEOUT_S` (or the
        interval, if shorter), keep the last set (logged once per new failure). A resolution that
        hangs is cancelled, so the next round starts afresh (a system resolver thread stuck in
        getaddrinfo stays busy: the executor's size bounds those)."""
        value = self.config.upstreams_dns
        if value is None:
            return
        timeout = min(RESOLVE_TIMEOUT_S, self.config.upstreams_dns_interval_s)
        try:
            target = dns_target(value)
            addresses = await asyncio.wait_for(self.resolve(target.host, target.port), timeout)
            if not addresses:
                raise ConfigError(f"{target.host} resolved to no address")
        except asyncio.TimeoutError:  # before OSError: it is one
            self._dns_failed(value, f"no answer in {timeout:g} s")
            return
        except (OSError, ValueError, ConfigError) as exc:
            self._dns_failed(value, f"{type(exc).__name__}: {exc}")
            return
        if self._dns_failure is not None:
            self._dns_failure = None
            log.info("upstreams_dns %s resolves again", value)
        self.discovered = discovery.to_specs(target, addresses)

    def _dns_failed(self, value: str, failure: str) -> None:
        if failure != self._dns_failure:
            self._dns_failure = failure
            log.warning(
                "upstreams_dns %s: cannot resolve (%s); keeping the last %d", value, failure, len(self.discovered)
            )

    async def follow_dns(self) -> None:
        """Re-resolve `upstreams_dns` every `upstreams_dns_interval_s` and apply what changed; a round
        that fails in an unforeseen way is logged, and the next one runs."""
        while True:
            await asyncio.sleep(self.config.upstreams_dns_interval_s)
            if self.config.upstreams_dns is None:
                continue
            try:
                await self._follow_round()
            except Exception:
                log.exception("upstreams_dns %s: this round failed; the fleet stays", self.config.upstreams_dns)

    async def _follow_round(self) -> None:
        before = self.discovered
        await self.discover()
        if self.discovered != before:
            change = self.apply()
            log.info(
                "upstreams_dns %s: added %s, removed %s",
                self.config.upstreams_dns,
                change.added or "none",
                change.removed or "none",
            )

    def end_requests(self) -> None:
        """A shutdown's grace is over: every upstream request in progress ends now, and no new one
        starts, so each stream ends with its terminal event and a whole reply with a 503."""
        if self.fleet.client.in_use:
            log.warning("shutdown grace over: ending %d upstream requests in flight", self.fleet.client.in_use)
        self.fleet.client.abort(Aborted(SHUTTING_DOWN))
        self.fleet.end_holds(SHUTTING_DOWN)

    def render_metrics(self) -> str:
        """This process's own `/metrics` text."""
        histograms = []
        if self.capture is not None:
            histograms.append(self.capture.batches())
        return self.metrics.render([*self.fleet.gauges(), *self._gauges()], histograms)

    def _gauges(self) -> Iterable[Gauge]:
        """The listener's and the launched replicas' series, where this process has them."""
        if self.capture is not None:
            yield from self.capture.gauges()
        connections, replicas = self.connections, self.replicas
        if connections is not None:
            yield ("gymproxy_client_connections", "gauge", "Open client connections.", lambda: [("", connections())])
        if replicas is not None:
            yield (
                "gymproxy_replica_ready",
                "gauge",
                "1 while the launched vLLM replica serves, by replica (its state: /health's replicas).",
                lambda: [(label(replica=r["name"]), int(r["state"] == "ready")) for r in replicas()],
            )
            yield (
                "gymproxy_replica_starts_total",
                "counter",
                "Times the launched vLLM replica was started (restarts are the starts after the first).",
                lambda: [(label(replica=r["name"]), r["starts"]) for r in replicas()],
            )

    async def close(self) -> None:
        self.fleet.stop()
        if self.control is not None:
            self.control.stop()
        await tasks.cancel(self._tasks)
        await self.fleet.client.close()
        if self.capture is not None:
            await self.capture.close()  # every record queued is written (SIGTERM's flush)
