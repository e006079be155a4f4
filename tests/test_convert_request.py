"""Tests for gymproxy.convert.request: Responses request -> Chat Completions body (spec section 5).

Every request goes through the real decoder first, so each case is exactly what a client could
send; results are compared in their wire form (encoded, then decoded back to plain JSON).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
import pytest

from gymproxy.convert.request import to_chat_body
from gymproxy.errors import BadRequest
from gymproxy.schemas.responses import REQUEST_DECODER, ResponsesRequest

USER_X = {"role": "user", "content": [{"type": "text", "text": "x"}]}
TOKENS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.5, -0.25]}


def decode(**fields: Any) -> ResponsesRequest:
    return REQUEST_DECODER.decode(orjson.dumps(fields))


def chat(**fields: Any) -> dict[str, Any]:
    """The chat body for a request, as the JSON that would go on the wire."""
    body = to_chat_body(decode(**fields))
    return msgspec.json.decode(msgspec.json.encode(body))


def refused(**fields: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        to_chat_body(decode(**fields))
    assert info.value.status == 400
    return info.value


def messages(input: Any, **fields: Any) -> list[dict[str, Any]]:
    return chat(input=input, **fields)["messages"]


def user_parts(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat content parts one user message with these Responses parts converts to."""
    return messages([{"role": "user", "content": list(parts)}])[0]["content"]


def reasoning(*texts: str, **extra: Any) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": t} for t in texts], **extra}


def call(
    call_id: str = "call_1", name: str = "get_weather", arguments: str = '{"city":"Paris"}', **extra: Any
) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, **extra}


def chat_call(
    call_id: str = "call_1", name: str = "get_weather", arguments: str = '{"city":"Paris"}'
) -> dict[str, Any]:
    return {"id": call_id, "function": {"arguments": arguments, "name": name}, "type": "function"}


def output(call_id: str = "call_1", out: Any = "sunny") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": out}


# --- 5.1: top level ---------------------------------------------------------------------------


def test_string_input_is_one_user_message_with_one_text_part():
    assert chat(input="Hello") == {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}


def test_nothing_unsent_is_forwarded():
    assert chat(input="x") == {"messages": [USER_X]}


def test_null_fields_count_as_not_sent():
    body = chat(
        input="x",
        temperature=None,
        top_p=None,
        max_output_tokens=None,
        metadata=None,
        tools=None,
        tool_choice=None,
        parallel_tool_calls=None,
        reasoning=None,
        text=None,
        instructions=None,
        background=None,
        truncation=None,
        previous_response_id=None,
    )
    assert body == {"messages": [USER_X]}


