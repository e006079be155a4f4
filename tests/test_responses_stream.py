"""convert.stream.ResponsesStream, sans IO: vLLM chat chunks in, Responses events out.

The streamed events must follow the Responses protocol the openai SDK's accumulator expects
(wire-facts B), and the terminal Response must equal the non-streaming conversion of the same
answer (`reply.to_response`, spec 7.1 and 8): for the chunk sequences built here, and for the
streams a real vLLM sent (tests/data/vllm-0.32), fed to the translator split at every byte.
"""

from __future__ import annotations

import re
import typing
from typing import Any

import orjson
import pytest

from gymproxy.convert.reply import to_response
from gymproxy.convert.stream import ResponsesStream
from gymproxy.errors import UpstreamError
from gymproxy.schemas import ENCODER
from gymproxy.schemas.chat import CHUNK_DECODER, COMPLETION_DECODER
from gymproxy.schemas.responses import Response, ResponsesRequest
from gymproxy.sse import DONE, SSEDecoder

from . import chunks as vllm
from . import recordings

# --- SSE parsing and protocol checks ------------------------------------------------------------


def _parse_frames(raw: bytes) -> list[dict[str, Any]]:
    assert raw.endswith(b"\n\n") or raw == b""
    events = []
    for frame in raw.split(b"\n\n")[:-1]:
        lines = frame.split(b"\n")
        assert len(lines) == 2, frame
        assert lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "), frame
        event = orjson.loads(lines[1][len(b"data: ") :])
        assert lines[0][len(b"event: ") :].decode() == event["type"]
        events.append(event)
    return events


def _run(chunks: list[dict[str, Any]], *, parser: bool, continued: bool, req: ResponsesRequest | None = None):
    stream = ResponsesStream(req or vllm.request(), model=vllm.MODEL, parser=parser, continued=continued)
    raw = stream.start()
    for chunk in chunks:
        raw += stream.feed(CHUNK_DECODER.decode(orjson.dumps(chunk)))
    tail = stream.finish()
    final = stream.final
    assert final is not None
    return _parse_frames(raw + tail), _parse_frames(tail), final


def _as_json(value: Any) -> Any:
    return orjson.loads(ENCODER.encode(value))


TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
INDEXED_EVENTS = {
    "response.content_part.added", "response.content_part.done",
    "response.output_text.delta", "response.output_text.done",
    "response.refusal.delta", "response.refusal.done",
    "response.reasoning_summary_part.added", "response.reasoning_summary_part.done",
    "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
    "response.function_call_arguments.delta", "response.function_call_arguments.done",
}  # fmt: skip


