"""Tests for gymproxy.convert.reply: chat completion -> Responses `Response` (spec sections 7.1, 8)."""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
import orjson
import pytest

from gymproxy.convert.reply import empty_completion, fold_reasoning, output_items, split_think, to_response, to_usage
from gymproxy.errors import UpstreamError
from gymproxy.schemas.chat import COMPLETION_DECODER, AssistantMessage, ChatCompletion, Usage
from gymproxy.schemas.responses import REQUEST_DECODER, ResponsesRequest

CREATED = 1767225600

# Spec 2.4: the Response key set of openai-python 2.44.
RESPONSE_KEYS = {
    "id", "created_at", "error", "incomplete_details", "instructions", "metadata", "model", "object", "output",
    "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background", "completed_at",
    "conversation", "max_output_tokens", "max_tool_calls", "moderation", "previous_response_id", "prompt",
    "prompt_cache_key", "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "status",
    "text", "top_logprobs", "truncation", "usage", "user",
}  # fmt: skip


def decode_request(**fields: Any) -> ResponsesRequest:
    return REQUEST_DECODER.decode(orjson.dumps({"input": "x", **fields}))


def completion(
    message: dict[str, Any] | None = None,
    *,
    finish_reason: str | None = "stop",
    choice: dict[str, Any] | None = None,
    **fields: Any,
) -> ChatCompletion:
    """A chat completion as vLLM would send it, decoded by the real decoder."""
    data = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": CREATED,
        "model": "upstream-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", **(message or {})},
                "finish_reason": finish_reason,
                "logprobs": None,
                "stop_reason": None,
                **(choice or {}),
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        **fields,
    }
    return COMPLETION_DECODER.decode(orjson.dumps(data))


def respond(
    comp: ChatCompletion | None = None,
    req: ResponsesRequest | None = None,
    *,
    model: str | None = "served-model",
    parser: bool = True,
    continued: bool = False,
) -> dict[str, Any]:
    """The Response as JSON on the wire."""
    response = to_response(
        comp or completion(), req or decode_request(), model=model, parser=parser, continued=continued
    )
    return msgspec.json.decode(msgspec.json.encode(response))


def items(message: dict[str, Any], *, parser: bool = True) -> list[dict[str, Any]]:
    """The output items for one assistant message, with ids checked and then removed."""
    out = respond(completion(message), parser=parser)["output"]
    for item in out:
        if item["type"] == "reasoning":
            assert re.fullmatch(r"rs_[0-9a-f]{32}", item.pop("id"))
        elif item["type"] == "message":
            assert re.fullmatch(r"msg_[0-9a-f]{32}", item.pop("id"))
    return out


def text_item(text: str = "", *refusals: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if text or not refusals:
        content.append({"type": "output_text", "text": text, "annotations": [], "logprobs": None})
    content.extend({"type": "refusal", "refusal": r} for r in refusals)
    return {"type": "message", "content": content, "role": "assistant", "status": "completed", "phase": None}


def reasoning_item(*texts: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "summary": [{"text": t, "type": "summary_text"} for t in texts],
        "encrypted_content": None,
        "content": None,
    }


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# --- 8.1: think tags --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "found", "rest"),
    [
        ("A<think>r</think>B", ["r"], "AB"),
        ("<think>a</think>x<think>b</think>y", ["a", "b"], "xy"),
        ("<think>\n line one\n line two \n</think>\n\nanswer", ["\n line one\n line two \n"], "\n\nanswer"),
        ("<think></think>z", [""], "z"),
        ("  <think>a</think>  ", ["a"], "    "),
        ("plain text", [], "plain text"),
        ("", [], ""),
        ("<think>never closed", [], "<think>never closed"),
        ("stray</think> close", [], "stray</think> close"),
        ("<think>a</think>b<think>unclosed", ["a"], "b<think>unclosed"),
        ("<think>outer<think>inner</think>tail</think>", ["outer<think>inner"], "tail</think>"),
    ],
)
def test_split_think(text, found, rest):
    assert split_think(text) == (found, rest)


# --- 7.1: reasoning folded back as <think> ---------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reasoning", "continued", "folded"),
    [
        ("answer", "plan", False, "<think>plan</think>answer"),
        (None, "plan", False, "<think>plan</think>"),
        ("", "plan", False, "<think>plan</think>"),
        ("answer", "plan", True, "plananswer"),
        (None, "plan", True, "plan"),
        ("answer", None, False, "answer"),
        ("answer", "", False, "answer"),
        (None, None, False, None),
    ],
)
def test_fold_reasoning(content, reasoning, continued, folded):
    assert fold_reasoning(content, reasoning, continued=continued) == folded


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_upstream_reasoning_becomes_a_reasoning_item(key):
    assert items({"content": "answer", key: "plan"}) == [reasoning_item("plan"), text_item("answer")]