# A meaning gymproxy cannot honour: answering anyway would answer another request (docs/routes.md,
# "Responses request fields").
REFUSED = {
    "background": True,
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "conversation": "conv_1",
    "previous_response_id": "resp_1",
    "prompt": {"id": "pmpt_1"},
    "truncation": "auto",
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_each_field_gymproxy_cannot_honour_is_refused_saying_why(field):
    error = refused(input="x", **{field: REFUSED[field]})
    assert error.param == field
    assert f"[{field!r}]" in error.message
    assert "have no Chat Completions representation" in error.message
    assert f"{field}: " in error.message  # the reason


def test_refused_fields_are_listed_sorted_and_checked_before_the_input():
    # The input item is itself unconvertible: the field refusal must win.
    error = refused(input=[{"type": "web_search_call"}], truncation="auto", background=True, prompt={"id": "p"})
    assert "['background', 'prompt', 'truncation']" in error.message
    assert error.param == "background"


# Accepted and not sent: no vLLM meaning, and the request is answered as asked without them.
IGNORED = {
    "background": False,
    "truncation": "disabled",
    "context_management": [],
    "store": False,
    "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "safety_identifier": "s-1",
    "moderation": {"model": "omni-moderation-latest"},
    "max_tool_calls": 3,
    "background_options": {"completion_window": "soonest"},
    "access_programs": {"cyber": "standard"},
    "image": {"context_compression": "auto"},
    "client_metadata": {"x-codex-installation-id": "i-1", "session_id": "s"},
    "stream_options": {"include_obfuscation": False},
}


@pytest.mark.parametrize("field", sorted(IGNORED))
def test_fields_without_a_vllm_meaning_are_accepted_and_not_sent(field):
    assert chat(input="x", **{field: IGNORED[field]}) == {"messages": [USER_X]}


def test_model_is_copied():
    assert chat(input="x", model="client-model")["model"] == "client-model"


def test_max_output_tokens_becomes_max_tokens():
    body = chat(input="x", max_output_tokens=64)
    assert body["max_tokens"] == 64
    assert "max_completion_tokens" not in body
    assert "max_output_tokens" not in body


PASSED = {
    "metadata": {"task": "t1", "chat_template_kwargs": '{"enable_thinking": false}'},
    "temperature": 0.25,
    "top_p": 0.5,
    "user": "u-1",
    "top_logprobs": 2,
}


@pytest.mark.parametrize("field", sorted(PASSED))
def test_passthrough_fields_keep_their_name_and_value(field):
    body = chat(input="x", **{field: PASSED[field]})
    assert body == {"messages": [USER_X], field: PASSED[field]}


def test_stream_false_is_forwarded():
    assert chat(input="x", stream=False)["stream"] is False


# --- 5.1 step 7: reasoning --------------------------------------------------------------------


def test_reasoning_effort_becomes_reasoning_effort():
    body = chat(input="x", reasoning={"effort": "high"})
    assert body["reasoning_effort"] == "high"
    assert "reasoning" not in body


def test_reasoning_without_effort_adds_nothing():
    assert chat(input="x", reasoning={"effort": None}) == {"messages": [USER_X]}


@pytest.mark.parametrize(
    "members",
    [{"summary": "auto"}, {"generate_summary": "concise"}, {"context": "all_turns"}, {"mode": "standard"}],
)
def test_other_reasoning_members_are_accepted_and_not_sent(members):
    # Codex sends `summary: "auto"`: the model's reasoning comes back as a summary anyway.
    assert chat(input="x", reasoning={"effort": "low", **members}) == {
        "messages": [USER_X],
        "reasoning_effort": "low",
    }


# --- 5.1 step 8: text -------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (
            {"type": "json_schema", "name": "answer", "schema": SCHEMA},
            {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
        ),
        (
            {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True, "description": "d"},
            {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True, "description": "d"},
            },
        ),
        (
            {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": False, "description": None},
            {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": False}},
        ),
        ({"type": "json_object"}, {"type": "json_object"}),
    ],
)
def test_text_format_becomes_response_format(fmt, expected):
    assert chat(input="x", text={"format": fmt})["response_format"] == expected


def test_text_format_text_adds_nothing():
    assert chat(input="x", text={"format": {"type": "text"}}) == {"messages": [USER_X]}


def test_text_verbosity_becomes_top_level_verbosity():
    body = chat(input="x", text={"verbosity": "low"})
    assert body == {"messages": [USER_X], "verbosity": "low"}


def test_text_format_and_verbosity_together():
    body = chat(input="x", text={"format": {"type": "json_object"}, "verbosity": "high"})
    assert body["response_format"] == {"type": "json_object"}
    assert body["verbosity"] == "high"
    assert "text" not in body


# --- 5.2: messages and content parts ----------------------------------------------------------


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_non_assistant_roles_keep_string_content(role):
    assert messages([{"role": role, "content": "hi"}]) == [{"role": role, "content": "hi"}]


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_non_assistant_roles_convert_list_content(role):
    got = messages([{"type": "message", "role": role, "content": [{"type": "input_text", "text": "hi"}]}])
    assert got == [{"role": role, "content": [{"type": "text", "text": "hi"}]}]


def test_assistant_role_becomes_an_assistant_message():
    assert messages([{"role": "assistant", "content": "hello"}]) == [{"content": "hello", "role": "assistant"}]