def _check_protocol(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Protocol rules of wire-facts B; returns the streamed items (with their accumulated deltas)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    for event in events[:2]:
        assert event["response"]["status"] == "in_progress" and event["response"]["output"] == []
    assert events[-1]["type"] in TERMINAL
    assert not any(
        e["type"] in TERMINAL or e["type"] in ("response.created", "response.in_progress") for e in events[2:-1]
    )
    response_id = events[0]["response"]["id"]
    assert all(e["response"]["id"] == response_id for e in events if "response" in e)

    items: dict[int, dict[str, Any]] = {}
    parts: dict[tuple[int, int], dict[str, Any]] = {}  # (output_index, content_index) -> state
    summaries: dict[tuple[int, int], dict[str, Any]] = {}  # (output_index, summary_index) -> state
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            index = event["output_index"]
            assert index == len(items), "output indexes are 0, 1, 2, ... in order"
            item = event["item"]
            assert item.get("status", "in_progress") == "in_progress" or item["type"] == "reasoning"
            items[index] = {"added": item, "done": None, "text": "", "refusal": "", "arguments": "", "summaries": []}
            if item["type"] == "message":
                assert item["content"] == []
            if item["type"] == "function_call":
                assert item["arguments"] == ""
            continue
        assert kind in INDEXED_EVENTS or kind == "response.output_item.done", kind
        index = event["output_index"]
        assert index in items, f"{kind} for output_index {index} before its output_item.added"
        state = items[index]
        assert state["done"] is None, f"{kind} after output_item.done"
        if kind == "response.output_item.done":
            assert event["item"]["type"] == state["added"]["type"] and event["item"]["id"] == state["added"]["id"]
            assert all(p["done"] for (i, _), p in parts.items() if i == index), "a content part left open"
            assert all(s["done"] for (i, _), s in summaries.items() if i == index), "a summary part left open"
            state["done"] = event["item"]
            continue
        assert event["item_id"] == state["added"]["id"]
        item_type = state["added"]["type"]
        if kind.startswith(("response.content_part", "response.output_text", "response.refusal")):
            assert item_type == "message"
            key = (index, event["content_index"])
            if kind == "response.content_part.added":
                assert key not in parts
                assert event["part"] in ({"type": "output_text", "text": "", "annotations": [], "logprobs": None},
                                         {"type": "refusal", "refusal": ""})  # fmt: skip
                parts[key] = {"type": event["part"]["type"], "text": "", "text_done": None, "done": None}
                continue
            assert key in parts, f"{kind} before content_part.added"
            part = parts[key]
            assert part["done"] is None
            if kind == "response.output_text.delta":
                assert part["type"] == "output_text" and part["text_done"] is None and event["delta"]
                assert event["logprobs"] == []
                part["text"] += event["delta"]
            elif kind == "response.refusal.delta":
                assert part["type"] == "refusal" and part["text_done"] is None
                part["text"] += event["delta"]
            elif kind == "response.output_text.done":
                assert part["type"] == "output_text" and event["text"] == part["text"]
                part["text_done"] = event["text"]
            elif kind == "response.refusal.done":
                assert part["type"] == "refusal" and event["refusal"] == part["text"]
                part["text_done"] = event["refusal"]
            else:  # content_part.done
                assert part["text_done"] is not None, "content_part.done before the text's .done"
                expected = (
                    {"type": "output_text", "text": part["text"], "annotations": [], "logprobs": None}
                    if part["type"] == "output_text"
                    else {"type": "refusal", "refusal": part["text"]}
                )
                assert event["part"] == expected
                part["done"] = event["part"]
                if part["type"] == "output_text":
                    state["text"] += part["text"]
                else:
                    state["refusal"] += part["text"]
        elif kind.startswith("response.reasoning_summary"):
            assert item_type == "reasoning"
            key = (index, event["summary_index"])
            if kind == "response.reasoning_summary_part.added":
                assert key not in summaries and event["summary_index"] == len(state["summaries"])
                assert event["part"] == {"type": "summary_text", "text": ""}
                summaries[key] = {"text": "", "text_done": None, "done": None}
                continue
            assert key in summaries, f"{kind} before reasoning_summary_part.added"
            summary = summaries[key]
            assert summary["done"] is None
            if kind == "response.reasoning_summary_text.delta":
                assert summary["text_done"] is None and event["delta"]
                summary["text"] += event["delta"]
            elif kind == "response.reasoning_summary_text.done":
                assert event["text"] == summary["text"]
                summary["text_done"] = event["text"]
            else:
                assert summary["text_done"] is not None
                assert event["part"] == {"type": "summary_text", "text": summary["text"]}
                summary["done"] = True
                state["summaries"].append(summary["text"])
        else:
            assert item_type == "function_call"
            assert state.get("args_done") is None
            if kind == "response.function_call_arguments.delta":
                assert event["delta"]
                state["arguments"] += event["delta"]
            else:
                assert event["arguments"] == state["arguments"]
                assert event["name"] == state["added"]["name"] or not state["added"]["name"]
                state["args_done"] = event

    assert all(state["done"] is not None for state in items.values()), "an item without output_item.done"
    streamed = []
    for index in range(len(items)):
        state = items[index]
        done = state["done"]
        if done["type"] == "message":
            assert done["status"] == "completed" and done["role"] == "assistant"
            keys = sorted(k for k in parts if k[0] == index)
            assert [k[1] for k in keys] == list(range(len(keys))), "content indexes are 0, 1, ..."
            assert done["content"] == [parts[k]["done"] for k in keys]
            texts = [p["text"] for p in done["content"] if p["type"] == "output_text"]
            assert "".join(texts) == state["text"]
            refusals = [p["refusal"] for p in done["content"] if p["type"] == "refusal"]
            assert "".join(refusals) == state["refusal"]
        elif done["type"] == "reasoning":
            assert [s["text"] for s in done["summary"]] == state["summaries"]
        else:
            assert state.get("args_done") is not None, "function_call_arguments.done missing"
            assert done["arguments"] == state["arguments"] and done["status"] == "completed"
            assert done["name"] == state["args_done"]["name"] and done["call_id"] == done["id"]
        streamed.append({**state, "type": done["type"], "id": done["id"], "item": done})
    return streamed


def _normalized(response: Any) -> dict[str, Any]:
    """A Response (Struct or JSON) with gymproxy-made ids blanked; tool-call ids are the upstream's."""
    data = _as_json(response) if isinstance(response, Response) else dict(response)
    data["id"] = "resp"
    data["output"] = [
        dict(item, id=item["type"]) if item["type"] in ("reasoning", "message") else item for item in data["output"]
    ]
    return data


def _check_against_final(streamed: list[dict[str, Any]], final: Response, *, strict_items: bool) -> None:
    output = _as_json(final)["output"]
    final_text = "".join(p.get("text", "") for i in output if i["type"] == "message" for p in i["content"])
    assert "".join(s["text"] for s in streamed if s["type"] == "message") == final_text
    final_summaries = [s["text"] for i in output if i["type"] == "reasoning" for s in i["summary"]]
    assert [t for s in streamed if s["type"] == "reasoning" for t in s["summaries"]] == final_summaries
    calls = [(i["call_id"], i["name"], i["arguments"]) for i in output if i["type"] == "function_call"]
    assert [
        (s["item"]["call_id"], s["item"]["name"], s["arguments"]) for s in streamed if s["type"] == "function_call"
    ] == calls
    # Every final item is one the stream announced (same type and id): the SDK checks identities.
    announced = {(s["type"], s["id"]) for s in streamed}
    assert all((i["type"], i["id"]) in announced for i in output)
    if strict_items:
        assert [(s["type"], s["id"]) for s in streamed] == [(i["type"], i["id"]) for i in output]
        assert [s["item"] for s in streamed] == output


# --- the openai SDK's own accumulator -----------------------------------------------------------


def _sdk_event_types() -> dict[str, Any]:
    from openai.types.responses import ResponseStreamEvent

    union = typing.get_args(ResponseStreamEvent)[0]
    return {typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in typing.get_args(union)}


def _sdk_replay(events: list[dict[str, Any]]) -> list[Any]:
    """Feed the events to `client.responses.stream()`'s accumulator, built as the SDK builds them.

    The SDK constructs events without validation; the non-lifecycle events (whose fields the
    accumulator reads) are also validated against their SDK models here. Lifecycle events carry
    a Response with the key set of openai-python 2.44, which newer SDK models extend.
    """
    streaming = pytest.importorskip("openai.lib.streaming.responses._responses")
    from openai import omit
    from openai._models import construct_type
    from openai.types.responses import ResponseStreamEvent

    models = _sdk_event_types()
    state = streaming.ResponseStreamState(input_tools=omit, text_format=omit)
    out = []
    for event in events:
        if "response" not in event:
            models[event["type"]].model_validate(event)
        out += state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    return out


# --- ResponsesStream ----------------------------------------------------------------------------

MATRIX = [
    pytest.param(
        name,
        finish,
        parser,
        continued,
        id=f"{name}-{finish}-{'parser' if parser else 'noparser'}-{'cont' if continued else 'new'}",
    )
    for name, (_, has_reasoning, _) in vllm.BODIES.items()
    for finish in vllm.FINISH_REASONS
    for parser in (True, False)
    for continued in (False, True)
    if parser or not has_reasoning
]


@pytest.mark.parametrize("name, finish, parser, continued", MATRIX)
def test_responses_stream_protocol_and_final_equal_non_streaming(name, finish, parser, continued):
    deltas, has_reasoning, strict_items = vllm.BODIES[name]
    if continued and has_reasoning and any("<think>" in (d.get("content") or "") for d in deltas):
        strict_items = False  # continued reasoning is plain text, so it is text before a think block
    chunks = vllm.chunks(deltas, finish)
    events, tail, final = _run(chunks, parser=parser, continued=continued)

    streamed = _check_protocol(events)

    # The terminal Response: returned by finish(), carried by the last frame, equal to the non-streamed one.
    assert tail and tail[-1] is not None and events[-1] == tail[-1]
    assert events[-1]["response"] == _as_json(final)
    assert final.id == events[0]["response"]["id"]
    expected = to_response(
        vllm.completion(chunks), vllm.request(), model=vllm.MODEL, parser=parser, continued=continued
    )
    assert _normalized(final) == _normalized(expected)
    assert final.created_at == vllm.CREATED
    incomplete = finish in ("length", "content_filter")
    assert events[-1]["type"] == ("response.incomplete" if incomplete else "response.completed")
    assert final.status == ("incomplete" if incomplete else "completed")
    if incomplete:
        assert (
            final.incomplete_details.reason
            == {"length": "max_output_tokens", "content_filter": "content_filter"}[finish]
        )

    _check_against_final(streamed, final, strict_items=strict_items or not parser)

    sdk_events = _sdk_replay(events)
    if not incomplete:
        completed = sdk_events[-1]
        assert completed.type == "response.completed" and completed.response.id == final.id
        output = _as_json(final)["output"]
        assert completed.response.output_text == "".join(
            p["text"] for i in output if i["type"] == "message" for p in i["content"] if p["type"] == "output_text"
        )


def test_responses_stream_reasoning_and_tool_calls_in_detail():
    chunks = vllm.chunks(vllm.BODIES["two_tool_calls"][0], "tool_calls")
    events, _, final = _run(chunks, parser=True, continued=False)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[1] == {
        "type": "function_call", "arguments": "", "call_id": "chatcmpl-tool-1", "name": "get_weather",
        "id": "chatcmpl-tool-1", "status": "in_progress", "namespace": None,
    }  # fmt: skip
    output = _as_json(final)["output"]
    assert [i["type"] for i in output] == ["reasoning", "function_call", "function_call"]
    assert output[0]["summary"] == [{"type": "summary_text", "text": "I should call tools."}]
    assert [(i["name"], i["arguments"]) for i in output[1:]] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"tz": "CET"}'),
    ]
    assert final.usage.input_tokens == 21 and final.usage.input_tokens_details.cached_tokens == 16
    assert final.usage.output_tokens_details.reasoning_tokens == 5 and final.usage.total_tokens == 34


