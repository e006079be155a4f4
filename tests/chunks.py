"""vLLM chat chunk sequences for the stream-translation tests: chunk builders, the answers they
spell, and the non-streamed completion the same answer would have been."""

from __future__ import annotations

from typing import Any

import orjson

from gymproxy.schemas.chat import COMPLETION_DECODER, ChatCompletion
from gymproxy.schemas.responses import REQUEST_DECODER, ResponsesRequest

CREATED = 1767225600
MODEL = "policy"
USAGE = {
    "prompt_tokens": 21,
    "completion_tokens": 13,
    "total_tokens": 34,
    "prompt_tokens_details": {"cached_tokens": 16},
    "completion_tokens_details": {"reasoning_tokens": 5},
}


def chunk(delta: dict[str, Any] | None = None, finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "chatcmpl-7f3a",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": "upstream-model",
        "choices": [
            {"index": 0, "delta": delta if delta is not None else {}, "logprobs": None, "finish_reason": finish_reason}
        ],
    }
    body.update(extra)
    return body


def reasoning(*pieces: str, key: str = "reasoning") -> list[dict[str, Any]]:
    return [{key: p} for p in pieces]


def content(*pieces: str) -> list[dict[str, Any]]:
    return [{"content": p} for p in pieces]


def call(index: int, call_id: str, name: str, *fragments: str) -> list[dict[str, Any]]:
    """vLLM's tool-call deltas: the first carries index/id/type/name, later ones argument fragments only."""
    first = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    return [{"tool_calls": [first]}] + [
        {"tool_calls": [{"index": index, "function": {"arguments": f}}]} for f in fragments
    ]


HERMES_FIRST = {
    "tool_calls": [
        {"index": 0, "id": "chatcmpl-tool-h1", "type": "function", "function": {"name": "calc", "arguments": None}},
        {"index": 0, "function": {"arguments": '{"x": '}},
    ]
}

# name -> (deltas, has_reasoning_field, items_follow_final_order)
# The last flag is False where streaming cannot know the final item layout in advance (text before a
# think block): the streamed text then still equals the final text, but spread over more items.
BODIES: dict[str, tuple[list[dict[str, Any]], bool, bool]] = {
    "text": (content("Hel", "lo", " world."), False, True),
    "empty": ([], False, True),
    "empty_deltas": ([{}, *content("a"), {}, *content("b"), {}], False, True),
    "reasoning_then_text": (reasoning("Let me ", "think.") + content("The answer", " is 4."), True, True),
    "reasoning_only": (reasoning("thinking", " harder"), True, True),
    "reasoning_content_key": (reasoning("old ", "vllm", key="reasoning_content") + content("ok"), True, True),
    "reasoning_and_text_in_one_delta": (
        [{"reasoning": "quick thought"}, {"reasoning": " end", "content": "Answer"}],
        True,
        True,
    ),
    "think_tags_straddling": (content("<thi", "nk>let me", " think</th", "ink>The ans", "wer"), False, True),
    "two_think_blocks": (content("<think>a</think><thi", "nk>b</think>", "X"), False, True),
    "empty_think": (content("<think></think>x"), False, True),
    "stray_close": (content("x</thi", "nk>y"), False, True),
    "partial_tag_at_end": (content("Hello <th"), False, True),
    "reasoning_then_think_in_content": (reasoning("r1") + content("<think>s</think>", "B"), True, True),
    "text_around_think": (content("A<think>r</thi", "nk>B"), False, False),
    "two_tool_calls": (
        reasoning("I should ", "call tools.")
        + call(0, "chatcmpl-tool-1", "get_weather", '{"city": ', '"Paris"}')
        + call(1, "chatcmpl-tool-2", "get_time", '{"tz":', ' "CET"}'),
        True,
        True,
    ),
    "text_then_tool_call": (content("Checking.") + call(0, "call_abc", "lookup", '{"q": "x"}'), False, True),
    "hermes_two_entries_one_delta": (
        [HERMES_FIRST, {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}],
        False,
        True,
    ),
    "tool_call_no_arguments": (call(0, "call_none", "ping"), False, True),
    "tool_call_name_arrives_late": (
        [
            {"tool_calls": [{"index": 0, "id": "call_late", "type": "function", "function": {"arguments": ""}}]},
            {"tool_calls": [{"index": 0, "function": {"name": "late", "arguments": "{}"}}]},
        ],
        False,
        True,
    ),
    "refusal_only": ([{"refusal": "I can't "}, {"refusal": "help with that."}], False, True),
    "text_then_refusal": (content("Well. ") + [{"refusal": "No."}], False, True),
}

FINISH_REASONS = ["stop", "length", "tool_calls", "content_filter"]


def chunks(deltas: list[dict[str, Any]], finish_reason: str, *, usage: bool = True) -> list[dict[str, Any]]:
    """Role chunk, the deltas, the finish (on the last delta for length, else a `{}` chunk), usage."""
    chunks = [chunk({"role": "assistant", "content": ""}, prompt_token_ids=None)]
    chunks += [chunk(d) for d in deltas]
    if finish_reason == "length" and deltas:
        chunks[-1]["choices"][0]["finish_reason"] = "length"
    else:
        chunks.append(chunk({}, finish_reason))
    if usage:
        chunks.append(chunk(choices=[], usage=USAGE))
    return chunks


def completion(chunks: list[dict[str, Any]]) -> ChatCompletion:
    """The non-streamed chat completion carrying the same answer as `chunks`."""
    content: list[str] = []
    reasoning: list[str] = []
    refusal: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    finish = None
    usage = None
    for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning") or delta.get("reasoning_content") or "")
            refusal.append(delta.get("refusal") or "")
            for call in delta.get("tool_calls") or ():
                entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                function = call.get("function") or {}
                entry["id"] = call.get("id") or entry["id"]
                entry["name"] = function.get("name") or entry["name"]
                entry["arguments"] += function.get("arguments") or ""
            finish = choice["finish_reason"] or finish
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None, "tool_calls": None}
    if "".join(refusal):
        message["refusal"] = "".join(refusal)
    if "".join(reasoning):
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
    body = {
        "id": "chatcmpl-7f3a",
        "object": "chat.completion",
        "created": CREATED,
        "model": "upstream-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }
    return COMPLETION_DECODER.decode(orjson.dumps(body))


def request(**fields: Any) -> ResponsesRequest:
    body = {
        "input": "What is 2+2?",
        "model": "m",
        "instructions": "Be brief.",
        "temperature": 0.6,
        "max_output_tokens": 256,
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "stream": True,
        **fields,
    }
    return REQUEST_DECODER.decode(orjson.dumps(body))
