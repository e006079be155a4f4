"""What one mounted gymproxy holds while it runs: config, upstream pool, boundary rules, metrics."""

from __future__ import annotations

import asyncio

from .config import Config
from .convert.boundary import Boundary
from .convert.completions import ChatTemplate
from .metrics import Metrics
from .upstream import UpstreamPool, make_client, probe


class Proxy:
    """One gymproxy instance; its handlers are bound to it, so several can share one app."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.boundary = Boundary(config)
        self.metrics = Metrics()
        self.pool = UpstreamPool(config, self.metrics)
        # The completions backend's chat template, loaded once; a bad tokenizer fails at startup.
        self.template = (
            ChatTemplate.load(config.tokenizer or config.model or "") if config.render_chat_template else None
        )
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Open the upstream client (needs the running loop), log what each upstream says,
        and start the background health checks."""
        self.pool.client = make_client(self.config)
        self._tasks = [asyncio.ensure_future(probe(self.pool)), asyncio.ensure_future(self.pool.watch_health())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.client.close()
