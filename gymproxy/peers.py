"""The workers of one `gymproxy serve --workers N`, as `/metrics` sees them.

The kernel hands a scrape to any one worker (SO_REUSEPORT), so that worker answers for all of them:
each worker serves its own metrics text on a unix socket, `worker-<i>.sock`, in a private runtime
directory the parent makes (and removes), and the worker that got the scrape reads its siblings'
texts, each within `PEER_TIMEOUT`, and merges them with its own (`metrics.merge`). Nothing of this
runs on the request path: the counters stay plain per-process dict updates, read only when scraped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from .metrics import merge

log = logging.getLogger("gymproxy")

PEER_TIMEOUT = 1.0  # seconds a sibling has to hand over its text; a stuck one is reported missing


class Peers:
    """Worker `index` of `count`, with its siblings' metrics sockets in `directory`."""

    def __init__(
        self, directory: str, index: int, count: int, *, timeout: float = PEER_TIMEOUT, restarts: int = 0
    ) -> None:
        self.directory = directory
        self.index = index
        self.count = count
        self.timeout = timeout
        self.restarts = restarts  # how many times the parent started this worker's index again
        self._server: asyncio.AbstractServer | None = None
        self._warned: set[int] = set()

    def path(self, index: int) -> str:
        return os.path.join(self.directory, f"worker-{index}.sock")

    async def serve(self, render: Callable[[], str]) -> None:
        """Answer each connection to this worker's socket with `render()`, then close it."""

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                writer.write(self._own(render()).encode())
                await writer.drain()
            except Exception:  # noqa: BLE001 - a sibling that left, or a bug: that scrape misses this worker
                log.exception("metrics: could not answer a sibling worker")
            finally:
                writer.close()

        path = self.path(self.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._server = await asyncio.start_unix_server(answer, path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(self.index))

    async def collect(self, own: str) -> str:
        """`own` text merged with every sibling's; a sibling that does not answer in time is left out."""
        others = await asyncio.gather(*(self._fetch(i) for i in range(self.count) if i != self.index))
        texts: list[str | None] = list(others)
        texts.insert(self.index, self._own(own))
        return merge(texts)

    def _own(self, text: str) -> str:
        """This worker's text, with its restart count (a counter kept by index, across its processes)."""
        return text + (
            "# HELP gymproxy_worker_restarts_total Times the worker was started again (it exited, or sent no heartbeat).\n"
            "# TYPE gymproxy_worker_restarts_total counter\n"
            f'gymproxy_worker_restarts_total{{worker="{self.index}"}} {self.restarts}\n'
        )

    async def _fetch(self, index: int) -> str | None:
        try:
            text = await asyncio.wait_for(self._read(index), self.timeout)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, UnicodeDecodeError) as exc:
            if index not in self._warned:  # once per outage: scrapes come every few seconds
                self._warned.add(index)
                log.warning("metrics: worker %d did not answer (%r); its numbers are left out", index, exc)
            return None
        self._warned.discard(index)
        return text

    async def _read(self, index: int) -> str:
        reader, writer = await asyncio.open_unix_connection(self.path(index))
        try:
            text = (await reader.read()).decode()  # to EOF: the sibling closes once it has written all
        finally:
            writer.close()
        if not text.endswith("\n"):  # it broke off mid-text: no half-counted worker
            raise OSError("incomplete metrics text")
        return text