def test_item_without_type_is_a_message():
    assert messages([{"role": "user", "content": "a"}]) == messages(
        [{"type": "message", "role": "user", "content": "a"}]
    )


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ({"type": "input_text", "text": "hi"}, {"type": "text", "text": "hi"}),
        (
            {"type": "input_image", "image_url": "https://x/cat.png", "detail": "low"},
            {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "low"}},
        ),
        (
            {"type": "input_image", "image_url": {"url": "data:image/png;base64,AAA"}, "detail": "high"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA", "detail": "high"}},
        ),
        # gymproxy: an image without `detail` is accepted and means `auto`.
        (
            {"type": "input_image", "image_url": "https://x/cat.png"},
            {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "auto"}},
        ),
        (
            {"type": "input_image", "image_url": "https://x/cat.png", "detail": "auto"},
            {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "auto"}},
        ),
        (
            {"type": "input_video", "video_url": "https://x/v.mp4"},
            {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
        ),
        (
            {"type": "input_video", "video_url": {"url": "https://x/v.mp4"}},
            {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
        ),
        (
            {"type": "input_video", "video": "https://x/v.mp4"},
            {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
        ),
        (
            {"type": "input_video", "video": {"url": "https://x/v.mp4"}},
            {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
        ),
    ],
)
def test_content_part_conversion(part, expected):
    assert user_parts(part) == [expected]


def test_content_parts_keep_their_order():
    got = user_parts(
        {"type": "input_text", "text": "a"},
        {"type": "input_image", "image_url": "u", "detail": "low"},
        {"type": "input_text", "text": "b"},
    )
    assert [p["type"] for p in got] == ["text", "image_url", "text"]


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        ({"type": "input_image", "file_id": "file-1", "detail": "auto"}, "input[0].content[0].image_url", "file_id"),
        (
            {"type": "input_image", "image_url": "", "detail": "auto"},
            "input[0].content[0].image_url",
            "non-empty image_url",
        ),
        (
            {"type": "input_image", "image_url": {"url": ""}, "detail": "auto"},
            "input[0].content[0].image_url",
            "non-empty image_url",
        ),
        (
            {"type": "input_image", "image_url": "https://x/a.png", "detail": "original"},
            "input[0].content[0].detail",
            "original",
        ),
        ({"type": "input_video", "video_url": ""}, "input[0].content[0].video_url", "non-empty"),
        ({"type": "input_video", "video": {"url": ""}}, "input[0].content[0].video_url", "non-empty"),
        ({"type": "input_video"}, "input[0].content[0].video_url", "exactly one"),
        ({"type": "input_video", "video_url": "a", "video": "b"}, "input[0].content[0].video_url", "exactly one"),
        (
            {"type": "input_file", "file_id": "file-1"},
            "input[0].content[0].type",
            "Unsupported part param type: input_file",
        ),
        ({"type": "output_text", "text": "x"}, "input[0].content[0].type", "Unsupported part param type: output_text"),
    ],
)
def test_unconvertible_content_parts_are_refused(part, param, words):
    error = refused(input=[{"role": "user", "content": [part]}])
    assert error.param == param
    assert words in error.message


def test_message_phase_is_refused():
    error = refused(input=[{"role": "assistant", "content": "x", "phase": "commentary"}])
    assert error.param == "input[0].phase"
    assert "phase" in error.message


@pytest.mark.parametrize(
    "kind",
    [
        "custom_tool_call",
        "custom_tool_call_output",
        "mcp_call",
        "web_search_call",
        "computer_call",
        "compaction",
        "item_reference",
    ],
)
def test_other_item_types_are_refused_by_name(kind):
    error = refused(input=[{"role": "user", "content": "x"}, {"type": kind, "id": "i1"}])
    assert error.param == "input[1].type"
    assert f"'{kind}' has no Chat Completions representation" in error.message


# --- 5.2: reasoning, function_call, function_call_output ---------------------------------------


