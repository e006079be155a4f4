"""gymproxy's Messages conversion (convert/anthropic.py) pinned to vLLM 0.32's own code, run in the
vLLM venv: for each Messages request, the chat request vLLM's Anthropic endpoint builds internally
and the one vLLM parses from gymproxy's chat body are the same model, field for field; for each
chat reply and stream a real vLLM sent (tests/data/vllm-0.32/) and a few made here, vLLM's
converters and gymproxy's give the same answer, ids and signatures aside.

No server is started: vLLM's converters are called directly (`to_chat_completion_request`,
`messages_full_converter`, `message_stream_converter`), a few seconds in all.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from gymproxy.convert.anthropic import MessagesStream, to_chat_body, to_message
from gymproxy.errors import UpstreamStatus
from gymproxy.schemas.chat import COMPLETION_DECODER
from gymproxy.schemas.messages import MESSAGES_DECODER

from .conftest import Paths

DATA = Path(__file__).resolve().parent.parent / "data"

VLLM_SIDE = r"""
import asyncio, json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as S
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

cases = json.load(sys.stdin)
out = {"requests": [], "replies": [], "streams": []}
for case in cases["requests"]:
    internal = S.to_chat_completion_request(
        AnthropicMessagesRequest.model_validate(case["request"]), merge_inline_system=case["merge"]
    )
    ours = ChatCompletionRequest.model_validate(case["chat"])
    dumps = [internal.model_dump(mode="json"), ours.model_dump(mode="json")]
    for dump in dumps:
        dump.pop("request_id")  # a random default
    out["requests"].append(dumps)
for raw in cases["replies"]:
    try:
        message = S.messages_full_converter(None, ChatCompletionResponse.model_validate_json(raw))
        out["replies"].append([200, message.model_dump(mode="json", exclude_none=True)])
    except Exception as exc:  # what the router answers then
        error = create_error_response(exc).error
        out["replies"].append([error.code, {"type": "error", "error": {"type": error.type, "message": error.message}}])

async def events(payloads):
    async def chunks():
        for payload in payloads:
            yield f"data: {payload}\n\n"
    return "".join([event async for event in S.message_stream_converter(None, chunks())])

for payloads in cases["streams"]:
    out["streams"].append(asyncio.run(events(payloads)))
print(json.dumps(out))
"""

TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": {"properties": {"city": {"type": "string"}}}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]},
    {"role": "system", "content": "x-anthropic-billing-header: dropped inline"},
    {"role": "system", "content": [{"type": "text", "text": "note one"}, {"type": "text", "text": " and two"}]},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Zürich", "n": [1, 2.50, True, None]}},
            {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {}},
            {"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text", "text": "odd"}]},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": [
                {"type": "text", "text": "sunny"}, {"type": "text", "text": "warm"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                {"type": "tool_reference", "tool_name": "get_weather"},
            ]},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": "plain", "is_error": True},
            {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c"}]},
    {"role": "assistant", "content": []},
]  # fmt: skip


def requests() -> list[dict[str, Any]]:
    """Messages requests that exercise each rule of vLLM's conversion."""
    claude = json.loads((DATA / "harnesses" / "claude-code-2.1-first-request.json").read_text())["body"]
    base = {"model": "m", "max_tokens": 2000}
    return [
        claude,
        {**base, "messages": HISTORY, "system": "x-anthropic-billing-header: kept in a string", "tools": [TOOL]},
        {
            **base,
            "messages": [{"role": "user", "content": "hi"}],
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}],
            "tools": [TOOL, {**TOOL, "name": "late", "defer_loading": True, "strict": True}],
            "tool_choice": {"type": "tool", "name": "late", "disable_parallel_tool_use": True},
            "stop_sequences": ["STOP", "END"],
            "temperature": 0.2,
            "top_p": 0.5,
            "top_k": 7,
            "stream": True,
            "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "chat_template_kwargs": {"enable_thinking": False},
            "cache_salt": "salt",
            "vllm_xargs": {"k": 1},
            "metadata": {"user_id": "u"},
        },
        {
            **base,
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "system", "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "late"}},
                    {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {**TOOL, "name": "new"}}},
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}},
                ]},
            ],
            "tools": [TOOL, {**TOOL, "name": "late", "defer_loading": True}],
            "tool_choice": {"type": "none"},
            "thinking": {"type": "adaptive"},
        },
        {**base, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "none"}},
    ]  # fmt: skip


def recorded_replies() -> tuple[list[str], list[list[str]]]:
    """vLLM 0.32's own chat replies and streams, from the recorded integration traffic."""
    replies: list[str] = []
    streams: list[list[str]] = []
    for path in sorted((DATA / "vllm-0.32").glob("*.json")):
        for step in json.loads(path.read_text())["steps"]:
            for up in step.get("upstream", []):
                if not (up["path"].startswith("/v1/chat/completions") and up["status"] == 200):
                    continue
                if up["content_type"] == "text/event-stream":
                    streams.append([frame[6:] for frame in up["response"].split("\n\n") if frame.startswith("data: ")])
                else:
                    replies.append(up["response"])
    return replies, streams


