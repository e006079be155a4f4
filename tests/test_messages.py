"""Anthropic's Messages API through gymproxy (gymproxy.messages and its routes): relayed to the fake
vLLM's Anthropic endpoint over real sockets, with the real anthropic SDK and Claude Code's requests."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from gymproxy import build_config, create_app
from gymproxy.errors import BadRequest, NoUpstream, Unauthorized, UpstreamError, UpstreamTimeout
from gymproxy.messages import error_body, prepare, upstream_headers
from gymproxy.pinning import Signer
from gymproxy.testing.fake_vllm import FakeVLLM, Script

from .faults import Conn, RawRequest, RawUpstream, free_port, reset_before_status, start_proxy
from .served import Served

CLAUDE_SESSION = "X-Claude-Code-Session-Id"
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"]


def claude_code_body(*, stream: bool = True, text: str = "list the files here") -> dict[str, Any]:
    """A request as Claude Code 2.1 sends it (shortened): thinking, context management, output config,
    metadata, custom tools (one deferred), the system prompt as blocks and a system message inline."""
    return {
        "model": "claude-sonnet-4-5-20250929",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "<system-reminder>The date is 2026-12-01.</system-reminder>"},
        ],
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=8f1d;"},
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI.",
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "Run a shell command",
                "input_schema": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}, "model": {"type": "string"}},
                    "required": ["command"],
                },
            },
            {"name": "WebSearch", "description": "Search", "input_schema": {"type": "object"}, "defer_loading": True},
        ],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "user_5f3a_account__session_0b1c2d3e"},
        "max_tokens": 32000,
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": stream,
    }


def claude_code_headers(session: str = "0b1c2d3e", key: str = "client-key") -> list[tuple[str, str]]:
    headers = [("x-api-key", key), ("anthropic-version", "2023-06-01"), (CLAUDE_SESSION, session)]
    headers += [("anthropic-beta", beta) for beta in BETAS]  # (aiohttp's client merges names of other cases)
    return headers + [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.3 (external, cli)")]


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """An Anthropic event stream's (event, data) pairs; checks the framing on the way."""
    frames = raw.split(b"\n\n")
    assert frames.pop() == b"", raw[-200:]
    pairs = []
    for frame in frames:
        event, data = frame.split(b"\n")
        assert event.startswith(b"event: ") and data.startswith(b"data: "), frame
        pairs.append((event[7:].decode(), orjson.loads(data[6:])))
    return pairs


@pytest.fixture
async def big_vllm(aiohttp_server) -> FakeVLLM:
    """A fake vLLM whose context takes Claude Code's max_tokens of 32000."""
    fake = FakeVLLM(max_model_len=200_000)
    fake.url = str((await aiohttp_server(fake.app)).make_url("/v1"))
    return fake


async def proxy_for(aiohttp_server, fake: FakeVLLM | str | list[str], **config: Any) -> str:
    base = fake.url if isinstance(fake, FakeVLLM) else fake
    server = await aiohttp_server(create_app(build_config({"base_url": base, **config}, environ={})))
    return str(server.make_url("")).rstrip("/")


async def post(url: str, path: str, body: Any, headers: Any = ()) -> tuple[int, aiohttp.typedefs.LooseHeaders, bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, data=data, headers=list(headers)) as r:
            return r.status, r.headers, await r.read()


def messages_of(fake: FakeVLLM) -> list[Any]:
    return [r for r in fake.requests if r.path.startswith("/v1/messages")]


# --- the pure parts ---------------------------------------------------------------------------------