def test_reasoning_summaries_become_think_blocks():
    got = messages([reasoning("first", "second")])
    assert got == [{"content": "<think>first</think><think>second</think>", "role": "assistant"}]


def test_reasoning_summary_with_empty_text_is_skipped():
    got = messages([reasoning("", "kept", "")])
    assert got == [{"content": "<think>kept</think>", "role": "assistant"}]


def test_lone_reasoning_item_without_summary_still_makes_an_assistant_message():
    assert messages([reasoning()]) == [{"content": None, "role": "assistant"}]
    assert messages([reasoning("")]) == [{"content": None, "role": "assistant"}]


def test_reasoning_content_and_encrypted_content_are_ignored():
    item = reasoning("s", content=[{"type": "reasoning_text", "text": "hidden"}], encrypted_content="gAAA", id="rs_1")
    assert messages([item]) == [{"content": "<think>s</think>", "role": "assistant"}]


def test_function_call_becomes_a_tool_call_and_drops_its_own_id_and_status():
    got = messages([call(id="fc_9", status="completed")])
    assert got == [{"content": None, "role": "assistant", "tool_calls": [chat_call()]}]


def test_function_call_output_string():
    assert messages([output(out="sunny")]) == [{"content": "sunny", "role": "tool", "tool_call_id": "call_1"}]


def test_function_call_output_list_of_input_text():
    out = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    got = messages([output(out=out)])
    assert got == [
        {
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "role": "tool",
            "tool_call_id": "call_1",
        }
    ]


def test_function_call_output_with_other_parts_is_refused_naming_every_type():
    out = [
        {"type": "input_text", "text": "a"},
        {"type": "input_image", "image_url": "u", "detail": "auto"},
        {"type": "input_file", "file_id": "f"},
    ]
    error = refused(input=[output(call_id="call_7", out=out)])
    assert error.param == "input[0].output"
    assert "for call 'call_7'" in error.message
    assert "'input_file', 'input_image'" in error.message


# --- 5.2 / 5.3: assistant-turn buffering --------------------------------------------------------


def test_assistant_items_merge_into_one_message():
    got = messages([reasoning("A"), {"role": "assistant", "content": "x"}, call()])
    assert got == [{"content": "<think>A</think>x", "role": "assistant", "tool_calls": [chat_call()]}]


def test_assistant_text_is_concatenated_in_item_order_and_tool_calls_collected():
    got = messages(
        [
            {"role": "assistant", "content": "x"},
            reasoning("A"),
            call("c1", "f"),
            {"role": "assistant", "content": [{"type": "output_text", "text": "y"}]},
            call("c2", "g"),
        ]
    )
    assert got == [
        {
            "content": "x<think>A</think>y",
            "role": "assistant",
            "tool_calls": [chat_call("c1", "f"), chat_call("c2", "g")],
        }
    ]


def test_assistant_list_content_joins_text_parts_without_separator():
    content = [{"type": "output_text", "text": "a", "annotations": []}, {"type": "input_text", "text": "b"}]
    assert messages([{"role": "assistant", "content": content}]) == [{"content": "ab", "role": "assistant"}]


def test_assistant_refusal_parts_go_to_refusal():
    content = [
        {"type": "output_text", "text": "t"},
        {"type": "refusal", "refusal": "no"},
        {"type": "refusal", "refusal": "pe"},
    ]
    assert messages([{"role": "assistant", "content": content}]) == [
        {"content": "t", "role": "assistant", "refusal": "nope"}
    ]


def test_refusal_only_assistant_turn_has_null_content():
    content = [{"type": "refusal", "refusal": "no"}]
    assert messages([{"role": "assistant", "content": content}]) == [
        {"content": None, "role": "assistant", "refusal": "no"}
    ]


def test_assistant_part_without_text_or_refusal_is_refused():
    error = refused(input=[{"role": "assistant", "content": [{"type": "output_text"}]}])
    assert error.param == "input[0].content[0]"
    assert "Unsupported assistant content part" in error.message


