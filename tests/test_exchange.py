"""gymproxy.exchange, streaming end to end: the openai client -> gymproxy -> the fake vLLM, over real sockets."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import orjson
import pytest

from gymproxy.testing.fake_vllm import Script

from .test_routes import OVERFLOW_032

TOOLS = [{"type": "function", "name": "calc", "parameters": {"type": "object"}}]


def _strip_ids(response: dict) -> dict:
    response = {k: v for k, v in response.items() if k not in ("id", "created_at")}
    response["output"] = [
        {k: v for k, v in item.items() if k != "id" or item["type"] == "function_call"} for item in response["output"]
    ]
    return response


async def _raw_stream(url: str, path: str, body: dict) -> tuple[aiohttp.ClientResponse, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as response:
            return response, await response.read()


def _body(path: str) -> dict:
    if path == "/v1/responses":
        return {"model": "m", "stream": True, "input": "x"}
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}


def _events(raw: bytes) -> list[dict]:
    return [
        orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]


async def test_responses_stream_events_and_final_equal_non_streaming(client, fake_vllm):
    script = Script(
        content="The answer is 4.",
        reasoning="two plus two",
        tool_calls=[{"name": "calc", "arguments": '{"x": 1}', "id": "call_9"}],
    )
    fake_vllm.push(script, script)
    plain = await client.responses.create(model="m", input="2+2?", tools=TOOLS)
    stream = await client.responses.create(model="m", input="2+2?", tools=TOOLS, stream=True)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert _strip_ids(final.model_dump()) == _strip_ids(plain.model_dump())
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "The answer is 4." and len([e for e in events if e.type == "response.output_text.delta"]) > 1
    thoughts = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert thoughts == "two plus two"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == '{"x": 1}'
    added = {e.item.id for e in events if e.type == "response.output_item.added"}
    assert {item.id for item in final.output} == added
    sent = fake_vllm.last_json()
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert final.usage is not None and final.usage.output_tokens > 0


async def test_responses_stream_helper_get_final_response(client, fake_vllm):
    fake_vllm.push(Script(content="hello world", reasoning="hmm"))
    async with client.responses.stream(model="m", input="x") as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.output_text == "hello world"
    assert [item.type for item in final.output] == ["reasoning", "message"]


async def test_responses_stream_length_ends_incomplete(client, fake_vllm):
    fake_vllm.push(Script(content="one two three", finish_reason="length"))
    events = [e async for e in await client.responses.create(model="m", input="x", stream=True)]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


async def test_responses_stream_context_overflow(client, fake_vllm):
    fake_vllm.push(Script(status=400, error_message=OVERFLOW_032))
    events = [e async for e in await client.responses.create(model="m", input="x", stream=True)]
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert "response.output_item.added" in types and "response.content_part.added" in types
    final = events[-1].response
    assert final.output_text == "" and final.status == "incomplete"


async def test_chat_stream_context_overflow_is_a_length_finish(client, fake_vllm):
    fake_vllm.push(Script(status=400, error_message=OVERFLOW_032))
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
async def test_error_before_first_chunk_is_a_json_error(proxy_url, fake_vllm, path):
    fake_vllm.push(Script(status=503, error_message="engine overloaded"))
    response, raw = await _raw_stream(proxy_url, path, _body(path))
    assert response.status == 503
    assert orjson.loads(raw)["error"]["message"] == "engine overloaded"


async def test_first_event_arrives_before_the_upstream_finishes(client, fake_vllm):
    fake_vllm.push(Script(content="a b c d e", chunk_delay=0.25))
    started = time.monotonic()
    stream = await client.responses.create(model="m", input="x", stream=True)
    first_text = None
    async for event in stream:
        if event.type == "response.output_text.delta" and first_text is None:
            first_text = time.monotonic() - started
    total = time.monotonic() - started
    assert total > 1.0
    assert first_text is not None and first_text < total - 0.5


async def test_chat_stream_relays_chunks_with_vllm_fields(start_proxy, fake_vllm):
    url = await start_proxy(uses_reasoning_parser=False)
    fake_vllm.push(Script(content="alpha beta gamma"))
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
        "stream_options": {"include_usage": True},
    }
    response, raw = await _raw_stream(url, "/v1/chat/completions", body)
    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    assert response.headers["X-Accel-Buffering"] == "no"
    assert "Content-Encoding" not in response.headers
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = _events(raw)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "alpha beta gamma"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert fake_vllm.last_json()["stream_options"] == {"include_usage": True}


async def test_chat_stream_folds_reasoning_into_think(client, fake_vllm):
    fake_vllm.push(Script(content="final answer", reasoning="step one step two"))
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "<think>step one step two</think>final answer"


async def test_chat_stream_openai_client_tool_calls(client, fake_vllm):
    fake_vllm.push(Script(tool_calls=[{"name": "a", "arguments": '{"k": 1}'}, {"name": "b", "arguments": '{"k": 2}'}]))
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        tools=[{"type": "function", "function": {"name": "a"}}],
    )
    calls: dict[int, list[str]] = {}
    async for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            calls.setdefault(call.index, []).append(call.function.arguments or "")
    assert {i: "".join(parts) for i, parts in calls.items()} == {0: '{"k": 1}', 1: '{"k": 2}'}


@pytest.mark.parametrize("mode", ["reset", "truncate", "bad_json", "error"])
async def test_responses_stream_upstream_dies_mid_stream(client, fake_vllm, mode):
    fake_vllm.push(Script(content="one two three four five six", fail_mid_stream=mode))
    stream = await client.responses.create(model="m", input="x", stream=True)
    events = [e async for e in stream]
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert events[-1].response.error.code == "server_error"
    assert "mid-stream" in events[-1].response.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("mode", ["reset", "truncate", "bad_json", "error"])
async def test_chat_stream_upstream_dies_mid_stream(proxy_url, fake_vllm, mode):
    fake_vllm.push(Script(content="one two three four five six", fail_mid_stream=mode))
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    response, raw = await _raw_stream(proxy_url, "/v1/chat/completions", body)
    assert response.status == 200
    assert raw.endswith(b"data: [DONE]\n\n")
    assert "error" in _events(raw)[-1]
    fake_vllm.push(Script(content="one two three four five six", fail_mid_stream=mode))
    async with openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.APIError):
            async for _ in await c.chat.completions.create(model="m", messages=body["messages"], stream=True):
                pass


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
async def test_client_disconnect_mid_stream_aborts_upstream(proxy_url, fake_vllm, path):
    fake_vllm.push(Script(content=" ".join(["word"] * 200), chunk_delay=0.05))
    body = _body(path)
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy_url + path, json=body) as response:
            assert response.status == 200
            await response.content.readany()
            await asyncio.sleep(0.1)
            left = time.monotonic()
            response.close()
    for _ in range(100):
        if fake_vllm.disconnects:
            break
        await asyncio.sleep(0.01)
    assert fake_vllm.disconnects, "the upstream never saw the disconnect"
    assert fake_vllm.disconnects[0] - left < 1.0


async def test_keepalive_comments_while_upstream_is_silent(start_proxy, fake_vllm):
    url = await start_proxy(stream_keepalive_s=0.1)
    fake_vllm.push(Script(content="slow answer", chunk_delay=0.45))
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    _, raw = await _raw_stream(url, "/v1/chat/completions", body)
    assert b": keep-alive\n\n" in raw
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in _events(raw) if c["choices"]) == "slow answer"


async def test_sequential_guard_streams_locally(start_proxy, fake_vllm):
    url = await start_proxy(sequential_reasoning_allowed=False, uses_reasoning_parser=True)
    items = [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
    ]
    _, raw = await _raw_stream(url, "/v1/responses", {"model": "m", "input": items, "stream": True})
    events = _events(raw)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "content_filter"}
