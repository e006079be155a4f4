"""Namespace tools (gymproxy.convert.request; restored by convert.reply and convert.stream): flattened for vLLM, restored for the client, on
both paths. NeMo Gym does it only when streaming (spec deliberate difference 7).

The vectors are NeMo Gym's own, restated: its tests of `flatten_namespace_tools`,
`sanitize_streaming_responses_body` and `restore_namespace_tool_calls`
(nemo_gym/responses_streaming.py). For each, the body gymproxy sends vLLM is compared with the one
NeMo Gym sends (its sanitized request, converted by spec 5 and 6: `strict` stripped, the config's
model), and the names a client gets back with the ones NeMo Gym restores. Where gymproxy differs
on purpose, the test says so and asserts both.
"""

from __future__ import annotations

import copy
from typing import Any

import aiohttp
import orjson
import pytest

from gymproxy.convert.boundary import Boundary, Rules
from gymproxy.convert.reply import to_response
from gymproxy.convert.request import RequestReader, to_chat_body
from gymproxy.convert.stream import ResponsesStream
from gymproxy.errors import BadRequest
from gymproxy.schemas import ENCODER
from gymproxy.schemas.chat import COMPLETION_DECODER
from gymproxy.schemas.responses import ResponsesRequest
from gymproxy.testing.fake_vllm import Script

from . import chunks as vllm
from .test_exchange import _strip_ids
from .test_responses_stream import _MADE, _check_against_final, _check_protocol, _parse_frames, _sdk_replay, _translate

NAMESPACE_TOOL: dict[str, Any] = {
    "type": "namespace",
    "name": "mcp__weather",
    "description": "Tools in the mcp__weather namespace.",
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Get the weather.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
}
FUNCTION_TOOL = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {}},
}
# Both, as vLLM gets them (NeMo Gym's boundary strips `strict`).
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "mcp__weather__get_weather",
        "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
EXEC_COMMAND = {
    "type": "function",
    "function": {
        "name": "exec_command",
        "description": "Run a command.",
        "parameters": {"type": "object", "properties": {}},
    },
}
MODEL = "policy"


def request(body: dict[str, Any]) -> ResponsesRequest:
    return RequestReader().decode(orjson.dumps(body))