@pytest.mark.parametrize("content", [None, "", []])
def test_empty_assistant_content_becomes_null(content):
    assert messages([{"role": "assistant", "content": content}]) == [{"content": None, "role": "assistant"}]


def test_no_empty_tool_calls_or_refusal_keys():
    (message,) = messages([{"role": "assistant", "content": "x"}])
    assert set(message) == {"content", "role"}


def test_chat_style_tool_calls_on_assistant_items_are_kept():
    item = {
        "role": "assistant",
        "content": "calling",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    got = messages([item, call("c2", "g")])
    assert got == [
        {"content": "calling", "role": "assistant", "tool_calls": [chat_call("c1", "f", "{}"), chat_call("c2", "g")]}
    ]


@pytest.mark.parametrize(
    ("flusher", "emitted"),
    [
        ({"role": "user", "content": "u"}, {"role": "user", "content": "u"}),
        ({"role": "system", "content": "s"}, {"role": "system", "content": "s"}),
        ({"role": "developer", "content": "d"}, {"role": "developer", "content": "d"}),
        (output("c1", "o"), {"content": "o", "role": "tool", "tool_call_id": "c1"}),
    ],
)
def test_pending_assistant_turn_is_flushed_before(flusher, emitted):
    got = messages([reasoning("A"), call("c1", "f"), flusher, {"role": "assistant", "content": "after"}])
    assert got == [
        {"content": "<think>A</think>", "role": "assistant", "tool_calls": [chat_call("c1", "f")]},
        emitted,
        {"content": "after", "role": "assistant"},
    ]


def test_a_full_rollout():
    got = messages(
        [
            {"role": "user", "content": "weather in Paris?"},
            reasoning("need a tool"),
            call("c1"),
            output("c1", "sunny"),
            reasoning("got it"),
            {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
            {"role": "user", "content": "thanks"},
        ]
    )
    assert got == [
        {"role": "user", "content": "weather in Paris?"},
        {"content": "<think>need a tool</think>", "role": "assistant", "tool_calls": [chat_call("c1")]},
        {"content": "sunny", "role": "tool", "tool_call_id": "c1"},
        {"content": "<think>got it</think>It is sunny.", "role": "assistant"},
        {"role": "user", "content": "thanks"},
    ]


# --- 5.4: instructions ------------------------------------------------------------------------


def test_instructions_become_a_leading_system_message():
    assert messages("x", instructions="Be brief.") == [{"content": "Be brief.", "role": "system"}, USER_X]


def test_instructions_fold_leading_system_and_developer_messages():
    got = messages(
        [
            {"role": "system", "content": "S"},
            {
                "role": "developer",
                "content": [{"type": "input_text", "text": "D1"}, {"type": "input_text", "text": "D2"}],
            },
            {"role": "user", "content": "u"},
            {"role": "system", "content": "late system"},
            {"role": "developer", "content": "late developer"},
        ],
        instructions="I",
    )
    assert got == [
        {"content": "I\n\nS\n\nD1D2", "role": "system"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": "late system"},
        {"role": "developer", "content": "late developer"},
    ]


def test_without_instructions_leading_system_messages_are_untouched():
    given = [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "u"},
    ]
    assert messages(given) == given


def test_empty_instructions_are_ignored():
    given = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    assert messages(given, instructions="") == given


def test_instructions_do_not_fold_a_leading_assistant_turn():
    got = messages([{"role": "assistant", "content": "a"}, {"role": "system", "content": "S"}], instructions="I")
    assert got == [
        {"content": "I", "role": "system"},
        {"content": "a", "role": "assistant"},
        {"role": "system", "content": "S"},
    ]


# --- 5.5: tools, tool_choice, parallel_tool_calls -----------------------------------------------

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize(
    ("tool", "expected"),
    [
        (
            {"type": "function", "name": "f", "description": "d", "parameters": PARAMS, "strict": True},
            {"type": "function", "function": {"name": "f", "description": "d", "parameters": PARAMS, "strict": True}},
        ),
        # `strict: false` is a value, not a null: it survives conversion too.
        (
            {"type": "function", "name": "f", "parameters": PARAMS, "strict": False},
            {"type": "function", "function": {"name": "f", "parameters": PARAMS, "strict": False}},
        ),
        (
            {
                "type": "function",
                "name": "f",
                "description": None,
                "parameters": None,
                "strict": None,
                "defer_loading": None,
            },
            {"type": "function", "function": {"name": "f"}},
        ),
        ({"type": "function", "name": "f", "defer_loading": False}, {"type": "function", "function": {"name": "f"}}),
        ({"type": "custom", "name": "c"}, {"type": "custom", "custom": {"name": "c"}}),
        (
            {"type": "custom", "name": "c", "description": "d", "format": {"type": "text"}},
            {"type": "custom", "custom": {"name": "c", "description": "d", "format": {"type": "text"}}},
        ),
        (
            {
                "type": "custom",
                "name": "c",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /x/"},
            },
            {
                "type": "custom",
                "custom": {
                    "name": "c",
                    "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": "start: /x/"}},
                },
            },
        ),
        ({"type": "custom", "name": "c", "defer_loading": False}, {"type": "custom", "custom": {"name": "c"}}),
    ],
)
def test_tool_conversion(tool, expected):
    assert chat(input="x", tools=[tool])["tools"] == [expected]


