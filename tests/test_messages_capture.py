"""Captured `/v1/messages` calls (convert/anthropic.py, routes.captured_messages): vLLM's Anthropic
endpoint returns no token ids, so a call with a rollout id is converted to chat in gymproxy, served
by vLLM's chat API, recorded with the exact tokens it returned, and answered exactly as vLLM's
Anthropic endpoint answers the same request (the fake vLLM's own /v1/messages, which mirrors it).

gymproxy runs mounted on a real port in front of the fake vLLM, with the real anthropic client
where a client is the point.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from gymproxy.testing.fake_vllm import FakeVLLM, Script

from .faults import eventually
from .test_capture import TOKEN_FIELDS, gymproxy, same_tokens, settled

MESSAGES = "/v1/messages"
CHAT = "/v1/chat/completions"
BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
# Claude Code's shape: the system prompt as blocks (its billing header first), a system note after
# the user's text.
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332;"},
    {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
]
NOTE = {"role": "system", "content": [{"type": "text", "text": "# Environment\nlinux"}]}


@pytest.fixture
async def fake(aiohttp_server: Any) -> FakeVLLM:
    fake = FakeVLLM()
    fake.url = str((await aiohttp_server(fake.app)).make_url("/v1"))
    return fake


def body(text: str, *, stream: bool = False, **fields: Any) -> dict[str, Any]:
    request = {"model": "m", "max_tokens": 200, "system": SYSTEM, "tools": [BASH], "stream": stream}
    return {**request, "messages": [{"role": "user", "content": text}, NOTE], **fields}


async def post(session: aiohttp.ClientSession, url: str, data: Any) -> tuple[int, bytes]:
    raw = data if isinstance(data, bytes) else orjson.dumps(data)
    async with session.post(url, data=raw, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """An Anthropic event stream's (event, data) pairs; checks the framing on the way."""
    frames = raw.split(b"\n\n")
    assert frames.pop() == b"", raw[-200:]
    pairs = []
    for frame in frames:
        event, data = frame.split(b"\n")
        assert event.startswith(b"event: ") and data.startswith(b"data: "), frame
        pairs.append((event[7:].decode(), orjson.loads(data[6:])))
    return pairs


def without_ids(value: Any) -> Any:
    """A reply with what differs between two generations of the same tokens left out: the message
    and tool call ids, and thinking signatures (vLLM makes a new uuid for each)."""
    if isinstance(value, dict):
        return {k: "*" if k in ("id", "signature") else without_ids(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_ids(v) for v in value]
    return value


def no_token_field(raw: bytes) -> None:
    for field in (*TOKEN_FIELDS, b"token_ids"):
        assert field not in raw, raw[:300]


# --- the same answer as vLLM's Anthropic endpoint --------------------------------------------------


CASES = {
    "text": "hello there [[no-call]]",
    "thinking": "think first [[reason]] [[no-call]]",
    "tool use": 'list them [[reason]] [[call:Bash {"command": "ls -la"}]]',
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_captured_call_is_answered_as_vllms_anthropic_endpoint_answers(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, case: str, stream: bool
) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    request = body(CASES[case], stream=stream)
    rid = "r-" + case.replace(" ", "-")
    async with aiohttp.ClientSession() as session:
        status, relayed = await post(session, url + MESSAGES, request)  # no rollout id: relayed
        assert status == 200, relayed
        status, captured = await post(session, f"{url}/ng-rollout/{rid}{MESSAGES}", request)
        assert status == 200, captured
        got = await settled(session, url, rid, 1)
    no_token_field(captured)
    if stream:
        assert without_ids(events(captured)) == without_ids(events(relayed))
    else:
        assert without_ids(orjson.loads(captured)) == without_ids(orjson.loads(relayed))
    paths = [r.path for r in fake.requests if r.path in (MESSAGES, CHAT)]
    assert paths == [MESSAGES, CHAT]  # the captured call went to vLLM's chat API
    (call,) = got["calls"]
    assert call["route"] == "messages" and call["outcome"] == "ok" and call["stream"] is stream
    (sent,) = fake.returned
    same_tokens(call, sent)
    assert call["usage"]["completion_tokens"] == len(sent["generation_token_ids"])


async def test_the_chat_request_is_the_one_vllm_builds(aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path) -> None:
    """System blocks joined (the billing header dropped), the inline note in place (the fake's template
    takes it: its /tokenize renders vLLM's probe), a user turn's tool results before its text, the
    tool call's input as Python's json.dumps writes it, sampling fields, tools and tool_choice."""
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    history = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "running"},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls", "n": 1.5}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a"}]},
                {"type": "text", "text": "and?"},
            ],
        },
        NOTE,
    ]
    extra = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["END"], "metadata": {"user_id": "u"}}
    request = {**body(""), "messages": history, "tool_choice": {"type": "any"}, **extra}
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, f"{url}/ng-rollout/shape{MESSAGES}", request)
        assert status == 200, reply
        status, _ = await post(session, f"{url}/ng-rollout/shape{MESSAGES}", request)
    probes = [r for r in fake.requests if r.path == "/tokenize"]
    assert len(probes) == 1  # learnt once
    chat = [r.json for r in fake.requests if r.path == CHAT][0]
    assert chat["messages"] == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": json.dumps({"command": "ls", "n": 1.5})},
                }
            ],
            "content": "running",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a"},
        {"role": "user", "content": "and?"},
        {"role": "system", "content": "# Environment\nlinux"},
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is True
    assert chat["tools"] == [{"type": "function", "function": {"name": "Bash", "description": BASH["description"],
                                                               "parameters": BASH["input_schema"], "strict": None,
                                                               "defer_loading": None}}]  # fmt: skip
    assert (chat["max_tokens"], chat["max_completion_tokens"], chat["stop"]) == (200, 200, ["END"])
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (0.5, 0.9, 5)
    assert "metadata" not in chat and "system" not in chat