def upstream(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body gymproxy sends vLLM for a Responses request (its streaming flags aside)."""
    boundary = Boundary(Rules(model=MODEL))
    sent = boundary.prepare(to_chat_body(request(body), boundary), built=True)
    return orjson.loads(ENCODER.encode(sent))


def with_strict(tool: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    tool = copy.deepcopy(tool)
    for sub in tool["tools"]:
        if strict is None:
            sub.pop("strict")
        else:
            sub["strict"] = strict
    return tool


# --- NeMo Gym's request vectors -------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_namespace_tool_flattens_to_one_function_tool(strict):
    # test_flattens_namespace_tools: one function tool `mcp__weather__get_weather`.
    body = {"input": [], "stream": True, "tools": [with_strict(NAMESPACE_TOOL, strict)]}
    nemo_gym = {"model": MODEL, "messages": [], "tools": [GET_WEATHER]}
    assert upstream(body) == nemo_gym


def test_function_tools_are_kept_and_namespaces_flattened_in_order():
    # test_sanitize_keeps_function_tools_and_flattens_namespaces.
    body = {"input": [], "stream": True, "tools": [FUNCTION_TOOL, NAMESPACE_TOOL]}
    nemo_gym = {"model": MODEL, "messages": [], "tools": [EXEC_COMMAND, GET_WEATHER]}
    assert upstream(body) == nemo_gym


def test_unsupported_tool_specs_are_dropped():
    # test_drops_unsupported_tool_specs: a tool type nobody knows leaves no tools at all.
    body = {"input": [], "stream": True, "tools": [{"type": "totally_unknown_tool_kind", "config": 1}]}
    nemo_gym = {"model": MODEL, "messages": []}
    assert upstream(body) == nemo_gym
    assert request(body).tools == []


def test_replayed_namespaced_calls_are_renamed_in_the_history():
    # test_rewrites_namespaced_calls_in_input_history (refused before gymproxy had namespaces).
    body = {
        "stream": True,
        "input": [
            {
                "type": "function_call",
                "namespace": "mcp__weather",
                "name": "get_weather",
                "arguments": "{}",
                "call_id": "call_1",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
    }
    nemo_gym = {
        "model": MODEL,
        "messages": [
            {
                "content": None,
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "function": {"arguments": "{}", "name": "mcp__weather__get_weather"},
                        "type": "function",
                    }
                ],
            },
            {"content": "sunny", "role": "tool", "tool_call_id": "call_1"},
        ],
    }
    assert upstream(body) == nemo_gym


def test_bookkeeping_fields_are_accepted_and_store_is_not_sent():
    # test_drops_unknown_top_level_fields: NeMo Gym drops client_metadata and prompt_cache_key and
    # forwards `store`; gymproxy accepts all three and sends none (docs/routes.md: "Responses request fields").
    body = {"input": [], "stream": True, "client_metadata": {"x": 1}, "prompt_cache_key": "abc", "store": False}
    nemo_gym = {"model": MODEL, "messages": [], "store": False}
    assert upstream(body) == {k: v for k, v in nemo_gym.items() if k != "store"}


def test_a_sub_tool_without_strict_is_kept_where_nemo_gym_drops_it():
    # NeMo Gym validates each flattened sub-tool against the SDK's function-tool schema, which
    # requires `strict`, so it silently drops this one (spec 16.7). It is a valid function tool:
    # gymproxy keeps it (a listed deliberate difference).
    body = {"input": [], "stream": True, "tools": [with_strict(NAMESPACE_TOOL, None)]}
    nemo_gym = {"model": MODEL, "messages": []}
    assert upstream(body) == {**nemo_gym, "tools": [GET_WEATHER]}


def test_a_custom_sub_tool_becomes_a_function_tool():
    # NeMo Gym's rule re-types custom sub-tools as functions (and then drops them too: no `strict`).
    tool = {
        "type": "namespace",
        "name": "code",
        "tools": [{"type": "custom", "name": "exec", "description": "Run JS."}],
    }
    sent = upstream({"input": [], "tools": [tool]})
    assert sent["tools"] == [{"type": "function", "function": {"name": "code__exec", "description": "Run JS."}}]


def test_strict_survives_without_a_boundary_and_the_echo_keeps_the_namespace_tool():
    tool = with_strict(NAMESPACE_TOOL, True)
    req = request({"input": "x", "tools": [tool]})
    assert to_chat_body(req)["tools"][0]["function"]["strict"] is True
    response = to_response(completion([]), req, model=MODEL, parser=False)
    echoed = copy.deepcopy(tool)
    echoed["tools"][0]["defer_loading"] = None  # as function tools are echoed (the SDK 2.44 key set)
    assert orjson.loads(ENCODER.encode(response))["tools"] == [echoed]


def test_an_empty_namespace_on_a_replayed_call_is_no_namespace():
    body = {"input": [{"type": "function_call", "namespace": "", "name": "f", "arguments": "{}", "call_id": "c"}]}
    assert upstream(body)["messages"][0]["tool_calls"][0]["function"]["name"] == "f"


# --- flattened names must stay unique -------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "function", "name": "mcp__weather__get_weather"}, NAMESPACE_TOOL], "tools[1].tools[0].name"),
        ([NAMESPACE_TOOL, {"type": "custom", "name": "mcp__weather__get_weather"}], "tools[0].tools[0].name"),
        (
            [
                {"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "b__c"}]},
                {"type": "namespace", "name": "a__b", "tools": [{"type": "function", "name": "c"}]},
            ],
            "tools[1].tools[0].name",
        ),
        (
            [
                {
                    "type": "namespace",
                    "name": "n",
                    "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}],
                }
            ],
            "tools[0].tools[1].name",
        ),
    ],
)
def test_a_flattened_name_taken_by_another_tool_is_a_400(tools, param):
    with pytest.raises(BadRequest) as info:
        to_chat_body(request({"input": "x", "tools": tools}))
    assert info.value.param == param
    assert "another tool already has that name" in info.value.message


def test_a_deferred_sub_tool_is_refused_as_a_deferred_tool_is():
    tool = {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f", "defer_loading": True}]}
    with pytest.raises(BadRequest) as info:
        to_chat_body(request({"input": "x", "tools": [tool]}))
    assert info.value.param == "tools[0].tools[0].defer_loading"


# --- NeMo Gym's restoration vectors, non-streamed and streamed ------------------------------------


def completion(calls: list[tuple[str, str]]) -> Any:
    """vLLM's reply calling each (call id, function name)."""
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
            for call_id, name in calls
        ]
        or None,
    }
    body = {"created": vllm.CREATED, "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}
    return COMPLETION_DECODER.decode(orjson.dumps(body))


def calls_of(response: Any) -> list[tuple[str, str | None]]:
    output = orjson.loads(ENCODER.encode(response))["output"]
    return [(item["name"], item["namespace"]) for item in output if item["type"] == "function_call"]


def stream_of(req: ResponsesRequest, calls: list[tuple[str, str]]) -> tuple[list[dict[str, Any]], Any]:
    deltas = [
        d for i, (call_id, name) in enumerate(calls) for d in vllm.call(i, call_id, name, '{"city": ', '"Paris"}')
    ]
    stream = ResponsesStream(req, model=MODEL, parser=False)
    raw = stream.start()
    for chunk in vllm.chunks(deltas, "tool_calls"):
        raw += stream.payload(orjson.dumps(chunk))
    raw += stream.finish()
    return _parse_frames(raw), stream.final


def test_namespaced_call_names_are_restored_in_the_response():
    # test_namespaced_call_names_restored, on the non-streamed Response too.
    req = request({"input": "x", "tools": [NAMESPACE_TOOL]})
    response = to_response(completion([("call_1", "mcp__weather__get_weather")]), req, model=MODEL, parser=False)
    assert calls_of(response) == [("get_weather", "mcp__weather")]


def test_unmapped_calls_are_left_alone():
    # test_unmapped_calls_left_alone: a plain tool beside a namespace keeps its name, and no namespace.
    other = {"type": "namespace", "name": "other", "tools": [{"type": "function", "name": "tool"}]}
    req = request({"input": "x", "tools": [FUNCTION_TOOL, other]})
    response = to_response(completion([("call_1", "exec_command")]), req, model=MODEL, parser=False)
    assert calls_of(response) == [("exec_command", None)]


def test_without_namespace_tools_a_flattened_looking_name_is_left_alone():
    req = request({"input": "x", "tools": [{"type": "function", "name": "mcp__weather__get_weather"}]})
    response = to_response(completion([("c", "mcp__weather__get_weather")]), req, model=MODEL, parser=False)
    assert calls_of(response) == [("mcp__weather__get_weather", None)]


def test_every_stream_event_carries_the_restored_name():
    req = request({"input": "x", "tools": [FUNCTION_TOOL, NAMESPACE_TOOL]})
    events, final = stream_of(req, [("call_1", "mcp__weather__get_weather"), ("call_2", "exec_command")])
    streamed = _check_protocol(events)
    named = [
        (e["type"], e["item"]["name"], e["item"]["namespace"]) if "item" in e else (e["type"], e["name"], None)
        for e in events
        if e["type"]
        in ("response.output_item.added", "response.output_item.done", "response.function_call_arguments.done")
    ]
    assert named == [
        ("response.output_item.added", "get_weather", "mcp__weather"),
        ("response.function_call_arguments.done", "get_weather", None),
        ("response.output_item.done", "get_weather", "mcp__weather"),
        ("response.output_item.added", "exec_command", None),
        ("response.function_call_arguments.done", "exec_command", None),
        ("response.output_item.done", "exec_command", None),
    ]
    # The terminal Response carries the same items, and equals the non-streamed one.
    assert events[-1]["type"] == "response.completed"
    assert calls_of(final) == [("get_weather", "mcp__weather"), ("exec_command", None)]
    assert events[-1]["response"]["output"] == [s["item"] for s in streamed]
    _check_against_final(streamed, final, strict_items=True)
    completed = _sdk_replay(events)[-1]
    assert [(i.name, i.namespace) for i in completed.response.output] == calls_of(final)


def test_streamed_final_equals_non_streamed_split_at_every_byte():
    req = request({"model": "m", "input": "x", "tools": [NAMESPACE_TOOL], "stream": True})
    deltas = vllm.call(0, "call_1", "mcp__weather__get_weather", '{"city": ', '"Paris"}')
    chunks = vllm.chunks(deltas, "tool_calls")
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    expected = orjson.loads(ENCODER.encode(to_response(vllm.completion(chunks), req, model=req.model, parser=False)))
    assert calls_of_json(expected) == [("get_weather", "mcp__weather")]
    whole, _ = _translate(raw, len(raw), req, False)
    _check_protocol(_parse_frames(whole))
    for cut in range(len(raw)):
        events, final = _translate(raw, cut, req, False)
        assert _MADE.sub(b"<made>", events) == _MADE.sub(b"<made>", whole), cut
        got = orjson.loads(ENCODER.encode(final))
        assert {**got, "id": "", "created_at": 0} == {**expected, "id": "", "created_at": 0}, cut


def calls_of_json(response: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(i["name"], i["namespace"]) for i in response["output"] if i["type"] == "function_call"]


# --- through the route ----------------------------------------------------------------------------


async def test_route_flattens_and_restores_on_both_paths(client, fake_vllm):
    # NeMo Gym's test_streaming_request_returns_synthesized_sse, and the same request not streamed.
    call = {"name": "mcp__weather__get_weather", "arguments": '{"city": "Paris"}', "id": "call_1"}
    fake_vllm.push(Script(tool_calls=[call]), Script(tool_calls=[call]))
    body: dict[str, Any] = {
        "model": "m",
        "input": [{"role": "user", "content": "hi"}],
        "tools": [NAMESPACE_TOOL],
        "prompt_cache_key": "abc",
        "extra_body": {"client_metadata": {"cli": "codex"}},
    }
    plain = await client.responses.create(**body)
    assert fake_vllm.last_json()["tools"] == [GET_WEATHER]
    events = [e async for e in await client.responses.create(**body, stream=True)]
    assert fake_vllm.last_json()["tools"] == [GET_WEATHER]
    (item,) = plain.output
    assert (item.type, item.name, item.namespace, item.arguments) == (
        "function_call",
        "get_weather",
        "mcp__weather",
        '{"city": "Paris"}',
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.namespace) for i in done] == [("get_weather", "mcp__weather")]
    assert events[-1].type == "response.completed"
    assert _strip_ids(events[-1].response.model_dump()) == _strip_ids(plain.model_dump())


