"""Two tiny baseline balancers for bench/fleet.py: round robin, and NeMo Gym's hash modulo N.

- `round_robin`: each request to the next upstream; no stickiness at all.
- `hash_mod_n`: sha256(session id) mod N, as NeMo Gym routes. The session id is the first of the
  headers `X-Session-ID`, `session-id`, `X-Claude-Code-Session-Id`, the body's `prompt_cache_key`
  or `user`, else a cookie this balancer sets (NeMo Gym keeps its session id in a cookie).

Neither retries, checks health or fails over: a dead upstream's requests fail (502), as they do
in NeMo Gym. `POST /admin/upstreams {"url": ...}` adds an upstream (the same route gymproxy's live
fleet takes), so the "engine added" scenario shows what hash mod N does to existing sessions.

    python bench/sim_balancer.py --policy hash_mod_n --port 8000 --upstream http://127.0.0.1:9001/v1 ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import secrets

import aiohttp
from aiohttp import web

SESSION_HEADERS = ("X-Session-ID", "session-id", "X-Claude-Code-Session-Id")
COOKIE = "fleetbench_sid"
PASSED = ("Content-Type", "X-Request-Id")


class Balancer:
    def __init__(self, policy: str, upstreams: list[str]) -> None:
        self.policy = policy
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.next = 0
        self.client: aiohttp.ClientSession | None = None

    def pick(self, request: web.Request, body: bytes) -> tuple[str, str | None]:
        """The upstream, and a session cookie to set (hash mod N, a client with no id)."""
        if self.policy == "round_robin":
            self.next += 1
            return self.upstreams[self.next % len(self.upstreams)], None
        key = next((request.headers[h] for h in SESSION_HEADERS if request.headers.get(h)), None)
        if key is None:
            try:
                fields = json.loads(body)
            except ValueError:
                fields = {}
            key = fields.get("prompt_cache_key") or fields.get("user") if isinstance(fields, dict) else None
        new = None
        if not key:
            key = request.cookies.get(COOKIE)
        if not key:
            key = new = secrets.token_hex(8)
        index = int.from_bytes(hashlib.sha256(str(key).encode()).digest()[:8], "big") % len(self.upstreams)
        return self.upstreams[index], new

    async def relay(self, request: web.Request) -> web.StreamResponse:
        assert self.client is not None
        body = await request.read()
        upstream, cookie = self.pick(request, body)
        path = request.path.removeprefix("/v1")
        headers = {h: request.headers[h] for h in PASSED if h in request.headers}
        response: web.StreamResponse | None = None
        try:
            async with self.client.request(request.method, upstream + path, data=body, headers=headers) as reply:
                response = web.StreamResponse(status=reply.status)
                response.content_type = reply.content_type
                if cookie:
                    response.set_cookie(COOKIE, cookie)
                await response.prepare(request)
                async for data in reply.content.iter_any():
                    await response.write(data)
                await response.write_eof()
                return response
        except aiohttp.ClientError as exc:
            if response is not None and response.prepared:  # cut mid-reply: so is the client's
                assert request.transport is not None
                request.transport.close()
                return response
            return web.json_response({"error": {"message": f"{upstream}: {exc!r}"}}, status=502)

    async def add(self, request: web.Request) -> web.Response:
        url = (await request.json())["url"]
        self.upstreams.append(url.rstrip("/"))
        return web.json_response({"upstreams": self.upstreams})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=("round_robin", "hash_mod_n"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True)
    args = parser.parse_args(argv)
    balancer = Balancer(args.policy, args.upstream)

    async def client(app: web.Application):  # type: ignore[no-untyped-def]
        connector = aiohttp.TCPConnector(limit=0)
        balancer.client = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        yield
        await balancer.client.close()

    app = web.Application()
    app.cleanup_ctx.append(client)
    app.router.add_get("/health", balancer.health)
    app.router.add_post("/admin/upstreams", balancer.add)
    app.router.add_route("*", "/v1/{tail:.*}", balancer.relay)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
