"""Tests for gymproxy.testing.fake_vllm: over real sockets, it must speak vLLM 0.32's wire format."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gymproxy.testing.fake_vllm import FakeVLLM, Script, start, token_id

USER = [{"role": "user", "content": "hello there"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT_KEYS = [
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
    "prompt_logprobs", "prompt_token_ids", "kv_transfer_params",
]  # fmt: skip
MESSAGE = {
    "role": "assistant", "content": "echo: hello there", "refusal": None, "annotations": None, "audio": None,
    "function_call": None, "tool_calls": [], "reasoning": None,
}  # fmt: skip


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


async def post(fake: FakeVLLM, path: str, body: Any) -> tuple[int, Any]:
    """POST to `fake.url + path` (use "/../tokenize" for the root); returns the status and decoded JSON."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession() as session, session.post(fake.url + path, data=data) as resp:
        return resp.status, await resp.json(content_type=None)


async def stream(fake: FakeVLLM, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST with stream=true; checks the SSE framing and returns the decoded chunks (without [DONE])."""
    async with aiohttp.ClientSession() as session:
        async with session.post(fake.url + path, json={**body, "stream": True}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            raw = await resp.read()
    frames = raw.split(b"\n\n")
    assert frames.pop() == b"" and frames.pop() == b"data: [DONE]"
    assert all(f.startswith(b"data: {") and b"\n" not in f for f in frames), raw
    return [orjson.loads(f.removeprefix(b"data: ")) for f in frames]


def choice(chunk: dict[str, Any]) -> Any:
    (only,) = chunk["choices"]
    return only


@pytest.fixture
async def small_vllm(aiohttp_server: Any) -> FakeVLLM:
    fake = FakeVLLM(max_model_len=8)
    fake.url = str((await aiohttp_server(fake.app)).make_url("/v1"))
    return fake


@pytest.fixture(params=["cancelling", "polling"])
async def served_vllm(request: pytest.FixtureRequest) -> AsyncIterator[FakeVLLM]:
    """A FakeVLLM whose server cancels handlers on disconnect (like run() and pytest-aiohttp), or doesn't."""
    fake = FakeVLLM()
    runner = web.AppRunner(fake.app, handler_cancellation=request.param == "cancelling")
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    yield fake
    await runner.cleanup()


async def test_non_streaming_chat_has_every_vllm_field(fake_vllm: FakeVLLM) -> None:
    status, body = await post(fake_vllm, "/chat/completions", chat())
    assert status == 200 and list(body) == CHAT_KEYS
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == "m"
    assert choice(body) == {
        "index": 0, "message": MESSAGE, "logprobs": None, "finish_reason": "stop", "stop_reason": None,
        "token_ids": None,
    }  # fmt: skip
    assert body["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 5,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
    }
    assert fake_vllm.last_json() == chat() and fake_vllm.requests[-1].path == "/v1/chat/completions"


@pytest.mark.parametrize(
    ("options", "usage"),
    [(None, False), ({}, True), ({"include_usage": True}, True), ({"include_usage": False}, False)],
)
async def test_stream_chunk_order(fake_vllm: FakeVLLM, options: Any, usage: bool) -> None:
    got = await stream(fake_vllm, "/chat/completions", chat() if options is None else chat(stream_options=options))
    assert len({c["id"] for c in got}) == 1 and {c["object"] for c in got} == {"chat.completion.chunk"}
    role, *deltas, finish = got[:-1] if usage else got
    assert choice(role) == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    assert role["prompt_token_ids"] is None
    assert [choice(d)["delta"] for d in deltas] == [{"content": "echo:"}, {"content": " hello"}, {"content": " there"}]
    assert all(choice(d)["finish_reason"] is None and "usage" not in d for d in deltas)
    assert choice(finish)["delta"] == {} and choice(finish)["finish_reason"] == "stop"
    if usage:
        assert got[-1]["choices"] == [] and got[-1]["usage"] == {
            "prompt_tokens": 2,
            "total_tokens": 5,
            "completion_tokens": 3,
        }


async def test_streamed_tool_calls_reassemble(fake_vllm: FakeVLLM) -> None:
    calls = [
        {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}', "id": "call_1"},
        {"name": "get_time", "arguments": '{"zone": "Europe/Paris"}'},
    ]
    fake_vllm.push(Script(tool_calls=calls), Script(tool_calls=calls))
    got = await stream(fake_vllm, "/chat/completions", chat(tools=[WEATHER]))
    assert choice(got[-1]) == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None,
        "token_ids": None,
    }  # fmt: skip
    deltas = [d for c in got for d in choice(c)["delta"].get("tool_calls", [])]
    assert len(deltas) == 6 and deltas[0]["id"] == "call_1"
    args: dict[int, str] = {}
    for d in deltas:
        if d["index"] not in args:
            assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
            assert d["function"]["name"] == calls[d["index"]]["name"]
            args[d["index"]] = ""
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        args[d["index"]] += d["function"]["arguments"]
    assert args == {0: calls[0]["arguments"], 1: calls[1]["arguments"]}

    _, body = await post(fake_vllm, "/chat/completions", chat(tools=[WEATHER]))
    message = choice(body)["message"]
    assert message["content"] is None and choice(body)["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0] == {
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": calls[0]["arguments"]},
    }  # fmt: skip
    assert message["tool_calls"][1]["id"].startswith("chatcmpl-tool-")