def test_prepare_edits_the_first_model_in_place_and_re_encodes_otherwise() -> None:
    raw = orjson.dumps(claude_code_body())
    body, user_id, stream = prepare(raw, "policy")
    assert body == raw.replace(b'"claude-sonnet-4-5-20250929"', b'"policy"', 1)  # not one other byte moved
    assert user_id == "user_5f3a_account__session_0b1c2d3e"
    assert prepare(raw, None) == (raw, user_id, stream)  # no model configured: the very bytes
    assert prepare(raw, "claude-sonnet-4-5-20250929")[0] is raw  # the configured one already: untouched
    assert prepare(b' {\n "model" : "c\\"q", "model2": 1}', "p")[0] == b' {\n "model" : "p", "model2": 1}'
    for other in (b'{"max_tokens": 1, "model": "c"}', b'{"model": "a", "model": "b"}', b'{"model": 5}', b"{}"):
        body = prepare(other, "p").body
        assert orjson.loads(body)["model"] == "p", other
    nested = b'{"metadata": {"model": "keep"}, "model": "c"}'
    assert orjson.loads(prepare(nested, "p")[0]) == {"metadata": {"model": "keep"}, "model": "p"}
    assert prepare(b'{"model": "c", "metadata": {"user_id": 7}}', None).user_id is None
    assert [prepare(b'{"model": "c", "stream": %s}' % v, None).stream for v in (b"true", b"false", b'"true"')] == [
        True,
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"model": "c"', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b'{"model": "c"} trailing', "not valid JSON"),
    ],
)
def test_prepare_refuses_what_is_not_one_json_object(raw: bytes, message: str) -> None:
    for model in (None, "p"):
        with pytest.raises(BadRequest, match=message):
            prepare(raw, model)


def test_upstream_headers_are_the_anthropic_ones() -> None:
    assert upstream_headers(claude_code_headers()) == {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": ",".join(BETAS),
    }
    assert upstream_headers([("Anthropic-Beta", "a"), ("anthropic-beta", "b"), ("X-Api-Key", "k")]) == {
        "anthropic-beta": "a,b"
    }


def test_error_envelope_types() -> None:
    cases = [
        (BadRequest("bad"), "invalid_request_error"),
        (Unauthorized("who"), "authentication_error"),
        (UpstreamError("gone"), "api_error"),
        (UpstreamTimeout("slow"), "api_error"),
        (NoUpstream("none"), "overloaded_error"),
    ]
    for exc, kind in cases:
        assert orjson.loads(error_body(exc)) == {"type": "error", "error": {"type": kind, "message": exc.message}}


# --- Claude Code, end to end -------------------------------------------------------------------------


async def test_claude_code_request_is_relayed_as_sent(aiohttp_server, big_vllm):
    url = await proxy_for(aiohttp_server, big_vllm, model="policy", api_key="sk-upstream", access={"api_keys": ["ck"]})
    async with aiohttp.ClientSession() as session:
        async with session.head(url + "/api/hello") as r:
            assert r.status == 200
        raw = orjson.dumps(claude_code_body())
        async with session.post(url + "/v1/messages?beta=true", data=raw, headers=claude_code_headers(key="ck")) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            assert r.headers["X-Accel-Buffering"] == "no" and "X-Request-Id" in r.headers
            events = sse(await r.read())
    (seen,) = messages_of(big_vllm)
    assert (seen.path, seen.query) == ("/v1/messages", "beta=true")
    assert seen.body == raw.replace(b'"claude-sonnet-4-5-20250929"', b'"policy"', 1)
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert seen.headers["anthropic-beta"] == ",".join(BETAS)
    assert seen.headers["Authorization"] == "Bearer sk-upstream"  # gymproxy's upstream key, not the client's
    assert "x-api-key" not in {name.lower() for name in seen.headers}
    sent = {name.lower(): value for name, value in seen.headers.items()}
    assert CLAUDE_SESSION.lower() not in sent and sent["x-request-id"] == r.headers["X-Request-Id"]
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    tool_use = next(data["content_block"] for kind, data in events if kind == "content_block_start")
    assert tool_use["type"] == "tool_use" and tool_use["name"] == "Bash"  # the fake's reply to tools offered
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[0][1]["message"]["model"] == "policy"


