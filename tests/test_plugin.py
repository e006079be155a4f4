"""gymproxy mounted three ways: standalone, as a sub-app, and with setup(prefix=...)."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from aiohttp import web

import gymproxy
import gymproxy.plugin


def _config(fake_vllm) -> gymproxy.Config:
    return gymproxy.build_config({"base_url": fake_vllm.url, "model": "policy"}, environ={})


async def _ask(base_url: str) -> str:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        response = await client.responses.create(model="m", input="ping")
    return response.output_text


async def test_standalone(aiohttp_server, fake_vllm):
    server = await aiohttp_server(gymproxy.create_app(_config(fake_vllm)))
    assert await _ask(str(server.make_url("/v1"))) == "echo: ping"


async def test_as_subapp(aiohttp_server, fake_vllm):
    host = web.Application()

    async def home(request: web.Request) -> web.Response:
        return web.Response(text="host")

    host.router.add_get("/", home)
    host.add_subapp("/llm", gymproxy.create_app(_config(fake_vllm)))
    server = await aiohttp_server(host)
    assert await _ask(str(server.make_url("/llm/v1"))) == "echo: ping"


async def test_setup_with_prefix_adds_no_middleware(aiohttp_server, aiohttp_client, fake_vllm):
    host = web.Application()

    async def boom(request: web.Request) -> web.Response:
        raise web.HTTPConflict(text="host's own")

    host.router.add_get("/teapot", boom)
    proxy = gymproxy.setup(host, _config(fake_vllm), prefix="/llm")
    assert proxy.config.model == "policy"
    assert list(host.middlewares) == []
    server = await aiohttp_server(host)
    assert await _ask(str(server.make_url("/llm/v1"))) == "echo: ping"
    client = await aiohttp_client(server)
    response = await client.get("/teapot")
    assert response.status == 409  # the host's own error handling is untouched
    assert await response.text() == "host's own"


async def test_two_instances_in_one_app(aiohttp_server, fake_vllm):
    host = web.Application()
    gymproxy.setup(host, gymproxy.build_config({"base_url": fake_vllm.url, "model": "a"}, environ={}), prefix="/a")
    gymproxy.setup(host, gymproxy.build_config({"base_url": fake_vllm.url, "model": "b"}, environ={}), prefix="/b")
    server = await aiohttp_server(host)
    await _ask(str(server.make_url("/a/v1")))
    assert fake_vllm.last_json()["model"] == "a"
    await _ask(str(server.make_url("/b/v1")))
    assert fake_vllm.last_json()["model"] == "b"


def test_bad_prefix_is_refused(fake_vllm):
    with pytest.raises(ValueError, match="prefix"):
        gymproxy.setup(web.Application(), _config(fake_vllm), prefix="llm/")


async def test_readme_plugin_snippet_runs(aiohttp_server, fake_vllm):
    """The README's plugin example, with the real vLLM URL swapped for the fake's."""
    readme = (__import__("pathlib").Path(__file__).parent.parent / "README.md").read_text()
    snippet = readme.split("## As a plugin in your own aiohttp app", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    snippet = snippet.replace("http://127.0.0.1:8001/v1", fake_vllm.url).replace("web.run_app(app)", "")
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    server = await aiohttp_server(scope["app"])
    assert await _ask(str(server.make_url("/llm/v1"))) == "echo: ping"


PROBE_PATHS = ("/", "/healthz", "/livez", "/readyz")


async def _probe(session, url: str) -> tuple[int, bytes]:
    async with session.get(url) as r:
        return r.status, await r.read()


async def test_liveness_probes_standalone_open_and_cheap(aiohttp_server, fake_vllm):
    config = gymproxy.build_config({"base_url": fake_vllm.url, "access": {"api_keys": ["k"]}}, environ={})
    server = await aiohttp_server(gymproxy.create_app(config))
    seen = len(fake_vllm.requests)
    async with aiohttp.ClientSession() as session:
        for path in PROBE_PATHS:
            assert await _probe(session, str(server.make_url(path))) == (200, b'{"status":"ok"}'), path
            async with session.head(server.make_url(path)) as r:
                assert r.status == 200
        async with session.get(server.make_url("/health")) as r:  # still the fleet's state
            assert r.status == 200 and (await r.json())["upstreams"][0]["healthy"] is True
        async with session.post(server.make_url("/v1/responses"), json={"model": "m", "input": "x"}) as r:
            assert r.status == 401  # the probes are open; the API is not
    assert [r.path for r in fake_vllm.requests[seen:] if r.path != "/v1/models"] == []  # but the startup probe


async def test_liveness_probes_leave_a_host_app_its_own_paths(aiohttp_server, fake_vllm):
    host = web.Application()

    async def own(request: web.Request) -> web.Response:
        return web.Response(text=f"host {request.path}")

    host.router.add_get("/", own)
    host.router.add_get("/healthz", own)
    gymproxy.setup(host, _config(fake_vllm))
    gymproxy.setup(host, gymproxy.build_config({"base_url": fake_vllm.url}, environ={}), prefix="/llm")
    server = await aiohttp_server(host)
    async with aiohttp.ClientSession() as session:
        assert await _probe(session, str(server.make_url("/"))) == (200, b"host /")
        assert await _probe(session, str(server.make_url("/healthz"))) == (200, b"host /healthz")
        assert await _probe(session, str(server.make_url("/livez"))) == (200, b'{"status":"ok"}')
        for path in PROBE_PATHS:  # under a prefix every probe is gymproxy's, `/` too
            assert await _probe(session, str(server.make_url("/llm" + path))) == (200, b'{"status":"ok"}'), path


async def test_liveness_probes_in_a_subapp_and_on_the_admin_port(aiohttp_server, fake_vllm):
    host = web.Application()
    host.add_subapp("/llm", gymproxy.create_app(_config(fake_vllm)))
    server = await aiohttp_server(host)
    admin = gymproxy.plugin.admin_app(gymproxy.setup(web.Application(), _config(fake_vllm)))
    admin_server = await aiohttp_server(admin)
    async with aiohttp.ClientSession() as session:
        for path in PROBE_PATHS:
            assert await _probe(session, str(server.make_url("/llm" + path))) == (200, b'{"status":"ok"}'), path
            assert await _probe(session, str(admin_server.make_url(path))) == (200, b'{"status":"ok"}'), path
