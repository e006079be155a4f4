"""Shared fixtures: a fake vLLM on a real port, and gymproxy on another port in front of it.

Every server a test starts runs as `gymproxy serve` runs it: on uvloop when it is installed, and
with `handler_cancellation=True` (aiohttp's test server sets it; `test_production_mode.py` checks).
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from gymproxy import build_config, create_app
from gymproxy.server import new_loop
from gymproxy.testing.fake_vllm import FakeVLLM

from .stores import Backend, RedisServer


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """The event loop `gymproxy serve` uses: uvloop's when installed, else asyncio's."""
    return {"uvloop" if _has_uvloop() else "asyncio": new_loop}


def has_ipv6_loopback() -> bool:
    """Whether this host can listen on ::1 (some containers have no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
async def fake_vllm(aiohttp_server):
    """A FakeVLLM on a real loopback port; `.url` is its base URL ending in /v1."""
    fake = FakeVLLM()
    server = await aiohttp_server(fake.app)
    fake.url = str(server.make_url("/v1"))
    return fake


ProxyFactory = Callable[..., Awaitable[str]]


@pytest.fixture
def start_proxy(aiohttp_server, fake_vllm) -> ProxyFactory:
    """`await start_proxy(**config)` runs gymproxy in front of `fake_vllm`; returns its root URL."""

    async def start(**config: Any) -> str:
        config.setdefault("base_url", fake_vllm.url)
        server = await aiohttp_server(create_app(build_config(config, environ={})))
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
async def proxy_url(start_proxy) -> str:
    """gymproxy with a NeMo Gym-like config (reasoning parser on, model pinned)."""
    return await start_proxy(model="policy", uses_reasoning_parser=True)


@pytest.fixture
async def client(proxy_url):
    """The real openai client, pointed at gymproxy."""
    async with openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="test-key", max_retries=0) as c:
        yield c


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """One line for CI: what the fault, hostile-input and load suites survived."""
    from .faults import STATS, summary

    if STATS["faults"] or STATS["hostile"]:
        terminalreporter.write_line(f"reliability: {summary()}")


@pytest.fixture
def redis_server(tmp_path):
    """A started redis-server of the test's own (skipped, saying why, when there is none), killed after it."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "redis"])
async def backend(request, tmp_path):
    """Each kind of rollout store in turn (see tests/stores.py); its stores closed after the test."""
    made = Backend(request.param, tmp_path)
    try:
        yield made
    finally:
        await made.close()