@pytest.mark.parametrize("kind", ["function", "custom"])
def test_defer_loading_true_is_refused(kind):
    error = refused(
        input="x", tools=[{"type": "function", "name": "ok"}, {"type": kind, "name": "t", "defer_loading": True}]
    )
    assert error.param == "tools[1].defer_loading"
    assert f"Responses {kind} tools with defer_loading enabled" in error.message


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
        ({"type": "custom", "name": "c"}, {"type": "custom", "custom": {"name": "c"}}),
        (
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "c"}],
            },
            {
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "required",
                    "tools": [
                        {"type": "function", "function": {"name": "f"}},
                        {"type": "custom", "custom": {"name": "c"}},
                    ],
                },
            },
        ),
    ],
)
def test_tool_choice_conversion(choice, expected):
    tools = [{"type": "function", "name": "f"}, {"type": "custom", "name": "c"}]
    assert chat(input="x", tools=tools, tool_choice=choice)["tool_choice"] == expected


@pytest.mark.parametrize("ref", [{"type": "web_search"}, {"type": "mcp", "server_label": "srv"}, {"type": "teleport"}])
def test_allowed_tools_drops_refs_to_hosted_tools(ref):
    # The hosted tool is dropped from `tools`, so it drops out of what the model may call.
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}, ref]}
    body = chat(input="x", tools=[{"type": "function", "name": "f"}, {"type": "web_search"}], tool_choice=choice)
    assert body["tool_choice"] == {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
    }


def test_allowed_tools_of_only_hosted_tools_is_refused():
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}
    error = refused(input="x", tools=[{"type": "function", "name": "f"}, {"type": "web_search"}], tool_choice=choice)
    assert error.param == "tool_choice.tools"
    assert "only hosted tools" in error.message


def test_allowed_tools_function_ref_needs_a_name():
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function"}]}
    error = refused(input="x", tools=[{"type": "function", "name": "f"}], tool_choice=choice)
    assert error.param == "tool_choice.tools[0].name"


HOSTED = [
    {"type": "web_search", "search_context_size": "low"},
    {"type": "web_search_preview"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
    {"type": "mcp", "server_label": "s"},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "local_shell"},
    {"type": "shell"},
    {"type": "apply_patch"},
]