def test_reasoning_content_wins_over_reasoning():
    assert items({"content": "a", "reasoning_content": "rc", "reasoning": "r"}) == [
        reasoning_item("rc"),
        text_item("a"),
    ]


def test_empty_reasoning_content_falls_back_to_reasoning():
    assert items({"content": "a", "reasoning_content": "", "reasoning": "r"}) == [reasoning_item("r"), text_item("a")]


def test_folded_reasoning_comes_before_inline_think_blocks():
    got = items({"content": "<think>inline</think>answer", "reasoning": "field"})
    assert got == [reasoning_item("field", "inline"), text_item("answer")]


def test_continued_turn_folds_reasoning_without_tags():
    got = respond(completion({"content": " and done", "reasoning": "the prefix"}), continued=True)["output"]
    assert [item["type"] for item in got] == ["message"]
    assert got[0]["content"][0]["text"] == "the prefix and done"


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_reasoning_without_a_parser_is_an_upstream_error(key):
    with pytest.raises(UpstreamError) as info:
        respond(completion({key: "plan"}), parser=False)
    assert "uses_reasoning_parser" in info.value.message


@pytest.mark.parametrize("empty", [None, ""])
def test_empty_reasoning_without_a_parser_is_fine(empty):
    got = items({"content": "a", "reasoning": empty, "reasoning_content": empty}, parser=False)
    assert got == [text_item("a")]


def test_without_a_parser_think_text_stays_in_the_message():
    assert items({"content": "<think>r</think>a"}, parser=False) == [text_item("<think>r</think>a")]


# --- 8.2: output items ------------------------------------------------------------------------


def test_reasoning_message_and_calls_come_in_that_order():
    message = {
        "content": "<think>plan</think>calling",
        "refusal": None,
        "tool_calls": [tool_call("call_a", "f", '{"x":1}'), tool_call("call_b", "g", "{}")],
    }
    assert items(message) == [
        reasoning_item("plan"),
        text_item("calling"),
        {
            "type": "function_call",
            "arguments": '{"x":1}',
            "call_id": "call_a",
            "name": "f",
            "id": "call_a",
            "status": "completed",
            "namespace": None,
        },
        {
            "type": "function_call",
            "arguments": "{}",
            "call_id": "call_b",
            "name": "g",
            "id": "call_b",
            "status": "completed",
            "namespace": None,
        },
    ]


def test_every_think_block_is_one_summary_entry():
    assert items({"content": "<think>a</think><think>b</think>c"}) == [reasoning_item("a", "b"), text_item("c")]


@pytest.mark.parametrize("content", [None, ""])
def test_empty_reply_is_one_empty_output_text(content):
    assert items({"content": content}) == [text_item("")]


def test_reasoning_only_reply_has_no_message():
    assert items({"content": "<think>only</think>"}) == [reasoning_item("only")]


def test_tool_calls_only_reply_has_no_message():
    got = items({"content": None, "tool_calls": [tool_call("c", "f", "{}")]})
    assert [item["type"] for item in got] == ["function_call"]


def test_refusal_only_reply_has_only_a_refusal_part():
    assert items({"content": None, "refusal": "I can't."}) == [text_item("", "I can't.")]


def test_text_and_refusal_parts_share_one_message():
    assert items({"content": "partly", "refusal": "no more"}) == [text_item("partly", "no more")]


def test_function_call_id_is_the_call_id():
    (item,) = items({"content": None, "tool_calls": [tool_call("chatcmpl-tool-42", "f", "{}")]})
    assert item["id"] == item["call_id"] == "chatcmpl-tool-42"


def test_upstream_custom_tool_call_becomes_a_custom_tool_call_item():
    call = {"id": "call_c", "type": "custom", "custom": {"name": "apply_patch", "input": "*** Begin Patch"}}
    assert items({"content": None, "tool_calls": [call]}) == [
        {
            "type": "custom_tool_call",
            "call_id": "call_c",
            "input": "*** Begin Patch",
            "name": "apply_patch",
            "id": "call_c",
            "status": "completed",
        }
    ]


def test_tool_call_with_neither_function_nor_custom_is_an_upstream_error():
    with pytest.raises(UpstreamError):
        items({"content": None, "tool_calls": [{"id": "c", "type": "mystery"}]})


