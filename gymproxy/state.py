"""What one mounted gymproxy holds while it runs: config, upstream pool, boundary rules, counters."""

from __future__ import annotations

import asyncio

from .config import Config
from .convert.boundary import Boundary
from .upstream import UpstreamPool, make_session, probe


class Proxy:
    """One gymproxy instance; its handlers are bound to it, so several can share one app."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.boundary = Boundary(config)
        self.pool = UpstreamPool(config)
        self.overflows = 0
        self._probe: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the upstream session (needs the running loop) and log what each upstream says."""
        self.pool.session = make_session(self.config)
        self._probe = asyncio.ensure_future(probe(self.pool))

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        await self.pool.session.close()