async def test_route_replays_a_namespaced_call_in_the_history(client, fake_vllm):
    history = [
        {"role": "user", "content": "weather?"},
        {
            "type": "function_call",
            "namespace": "mcp__weather",
            "name": "get_weather",
            "arguments": "{}",
            "call_id": "c1",
        },
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    await client.responses.create(model="m", input=history, tools=[NAMESPACE_TOOL])
    assistant = fake_vllm.last_json()["messages"][1]
    assert assistant["tool_calls"][0]["function"]["name"] == "mcp__weather__get_weather"


async def test_route_refuses_a_colliding_name(proxy_url):
    tools = [{"type": "function", "name": "mcp__weather__get_weather"}, NAMESPACE_TOOL]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy_url}/v1/responses", json={"model": "m", "input": "x", "tools": tools}) as r:
            status, body = r.status, await r.json()
    assert status == 400 and body["error"]["param"] == "tools[1].tools[0].name"


async def test_route_without_a_namespace_tool_is_as_before(client, fake_vllm):
    fake_vllm.push(Script(tool_calls=[{"name": "exec_command", "arguments": "{}", "id": "c"}]))
    response = await client.responses.create(model="m", input="x", tools=[FUNCTION_TOOL])
    assert [(i.name, i.namespace) for i in response.output] == [("exec_command", None)]
