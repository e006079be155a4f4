"""Tests for gymproxy.schemas: what a Responses request body may hold (spec 2.2, as amended), and
how much of a vLLM chat completion the reply decoder reads.

Decode failures are checked the way a client sees them: through `errors.from_validation`, as a
400 whose `param` names the offending field.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import orjson
import pytest

from gymproxy.errors import BadRequest, from_validation
from gymproxy.schemas.chat import COMPLETION_DECODER
from gymproxy.schemas.responses import (
    HOSTED_TOOL_TYPES,
    REQUEST_DECODER,
    FunctionChoice,
    FunctionTool,
    HostedChoice,
    HostedTool,
    ResponsesRequest,
)


def decode(body: dict[str, Any]) -> ResponsesRequest:
    return REQUEST_DECODER.decode(orjson.dumps(body))


def invalid(body: Any) -> BadRequest:
    """The 400 a client gets for this body."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(msgspec.DecodeError) as info:
        REQUEST_DECODER.decode(raw)
    error = from_validation(info.value)
    assert error.status == 400
    return error


# --- the top level is strict ------------------------------------------------------------------


@pytest.mark.parametrize("field", ["foo", "top_k", "min_p", "n", "seed", "stop", "max_completion_tokens", "messages"])
def test_unknown_top_level_field_is_named(field):
    error = invalid({"input": "x", field: 1})
    assert error.param == field
    assert f"`{field}`" in error.message
    assert "unknown field" in error.message
    assert "not valid JSON" not in error.message


def test_missing_input_is_named():
    error = invalid({"model": "m"})
    assert error.param == "input"
    assert "`input`" in error.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
        ({"input": "x", "stream": "true"}, "stream"),
        ({"input": "x", "stream": 1}, "stream"),
        ({"input": "x", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input[0].content[0].text"),
        ({"input": ["x"]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": "x"}, {"type": "function_call", "arguments": {"a": 1}}]},
            "input[1].arguments",
        ),
        ({"input": "x", "tools": [{"type": "function", "name": 3}]}, "tools[0].name"),
        ({"input": "x", "tool_choice": "maybe"}, "tool_choice"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "none", "tools": []}}, "tool_choice.mode"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": "x", "reasoning": {"effort": 3}}, "reasoning.effort"),
    ],
)
def test_wrong_types_give_a_path(body, param):
    error = invalid(body)
    assert error.param == param
    assert f"`{param}`" in error.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto"}}, "tool_choice.tools"),
    ],
)
def test_missing_required_members_are_named_with_their_path(body, param):
    error = invalid(body)
    assert error.param == param
    assert f"`{param.rsplit('.', 1)[1]}`" in error.message


def test_body_that_is_not_an_object_is_a_400():
    assert invalid([{"input": "x"}]).status == 400


def test_malformed_json_is_a_400_saying_so():
    error = invalid(b'{"input": "x",')
    assert "not valid JSON" in error.message
    assert error.param is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "reasoning": {"effort": "low", "bogus": 1}}, "reasoning.bogus"),
        ({"input": "x", "text": {"verbosity": "low", "bogus": 1}}, "text.bogus"),
        ({"input": "x", "text": {"format": {"type": "json_object", "bogus": 1}}}, "text.format.bogus"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "bogus": 1}]}, "tools[0].bogus"),
        ({"input": "x", "tools": [{"type": "custom", "name": "c", "bogus": 1}]}, "tools[0].bogus"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "f", "bogus": 1}}, "tool_choice.bogus"),
        ({"input": "x", "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ],
)
def test_structured_top_level_members_are_strict(body, param):
    error = invalid(body)
    assert error.param == param


# --- input items and parts ignore unknown keys ------------------------------------------------


def test_items_and_parts_ignore_unknown_keys():
    req = decode(
        {
            "input": [
                {"role": "user", "content": "a", "id": "msg_1", "status": "completed", "zzz": 1},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "b", "annotations": [], "zzz": 2}],
                },
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "t", "zzz": 3}],
                    "encrypted_content": None,
                },
                {
                    "role": "assistant",
                    "content": "c",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}", "zzz": 4},
                            "zzz": 5,
                        }
                    ],
                },
            ]
        }
    )
    assert isinstance(req.input, list)
    assert [item.role for item in req.input] == ["user", "user", None, "assistant"]
    assert req.input[2].summary[0].text == "t"