# --- a rollout of Claude Code's shape ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_three_call_tool_task_is_one_segment_and_the_client_sees_no_token(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, stream: bool
) -> None:
    """A tool call (with thinking), the answer to its result, a second user turn: through the real
    anthropic client, every call recorded with what the fake returned, in one segment."""
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    history: list[Any] = [{"role": "user", "content": 'run it [[reason]] [[call:Bash {"command": "ls"}]]'}, NOTE]
    seen: list[bytes] = []
    async with anthropic.AsyncAnthropic(base_url=f"{url}/ng-rollout/claude-1", api_key="k", max_retries=0) as client:
        for turn in range(3):
            kwargs: dict[str, Any] = {"model": "m", "max_tokens": 300, "system": SYSTEM, "tools": [BASH]}
            if stream:
                async with client.messages.stream(messages=history, **kwargs) as events_:
                    message = await events_.get_final_message()
            else:
                message = await client.messages.create(messages=history, **kwargs)
            seen.append(orjson.dumps(message.model_dump()))
            history.append(
                {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]}
            )
            if turn == 0:
                assert message.stop_reason == "tool_use" and [b.type for b in message.content] == [
                    "thinking",
                    "tool_use",
                ]
                call = message.content[1]
                assert call.name == "Bash" and call.input == {"command": "ls"}
                result = {"type": "tool_result", "tool_use_id": call.id, "content": "file-a"}
                history.append({"role": "user", "content": [result]})
            elif turn == 1:
                assert message.stop_reason == "end_turn" and message.content[-1].text == "tool said: file-a"
                history.append({"role": "user", "content": "thanks [[no-call]]"})
            else:
                assert message.content[-1].text == "echo: thanks [[no-call]]"
    for raw in seen:
        no_token_field(raw)
    async with aiohttp.ClientSession() as session:
        got = await settled(session, url, "claude-1", 3)
    assert [c["route"] for c in got["calls"]] == ["messages"] * 3
    for call, sent in zip(got["calls"], fake.returned, strict=True):
        same_tokens(call, sent)
    assert got["breaks"] == []
    (segment,) = got["segments"]
    assert segment["calls"] == [1, 2, 3]
    assert sum(segment["loss_mask"]) == sum(c["usage"]["completion_tokens"] for c in got["calls"])
    generated = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
    assert generated == [t for c in got["calls"] for t in c["generation_token_ids"]]


# --- what stays relayed ----------------------------------------------------------------------------