async def test_default_reply_calls_the_first_tool_after_a_user_turn(fake_vllm: FakeVLLM) -> None:
    _, body = await post(fake_vllm, "/chat/completions", chat(tools=[WEATHER]))
    (call,) = choice(body)["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": "{}"}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
    _, body = await post(fake_vllm, "/chat/completions", chat(messages=[*USER, result], tools=[WEATHER]))
    assert choice(body)["message"] == MESSAGE
    _, body = await post(fake_vllm, "/chat/completions", chat(tools=[WEATHER], tool_choice="none"))
    assert choice(body)["message"] == MESSAGE
    clock = {"type": "function", "function": {"name": "get_time"}}
    _, body = await post(fake_vllm, "/chat/completions", chat(tools=[WEATHER, clock], tool_choice=clock))
    assert choice(body)["message"]["tool_calls"][0]["function"]["name"] == "get_time"


async def test_token_ids_and_logprobs_agree_with_tokenize(fake_vllm: FakeVLLM) -> None:
    asks = chat(return_token_ids=True, logprobs=True, return_tokens_as_token_ids=True)
    fake_vllm.push(*[Script(content="The answer is 42.", reasoning="Let me think.")] * 2)
    _, body = await post(fake_vllm, "/chat/completions", asks)
    _, tokenized = await post(fake_vllm, "/../tokenize", {"model": "m", "messages": USER})
    assert tokenized == {"count": 2, "max_model_len": 4096, "tokens": body["prompt_token_ids"], "token_strs": None}
    ids, entries = choice(body)["token_ids"], choice(body)["logprobs"]["content"]
    assert [int(e["token"].removeprefix("token_id:")) for e in entries] == ids
    assert len(ids) == body["usage"]["completion_tokens"] == 7 and ids[-1] == token_id(" 42.")
    assert all(isinstance(e["logprob"], float) and e["top_logprobs"] == [] and e["bytes"] for e in entries)

    got = await stream(fake_vllm, "/chat/completions", asks)
    assert got[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert [i for c in got[1:] for i in choice(c)["token_ids"]] == ids
    assert [e for c in got[1:] for e in choice(c)["logprobs"]["content"]] == entries
    assert [choice(c)["delta"].get("reasoning") for c in got[1:4]] == ["Let", " me", " think."]


async def test_pieces_and_reasoning_key(fake_vllm: FakeVLLM) -> None:
    old_vllm = Script(content="abcdefghij", reasoning="x y", reasoning_key="reasoning_content", pieces=3)
    fake_vllm.push(old_vllm, old_vllm)
    _, body = await post(fake_vllm, "/chat/completions", chat())
    message = {k: v for k, v in MESSAGE.items() if k != "reasoning"}
    assert choice(body)["message"] == {**message, "content": "abcdefghij", "reasoning_content": "x y"}
    got = await stream(fake_vllm, "/chat/completions", chat(return_token_ids=True))
    assert [choice(c)["delta"] for c in got[1:-1]] == [
        {"reasoning_content": "x"}, {"reasoning_content": " "}, {"reasoning_content": "y"},
        {"content": "abc"}, {"content": "def"}, {"content": "ghij"},
    ]  # fmt: skip
    assert [choice(c)["token_ids"] for c in got[1:-1]] == [
        [token_id("x")],
        [],
        [token_id(" y")],
        [],
        [],
        [token_id("abcdefghij")],
    ]


async def test_scripted_replies_in_order_then_default(fake_vllm: FakeVLLM) -> None:
    fake_vllm.push(
        Script(
            content="one", message_extra={"gen_ids": [1]}, choice_extra={"x": 1}, top_extra={"y": 2}, usage={"n": 9}
        ),
        Script(status=429, error_body=b'{"raw": true}'),
        Script(status=500, error_message="boom"),
    )
    _, first = await post(fake_vllm, "/chat/completions", chat())
    assert choice(first)["message"] == {**MESSAGE, "content": "one", "gen_ids": [1]}
    assert choice(first)["x"] == 1 and first["y"] == 2 and first["usage"] == {"n": 9}
    assert await post(fake_vllm, "/chat/completions", chat()) == (429, {"raw": True})
    error = {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    assert await post(fake_vllm, "/chat/completions", chat()) == (500, {"error": error})
    _, last = await post(fake_vllm, "/chat/completions", chat())
    assert choice(last)["message"] == MESSAGE


async def test_directives(fake_vllm: FakeVLLM) -> None:
    def say(text: str) -> dict[str, Any]:
        return chat(messages=[{"role": "user", "content": [{"type": "text", "text": text}]}])

    _, body = await post(fake_vllm, "/chat/completions", say("why [[reason]]"))
    assert choice(body)["message"]["reasoning"] == "thinking about it"
    status, body = await post(fake_vllm, "/chat/completions", say("[[error:503]]"))
    assert status == 503 and body["error"]["code"] == 503 and body["error"]["type"] == "InternalServerError"
    status, body = await post(fake_vllm, "/chat/completions", {**say("[[overflow]]"), "stream": True})
    assert status == 400 and body["error"]["param"] == "input_tokens"
    assert (
        "maximum context length is 4096 tokens. However, your prompt contains at least 4097" in body["error"]["message"]
    )


SHELL = {"type": "function", "function": {"name": "exec_command", "parameters": {"type": "object"}}}
CALL = '[[call:exec_command {"cmd": "echo hi [x]", "env": {"A": "}]"}}]]'


async def test_call_directive_round_trip(fake_vllm: FakeVLLM) -> None:
    """[[call:...]]: the named call with exactly those arguments, then the tool's output in text."""
    ask = [{"role": "user", "content": f"please {CALL} now"}, {"role": "system", "content": "a harness note"}]
    _, body = await post(fake_vllm, "/chat/completions", chat(messages=ask, tools=[WEATHER, SHELL]))
    (call,) = choice(body)["message"]["tool_calls"]
    assert call["function"] == {"name": "exec_command", "arguments": '{"cmd": "echo hi [x]", "env": {"A": "}]"}}'}
    assert choice(body)["finish_reason"] == "tool_calls"

    streamed = await stream(fake_vllm, "/chat/completions", chat(messages=ask, tools=[SHELL]))
    parts = [c for chunk in streamed[1:] for c in choice(chunk)["delta"].get("tool_calls", [])]
    assert parts[0]["function"]["name"] == "exec_command"
    assert "".join(p["function"]["arguments"] for p in parts) == call["function"]["arguments"]

    assistant = {"role": "assistant", "content": None, "tool_calls": [{**call, "type": "function"}]}
    result = {"role": "tool", "tool_call_id": call["id"], "content": [{"type": "text", "text": "hi [x]\n"}]}
    after = [*ask, assistant, result, {"role": "developer", "content": "another note"}]
    _, body = await post(fake_vllm, "/chat/completions", chat(messages=after, tools=[SHELL]))
    assert choice(body)["message"]["content"] == "tool said: hi [x]\n" and not choice(body)["message"]["tool_calls"]
    got = await stream(fake_vllm, "/chat/completions", chat(messages=after, tools=[SHELL]))
    assert "".join(choice(c)["delta"].get("content") or "" for c in got[1:]) == "tool said: hi [x]\n"

    # Two results of parallel calls: both outputs, in order.
    two = [*ask, assistant, result, {**result, "content": "second"}]
    _, body = await post(fake_vllm, "/chat/completions", chat(messages=two, tools=[SHELL]))
    assert choice(body)["message"]["content"] == "tool said: hi [x]\n\nsecond"


async def test_call_directive_names_any_tool_and_checks_its_arguments(fake_vllm: FakeVLLM) -> None:
    # A tool the request does not offer is called all the same; no arguments means {}.
    _, body = await post(fake_vllm, "/chat/completions", chat(messages=[{"role": "user", "content": "[[call:nope]]"}]))
    assert choice(body)["message"]["tool_calls"][0]["function"] == {"name": "nope", "arguments": "{}"}
    status, body = await post(
        fake_vllm, "/chat/completions", chat(messages=[{"role": "user", "content": "[[call:x {oops}]]"}])
    )
    assert status == 400 and "are not JSON" in body["error"]["message"]


async def test_no_call_directive_answers_in_text_despite_tools(fake_vllm: FakeVLLM) -> None:
    say = [{"role": "user", "content": "hello there [[no-call]]"}]
    _, body = await post(fake_vllm, "/chat/completions", chat(messages=say, tools=[WEATHER]))
    assert choice(body)["message"]["tool_calls"] == []
    assert choice(body)["message"]["content"] == "echo: hello there [[no-call]]"


@pytest.mark.parametrize("streamed", [False, True])
async def test_errors_before_generation_are_plain_json(small_vllm: FakeVLLM, streamed: bool) -> None:
    nine = [{"role": "user", "content": "one two three four five six seven eight nine"}]
    message = (
        "This model's maximum context length is 8 tokens. However, your prompt contains at least 9 input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value=9)"
    )
    error = {"message": message, "type": "BadRequestError", "param": "input_tokens", "code": 400}
    assert await post(small_vllm, "/chat/completions", chat(messages=nine, stream=streamed)) == (400, {"error": error})

    message = "max_tokens=100 cannot be greater than max_model_len=8. Please request fewer output tokens."
    error = {
        "message": f"{message} (parameter=max_tokens, value=100)",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    assert await post(small_vllm, "/chat/completions", chat(max_tokens=100, stream=streamed)) == (400, {"error": error})

    error = {
        "message": "max_tokens must be at least 1, got 0",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    assert await post(small_vllm, "/chat/completions", chat(messages=[{"role": "user", "content": "w " * 8}])) == (
        400,
        {"error": error},
    )

    status, body = await post(small_vllm, "/chat/completions", b'{"model": "m", "stream": true, "messages": [')
    assert status == 400 and body["error"]["type"] == "Bad Request" and body["error"]["code"] == 400
    assert small_vllm.requests[-1].json is None and small_vllm.requests[-1].body.endswith(b'"messages": [')


async def test_max_tokens_cuts_the_reply_with_length(small_vllm: FakeVLLM) -> None:
    _, body = await post(small_vllm, "/chat/completions", chat(max_tokens=2))
    assert choice(body)["message"]["content"] == "echo: hello"
    assert choice(body)["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2
    small_vllm.push(Script(content="a b c d e f g h"))
    _, body = await post(small_vllm, "/chat/completions", chat(max_tokens=8))  # 2 + 8 > 8: cut to fit, no error
    assert choice(body)["message"]["content"] == "a b c d e f"
    last = choice((await stream(small_vllm, "/chat/completions", chat(max_tokens=2)))[-1])
    assert last["delta"] == {"content": " hello"} and last["finish_reason"] == "length"


@pytest.mark.parametrize("mode", ["reset", "truncate", "bad_json", "error"])
async def test_fail_mid_stream(fake_vllm: FakeVLLM, mode: str) -> None:
    fake_vllm.push(Script(content="a b c d e f", fail_mid_stream=mode, error_message="engine died"))
    async with aiohttp.ClientSession() as session:
        async with session.post(fake_vllm.url + "/chat/completions", json=chat(stream=True)) as resp:
            assert resp.status == 200 and (resp.headers.get("Connection") == "close") is (mode == "truncate")
            if mode == "reset":
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
                return
            raw = await resp.read()
    *frames, end = raw.split(b"\n\n")
    assert end == b"" and [orjson.loads(f[6:])["choices"][0]["delta"] for f in frames[1:4]] == [
        {"content": "a"}, {"content": " b"}, {"content": " c"},
    ]  # fmt: skip
    error = b'data: {"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}'
    tail = {"truncate": [], "bad_json": [b"data: {not json", b"data: [DONE]"], "error": [error, b"data: [DONE]"]}
    assert frames[4:] == tail[mode]


async def test_openai_client_reads_the_fake(fake_vllm: FakeVLLM) -> None:
    async with openai.AsyncOpenAI(base_url=fake_vllm.url, api_key="x", max_retries=0) as client:
        reply = await client.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
        assert reply.choices[0].message.content == "echo: hello there"
        fake_vllm.push(Script(content="streamed words here"))
        parts = [c async for c in await client.chat.completions.create(model="m", messages=USER, stream=True)]  # type: ignore[arg-type]
        assert "".join(c.choices[0].delta.content or "" for c in parts) == "streamed words here"
        fake_vllm.push(Script(content="a b c d", fail_mid_stream="error"))
        with pytest.raises(openai.APIError, match="injected mid-stream error"):
            async for _ in await client.chat.completions.create(model="m", messages=USER, stream=True):  # type: ignore[arg-type]
                pass
        with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len"):
            await client.chat.completions.create(model="m", messages=USER, max_tokens=10**6)  # type: ignore[arg-type]


async def test_completions(fake_vllm: FakeVLLM) -> None:
    asks = {
        "model": "m",
        "prompt": "say hi",
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    _, body = await post(fake_vllm, "/completions", asks)
    assert [k for k in CHAT_KEYS if k in body] == list(body) == [k for k in CHAT_KEYS if "prompt_" not in k]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    one = choice(body)
    assert one["text"] == "echo: say hi" and one["finish_reason"] == "stop"
    assert one["prompt_token_ids"] == [token_id("say"), token_id(" hi")]
    assert one["logprobs"]["tokens"] == [f"token_id:{i}" for i in one["token_ids"]]
    assert one["logprobs"]["text_offset"] == [0, 5, 9] and len(one["logprobs"]["token_logprobs"]) == 3

    got = await stream(fake_vllm, "/completions", {**asks, "stream_options": {"include_usage": True}})
    assert {c["object"] for c in got} == {"text_completion"}
    assert choice(got[0])["prompt_token_ids"] == one["prompt_token_ids"]
    assert [choice(c)["prompt_token_ids"] for c in got[1:-1]] == [None] * (len(got) - 2)
    assert "".join(choice(c)["text"] for c in got[:-1]) == "echo: say hi"
    assert [t for c in got[:-1] for t in choice(c)["logprobs"]["text_offset"]] == [0, 5, 9]
    assert choice(got[-2])["finish_reason"] == "stop" and got[-1]["choices"] == []
    assert got[-1]["usage"] == {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3}

    _, body = await post(fake_vllm, "/completions", {"model": "m", "prompt": " ".join(["w"] * 30)})
    assert choice(body)["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 16


async def test_models_health_and_tokenize(fake_vllm: FakeVLLM) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(fake_vllm.url + "/models") as resp:
            models = await resp.json()
        async with session.get(fake_vllm.url + "/../health") as resp:
            assert resp.status == 200 and await resp.read() == b""
    _, tokenized = await post(fake_vllm, "/../tokenize", {"prompt": "a b", "return_token_strs": True})
    assert tokenized == {
        "count": 2,
        "max_model_len": 4096,
        "tokens": [token_id("a"), token_id(" b")],
        "token_strs": ["a", " b"],
    }
    assert models["object"] == "list" and models["data"][0] == {
        **models["data"][0], "id": "fake-model", "object": "model", "owned_by": "vllm", "root": "fake-model",
        "parent": None, "max_model_len": 4096, "permission": [],
    }  # fmt: skip
    assert [r.path for r in fake_vllm.requests] == ["/v1/models", "/tokenize"]


@pytest.mark.parametrize("script", [Script(hang=True), Script(content="a b c d e f g h", chunk_delay=0.1)])
@pytest.mark.parametrize("streamed", [False, True])
async def test_client_leaving_is_recorded(served_vllm: FakeVLLM, script: Script, streamed: bool) -> None:
    served_vllm.push(script)
    sent = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(served_vllm.url + "/chat/completions", json=chat(stream=streamed)) as resp:
                await resp.read()
    while not served_vllm.disconnects and time.monotonic() - sent < 1.2:
        await asyncio.sleep(0.01)
    # The client's 0.2 s timer may fire a little early (asyncio runs timers due within its clock
    # resolution), so the disconnect is seen at 0.2 s less a few milliseconds at the earliest.
    assert len(served_vllm.disconnects) == 1 and 0.19 <= served_vllm.disconnects[0] - sent < 1.2
    assert served_vllm.last_json()["stream"] is streamed


async def test_start_and_main_serve_it() -> None:
    fake, runner, url = await start(model="demo")
    try:
        assert url == fake.url and url.endswith("/v1")
        _, body = await post(fake, "/chat/completions", {"messages": USER})
        assert body["model"] == "demo" and choice(body)["message"]["content"] == "echo: hello there"
    finally:
        await runner.cleanup()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["--port", str(port), "--model", "cli-model", "--max-model-len", "77"]
    proc = subprocess.Popen([sys.executable, "-m", "gymproxy.testing.fake_vllm", *argv], stdout=subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/v1/models") as resp:
                        card = (await resp.json())["data"][0]
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
        assert (card["id"], card["max_model_len"]) == ("cli-model", 77)
    finally:
        proc.terminate()
        proc.wait(timeout=5)


async def test_client_leaving_a_fast_stream_is_recorded(served_vllm: FakeVLLM) -> None:
    served_vllm.push(Script(content="x" * 2**24, pieces=64))  # far more than the socket buffers hold
    async with aiohttp.ClientSession() as session:
        async with session.post(served_vllm.url + "/chat/completions", json=chat(stream=True)) as resp:
            assert (await resp.content.readline()).startswith(b"data: {")
        left = time.monotonic()
        while not served_vllm.disconnects and time.monotonic() - left < 1:
            await asyncio.sleep(0.01)
    assert len(served_vllm.disconnects) == 1
