"""The test suite runs its servers the way `gymproxy serve` runs them, or these tests fail.

A leak once hid behind the difference: with `handler_cancellation=False`, a client that leaves lets
its handler run on, so cleanup that only cancellation triggers was never exercised.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from .conftest import _has_uvloop


async def test_a_client_that_leaves_cancels_its_handler(aiohttp_server) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def forever(request: web.Request) -> web.StreamResponse:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.Response()

    app = web.Application()
    app.router.add_get("/", forever)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(session.get(server.make_url("/")))
        await asyncio.wait_for(started.wait(), 5)
        request.cancel()  # the client leaves
    await asyncio.wait_for(cancelled.wait(), 5)  # a TimeoutError here: the handler ran on
    assert cancelled.is_set()


async def test_the_loop_is_uvloop_when_it_is_installed() -> None:
    kind = type(asyncio.get_running_loop()).__module__
    assert kind.startswith("uvloop") == _has_uvloop(), kind