def test_responses_stream_text_deltas_arrive_per_chunk():
    """Each upstream content chunk yields its text delta at once (true streaming, no buffering)."""
    stream = ResponsesStream(vllm.request(), model=vllm.MODEL, parser=True)
    stream.start()
    first = _parse_frames(
        stream.feed(CHUNK_DECODER.decode(orjson.dumps(vllm.chunk({"role": "assistant", "content": ""}))))
    )
    assert first == []
    frames = _parse_frames(stream.feed(CHUNK_DECODER.decode(orjson.dumps(vllm.chunk({"content": "Hel"})))))
    assert [e["type"] for e in frames] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert frames[-1]["delta"] == "Hel"
    frames = _parse_frames(stream.feed(CHUNK_DECODER.decode(orjson.dumps(vllm.chunk({"content": "lo <thi"})))))
    assert [(e["type"], e["delta"]) for e in frames] == [("response.output_text.delta", "lo ")]  # the partial tag waits
    frames = _parse_frames(stream.feed(CHUNK_DECODER.decode(orjson.dumps(vllm.chunk({"reasoning": "r"})))))
    assert frames[0]["type"] == "response.output_text.done" and frames[0]["text"] == "Hello "


def test_responses_stream_refusal_then_text_keeps_content_index_order():
    chunks = vllm.chunks([{"refusal": "No."}, *vllm.content("But here is why.")], "stop")
    events, _, final = _run(chunks, parser=False, continued=False)
    streamed = _check_protocol(events)
    assert [p["type"] for p in streamed[0]["item"]["content"]] == ["refusal", "output_text"]
    assert _normalized(final) == _normalized(
        to_response(vllm.completion(chunks), vllm.request(), model=vllm.MODEL, parser=False)
    )
    _check_against_final(streamed, final, strict_items=False)
    _sdk_replay(events)