def test_codex_reasoning_items_with_null_summary_and_encrypted_content_decode():
    req = decode(
        {
            "input": [
                {"type": "reasoning", "id": "rs_1", "summary": None, "content": None, "encrypted_content": "gAAA"},
                {
                    "type": "reasoning",
                    "id": "rs_2",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "r"}],
                },
            ]
        }
    )
    assert req.input[0].summary is None and req.input[1].summary == []


def test_newer_sdk_tool_members_decode():
    tool = {
        "type": "function",
        "name": "f",
        "parameters": None,
        "strict": None,
        "allowed_callers": ["direct"],
        "output_schema": {"type": "object"},
        "async": False,
    }
    (decoded,) = decode({"input": "x", "tools": [tool]}).tools
    assert (decoded.allowed_callers, decoded.output_schema, decoded.async_) == (["direct"], {"type": "object"}, False)


def test_every_reasoning_member_of_the_sdk_decodes():
    from openai.types.shared_params.reasoning import Reasoning

    members = {
        "context": "all_turns",
        "effort": "high",
        "generate_summary": "auto",
        "mode": "standard",
        "summary": "auto",
    }
    assert set(members) == set(Reasoning.__annotations__)
    assert msgspec.structs.asdict(decode({"input": "x", "reasoning": members}).reasoning) == members


@pytest.mark.parametrize("role", ["tool", "function", "model", ""])
def test_message_roles_outside_the_responses_set_are_rejected(role):
    error = invalid({"input": [{"role": "user", "content": "q"}, {"role": role, "content": "x"}]})
    assert error.param == "input[1].role"


@pytest.mark.parametrize("role", ["user", "assistant", "system", "developer"])
def test_message_roles_accepted(role):
    assert decode({"input": [{"role": role, "content": "x"}]}).input[0].role == role


def test_input_image_without_detail_decodes():
    req = decode({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]}]})
    assert req.input[0].content[0].detail is None


def test_chat_style_tool_calls_on_assistant_items_decode():
    req = decode(
        {
            "input": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        }
    )
    (call,) = req.input[0].tool_calls
    assert (call.id, call.type, call.function.name, call.function.arguments) == ("c1", "function", "f", "{}")


# --- tools and tool_choice --------------------------------------------------------------------


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "web_search", "search_context_size": "low"},
        {"type": "web_search_preview"},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "code_interpreter", "container": {"type": "auto"}},
        {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
        {"type": "image_generation", "quality": "high"},
        {"type": "local_shell"},
        {"type": "shell"},
        {"type": "apply_patch"},
        {"type": "mcp", "server_label": "s", "require_approval": "never"},
        {"type": "tool_search"},
    ],
)
def test_hosted_tools_decode_without_their_members_being_read(tool):
    req = decode({"input": "x", "tools": [{"type": "function", "name": "f"}, tool]})
    assert isinstance(req.tools[1], HostedTool) and req.tools[1].kind == tool["type"]


