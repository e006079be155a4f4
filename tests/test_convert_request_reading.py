"""gymproxy.convert.request, reading: what `/v1/responses` takes in (every field of the Responses API's request), what
it drops on the way (hosted tools, unknown fields with `unknown_fields: drop`), each said once.

The reader is tested on its own, then through the real route in front of the fake vLLM: a request
carrying every field of the installed openai SDK's `ResponseCreateParams`, a misspelt field, and a
Codex CLI turn as Codex sends it.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from gymproxy.convert.request import MAX_WARNED, RequestReader
from gymproxy.errors import BadRequest
from gymproxy.schemas.responses import CustomTool, FunctionTool

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False}


def read(body: Any, *, drop: bool = False, reader: RequestReader | None = None):
    reader = reader or RequestReader(drop_unknown_fields=drop)
    return reader.decode(body if isinstance(body, bytes) else orjson.dumps(body))


def refused(body: Any, *, drop: bool = False) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        read(body, drop=drop)
    assert info.value.status == 400
    return info.value


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "gymproxy"]


# --- hosted tools ---------------------------------------------------------------------------------


def test_hosted_tools_are_dropped_and_said_once_per_type(caplog):
    reader = RequestReader()
    body = {"input": "x", "tools": [{"type": "web_search"}, WEATHER, {"type": "local_shell"}, {"type": "web_search"}]}
    for _ in range(3):
        req = read(body, reader=reader)
        assert [type(t) for t in req.tools] == [FunctionTool]  # nor echoed in the Response's `tools`
    said = warnings(caplog)
    assert len(said) == 2
    assert "'web_search'" in said[0] and "'local_shell'" in said[1]
    assert all("no Chat Completions form" in line for line in said)


def test_tool_types_not_known_yet_are_dropped_too(caplog):
    reader = RequestReader()
    body = {"input": "x", "tools": [{"type": "teleport", "to": "mars"}, WEATHER, {"type": "custom", "name": "c"}]}
    for _ in range(2):
        req = read(body, reader=reader)
        assert [type(t) for t in req.tools] == [FunctionTool, CustomTool]
    assert len(warnings(caplog)) == 1 and "'teleport'" in warnings(caplog)[0]


def test_an_unknown_tool_type_does_not_hide_another_error():
    error = refused({"input": "x", "temperature": "hot", "tools": [{"type": "teleport"}]})
    assert error.param == "temperature"


@pytest.mark.parametrize("kind", [5, None])
def test_a_tool_type_that_is_no_string_is_a_400(kind):
    assert refused({"input": "x", "tools": [{"type": kind}]}).param == "tools[0].type"


def test_a_body_orjson_cannot_read_again_keeps_the_first_400():
    # msgspec stops at the unknown tool type before the deep member that orjson refuses.
    raw = b'{"input": "x", "tools": [{"type": "teleport"}], "moderation": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    assert refused(raw).param == "tools[0].type"


def test_without_hosted_tools_the_list_is_left_as_decoded():
    req = read({"input": "x", "tools": [WEATHER]})
    assert [t.name for t in req.tools] == ["get_weather"]


# --- unknown top-level fields ---------------------------------------------------------------------


def test_an_unknown_top_level_field_is_a_400_naming_it():
    error = refused({"input": "x", "top_k": 5})
    assert error.param == "top_k"
    assert "unknown field `top_k`" in error.message and "metadata.extra_body" in error.message


def test_drop_mode_drops_unknown_top_level_fields_saying_so_once_per_name(caplog):
    reader = RequestReader(drop_unknown_fields=True)
    for _ in range(2):
        req = read({"input": "x", "top_k": 5, "temperature": 0.5, "x_trace": "t"}, reader=reader)
        assert req.temperature == 0.5
    said = warnings(caplog)
    assert len(said) == 2 and "'top_k'" in said[0] and "'x_trace'" in said[1]
    assert all("unknown_fields: drop" in line for line in said)


def test_drop_mode_with_an_unknown_tool_type_as_well():
    req = read({"input": "x", "top_k": 5, "tools": [{"type": "teleport"}, WEATHER]}, drop=True)
    assert [t.name for t in req.tools] == ["get_weather"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "reasoning": {"effort": "low", "bogus": 1}}, "reasoning.bogus"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "bogus": 1}]}, "tools[0].bogus"),
        ({"input": "x", "temperature": "hot", "top_k": 5}, "temperature"),
    ],
)
def test_drop_mode_drops_only_top_level_fields(body, param):
    assert refused(body, drop=True).param == param


def test_warnings_stop_after_so_many_names(caplog):
    reader = RequestReader(drop_unknown_fields=True)
    for i in range(MAX_WARNED + 10):
        read({"input": "x", f"junk_{i}": 1}, reader=reader)
    assert len(warnings(caplog)) == MAX_WARNED


@pytest.mark.parametrize("raw", [b'{"input": "x",', b"[1]", b'"x"'])
def test_bodies_that_are_no_json_object_are_a_400(raw):
    assert refused(raw, drop=True).status == 400


# --- through the route ----------------------------------------------------------------------------


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        data = io.BytesIO(orjson.dumps(body))
        async with session.post(f"{url}/v1/responses", data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, orjson.loads(await r.read())


def sdk_fields() -> set[str]:
    from openai.types.responses import response_create_params

    return set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}


# Every field of openai-python's `ResponseCreateParams`, with plausible values. The fields gymproxy
# refuses when they ask for what it cannot do (previous_response_id, conversation, prompt,
# background: true, truncation: "auto", context_management) carry the values that ask for nothing.
EVERY_FIELD: dict[str, Any] = {
    "access_programs": {"cyber": "standard"},
    "background": False,
    "background_options": {"completion_window": "soonest"},
    "context_management": [],
    "conversation": None,
    "image": {"context_compression": "auto"},
    "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]}],
    "instructions": "Be brief.",
    "max_output_tokens": 64,
    "max_tool_calls": 4,
    "metadata": {"run": "7"},
    "model": "m",
    "moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "prompt": None,
    "prompt_cache_key": "conversation-1",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low", "summary": "auto"},
    "safety_identifier": "user-1f3a",
    "service_tier": "auto",
    "store": False,
    "stream": False,
    "stream_options": {"include_obfuscation": False},
    "temperature": 0.5,
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "tool_choice": "auto",
    "tools": [WEATHER, {"type": "web_search"}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "truncation": "disabled",
    "user": "u-1",
}

# What of it reaches vLLM (stream and stream_options are the route's, for a streamed request).
SENT = {
    "model": "policy",
    "messages": [
        {"content": "Be brief.", "role": "system"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
    ],
    "max_tokens": 64,
    "metadata": {"run": "7"},
    "temperature": 0.5,
    "top_p": 0.9,
    "top_logprobs": 2,
    "user": "u-1",
    "reasoning_effort": "low",
    "verbosity": "low",
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
}


def test_every_field_of_the_sdk_is_in_the_test():
    assert set(EVERY_FIELD) == sdk_fields(), "a field the installed SDK has: decide what gymproxy does with it"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_with_every_field_of_the_sdk_is_accepted(proxy_url, fake_vllm, stream):
    body = {**EVERY_FIELD, "client_metadata": {"x-codex-installation-id": "i-1"}, "stream": stream}
    if not stream:
        status, response = await post(proxy_url, body)
        assert status == 200, response
        assert response["status"] == "completed" and response["output"][-1]["name"] == "get_weather"
        assert [t["type"] for t in response["tools"]] == ["function"]  # the dropped web_search is not echoed
        assert response["service_tier"] == "auto" and response["reasoning"]["summary"] == "auto"
    else:
        extra = {"client_metadata": body.pop("client_metadata")}  # Codex's: the SDK has no such parameter
        async with openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="k", max_retries=0) as client:
            events = [e async for e in await client.responses.create(**body, extra_body=extra)]
        assert events[-1].type == "response.completed"
    expected = (
        {**SENT, "stream": True, "stream_options": {"include_usage": True}} if stream else {**SENT, "stream": False}
    )
    assert fake_vllm.last_json() == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("previous_response_id", "resp_1"),
        ("conversation", {"id": "conv_1"}),
        ("prompt", {"id": "pmpt_1", "variables": {"city": "Paris"}}),
        ("background", True),
        ("truncation", "auto"),
        ("context_management", [{"type": "compaction", "compact_threshold": 2000}]),
    ],
)
async def test_fields_gymproxy_cannot_honour_are_a_400_naming_them(proxy_url, fake_vllm, field, value):
    status, body = await post(proxy_url, {"model": "m", "input": "x", field: value})
    assert status == 400 and body["error"]["param"] == field
    assert not [r for r in fake_vllm.requests if r.path == "/v1/chat/completions"]


@pytest.mark.parametrize("typo", ["temprature", "max_ouput_tokens", "tool_choise", "prompt_cache"])
async def test_a_misspelt_field_is_a_400_naming_it(proxy_url, typo):
    status, body = await post(proxy_url, {"model": "m", "input": "x", typo: 1})
    assert status == 400
    assert body["error"]["param"] == typo and f"`{typo}`" in body["error"]["message"]


async def test_unknown_fields_drop_through_the_route(start_proxy, fake_vllm):
    url = await start_proxy(model="policy", unknown_fields="drop")
    status, _ = await post(url, {"model": "m", "input": "x", "temprature": 1, "temperature": 0.25})
    assert status == 200
    sent = fake_vllm.last_json()
    assert sent["temperature"] == 0.25 and "temprature" not in sent


# A turn as Codex CLI sends it: developer and user messages, earlier reasoning (encrypted, no
# summary), a call and its output, all with ids; bookkeeping fields gymproxy accepts and does not send.
CODEX_TURN: dict[str, Any] = {
    "model": "gpt-5-codex",
    "instructions": "You are Codex.",
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": None, "content": None, "encrypted_content": "gAAAA"},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
            "status": "completed",
        },
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "README.md"},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "One file.", "annotations": []}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
    ],
    "tools": [
        {"type": "function", "name": "shell", "description": "Run.", "strict": False, "parameters": {"type": "object"}},
        {"type": "web_search"},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199a1b2-conversation",
    "client_metadata": {"x-codex-installation-id": "inst-1"},
}


async def test_a_codex_cli_turn_streams(proxy_url, fake_vllm):
    async with openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="k", max_retries=0) as client:
        turn = dict(CODEX_TURN)
        extra = {"client_metadata": turn.pop("client_metadata")}
        events = [e async for e in await client.responses.create(**turn, extra_body=extra)]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.usage.input_tokens_details.cached_tokens == 0
    assert completed.response.usage.output_tokens_details.reasoning_tokens == 0
    sent = fake_vllm.last_json()
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert sent["messages"][0]["content"] == "You are Codex.\n\n<permissions>"
    assert sent["messages"][2]["tool_calls"][0]["function"]["name"] == "shell"
    assert [t["function"]["name"] for t in sent["tools"]] == ["shell"]
    for field in ("store", "include", "prompt_cache_key", "client_metadata", "reasoning"):
        assert field not in sent