async def test_the_anthropic_sdk_through_gymproxy(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm, model="policy", access={"api_keys": ["ck"]})
    async with anthropic.AsyncAnthropic(base_url=url, api_key="ck", max_retries=0) as client:
        fake_vllm.push(Script(reasoning="a plan", content="Hello there."))
        message = await client.messages.create(
            model="claude-opus-4-1", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        )
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[1].text == "Hello there." and message.model == "policy"
        fake_vllm.push(Script(content="streamed one two three"))
        async with client.messages.stream(
            model="claude-opus-4-1", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "streamed one two three" and final.stop_reason == "end_turn"
        counted = await client.messages.count_tokens(
            model="claude-opus-4-1", messages=[{"role": "user", "content": "a b c"}]
        )
        assert counted.input_tokens == 3
        with pytest.raises(anthropic.BadRequestError) as caught:  # vLLM's own 400, as it sent it
            await client.messages.create(
                model="x", max_tokens=64, messages=[{"role": "user", "content": "[[overflow]]"}]
            )
        assert caught.value.body["error"]["type"] == "BadRequestError"
        assert "maximum context length" in caught.value.message
    async with anthropic.AsyncAnthropic(base_url=url, auth_token="ck", max_retries=0) as client:  # Bearer
        assert (await client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}])).input_tokens
    assert [r.json["model"] for r in messages_of(fake_vllm)] == ["policy"] * 5


async def test_the_model_passes_unchanged_without_a_configured_one(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm)
    raw = orjson.dumps({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "model": "claude-x"})
    status, _, body = await post(url, "/v1/messages", raw)
    assert status == 200 and orjson.loads(body)["model"] == "claude-x"
    assert messages_of(fake_vllm)[-1].body == raw


async def test_count_tokens_and_rollout_scoped_urls(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm, model="policy", default_query={"api-version": "7"})
    body = {"model": "claude-x", "messages": [{"role": "user", "content": "one two"}]}
    status, _, reply = await post(url, "/v1/messages/count_tokens?beta=true", body)
    assert (status, orjson.loads(reply)["input_tokens"]) == (200, 2)
    seen = messages_of(fake_vllm)[-1]
    assert (seen.path, seen.query, seen.json["model"]) == (
        "/v1/messages/count_tokens",
        "api-version=7&beta=true",
        "policy",
    )
    status, _, reply = await post(url, "/ng-rollout/r-1/v1/messages", {**body, "max_tokens": 8})
    assert status == 200 and orjson.loads(reply)["content"][0]["text"] == "echo: one two"


# --- streaming, disconnects ---------------------------------------------------------------------------


async def test_events_are_relayed_as_they_come(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm)
    fake_vllm.push(Script(content="a b c d e", chunk_delay=0.25))
    started = time.monotonic()
    arrivals = []
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        async with session.post(url + "/v1/messages", json=body) as r:
            async for line in r.content:
                if line.startswith(b"event: content_block_delta"):
                    arrivals.append(time.monotonic() - started)
    total = time.monotonic() - started
    assert total > 1.0 and len(arrivals) == 5
    assert arrivals[0] < total - 0.75  # the first delta came a second before the stream ended


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_client_that_leaves_aborts_the_generation(aiohttp_server, fake_vllm, streamed):
    url = await proxy_for(aiohttp_server, fake_vllm)
    fake_vllm.push(Script(content=" ".join(["word"] * 200), chunk_delay=0.05) if streamed else Script(hang=True))
    body = {"model": "m", "max_tokens": 300, "stream": streamed, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(session.post(url + "/v1/messages", json=body))
        if streamed:
            response = await request
            assert response.status == 200
            await response.content.readany()
            left = time.monotonic()
            response.close()
        else:
            await asyncio.sleep(0.3)
            left = time.monotonic()
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
    for _ in range(100):
        if fake_vllm.disconnects:
            break
        await asyncio.sleep(0.01)
    assert fake_vllm.disconnects, "vLLM never saw the client go away"
    assert fake_vllm.disconnects[0] - left < 1.0


async def test_claude_code_through_gymproxy_serve(tmp_path, big_vllm):
    """The command as installed: HEAD /api/hello, then a streamed turn, keyed by Claude Code's session."""
    async with Served(tmp_path, {"base_url": big_vllm.url, "model": "policy"}) as served:
        big_vllm.push(Script(content="done and dusted", chunk_delay=0.05))
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            async with session.head(served.url + "/api/hello") as r:
                assert r.status == 200
            async with session.post(
                served.url + "/v1/messages?beta=true", json=claude_code_body(text="hi"), headers=claude_code_headers()
            ) as r:
                assert r.status == 200
                events = sse(await r.read())
    assert "".join(d["delta"].get("text", "") for k, d in events if k == "content_block_delta") == "done and dusted"
    assert messages_of(big_vllm)[-1].json["model"] == "policy"


# --- errors -------------------------------------------------------------------------------------------


def envelope(raw: bytes) -> tuple[str, str]:
    body = orjson.loads(raw)
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]["type"], body["error"]["message"]


