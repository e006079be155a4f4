"""gymproxy mounted three ways: standalone, as a sub-app, and with setup(prefix=...)."""

from __future__ import annotations

import openai
import pytest
from aiohttp import web

import gymproxy


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