def test_hosted_tool_types_cover_the_sdk():
    """Every tool type of the installed SDK's `ToolParam` is known: function, custom, or hosted."""
    from openai.types.responses.tool_param import ToolParam

    sdk = {kind for cls in typing.get_args(ToolParam) for kind in typing.get_args(typing.get_type_hints(cls)["type"])}
    assert {"function", "custom", "namespace", "web_search", "mcp"} <= sdk
    assert sdk - {"function", "custom", "namespace"} <= set(HOSTED_TOOL_TYPES)


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "web_search_preview"},
        {"type": "file_search"},
        {"type": "computer_use"},
        {"type": "mcp", "server_label": "s"},
        {"type": "shell"},
        {"type": "apply_patch"},
    ],
)
def test_hosted_tool_choices_decode_so_the_conversion_can_refuse_them(choice):
    req = decode({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": choice})
    assert isinstance(req.tool_choice, HostedChoice) and req.tool_choice.kind == choice["type"]


def test_unknown_tool_type_fails_the_plain_decode():
    # convert.request.RequestReader drops such tools (tests/test_convert_request_reading.py); the decoder alone names the field.
    error = invalid({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "teleport"}]})
    assert error.param == "tools[1].type"


def test_function_tool_and_choice_decode():
    req = decode(
        {"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}}
    )
    assert isinstance(req.tools[0], FunctionTool)
    assert isinstance(req.tool_choice, FunctionChoice)


# --- metadata ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [{"a": 1}, 1, 1.5, True, None, ["a"]])
def test_metadata_values_must_be_strings(value):
    error = invalid({"input": "x", "metadata": {"task": "t", "bad": value}})
    assert error.param == "metadata"


def test_metadata_must_be_an_object():
    assert invalid({"input": "x", "metadata": "task"}).param == "metadata"


def test_metadata_control_keys_are_strings_holding_json():
    req = decode({"input": "x", "metadata": {"chat_template_kwargs": '{"enable_thinking": false}', "extra_body": "{}"}})
    assert req.metadata == {"chat_template_kwargs": '{"enable_thinking": false}', "extra_body": "{}"}


# --- presence ---------------------------------------------------------------------------------


def _sdk_fields() -> set[str]:
    from openai.types.responses import response_create_params

    return set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}


def test_the_request_has_every_field_of_the_sdk_and_only_codex_cli_adds_one():
    fields = set(ResponsesRequest.__struct_encode_fields__)
    assert _sdk_fields() <= fields, f"fields the installed openai SDK has and gymproxy lacks: {_sdk_fields() - fields}"
    assert fields - _sdk_fields() == {"client_metadata"}  # Codex CLI sends it; the SDK has no such field


def test_null_means_not_sent():
    req = decode({"input": "x", "temperature": None, "tools": None, "tool_choice": None, "truncation": None})
    assert req.temperature is None
    assert req.tools is None
    assert req.tool_choice is None
    assert req.truncation is None


# --- chat completion replies --------------------------------------------------------------------


def test_completion_decoder_ignores_upstream_extras():
    raw = orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1767225600,
            "model": "m",
            "system_fingerprint": None,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "service_tier": None,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "a",
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "finish_reason": "stop",
                    "stop_reason": 151645,
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3, "prompt_tokens_details": None},
        }
    )
    completion = COMPLETION_DECODER.decode(raw)
    assert completion.created == 1767225600
    (choice,) = completion.choices
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("stop", "a", [])
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        1,
        2,
        3,
    )


def test_completion_decoder_reads_reasoning_and_both_tool_call_kinds():
    raw = orjson.dumps(
        {
            "choices": [
                {
                    "message": {
                        "reasoning": "r",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                            {"id": "c2", "type": "custom", "custom": {"name": "g", "input": "raw"}},
                        ],
                    },
                    "native_finish_reason": "eos",
                }
            ]
        }
    )
    (choice,) = COMPLETION_DECODER.decode(raw).choices
    assert choice.message.reasoning == "r"
    assert choice.native_finish_reason == "eos"
    first, second = choice.message.tool_calls
    assert (first.function.name, first.custom) == ("f", None)
    assert (second.type, second.function, second.custom) == ("custom", None, {"name": "g", "input": "raw"})


def test_completion_decoder_defaults():
    completion = COMPLETION_DECODER.decode(b"{}")
    assert completion.choices == []
    assert completion.usage is None
    assert completion.created == 0