def test_output_items_direct():
    message = AssistantMessage(content="<think>r</think>a")
    assert [type(item).__name__ for item in output_items(message, parse_think=True)] == ["ReasoningItem", "MessageItem"]
    assert [type(item).__name__ for item in output_items(message, parse_think=False)] == ["MessageItem"]


def test_output_items_carry_no_token_fields_outside_training():
    for item in items({"content": "<think>r</think>a", "tool_calls": [tool_call("c", "f", "{}")]}):
        assert not {"prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts"} & set(item)


def test_only_the_first_choice_is_used():
    comp = completion({"content": "first"})
    data = msgspec.json.decode(msgspec.json.encode(comp))
    data["choices"].append(
        {"index": 1, "message": {"role": "assistant", "content": "second"}, "finish_reason": "length"}
    )
    got = respond(COMPLETION_DECODER.decode(msgspec.json.encode(data)))
    assert got["status"] == "completed"
    assert got["output"][0]["content"][0]["text"] == "first"


def test_no_choices_is_an_upstream_error():
    with pytest.raises(UpstreamError):
        respond(COMPLETION_DECODER.decode(b'{"id":"x","created":1,"choices":[]}'))


# --- 8.3: the envelope ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish_reason", "status", "incomplete"),
    [
        ("length", "incomplete", {"reason": "max_output_tokens"}),
        ("content_filter", "incomplete", {"reason": "content_filter"}),
        ("stop", "completed", None),
        ("tool_calls", "completed", None),
        (None, "completed", None),
    ],
)
def test_finish_reason_sets_status_and_incomplete_details(finish_reason, status, incomplete):
    got = respond(completion(finish_reason=finish_reason))
    assert got["status"] == status
    assert got["incomplete_details"] == incomplete


def test_full_key_set():
    assert set(respond()) == RESPONSE_KEYS


def test_native_finish_reason_is_added_only_when_the_upstream_has_one():
    assert set(respond(completion(choice={"native_finish_reason": "eos_token"}))) == RESPONSE_KEYS | {
        "native_finish_reason"
    }
    assert respond(completion(choice={"native_finish_reason": "eos_token"}))["native_finish_reason"] == "eos_token"
    assert respond(completion(choice={"native_finish_reason": 151645}))["native_finish_reason"] == "151645"
    assert "native_finish_reason" not in respond(completion(choice={"native_finish_reason": None}))


def test_envelope_constants():
    got = respond()
    assert re.fullmatch(r"resp_[0-9a-f]{32}", got["id"])
    assert got["id"] != "chatcmpl-1"
    assert got["object"] == "response"
    for key in (
        "error", "background", "completed_at", "conversation", "max_tool_calls", "moderation",
        "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
        "truncation",
    ):  # fmt: skip
        assert got[key] is None, key


def test_ids_are_fresh_per_response():
    assert respond()["id"] != respond()["id"]


def test_created_at_is_the_upstream_created_as_a_float():
    response = to_response(completion(), decode_request(), model="m", parser=True)
    assert response.created_at == float(CREATED)
    assert f'"created_at":{CREATED}.0'.encode() in msgspec.json.encode(response)


def test_created_at_falls_back_to_now_without_an_upstream_created():
    before = time.time()
    got = respond(COMPLETION_DECODER.decode(b'{"choices":[{"message":{"content":"a"}}]}'))
    assert isinstance(got["created_at"], float)
    assert before - 1 <= got["created_at"] <= time.time() + 1


def test_model_is_the_configured_model_else_the_upstream_one():
    assert respond(model="served-model")["model"] == "served-model"
    assert respond(model=None)["model"] == "upstream-model"


def test_response_id_can_be_given():
    got = to_response(completion(), decode_request(), model="m", parser=True, response_id="resp_fixed")
    assert got.id == "resp_fixed"


# --- 8.3: echoed request fields -----------------------------------------------------------------


def test_defaults_echoed_for_a_bare_request():
    got = respond(req=decode_request())
    assert got["tools"] == []
    assert got["tool_choice"] == "auto"
    assert got["parallel_tool_calls"] is True
    for key in ("instructions", "metadata", "temperature", "top_p", "max_output_tokens", "reasoning", "text",
                "service_tier", "top_logprobs", "user"):  # fmt: skip
        assert got[key] is None, key


def test_scalar_request_fields_are_echoed():
    fields = {
        "instructions": "Be brief.",
        "metadata": {"task": "t1", "extra_body": '{"top_k": 2}'},
        "temperature": 0.25,
        "top_p": 0.5,
        "max_output_tokens": 64,
        "service_tier": "auto",
        "top_logprobs": 3,
        "user": "u-1",
        "parallel_tool_calls": False,
    }
    got = respond(req=decode_request(**fields))
    for key, value in fields.items():
        assert got[key] == value, key