def test_responses_stream_without_usage_chunk_has_null_usage():
    chunks = vllm.chunks(vllm.content("hi"), "stop", usage=False)
    events, _, final = _run(chunks, parser=True, continued=False)
    assert final.usage is None and events[-1]["response"]["usage"] is None
    assert _normalized(final) == _normalized(
        to_response(vllm.completion(chunks), vllm.request(), model=vllm.MODEL, parser=True)
    )


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_responses_stream_usage_details_are_integers_in_the_terminal_event(finish):
    # vLLM's usage chunk (dumped with exclude_none) has no details: Codex still needs integers there.
    chunks = vllm.chunks(vllm.content("hi"), finish)
    chunks[-1]["usage"] = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    events, _, final = _run(chunks, parser=True, continued=False)
    usage = events[-1]["response"]["usage"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert _as_json(final)["usage"] == usage


@pytest.mark.parametrize("finish", vllm.FINISH_REASONS)
def test_responses_stream_empty_answer_has_one_empty_message(finish):
    events, _, final = _run(vllm.chunks([], finish), parser=True, continued=False)
    types = [e["type"] for e in events]
    assert types[2:-1] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert events[3]["content_index"] == 0 and events[3]["part"]["type"] == "output_text"
    assert events[4]["text"] == "" and events[4]["content_index"] == 0
    output = _as_json(final)["output"]
    assert len(output) == 1 and output[0]["type"] == "message" and output[0]["id"] == events[2]["item"]["id"]
    assert output[0]["content"] == [{"type": "output_text", "text": "", "annotations": [], "logprobs": None}]
    assert events[-2]["item"] == output[0]


def test_responses_stream_length_ends_incomplete():
    events, _, final = _run(vllm.chunks(vllm.content("cut sh"), "length"), parser=False, continued=False)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final.output[0].content[0].text == "cut sh"


def test_responses_stream_echoes_request_fields():
    req = vllm.request(metadata={"k": "v"}, top_p=0.9, parallel_tool_calls=False, tool_choice="required")
    events, _, final = _run(vllm.chunks(vllm.content("x"), "stop"), parser=True, continued=False, req=req)
    for response in (events[0]["response"], events[-1]["response"]):
        assert response["instructions"] == "Be brief." and response["metadata"] == {"k": "v"}
        assert response["temperature"] == 0.6 and response["top_p"] == 0.9 and response["max_output_tokens"] == 256
        assert response["parallel_tool_calls"] is False and response["tool_choice"] == "required"
        assert [t["name"] for t in response["tools"]] == ["get_weather"]
        assert response["model"] == vllm.MODEL


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_responses_stream_reasoning_without_parser_raises(key):
    stream = ResponsesStream(vllm.request(), model=vllm.MODEL, parser=False)
    stream.start()
    stream.feed(CHUNK_DECODER.decode(orjson.dumps(vllm.chunk({"role": "assistant", "content": ""}))))
    with pytest.raises(UpstreamError, match="uses_reasoning_parser"):
        stream.feed(CHUNK_DECODER.decode(orjson.dumps(vllm.chunk({key: "thinking"}))))


def _fail_after(deltas: list[dict[str, Any]], *, parser: bool = True) -> list[dict[str, Any]]:
    stream = ResponsesStream(vllm.request(), model=vllm.MODEL, parser=parser)
    raw = stream.start()
    for chunk in [vllm.chunk({"role": "assistant", "content": ""})] + [vllm.chunk(d) for d in deltas]:
        raw += stream.feed(CHUNK_DECODER.decode(orjson.dumps(chunk)))
    return _parse_frames(raw + stream.fail("the upstream died mid-stream"))


@pytest.mark.parametrize(
    "deltas",
    [
        [],
        vllm.content("partial ans"),
        vllm.reasoning("half a thought"),
        vllm.reasoning("r") + vllm.content("<think>s"),
        vllm.content("A") + vllm.call(0, "call_1", "f", '{"a"'),
    ],
    ids=["nothing", "mid_message", "mid_reasoning", "mid_think_content", "mid_tool_call"],
)
def test_responses_stream_fail_ends_with_response_failed(deltas):
    events = _fail_after(deltas)
    _check_protocol(events)
    last = events[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "the upstream died mid-stream"}
    assert last["response"]["id"] == events[0]["response"]["id"]
    sdk_events = _sdk_replay(events)
    assert sdk_events[-1].type == "response.failed" and sdk_events[-1].response.error.code == "server_error"


def test_responses_stream_ids_are_unique_per_stream():
    a, _, final_a = _run(vllm.chunks(vllm.reasoning("r") + vllm.content("x"), "stop"), parser=True, continued=False)
    b, _, final_b = _run(vllm.chunks(vllm.reasoning("r") + vllm.content("x"), "stop"), parser=True, continued=False)
    assert final_a.id != final_b.id and final_a.id.startswith("resp_")
    assert {i.id for i in final_a.output}.isdisjoint({i.id for i in final_b.output})
    assert final_a.output[0].id.startswith("rs_") and final_a.output[1].id.startswith("msg_")


@pytest.mark.xfail(reason="known gap: an unclosed <think> in content streams as reasoning, the final keeps it as text")
def test_responses_stream_unclosed_think_in_content_streams_as_text():
    chunks = vllm.chunks(vllm.content("Sure. <think>never clo", "sed"), "length")
    events, _, final = _run(chunks, parser=True, continued=False)
    streamed = _check_protocol(events)
    assert _normalized(final) == _normalized(
        to_response(vllm.completion(chunks), vllm.request(), model=vllm.MODEL, parser=True)
    )
    _check_against_final(streamed, final, strict_items=True)


def test_responses_stream_unclosed_think_final_still_equals_non_streaming():
    chunks = vllm.chunks(vllm.content("Sure. <think>never clo", "sed"), "length")
    events, _, final = _run(chunks, parser=True, continued=False)
    _check_protocol(events)
    assert _normalized(final) == _normalized(
        to_response(vllm.completion(chunks), vllm.request(), model=vllm.MODEL, parser=True)
    )
    _sdk_replay(events)


# --- the streams a real vLLM sent, split at every byte ---------------------------------------------


# What differs between two translations of one stream: the ids gymproxy makes, and timestamps.
_MADE = re.compile(rb"\b(?:resp|msg|rs)_[0-9a-f]{32}\b|\"created_at\":[0-9.e+]+")


def _translate(raw: bytes, cut: int, req: ResponsesRequest, parser: bool) -> tuple[bytes, Response]:
    """The whole Responses stream for `raw` (an upstream SSE body) fed in two reads, `raw[:cut]`
    and `raw[cut:]`, through what the exchange runs: the SSE decoder, then `payload`."""
    translator = ResponsesStream(req, model=req.model, parser=parser)
    decoder = SSEDecoder()
    out = [translator.start()]
    for piece in (raw[:cut], raw[cut:]):
        out += [translator.payload(p) for p in decoder.feed(piece) if p != DONE]
    out.append(translator.finish())
    assert translator.final is not None
    return b"".join(out), translator.final


def _compared_steps(pair: tuple[Any, Any]) -> list[tuple[bytes, bytes, ResponsesRequest, bool]]:
    """(streamed SSE body, non-streamed reply, request, parser) of each step vLLM answered both ways."""
    streamed, plain = (recordings.load(p) for p in pair)
    parser = streamed["gymproxy_config"].get("uses_reasoning_parser", False)
    steps = []
    for step_s, step_n in zip(streamed["steps"], plain["steps"], strict=True):
        up_s, up_n = recordings.chat_reply(step_s), recordings.chat_reply(step_n)
        if up_s is None or up_n is None or step_n["client"]["path"] != "/v1/responses":
            continue
        if step_n["client"]["status"] != 200:
            continue
        request_s, request_n = step_s["client"]["request"], step_n["client"]["request"]
        if recordings.without_stream(request_s) != recordings.without_stream(request_n):
            continue  # a later turn whose history came from the (different) earlier answers
        req = recordings.RESPONSES_REQUEST.decode(orjson.dumps(request_n))
        steps.append((up_s["response"].encode(), up_n["response"].encode(), req, parser))
    return steps


@pytest.mark.parametrize("pair", recordings.PAIRS, ids=[p[0].stem for p in recordings.PAIRS])
def test_recorded_vllm_streams_split_anywhere_equal_the_non_streamed_reply(pair):
    """vLLM's recorded chunks, split at every byte, give one event stream, whose terminal Response is
    what `to_response` makes of vLLM's recorded non-streamed reply to the same request."""
    steps = _compared_steps(pair)
    assert steps, pair[0].name
    for raw, plain, req, parser in steps:
        whole, final = _translate(raw, len(raw), req, parser)
        _check_protocol(_parse_frames(whole))
        for cut in range(len(raw)):
            events, again = _translate(raw, cut, req, parser)
            assert _MADE.sub(b"<made>", events) == _MADE.sub(b"<made>", whole), cut  # the same stream
            assert recordings.items(again) == recordings.items(final), cut
        want = recordings.items(to_response(COMPLETION_DECODER.decode(plain), req, model=req.model, parser=parser))
        got = recordings.items(final)
        if any(i.get("type") == "function_call" for i in want[2:]):
            # vLLM 0.32 streams the "\n\n" between </think> and <tool_call> as content, but its
            # non-streamed reply has content null: the streamed Response has one more item.
            assert {"type": "message", "content": ["\n\n"]} in got
            got = [i for i in got if i != {"type": "message", "content": ["\n\n"]}]
        assert got == want, pair[0].name