def chunk(delta: dict[str, Any] | None = None, **fields: Any) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, **fields}]
    usage = {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3}
    if delta is None:
        usage["prompt_tokens_details"] = {"cached_tokens": 4}
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": choices, "usage": usage})  # fmt: skip


def call(index: int, arguments: str, name: str | None = None, id: str | None = None) -> dict[str, Any]:
    head = {"id": id, "type": "function"} if id else {}
    return {"index": index, **head, "function": {**({"name": name} if name else {}), "arguments": arguments}}


MADE_STREAMS = [
    # text after a tool call is held and sent as a block of its own; a second call's fragments
    [chunk({"role": "assistant", "content": ""}), chunk({"reasoning": "think"}), chunk({"tool_calls": [call(0, '{"a"', "f", "c1"), call(0, ": 1}")]}),
     chunk({"content": "between"}), chunk({"tool_calls": [call(1, '{"b": 2', "g", "c2")]}), chunk({"tool_calls": [call(0, "lost")]}),
     chunk({"tool_calls": [call(1, "}")]}), chunk({}, finish_reason="tool_calls"), chunk(), "[DONE]"],
    # a stop string matched
    [chunk({"role": "assistant", "content": ""}), chunk({"content": "a"}), chunk({}, finish_reason="stop", stop_reason="END"), chunk(), "[DONE]"],
    # a pause cut it; a call cut short
    [chunk({"role": "assistant", "content": ""}), chunk({"tool_calls": [call(0, '{"a": ', "f", "c1")]}), chunk({}, finish_reason="abort"), chunk(), "[DONE]"],
    [chunk({"role": "assistant", "content": ""}), chunk({"tool_calls": [call(0, '{"a": ', "f", "c1")]}), chunk({}, finish_reason="stop"), chunk(), "[DONE]"],
]  # fmt: skip


def completion(message: dict[str, Any], finish: str = "stop", stop: Any = None, **usage: Any) -> str:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, "stop_reason": stop}
    return json.dumps({"id": "chatcmpl-2", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice],
                       "usage": {"prompt_tokens": 10, "total_tokens": 12, "completion_tokens": 2, **usage}})  # fmt: skip


MADE_REPLIES = [
    completion({"content": None}),
    completion({"content": "x"}, "stop", "END"),
    completion({"content": "x"}, "abort"),
    completion({"content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "stop"),
    completion({"content": "x"}, prompt_tokens_details={"cached_tokens": 6, "created_cache_tokens": 1}),
    completion({"tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}, "tool_calls"),
]  # fmt: skip


def without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "*" if k in ("id", "signature") else without_ids(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def events(raw: str) -> list[Any]:
    return [
        [frame.split("\n")[0], without_ids(json.loads(frame.split("\n")[1][6:]))]
        for frame in raw.split("\n\n")
        if frame
    ]


def ours_whole(raw: str) -> list[Any]:
    try:
        return [200, orjson.loads(to_message(COMPLETION_DECODER.decode(raw)))]
    except UpstreamStatus as exc:
        assert exc.raw is not None
        return [exc.status, orjson.loads(exc.raw)]


def ours_stream(payloads: list[str]) -> str:
    stream = MessagesStream()
    out = [stream.payload(p.encode()) for p in payloads if p != "[DONE]"]
    return b"".join([*out, stream.finish()]).decode()


def test_the_conversion_is_vllms_own(paths: Paths) -> None:
    replies, streams = recorded_replies()
    assert len(replies) >= 20 and len(streams) >= 10  # the recordings are there
    replies += MADE_REPLIES
    streams += MADE_STREAMS
    cases = [
        {"request": request, "merge": merge, "chat": to_chat_body(MESSAGES_DECODER.decode(orjson.dumps(request)), merge_inline_system=merge)}
        for request in requests()
        for merge in (False, True)
    ]  # fmt: skip
    given = json.dumps({"requests": cases, "replies": replies, "streams": streams})
    done = subprocess.run([paths.python, "-c", VLLM_SIDE], input=given, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    vllm = json.loads(done.stdout.strip().splitlines()[-1])
    for case, (internal, ours) in zip(cases, vllm["requests"], strict=True):
        assert ours == internal, case["request"].get("messages", [])[:2]
    for raw, theirs in zip(replies, vllm["replies"], strict=True):
        assert without_ids(ours_whole(raw)) == without_ids(theirs), raw
    for payloads, theirs in zip(streams, vllm["streams"], strict=True):
        assert events(ours_stream(payloads)) == events(theirs), payloads


@pytest.mark.parametrize("merge", [False, True])
def test_claude_codes_request_keeps_its_system_note_where_the_template_says(merge: bool) -> None:
    """The recorded request's inline system message: in place, or joined to the system prompt."""
    body = json.loads((DATA / "harnesses" / "claude-code-2.1-first-request.json").read_text())["body"]
    chat = to_chat_body(MESSAGES_DECODER.decode(orjson.dumps(body)), merge_inline_system=merge)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == (["system", "user"] if merge else ["system", "user", "system"])
    assert "x-anthropic-billing-header" not in chat["messages"][0]["content"]