@pytest.mark.parametrize(
    "not_echoed",
    [
        {"store": True},
        {"prompt_cache_key": "k"},
        {"prompt_cache_retention": "24h"},
        {"safety_identifier": "s"},
        {"moderation": {"x": 1}},
    ],
)
def test_forwarded_only_fields_are_not_echoed(not_echoed):
    ((key, _),) = not_echoed.items()
    got = respond(req=decode_request(**not_echoed))
    assert got.get(key) is None


def test_tools_are_echoed_as_sdk_tool_objects():
    tools = [
        {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
        {"type": "custom", "name": "c", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
    ]
    got = respond(req=decode_request(tools=tools))["tools"]
    assert got == [
        {
            "type": "function",
            "name": "f",
            "parameters": {"type": "object"},
            "strict": True,
            "description": None,
            "defer_loading": None,
        },
        {
            "type": "custom",
            "name": "c",
            "description": None,
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"},
            "defer_loading": None,
        },
    ]


def test_function_tool_echo_has_null_parameters_and_strict_when_unsent():
    got = respond(req=decode_request(tools=[{"type": "function", "name": "f"}]))["tools"]
    assert got == [
        {
            "type": "function",
            "name": "f",
            "parameters": None,
            "strict": None,
            "description": None,
            "defer_loading": None,
        }
    ]


@pytest.mark.parametrize(
    "choice",
    [
        "none",
        "required",
        {"type": "function", "name": "f"},
        {"type": "custom", "name": "c"},
        {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]},
    ],
)
def test_tool_choice_is_echoed_as_sent(choice):
    tools = [{"type": "function", "name": "f"}, {"type": "custom", "name": "c"}]
    echoed = respond(req=decode_request(tools=tools, tool_choice=choice))["tool_choice"]
    if isinstance(choice, dict) and choice["type"] == "allowed_tools":
        assert echoed == {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]}
    else:
        assert echoed == choice


def test_reasoning_echo_shape():
    got = respond(req=decode_request(reasoning={"effort": "low"}))["reasoning"]
    assert got == {"context": None, "effort": "low", "generate_summary": None, "summary": None}


def test_reasoning_echo_of_codex_members():
    # Accepted and not sent to vLLM; echoed as sent (`mode`, newer than NeMo Gym's key set, only when sent).
    got = respond(req=decode_request(reasoning={"effort": "medium", "summary": "auto", "mode": "standard"}))
    assert got["reasoning"] == {
        "context": None,
        "effort": "medium",
        "generate_summary": None,
        "summary": "auto",
        "mode": "standard",
    }


@pytest.mark.parametrize(
    ("text", "echoed"),
    [
        ({"verbosity": "low"}, {"format": None, "verbosity": "low"}),
        ({"format": {"type": "text"}}, {"format": {"type": "text"}, "verbosity": None}),
        ({"format": {"type": "json_object"}}, {"format": {"type": "json_object"}, "verbosity": None}),
        (
            {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}},
            {
                "format": {
                    "type": "json_schema",
                    "name": "n",
                    "schema": {"type": "object"},
                    "strict": True,
                    "description": None,
                },
                "verbosity": None,
            },
        ),
    ],
)
def test_text_echo_shape(text, echoed):
    assert respond(req=decode_request(text=text))["text"] == echoed


# --- 8.4: usage -------------------------------------------------------------------------------


def usage(**fields: Any) -> dict[str, Any] | None:
    data = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, **fields}
    result = to_usage(msgspec.json.decode(orjson.dumps(data), type=Usage))
    return msgspec.json.decode(msgspec.json.encode(result))


def test_usage_mapping():
    got = usage(
        total_tokens=99,
        prompt_tokens_details={"cached_tokens": 4},
        completion_tokens_details={"reasoning_tokens": 2},
    )
    assert got == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 99,  # copied, not recomputed
    }


