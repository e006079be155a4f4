"""The bare relay floor: the least any aiohttp proxy does, to measure gymproxy against.

It reads the request body, POSTs the same bytes to the same path on the upstream through one
shared ClientSession (with the connector settings gymproxy used before it had its own client), and returns
the reply: whole, or for an event stream, relayed chunk by chunk with `iter_any` + `write`. It
runs on the same event loop gymproxy picks (uvloop when installed) and without an access log, as
`gymproxy serve` does. Several `--upstream` URLs are used in turn.

With `--client gymproxy` it relays through gymproxy's own upstream client (`gymproxy.http1`)
instead of aiohttp's ClientSession: the `lean-floor` target of bench_proxy.py, which shows what
gymproxy's conversion work costs on top of a relay that talks to vLLM the way gymproxy does.

    python bench/floor.py --upstream http://127.0.0.1:8001/v1 --port 8002 [--client gymproxy]
"""

from __future__ import annotations

import argparse
import itertools
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from upstream import new_loop
from yarl import URL

from gymproxy.http1 import Client

SESSION = web.AppKey("session", aiohttp.ClientSession)
CLIENT = web.AppKey("client", Client)
JSON_HEADERS = {"Content-Type": "application/json"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(upstreams: list[str], client: str = "aiohttp") -> web.Application:
    bases = itertools.cycle([url.rstrip("/") for url in upstreams])

    async def session(app: web.Application) -> AsyncIterator[None]:
        # The connector settings gymproxy used with aiohttp, at its default config.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=None)
        app[SESSION] = aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar())
        yield
        await app[SESSION].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = f"{next(bases)}/{request.match_info['tail']}"
        async with request.app[SESSION].post(url, data=body, headers=JSON_HEADERS) as up:
            if up.content_type != "text/event-stream":
                return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
            response = web.StreamResponse(status=up.status, headers=SSE_HEADERS)
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def lean_client(app: web.Application) -> AsyncIterator[None]:
        app[CLIENT] = Client(limit=0, keepalive=4.0, connect_timeout=10.0, read_timeout=None)
        yield
        await app[CLIENT].close()

    async def lean_relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = URL(f"{next(bases)}/{request.match_info['tail']}")
        async with await request.app[CLIENT].request("POST", url, JSON_HEADERS, body) as up:
            if up.content_type != "text/event-stream":
                return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
            response = web.StreamResponse(status=up.status, headers=SSE_HEADERS)
            await response.prepare(request)
            async for chunk in up.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=32 * 1024 * 1024)
    app.cleanup_ctx.append(lean_client if client == "gymproxy" else session)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/{tail:.*}", lean_relay if client == "gymproxy" else relay)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", action="append", required=True, metavar="URL", help="base URL ending in /v1")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--client", choices=("aiohttp", "gymproxy"), default="aiohttp", help="the upstream client")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    web.run_app(
        create_app(args.upstream, args.client),
        host=args.host,
        port=args.port,
        access_log=None,
        handler_cancellation=True,
        print=None,
        loop=new_loop(),
    )


if __name__ == "__main__":
    main()