async def test_gymproxys_own_errors_in_anthropic_s_envelope(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm, access={"api_keys": ["ck"]}, max_body_size=4096)
    key = [("x-api-key", "ck")]
    ok = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, _, raw = await post(url, path, ok)
        assert (status, envelope(raw)[0]) == (401, "authentication_error"), path
        status, _, raw = await post(url, path, ok, [("x-api-key", "wrong"), ("Authorization", "Bearer nope")])
        assert (status, envelope(raw)[0]) == (401, "authentication_error")
        for bad in (b"{not json", b"[1]"):
            status, _, raw = await post(url, path, bad, key)
            assert (status, envelope(raw)[0]) == (400, "invalid_request_error"), bad
        status, _, raw = await post(url, path, {**ok, "padding": "x" * 5000}, key)
        assert (status, envelope(raw)[0]) == (413, "request_too_large")
        assert (await post(url, path, ok, key))[0] == 200
        assert (await post(url, path, ok, [("Authorization", "Bearer ck")]))[0] == 200
    status, _, raw = await post(url, "/v1/responses", b"{not json", [("Authorization", "Bearer ck")])
    assert status == 400 and "error" in orjson.loads(raw) and "type" not in orjson.loads(raw)  # still OpenAI's there


async def test_a_body_that_stops_arriving_is_a_408_in_the_envelope(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm, limits={"client_body_timeout": 0.3})
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    writer.write(b'Content-Length: 100\r\n\r\n{"model":')
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert envelope(reply.partition(b"\r\n\r\n")[2])[0] == "invalid_request_error"


async def test_upstream_errors_pass_as_vllm_sent_them(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm, model="policy")
    for text, status in (("[[error:503]]", 503), ("[[overflow]]", 400), ("[[error:429]]", 429)):
        body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": text}]}
        got, headers, raw = await post(url, "/v1/messages", body)
        direct = FakeVLLM()._overflow(4097).message if text == "[[overflow]]" else f"fake vLLM: injected error {status}"
        assert got == status and headers["Content-Type"].startswith("application/json")
        assert orjson.loads(raw)["error"]["message"] == direct
    status, _, raw = await post(url, "/v1/messages", {"model": "m", "messages": []})  # vLLM's validation answer
    assert status == 400 and orjson.loads(raw)["error"]["code"] == 400


async def test_no_upstream_and_a_silent_one(aiohttp_server, fake_vllm):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    port = free_port()
    url = await proxy_for(aiohttp_server, f"http://user:secret@127.0.0.1:{port}/v1")
    status, _, raw = await post(url, "/v1/messages", body)
    kind, message = envelope(raw)
    assert (status, kind) == (502, "api_error")
    assert f"http://127.0.0.1:{port}/v1/messages" in message and "secret" not in message
    two = [f"http://127.0.0.1:{free_port()}/v1", f"http://127.0.0.1:{port}/v1"]
    url = await proxy_for(aiohttp_server, two, health={"interval": 60})
    status, _, raw = await post(url, "/v1/messages", body)
    assert (status, envelope(raw)[0]) == (503, "overloaded_error")
    url = await proxy_for(aiohttp_server, f"http://user:secret@{fake_vllm.url[7:]}", timeouts={"read": 0.3})
    fake_vllm.push(Script(hang=True))
    status, _, raw = await post(url, "/v1/messages", {**body, "stream": True})
    kind, message = envelope(raw)
    assert (status, kind) == (504, "api_error")
    assert fake_vllm.url + "/messages" in message and "secret" not in message


# --- hostile upstreams --------------------------------------------------------------------------------


HALF = b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","content":[],"model":"raw"}}\n\n'


