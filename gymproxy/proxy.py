"""One mounted gymproxy while it runs: its config made into rules once, the fleet, metrics, and the
end of its upstream requests when a shutdown's grace is over (plugin.py keeps the time)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

import msgspec

from .config import Config
from .convert import boundary, completions
from .convert.request import RequestReader
from .fleet import Fleet
from .http1 import Aborted
from .metrics import Metrics
from .peers import Peers
from .templates import ChatTemplate

log = logging.getLogger("gymproxy")

R = TypeVar("R", bound=msgspec.Struct)
SHUTTING_DOWN = "gymproxy is shutting down"


def rules(kind: type[R], config: Config) -> R:
    """A `convert` rules object: the config keys it names, and nothing else of the config."""
    values: dict[str, Any] = {name: getattr(config, name) for name in kind.__struct_fields__}
    return kind(**values)


class Proxy:
    """One gymproxy instance; its routes are bound to it, so several can share one app."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.fleet = Fleet(config, self.metrics)
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
        self.peers: Peers | None = None  # the sibling workers of `gymproxy serve --workers N`

    async def start(self) -> None:
        """Open the upstream client, log what each upstream says, and start the health checks."""
        self.fleet.open()
        self._tasks = [asyncio.ensure_future(self.fleet.probe()), asyncio.ensure_future(self.fleet.watch_health())]

    def end_requests(self) -> None:
        """A shutdown's grace is over: every upstream request in progress ends now, and no new one
        starts, so each stream ends with its terminal event and a whole reply with a 503."""
        if self.fleet.client.in_use:
            log.warning("shutdown grace over: ending %d upstream requests in flight", self.fleet.client.in_use)
        self.fleet.client.abort(Aborted(SHUTTING_DOWN))

    def render_metrics(self) -> str:
        """This process's own `/metrics` text."""
        return self.metrics.render(self.fleet.gauges())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.fleet.client.close()
