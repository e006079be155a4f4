"""The first request of each real agent harness, replayed through gymproxy in front of the fake vLLM.

tests/data/harnesses/ holds what Codex CLI (`codex exec`) and Claude Code (`claude -p`) send first,
as they sent it to gymproxy (recorded, redacted, by tests/integration/test_harnesses.py with
GYMPROXY_RECORD=1): headers and body unchanged but for ids, local paths and long texts. Each must
get a 200 and a complete stream whose text is the fake's answer to the prompt, as the harness
needs to go on; the integration suite then runs the harnesses themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gymproxy import build_config, create_app
from gymproxy.testing.fake_vllm import FakeVLLM

SAMPLES = sorted((Path(__file__).parent / "data" / "harnesses").glob("*-first-request.json"))
PROMPT = "Say hello [[no-call]]"  # what the recordings asked; the fake answers "echo: <last user text>"
# How each API's stream ends, and where its text is.
TERMINAL = {"/v1/responses": "response.completed", "/v1/messages": "message_stop"}
TEXT_DELTAS = {"/v1/responses": "response.output_text.delta", "/v1/messages": "content_block_delta"}


@pytest.fixture
async def long_vllm(aiohttp_server: Any) -> FakeVLLM:
    """A fake vLLM with the context the harnesses need (Claude Code asks for max_tokens 32000)."""
    fake = FakeVLLM(model="tiny-qwen2", max_model_len=65_536)
    fake.url = str((await aiohttp_server(fake.app)).make_url("/v1"))
    return fake


def events(body: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body (either API's: `data:` lines, `event:` lines ignored)."""
    lines = body.decode().splitlines()
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]


def text_of(route: str, stream: list[dict[str, Any]]) -> str:
    deltas = [e for e in stream if e.get("type") == TEXT_DELTAS[route]]
    if route == "/v1/responses":
        return "".join(e["delta"] for e in deltas)
    return "".join(e["delta"].get("text", "") for e in deltas if e["delta"].get("type") == "text_delta")


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.name.removesuffix("-first-request.json") for p in SAMPLES])
async def test_first_request_of_a_harness_is_served(sample: Path, aiohttp_server: Any, long_vllm: FakeVLLM) -> None:
    case = json.loads(sample.read_text())
    assert PROMPT in case["command"], "re-recorded with another prompt: update PROMPT"
    config = build_config({"model": "tiny-qwen2", "base_url": long_vllm.url, "uses_reasoning_parser": True}, {})
    proxy = await aiohttp_server(create_app(config))
    route = case["path"].split("?")[0]
    async with aiohttp.ClientSession() as session:
        async with session.request(
            case["method"], proxy.make_url(case["path"]), data=json.dumps(case["body"]), headers=case["headers"]
        ) as resp:
            status, content_type, body = resp.status, resp.content_type, await resp.read()
    assert (status, content_type) == (200, "text/event-stream"), body[:2000]
    stream = events(body)
    assert stream and stream[-1]["type"] == TERMINAL[route], stream[-3:]
    assert text_of(route, stream).startswith("echo: ") and PROMPT in text_of(route, stream)
    (generation,) = [r for r in long_vllm.requests if r.path != "/v1/models"]
    assert generation.json["stream"] is True