async def test_without_a_rollout_or_capture_messages_are_relayed_and_count_tokens_always(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    count = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        assert (await post(session, url + MESSAGES, body("hi")))[0] == 200
        assert (await post(session, f"{url}/ng-rollout/c{MESSAGES}/count_tokens", count))[0] == 200
    assert [r.path for r in fake.requests if r.path != "/v1/models"] == [MESSAGES, MESSAGES + "/count_tokens"]
    fake.requests.clear()
    plain, _ = await gymproxy(aiohttp_server, fake, tmp_path / "off", capture={"enabled": False})
    async with aiohttp.ClientSession() as session:
        assert (await post(session, f"{plain}/ng-rollout/r{MESSAGES}", body("hi")))[0] == 200
    assert [r.path for r in fake.requests if r.path != "/v1/models"] == [MESSAGES]


# --- errors, as vLLM's Anthropic endpoint says them ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"thinking": {"type": "disabled"}}, "thinking.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
        ({"tools": []}, "tools"),
        ({"tools": None, "tool_choice": {"type": "auto"}}, "tool_choice"),
    ],
)
async def test_a_body_vllm_would_refuse_or_that_has_no_chat_form_is_a_400_naming_the_field(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    request = {k: v for k, v in {**body("hi"), **fields}.items() if v is not None}
    async with aiohttp.ClientSession() as session:
        status, raw = await post(session, f"{url}/ng-rollout/bad{MESSAGES}", request)
        assert status == 400, raw
        error = orjson.loads(raw)
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert named in error["error"]["message"] or named.split(".")[0] in error["error"]["message"], error
        for not_json in (b"{not json", b"[1]"):
            status, raw = await post(session, f"{url}/ng-rollout/bad{MESSAGES}", not_json)
            assert status == 400 and orjson.loads(raw)["type"] == "error"
        async with session.get(f"{url}/v1/rollouts/bad") as r:
            assert r.status == 404  # nothing was recorded
    assert not [r for r in fake.requests if r.path in (CHAT, MESSAGES)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("directive", ["[[overflow]]", "[[error:500]]"])
async def test_vllms_errors_and_a_context_overflow_come_as_its_anthropic_endpoint_sends_them(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, directive: str, stream: bool
) -> None:
    url, proxy = await gymproxy(aiohttp_server, fake, tmp_path)
    request = body(f"too much {directive}", stream=stream)
    async with aiohttp.ClientSession() as session:
        relayed = await post(session, url + MESSAGES, request)
        captured = await post(session, f"{url}/ng-rollout/err{MESSAGES}", request)
        got = await settled(session, url, "err", 1)
    assert captured == relayed and captured[0] in (400, 500)
    assert orjson.loads(captured[1])["type"] == "error"
    (call,) = got["calls"]
    assert call["outcome"] == ("overflow" if directive == "[[overflow]]" else "error")
    if directive == "[[overflow]]":
        assert proxy.metrics.overflows == 1


async def test_a_tool_call_whose_arguments_are_not_json_is_vllms_400(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    broken = Script(tool_calls=[{"name": "Bash", "arguments": '{"command": '}])
    fake.push(broken, broken)
    async with aiohttp.ClientSession() as session:
        relayed = await post(session, url + MESSAGES, body("go"))
        captured = await post(session, f"{url}/ng-rollout/args{MESSAGES}", body("go"))
        got = await settled(session, url, "args", 1)
    assert captured == relayed and captured[0] == 400
    assert orjson.loads(captured[1])["error"]["type"] == "BadRequestError"
    (call,) = got["calls"]
    assert call["outcome"] == "error" and call["generation_token_ids"] == fake.returned[0]["generation_token_ids"]


@pytest.mark.parametrize("how", ["reset", "bad_json", "error"])
async def test_an_upstream_that_breaks_mid_stream_ends_it_with_an_error_event(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, how: str
) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    fake.push(Script(content="one two three four five six", fail_mid_stream=how))
    async with aiohttp.ClientSession() as session:
        status, raw = await post(session, f"{url}/ng-rollout/broken{MESSAGES}", body("go", stream=True))
        got = await settled(session, url, "broken", 1)
    assert status == 200
    pairs = events(raw)
    assert pairs[0][0] == "message_start" and pairs[-1][0] == "error", pairs
    assert pairs[-1][1]["type"] == "error" and pairs[-1][1]["error"]["type"] == "api_error"
    assert "message_stop" not in [kind for kind, _ in pairs]
    assert got["calls"][0]["outcome"] == "cut"


async def test_a_client_that_leaves_aborts_the_generation(aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    fake.push(Script(content="slow " * 400, chunk_delay=0.02))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/ng-rollout/gone{MESSAGES}", json=body("go", stream=True)) as r:
            assert r.status == 200
            await r.content.readany()
        assert await eventually(lambda: bool(fake.disconnects))  # vLLM saw the connection close: it aborts
        got = await settled(session, url, "gone", 1)
    assert got["calls"][0]["outcome"] == "cut"
    await asyncio.sleep(0)