@pytest.mark.parametrize(
    "fields",
    [{}, {"prompt_tokens_details": None, "completion_tokens_details": None}],
    ids=["absent", "null"],
)
def test_usage_details_are_zero_when_unknown(fields):
    # Integers on the wire, as the SDK types them: Codex rejects a null (NeMo Gym 0.7.0 copies it).
    got = usage(**fields)
    assert got["input_tokens_details"] == {"cached_tokens": 0}
    assert got["output_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize(
    ("fields", "cached"),
    [
        ({"prompt_tokens_details": {"cached_tokens": 4}, "cached_input_tokens": 3, "cache_read_input_tokens": 2}, 4),
        ({"prompt_tokens_details": {"cached_tokens": 0}, "cached_input_tokens": 3}, 0),
        ({"cached_input_tokens": 3, "cache_read_input_tokens": 2}, 3),
        ({"prompt_tokens_details": None, "cached_input_tokens": 3}, 3),
        ({"prompt_tokens_details": {"cached_tokens": None}, "cached_input_tokens": 3}, 3),
        ({"prompt_tokens_details": {}, "cache_read_input_tokens": 2}, 2),
        ({"cache_read_input_tokens": 2}, 2),
        ({"prompt_tokens_details": {"cached_tokens": None}}, 0),
        ({"prompt_tokens_details": {"cached_tokens": -1}}, 0),
        ({"prompt_tokens_details": {"cached_tokens": 1.5}}, 0),
        ({"prompt_tokens_details": {"cached_tokens": "4"}}, 0),
        ({"prompt_tokens_details": {"cached_tokens": True}}, 0),
        ({"cached_input_tokens": -3}, 0),
        ({"cache_read_input_tokens": "2"}, 0),
    ],
)
def test_cached_tokens_and_fallbacks(fields, cached):
    assert usage(**fields)["input_tokens_details"] == {"cached_tokens": cached}


@pytest.mark.parametrize(
    ("fields", "reasoning"),
    [
        ({"completion_tokens_details": {"reasoning_tokens": 2}, "reasoning_output_tokens": 9}, 2),
        ({"completion_tokens_details": {"reasoning_tokens": 0}, "reasoning_output_tokens": 9}, 0),
        ({"reasoning_output_tokens": 9}, 9),
        ({"completion_tokens_details": None, "reasoning_output_tokens": 9}, 9),
        ({"completion_tokens_details": {"reasoning_tokens": None}, "reasoning_output_tokens": 9}, 9),
        ({"completion_tokens_details": {"reasoning_tokens": None}}, 0),
        ({"completion_tokens_details": {"reasoning_tokens": -2}}, 0),
        ({"completion_tokens_details": {"reasoning_tokens": 2.0}}, 0),
        ({"completion_tokens_details": {"reasoning_tokens": False}}, 0),
        ({"reasoning_output_tokens": "9"}, 0),
    ],
)
def test_reasoning_tokens_and_fallback(fields, reasoning):
    assert usage(**fields)["output_tokens_details"] == {"reasoning_tokens": reasoning}


def test_no_usage_is_null():
    assert to_usage(None) is None
    assert respond(completion(usage=None))["usage"] is None


def test_usage_reaches_the_response():
    got = respond(completion(usage={"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}))
    assert got["usage"]["input_tokens"] == 7
    assert got["usage"]["output_tokens"] == 3
    assert got["usage"]["total_tokens"] == 10


# --- 7.2 / 7.3: the local empty reply --------------------------------------------------------


@pytest.mark.parametrize("finish_reason", ["length", "content_filter"])
def test_empty_completion_shape(finish_reason):
    before = int(time.time())
    got = empty_completion("served-model", finish_reason)
    assert got["object"] == "chat.completion"
    assert got["model"] == "served-model"
    assert before <= got["created"] <= time.time() + 1
    assert got["usage"] is None
    (choice,) = got["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == finish_reason
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": None}


@pytest.mark.parametrize(
    ("finish_reason", "reason"), [("length", "max_output_tokens"), ("content_filter", "content_filter")]
)
def test_empty_completion_becomes_an_incomplete_response(finish_reason, reason):
    comp = COMPLETION_DECODER.decode(msgspec.json.encode(empty_completion("served-model", finish_reason)))
    got = respond(comp)
    assert got["status"] == "incomplete"
    assert got["incomplete_details"] == {"reason": reason}
    assert got["usage"] is None
    assert len(got["output"]) == 1
    assert got["output"][0]["content"] == [{"type": "output_text", "text": "", "annotations": [], "logprobs": None}]


def test_empty_instructions_are_still_echoed():
    assert respond(req=decode_request(instructions=""))["instructions"] == ""


def test_split_think_equals_the_non_greedy_regex():
    """The str.find splitter must agree with `<think>(.*?)</think>` (DOTALL) findall + sub everywhere."""
    import re

    from hypothesis import given, settings
    from hypothesis import strategies as st

    pattern = re.compile(r"<think>(.*?)</think>", re.DOTALL)
    pieces = st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</", "a", "\n", " ", "é", "<", ">"])

    @settings(max_examples=2000, deadline=None)
    @given(st.lists(pieces, max_size=12).map("".join))
    def check(text: str) -> None:
        assert split_think(text) == (pattern.findall(text), pattern.sub("", text))

    check()