def test_hosted_tools_are_dropped_from_what_goes_to_vllm():
    body = chat(input="x", tools=[HOSTED[0], {"type": "function", "name": "f"}, *HOSTED[1:]], tool_choice="auto")
    assert body["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert body["tool_choice"] == "auto"


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_only_hosted_tools_is_no_tools(choice):
    assert chat(input="x", tools=HOSTED, tool_choice=choice, parallel_tool_calls=True) == {"messages": [USER_X]}


def test_only_hosted_tools_and_a_required_choice_is_refused():
    assert refused(input="x", tools=HOSTED, tool_choice="required").param == "tool_choice"


@pytest.mark.parametrize("tools", [HOSTED, [{"type": "function", "name": "f"}, *HOSTED]])
@pytest.mark.parametrize("choice", [{"type": "web_search_preview"}, {"type": "mcp", "server_label": "s"}])
def test_tool_choice_naming_a_hosted_tool_is_refused(tools, choice):
    error = refused(input="x", tools=tools, tool_choice=choice)
    assert error.param == "tool_choice.type"
    assert f"'{choice['type']}'" in error.message and "drops" in error.message


def test_tool_choice_and_parallel_tool_calls_are_forwarded_only_when_sent():
    body = chat(input="x", tools=[{"type": "function", "name": "f"}])
    assert "tool_choice" not in body
    assert "parallel_tool_calls" not in body
    body = chat(input="x", tools=[{"type": "function", "name": "f"}], tool_choice="auto", parallel_tool_calls=False)
    assert body["tool_choice"] == "auto"
    assert body["parallel_tool_calls"] is False


@pytest.mark.parametrize("tools", [None, []])
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_without_tools_auto_or_none_is_accepted_and_not_forwarded(tools, choice):
    body = chat(input="x", tools=tools, tool_choice=choice, parallel_tool_calls=True)
    assert body == {"messages": [USER_X]}


@pytest.mark.parametrize(
    ("choice", "shown"),
    [
        ("required", "'required'"),
        ({"type": "function", "name": "f"}, "{'type': 'function', 'name': 'f'}"),
        ({"type": "custom", "name": "c"}, "{'type': 'custom', 'name': 'c'}"),
        ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]}, "'allowed_tools'"),
    ],
)
@pytest.mark.parametrize("tools", [None, []])
def test_tool_choice_needing_a_tool_is_refused_without_tools(choice, shown, tools):
    error = refused(input="x", tools=tools, tool_choice=choice)
    assert error.param == "tool_choice"
    assert error.message.startswith("tool_choice=")
    assert error.message.endswith("requires at least one tool")
    assert shown in error.message


def test_parallel_tool_calls_is_dropped_without_tools():
    assert "parallel_tool_calls" not in chat(input="x", parallel_tool_calls=False)


# --- 9.2: token metadata on input items --------------------------------------------------------


@pytest.mark.parametrize(
    "partial",
    [
        {"prompt_token_ids": [1]},
        {"generation_token_ids": [1]},
        {"generation_log_probs": [-1.0]},
        {"prompt_token_ids": [1], "generation_token_ids": [2]},
        {"routed_experts": [[0, 1]]},
    ],
)
def test_token_metadata_is_all_or_nothing(partial):
    error = refused(input=[{"role": "user", "content": "q"}, call(**partial)])
    assert error.param is not None and error.param.startswith("input[1].")
    assert "partial token metadata" in error.message


@pytest.mark.parametrize("extra", [{}, {"routed_experts": [[3, 4]]}])
def test_token_fields_are_accepted_but_never_sent_upstream(extra):
    inp = [
        {"role": "user", "content": "q", **TOKENS},
        reasoning("r", **TOKENS),
        call(**TOKENS, **extra),
        output("call_1", "o"),
        {"role": "assistant", "content": "a", **TOKENS},
    ]
    got = chat(input=inp)["messages"]
    assert got == [
        {"role": "user", "content": "q"},
        {"content": "<think>r</think>", "role": "assistant", "tool_calls": [chat_call()]},
        {"content": "o", "role": "tool", "tool_call_id": "call_1"},
        {"content": "a", "role": "assistant"},
    ]