def stream_then(ending: str):
    """Half an Anthropic stream, then: `reset` at an event boundary, or `cut` inside an event."""

    async def behave(conn: Conn, req: RawRequest) -> bool:
        await conn.head(200, "text/event-stream")
        await conn.chunk(HALF if ending == "reset" else HALF + b'event: content_block_delta\ndata: {"ty')
        await conn.settle()
        conn.reset()
        return False

    return behave


@pytest.fixture
async def raw():
    upstream = await RawUpstream().start()
    yield upstream
    await upstream.close()


async def test_a_reset_before_any_byte_is_a_502_and_a_refused_connection_fails_over(aiohttp_server, raw, fake_vllm):
    url, _ = await start_proxy(aiohttp_server, raw.url)
    raw.push(reset_before_status)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    status, _, reply = await post(url, "/v1/messages", body)
    kind, message = envelope(reply)
    assert (status, kind) == (502, "api_error") and f"{raw.url}/messages" in message
    # Two upstreams, the session pinned to one that refuses: the other serves it, and vLLM ran it once.
    dead = f"http://127.0.0.1:{free_port()}/v1"
    url, _ = await start_proxy(aiohttp_server, [dead, fake_vllm.url], pinning={"secret": "s"})
    pin = Signer(b"s", 3600).sign(dead)
    status, headers, reply = await post(url, "/v1/messages", body, [("Cookie", f"gymproxy_pin={pin}")])
    assert status == 200 and orjson.loads(reply)["content"][0]["text"] == "echo: x"
    assert len(messages_of(fake_vllm)) == 1 and "gymproxy_pin=" in headers["Set-Cookie"]


async def test_a_stream_broken_off_ends_with_an_error_event_or_a_cut(aiohttp_server, raw):
    url, proxy = await start_proxy(aiohttp_server, raw.url)
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    raw.push(stream_then("reset"))
    status, _, reply = await post(url, "/v1/messages", body)
    assert status == 200 and reply.startswith(HALF)
    (last, data) = sse(reply)[-1]
    assert last == "error" and data["error"]["type"] == "api_error"
    assert f"{raw.url} failed mid-stream" in data["error"]["message"]
    raw.push(stream_then("cut"))  # inside an event: no event can follow, so the client sees the cut
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/messages", json=body) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    assert proxy.fleet.client.in_use == 0


async def test_a_stream_still_running_at_the_end_of_the_grace_ends_with_an_overloaded_error(aiohttp_server, fake_vllm):
    url, proxy = await start_proxy(aiohttp_server, fake_vllm.url)
    fake_vllm.push(Script(content=" ".join(["word"] * 100), chunk_delay=0.05))
    body = {"model": "m", "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/messages", json=body) as r:
            await r.content.readuntil(b"\n\n")
            proxy.end_requests()
            events = sse(b"event: " + (await r.read()).partition(b"event: ")[2])
    assert events[-1][0] == "error" and events[-1][1]["error"] == {
        "type": "overloaded_error",
        "message": "gymproxy is shutting down",
    }


# --- the switch, metrics ------------------------------------------------------------------------------


async def test_the_switch_turns_the_routes_off(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm, anthropic_messages=False)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert (await post(url, path, body))[0] == 404
    async with aiohttp.ClientSession() as session:
        async with session.head(url + "/api/hello") as r:
            assert r.status == 404
    assert messages_of(fake_vllm) == []


async def test_metrics_count_the_routes(aiohttp_server, fake_vllm):
    url = await proxy_for(aiohttp_server, fake_vllm)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    await post(url, "/v1/messages", body)
    await post(url, "/v1/messages", b"[]")
    await post(url, "/v1/messages/count_tokens", body)
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/api/hello") as r:
            assert r.status == 200
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    for line in (
        'gymproxy_requests_total{route="/v1/messages",status="200"} 1',
        'gymproxy_requests_total{route="/v1/messages",status="400"} 1',
        'gymproxy_requests_total{route="/v1/messages/count_tokens",status="200"} 1',
        'gymproxy_requests_total{route="/api/hello",status="200"} 1',
    ):
        assert line in text, line
