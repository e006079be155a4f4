"""The fake vLLM's Anthropic Messages endpoint, over real sockets: vLLM's wire format, read by the real SDK."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from gymproxy.testing.fake_vllm import FakeVLLM, Script

TOOLS = [
    {"name": "Bash", "description": "run a command", "input_schema": {"type": "object"}},
    {"name": "WebFetch", "input_schema": {"type": "object"}, "defer_loading": True},
]


def ask(text: Any = "hello there", **fields: Any) -> dict[str, Any]:
    return {"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": text}], **fields}


async def post(fake: FakeVLLM, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession() as session, session.post(fake.url + path, data=data) as resp:
        return resp.status, await resp.json(content_type=None)


async def events(fake: FakeVLLM, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """POST with stream=true; checks the framing (`event:` then `data:`) and returns (event, data) pairs."""
    async with aiohttp.ClientSession() as session:
        async with session.post(fake.url + "/messages", json={**body, "stream": True}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            raw = await resp.read()
    frames = raw.split(b"\n\n")
    assert frames.pop() == b""
    out = []
    for frame in frames:
        event, data = frame.split(b"\n")
        assert event.startswith(b"event: ") and data.startswith(b"data: "), frame
        payload = orjson.loads(data[6:])
        assert payload["type"] == event[7:].decode()
        out.append((event[7:].decode(), payload))
    return out


async def test_a_whole_message_as_vllm_answers(fake_vllm: FakeVLLM) -> None:
    status, body = await post(fake_vllm, "/messages", ask())
    assert status == 200
    assert list(body) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert body["id"].startswith("chatcmpl-") and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": "echo: hello there"}]
    assert (body["model"], body["stop_reason"]) == ("claude-x", "end_turn")
    assert body["usage"] == {"input_tokens": 2, "output_tokens": 3}
    assert fake_vllm.last_json() == ask() and fake_vllm.requests[-1].path == "/v1/messages"


async def test_thinking_text_and_tool_use_blocks(fake_vllm: FakeVLLM) -> None:
    call = {"name": "Bash", "arguments": '{"command": "ls -la"}', "id": "toolu_1"}
    fake_vllm.push(Script(reasoning="let me see", content="Listing.", tool_calls=[call]))
    _, body = await post(fake_vllm, "/messages", ask(tools=TOOLS))
    thinking, text, tool = body["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "let me see" and len(thinking["signature"]) == 32
    assert text == {"type": "text", "text": "Listing."}
    assert tool == {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls -la"}}
    assert body["stop_reason"] == "tool_use"
    fake_vllm.push(Script(content="one two three", finish_reason="length"))
    _, body = await post(fake_vllm, "/messages", ask())
    assert body["stop_reason"] == "max_tokens"


async def test_the_stream_as_vllm_sends_it(fake_vllm: FakeVLLM) -> None:
    call = {"name": "Bash", "arguments": '{"command": "ls"}', "id": "toolu_1"}
    fake_vllm.push(Script(reasoning="hmm ok", content="Sure thing.", tool_calls=[call]))
    got = await events(fake_vllm, ask(tools=TOOLS))
    kinds = [
        (kind, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type"))
        for kind, data in got
    ]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    start = got[0][1]["message"]
    # exclude_unset, with type and role set explicitly (vLLM 0.32, its issue #45367)
    assert list(start) == ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"]
    assert start["usage"] == {"input_tokens": 2, "output_tokens": 0} and start["content"] == []
    assert got[1][1] == {
        "type": "content_block_start",
        "content_block": {"type": "thinking", "thinking": ""},
        "index": 0,
    }
    assert got[6][1]["content_block"] == {"type": "text", "text": ""}
    assert got[10][1]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}
    assert "".join(d["delta"].get("thinking", "") for _, d in got if "delta" in d) == "hmm ok"
    assert "".join(d["delta"].get("text", "") for _, d in got if "delta" in d) == "Sure thing."
    assert "".join(d["delta"].get("partial_json", "") for _, d in got if "delta" in d) == '{"command": "ls"}'
    assert got[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 2, "output_tokens": 7},
    }
    assert got[-1][1] == {"type": "message_stop"}


async def test_replies_from_the_request_tools_and_tool_results(fake_vllm: FakeVLLM) -> None:
    _, body = await post(fake_vllm, "/messages", ask(tools=TOOLS))
    (tool,) = body["content"]
    assert tool["type"] == "tool_use" and tool["name"] == "Bash" and tool["input"] == {}
    assert body["stop_reason"] == "tool_use"
    named = ask(tools=TOOLS, tool_choice={"type": "tool", "name": "WebFetch"})
    assert (await post(fake_vllm, "/messages", named))[1]["content"][0]["name"] == "WebFetch"
    none = ask(tools=TOOLS, tool_choice={"type": "none"})
    assert (await post(fake_vllm, "/messages", none))[1]["content"][0]["type"] == "text"
    # The answer to a tool call, even with Claude Code's reminder text beside the result: text.
    history = [
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.txt"}]},
                {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
            ],
        },
    ]
    _, body = await post(fake_vllm, "/messages", {**ask(tools=TOOLS), "messages": history})
    # (vLLM puts the text after the tool result; it is no turn of its own: the user's turn is echoed)
    assert body["content"] == [{"type": "text", "text": "echo: list files"}]
    assert body["stop_reason"] == "end_turn"


async def test_system_prompt_forms_and_count_tokens(fake_vllm: FakeVLLM) -> None:
    status, body = await post(fake_vllm, "/messages/count_tokens", {"model": "claude-x", "messages": ask()["messages"]})
    assert (status, body) == (200, {"input_tokens": 2, "context_management": {"original_input_tokens": 2}})
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1a2b;"},  # dropped, as vLLM does
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ]
    messages = [{"role": "system", "content": "Be terse."}, *ask()["messages"]]
    for fields, tokens in [
        ({"system": "one two three"}, 5),
        ({"system": system}, 6),
        ({"system": system, "messages": messages}, 8),
    ]:
        _, counted = await post(fake_vllm, "/messages/count_tokens", {**ask(), **fields})
        assert counted["input_tokens"] == tokens, fields
        _, body = await post(fake_vllm, "/messages", {**ask(), **fields})
        assert body["usage"]["input_tokens"] == tokens and body["content"][0]["text"] == "echo: hello there"
    assert [r.path for r in fake_vllm.requests].count("/v1/messages/count_tokens") == 4


async def test_directives_and_errors_in_the_anthropic_envelope(fake_vllm: FakeVLLM) -> None:
    _, body = await post(fake_vllm, "/messages", ask("why [[reason]]"))
    assert [block["type"] for block in body["content"]] == ["thinking", "text"]
    status, body = await post(fake_vllm, "/messages", ask("[[error:503]]", stream=True))
    assert (status, body) == (
        503,
        {"type": "error", "error": {"type": "InternalServerError", "message": "fake vLLM: injected error 503"}},
    )
    status, body = await post(fake_vllm, "/messages", ask("[[overflow]]", stream=True))
    assert status == 400 and list(body) == ["type", "error"] and body["error"]["type"] == "BadRequestError"
    assert "maximum context length is 4096 tokens" in body["error"]["message"]
    status, body = await post(fake_vllm, "/messages", ask(max_tokens=5000))
    assert status == 400 and "cannot be greater than max_model_len" in body["error"]["message"]
    status, body = await post(fake_vllm, "/messages", ask(messages=[]))
    assert (status, body["error"]["type"]) == (400, "BadRequestError")
    # What vLLM's request model refuses gets FastAPI's answer there: vLLM's OpenAI-style 400.
    for bad in [{"model": "claude-x", "messages": []}, b'{"model": "claude-x", "messages": [', b"[1]"]:
        status, body = await post(fake_vllm, "/messages", bad)
        assert status == 400 and body["error"]["code"] == 400, bad


@pytest.mark.parametrize("mode", ["reset", "truncate", "bad_json", "error"])
async def test_fail_mid_stream(fake_vllm: FakeVLLM, mode: str) -> None:
    fake_vllm.push(Script(content="a b c d e f", fail_mid_stream=mode, error_message="engine died"))
    async with aiohttp.ClientSession() as session:
        async with session.post(fake_vllm.url + "/messages", json=ask(stream=True)) as resp:
            assert resp.status == 200
            if mode == "reset":
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
                return
            raw = await resp.read()
    assert raw.startswith(b"event: message_start\n") and b"message_stop" not in raw
    tail = {
        "truncate": b"",
        "bad_json": b"event: content_block_delta\ndata: {not json\n\n",
        "error": b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"engine died"}}\n\n',
    }[mode]
    assert raw.endswith(b'"index":0}\n\n' + tail)


async def test_the_anthropic_sdk_reads_the_fake(fake_vllm: FakeVLLM) -> None:
    root = fake_vllm.url.removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=root, api_key="x", max_retries=0) as client:
        fake_vllm.push(Script(reasoning="think", content="Hello, world."))
        message = await client.messages.create(model="claude-x", max_tokens=64, messages=ask()["messages"])
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[1].text == "Hello, world." and message.stop_reason == "end_turn"
        fake_vllm.push(Script(content="Streamed words.", tool_calls=[{"name": "Bash", "arguments": '{"a": 1}'}]))
        async with client.messages.stream(model="claude-x", max_tokens=64, messages=ask()["messages"]) as stream:
            text = "".join([chunk async for chunk in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Streamed words."
        assert [block.type for block in final.content] == ["text", "tool_use"]
        assert final.content[1].input == {"a": 1} and final.stop_reason == "tool_use"
        assert final.usage.output_tokens > 0
        counted = await client.messages.count_tokens(model="claude-x", messages=ask()["messages"])
        assert counted.input_tokens == 2
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model="claude-x", max_tokens=64, messages=ask("[[overflow]]")["messages"])
        assert "maximum context length" in caught.value.message
