"""Tests for gymproxy.convert.boundary: the last rewrite of a chat body before vLLM (spec section 6)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymproxy.convert.boundary import Boundary, Rules, sequential_reasoning_blocked
from gymproxy.convert.request import to_chat_body
from gymproxy.errors import BadRequest
from gymproxy.schemas.responses import REQUEST_DECODER

USER = {"role": "user", "content": "hi"}


def boundary(**config: Any) -> Boundary:
    return Boundary(Rules(**config))


def prepare(body: dict[str, Any], **config: Any) -> dict[str, Any]:
    """The body as it would go on the wire to vLLM."""
    return msgspec.json.decode(msgspec.json.encode(boundary(**config).prepare(body)))


def rejected(body: dict[str, Any], **config: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        boundary(**config).prepare(body)
    assert info.value.status == 400
    return info.value


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages) or [USER], **fields}


def assistant(content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def from_responses(**fields: Any) -> dict[str, Any]:
    return to_chat_body(REQUEST_DECODER.decode(orjson.dumps(fields)))


# --- steps 1-3: strict, developer role, model ---------------------------------------------------


def test_strict_is_stripped_from_function_tools_only():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
        {"type": "function", "function": {"name": "g", "strict": False}},
        {"type": "custom", "custom": {"name": "c", "strict": True}},
    ]
    assert prepare(body(tools=tools))["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g"}},
        {"type": "custom", "custom": {"name": "c", "strict": True}},
    ]


def test_strict_kept_by_the_conversion_is_stripped_at_the_boundary():
    converted = from_responses(input="x", tools=[{"type": "function", "name": "f", "strict": True}])
    assert converted["tools"] == [{"type": "function", "function": {"name": "f", "strict": True}}]
    assert prepare(converted)["tools"] == [{"type": "function", "function": {"name": "f"}}]


def test_developer_becomes_system_only_when_configured():
    given = body(
        {"role": "developer", "content": "d"}, USER, {"role": "developer", "content": [{"type": "text", "text": "e"}]}
    )
    assert [m["role"] for m in prepare(dict(given))["messages"]] == ["developer", "user", "developer"]
    got = prepare(given, replace_developer_role_with_system=True)["messages"]
    assert got == [
        {"role": "system", "content": "d"},
        USER,
        {"role": "system", "content": [{"type": "text", "text": "e"}]},
    ]


def test_config_model_replaces_the_client_model():
    assert prepare(body(model="client"), model="served")["model"] == "served"
    assert prepare(body(), model="served")["model"] == "served"


# --- step 4: chat_template_kwargs ---------------------------------------------------------------


def test_config_chat_template_kwargs_are_sent():
    assert prepare(body(), chat_template_kwargs={"enable_thinking": False})["chat_template_kwargs"] == {
        "enable_thinking": False
    }


def test_no_chat_template_kwargs_key_when_there_are_none():
    assert "chat_template_kwargs" not in prepare(body())
    assert "chat_template_kwargs" not in prepare(
        body(chat_template_kwargs={}), forward_request_chat_template_kwargs=True
    )


def test_request_chat_template_kwargs_are_dropped_unless_forwarding_is_on(caplog):
    caplog.set_level(logging.WARNING, logger="gymproxy")
    once = boundary(chat_template_kwargs={"a": 0})
    for _ in range(2):
        got = once.prepare(body(chat_template_kwargs={"a": 1, "b": 1}))
        assert got["chat_template_kwargs"] == {"a": 0}
    warnings = [r for r in caplog.records if "chat_template_kwargs" in r.getMessage()]
    assert len(warnings) == 1
    assert "forward_request_chat_template_kwargs" in warnings[0].getMessage()


def test_request_chat_template_kwargs_alone_are_dropped_without_forwarding():
    assert "chat_template_kwargs" not in prepare(body(chat_template_kwargs={"a": 1}))


def test_chat_template_kwargs_precedence_config_then_request_then_metadata():
    got = prepare(
        body(
            chat_template_kwargs={"request": 1, "both": "request", "all": "request"},
            metadata={"chat_template_kwargs": orjson.dumps({"meta": 1, "all": "metadata"}).decode()},
        ),
        chat_template_kwargs={"config": 1, "both": "config", "all": "config"},
        forward_request_chat_template_kwargs=True,
    )
    assert got["chat_template_kwargs"] == {
        "config": 1,
        "request": 1,
        "meta": 1,
        "both": "request",
        "all": "metadata",
    }


def test_metadata_chat_template_kwargs_apply_without_forwarding():
    got = prepare(
        body(chat_template_kwargs={"x": 1}, metadata={"chat_template_kwargs": '{"enable_thinking": true}'}),
        chat_template_kwargs={"enable_thinking": False},
    )
    assert got["chat_template_kwargs"] == {"enable_thinking": True}


# --- step 5 and 10: extra_body ------------------------------------------------------------------


def test_config_extra_body_goes_under_the_body():
    got = prepare(body(temperature=0.2), extra_body={"top_k": 20, "temperature": 1.5})
    assert got["top_k"] == 20
    assert got["temperature"] == 0.2  # request fields win
    assert list(got)[:2] == ["top_k", "temperature"]  # extra_body keys come first


def test_metadata_extra_body_overrides_config_and_stays_under_the_body():
    got = prepare(
        body(temperature=0.2, metadata={"extra_body": '{"top_k": 5, "min_p": 0.1, "temperature": 9}'}),
        extra_body={"top_k": 20, "repetition_penalty": 1.1},
    )
    assert got["top_k"] == 5
    assert got["min_p"] == 0.1
    assert got["repetition_penalty"] == 1.1
    assert got["temperature"] == 0.2


# --- deliberate difference 6: control keys leave metadata ----------------------------------------


def test_metadata_control_keys_are_removed_and_the_rest_forwarded():
    meta = {"task": "t1", "chat_template_kwargs": '{"a": 1}', "extra_body": '{"top_k": 3}'}
    got = prepare(body(metadata=meta))
    assert got["metadata"] == {"task": "t1"}
    assert got["chat_template_kwargs"] == {"a": 1}
    assert got["top_k"] == 3


def test_metadata_of_only_control_keys_is_not_forwarded():
    got = prepare(body(metadata={"chat_template_kwargs": "{}", "extra_body": "{}"}))
    assert not got.get("metadata")


def test_metadata_without_control_keys_is_forwarded_unchanged():
    assert prepare(body(metadata={"task": "t1", "k": "v"}))["metadata"] == {"task": "t1", "k": "v"}


def test_control_keys_do_not_leak_back_into_the_request_metadata():
    req = REQUEST_DECODER.decode(b'{"input":"x","metadata":{"task":"t","extra_body":"{\\"top_k\\":2}"}}')
    boundary().prepare(to_chat_body(req))
    assert req.metadata == {"task": "t", "extra_body": '{"top_k":2}'}


@pytest.mark.parametrize("key", ["chat_template_kwargs", "extra_body"])
def test_empty_control_string_means_no_change(key):
    got = prepare(body(metadata={key: ""}))
    assert "chat_template_kwargs" not in got
    assert not got.get("metadata")


@pytest.mark.parametrize("key", ["chat_template_kwargs", "extra_body"])
@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "3", "null", "true"])
def test_control_key_that_is_not_a_json_object_is_a_400(key, raw):
    error = rejected(body(metadata={key: raw}))
    assert error.param == f"metadata.{key}"


@pytest.mark.parametrize("key", ["chat_template_kwargs", "extra_body"])
def test_control_key_that_is_not_json_is_a_400(key):
    error = rejected(body(metadata={key: "{not json"}))
    assert error.param == f"metadata.{key}"


# --- step 6: continue_final_assistant_message -----------------------------------------------------


def test_trailing_assistant_message_is_continued_when_configured():
    got = prepare(body(USER, assistant("partial")), continue_final_assistant_message=True)
    assert got["continue_final_message"] is True
    assert got["add_generation_prompt"] is False


def test_continue_needs_a_trailing_assistant_message_and_the_option():
    for got in (
        prepare(body(assistant("a"), USER), continue_final_assistant_message=True),
        prepare(body(USER, assistant("partial"))),
    ):
        assert "continue_final_message" not in got
        assert "add_generation_prompt" not in got


# --- step 7 and 13: training mode ---------------------------------------------------------------


def test_training_mode_asks_for_token_ids():
    got = prepare(body(), return_token_id_information=True)
    assert got["logprobs"] is True
    assert got["top_logprobs"] == 0
    assert got["return_tokens_as_token_ids"] is True
    assert "return_token_ids" not in got


def test_training_mode_asks_for_inline_ids_when_configured():
    got = prepare(body(), return_token_id_information=True, request_prompt_and_generation_token_ids=True)
    assert got["return_token_ids"] is True


@pytest.mark.parametrize("client", [None, 5])
def test_training_mode_forces_top_logprobs_zero(client):
    got = prepare(body(top_logprobs=client, logprobs=False), return_token_id_information=True)
    assert got["top_logprobs"] == 0
    assert got["logprobs"] is True


def test_no_training_flags_outside_training_mode():
    got = prepare(body(), request_prompt_and_generation_token_ids=True)
    for key in ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "return_token_ids"):
        assert key not in got


@pytest.mark.parametrize("n", [None, 1])
def test_training_mode_accepts_a_single_choice(n):
    sent = prepare(body(n=n), return_token_id_information=True)
    assert sent["n"] == n and sent["logprobs"] is True and sent["return_tokens_as_token_ids"] is True


@pytest.mark.parametrize("n", [0, 2, 4])
def test_training_mode_refuses_several_choices(n):
    assert rejected(body(n=n), return_token_id_information=True).param == "n"


def test_several_choices_are_forwarded_outside_training_mode():
    assert prepare(body(n=3))["n"] == 3


def test_training_mode_refuses_n_set_by_extra_body():
    assert rejected(body(metadata={"extra_body": '{"n": 2}'}), return_token_id_information=True).param == "n"


# --- step 8: reasoning history split --------------------------------------------------------------

PARSER = {"uses_reasoning_parser": True}


@pytest.mark.parametrize(
    ("field", "keys"),
    [
        ("both", {"reasoning_content", "reasoning"}),
        ("reasoning", {"reasoning"}),
        ("reasoning_content", {"reasoning_content"}),
    ],
)
def test_think_blocks_move_to_the_configured_reasoning_fields(field, keys):
    (message,) = prepare(body(assistant("<think>plan</think>answer")), reasoning_field=field, **PARSER)["messages"]
    assert message == {"role": "assistant", "content": "answer", **{key: "plan" for key in keys}}


def test_all_think_blocks_are_kept_joined_by_newline():
    (message,) = prepare(body(assistant("<think>a</think>x<think>b\nc</think>y")), **PARSER)["messages"]
    assert message == {"role": "assistant", "content": "xy", "reasoning_content": "a\nb\nc", "reasoning": "a\nb\nc"}


def test_list_content_is_split_part_by_part():
    content = [{"type": "text", "text": "<think>a</think>x"}, {"type": "text", "text": "y<think>b</think>"}]
    (message,) = prepare(body(assistant(content)), reasoning_field="reasoning", **PARSER)["messages"]
    assert message == {
        "role": "assistant",
        "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
        "reasoning": "a\nb",
    }


def test_list_content_part_without_text_is_a_400():
    content = [{"type": "text", "text": "<think>a</think>"}, {"type": "image_url", "image_url": {"url": "u"}}]
    error = rejected(body(USER, assistant(content)), **PARSER)
    assert error.param == "messages[1].content[1]"


def test_think_only_turn_keeps_an_empty_string_content():
    (message,) = prepare(body(assistant("<think>only</think>")), **PARSER)["messages"]
    assert message["content"] == ""
    assert message["reasoning"] == "only"


def test_without_interleaved_reasoning_the_reasoning_is_dropped():
    (message,) = prepare(body(assistant("<think>plan</think>answer")), uses_interleaved_reasoning=False, **PARSER)[
        "messages"
    ]
    assert message == {"role": "assistant", "content": "answer"}


@pytest.mark.parametrize(
    "config",
    [
        {"uses_reasoning_parser": False},
        {"uses_reasoning_parser": True, "preserve_reasoning_in_assistant_content": True},
    ],
)
def test_history_is_untouched_byte_for_byte_without_splitting(config):
    content = "  <think>\n plan \n</think>\n\nanswer <think>open"
    (message,) = prepare(body(assistant(content)), **config)["messages"]
    assert message == {"role": "assistant", "content": content}


@pytest.mark.parametrize("content", [None, ""])
def test_empty_assistant_content_is_untouched(content):
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    (message,) = prepare(body(assistant(content, tool_calls=calls)), **PARSER)["messages"]
    assert message == {"role": "assistant", "content": content, "tool_calls": calls}


def test_assistant_content_without_think_blocks_is_unchanged():
    (message,) = prepare(body(assistant("plain </think> text <think>")), **PARSER)["messages"]
    assert message == {"role": "assistant", "content": "plain </think> text <think>"}


def test_only_assistant_messages_are_split():
    given = [{"role": "user", "content": "<think>u</think>"}, {"role": "system", "content": "<think>s</think>"}]
    assert prepare(body(*given), **PARSER)["messages"] == given


def test_a_reasoning_only_responses_turn_arrives_with_empty_content():
    converted = from_responses(
        input=[
            {"role": "user", "content": "q"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
        ]
    )
    messages = prepare(converted, **PARSER)["messages"]
    assert messages[-1] == {"content": "", "role": "assistant", "reasoning_content": "r", "reasoning": "r"}


def test_the_split_does_not_touch_the_callers_messages():
    original = assistant("<think>a</think>b")
    boundary(**PARSER).prepare(body(original))
    assert original == assistant("<think>a</think>b")


# --- step 9: top_logprobs null ------------------------------------------------------------------


def test_null_top_logprobs_is_removed():
    assert "top_logprobs" not in prepare(body(top_logprobs=None))


def test_top_logprobs_value_is_kept():
    assert prepare(body(top_logprobs=3))["top_logprobs"] == 3


# --- step 12: sampling_overrides ----------------------------------------------------------------


def test_sampling_overrides_win_over_everything():
    got = prepare(
        body(temperature=0.2, top_p=0.5, metadata={"extra_body": '{"top_k": 5, "temperature": 9}'}),
        extra_body={"top_k": 20, "min_p": 0.3},
        sampling_overrides={"temperature": 1.0, "top_k": -1, "min_p": 0.0, "seed": 7},
    )
    assert got["temperature"] == 1.0
    assert got["top_k"] == -1
    assert got["min_p"] == 0.0
    assert got["seed"] == 7
    assert got["top_p"] == 0.5


def test_sampling_overrides_win_over_training_flags():
    got = prepare(body(), return_token_id_information=True, sampling_overrides={"top_logprobs": 2})
    assert got["top_logprobs"] == 2


# --- 7.3: sequential_reasoning_blocked --------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "blocked"),
    [
        ([USER, assistant(None)], True),
        ([USER, assistant("")], True),
        ([USER, assistant("", tool_calls=[])], True),
        ([USER, assistant("text")], False),
        (
            [
                USER,
                assistant(
                    None, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}]
                ),
            ],
            False,
        ),
        ([assistant(None), USER], False),
        ([USER], False),
        ([], False),
    ],
)
def test_sequential_reasoning_blocked(messages, blocked):
    assert sequential_reasoning_blocked({"messages": messages}) is blocked


@pytest.mark.parametrize(("parser", "blocked"), [(True, True), (False, False)])
def test_trailing_reasoning_item_is_blocked_only_with_the_parser(parser, blocked):
    converted = from_responses(
        input=[
            {"role": "user", "content": "q"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
        ]
    )
    assert sequential_reasoning_blocked(boundary(uses_reasoning_parser=parser).prepare(converted)) is blocked


# --- the Responses route: a body built with the rules equals the body they rewrite ----------------

# Text made of tag fragments, so that `<think>` blocks, stray tags and tags that only form where two
# texts meet are common.
TEXT = st.lists(st.sampled_from(["<think>", "</think>", "think>", "<", "</", "thi", "nk>", "a", "\n"]), max_size=5).map(
    "".join
)
ITEM = st.one_of(
    st.builds(
        lambda texts: {"type": "reasoning", "summary": [{"type": "summary_text", "text": t} for t in texts]},
        st.lists(TEXT, max_size=2),
    ),
    st.builds(
        lambda content: {"type": "message", "role": "assistant", "content": content},
        TEXT
        | st.lists(
            st.builds(lambda t: {"type": "output_text", "text": t}, TEXT)
            | st.builds(lambda r: {"type": "refusal", "refusal": r}, TEXT),
            max_size=3,
        ),
    ),
    st.builds(
        lambda i: {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}, st.integers(0, 9)
    ),
    st.builds(lambda t: {"type": "function_call_output", "call_id": "c0", "output": t}, TEXT),
    st.builds(lambda role, t: {"role": role, "content": t}, st.sampled_from(["user", "system", "developer"]), TEXT),
)
CONFIGS = [
    {},
    PARSER,
    {**PARSER, "reasoning_field": "reasoning"},
    {**PARSER, "uses_interleaved_reasoning": False},
    {**PARSER, "preserve_reasoning_in_assistant_content": True},
    {**PARSER, "replace_developer_role_with_system": True},
]


TOOLS = [
    None,
    [
        {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
        {"type": "function", "name": "g", "description": "d", "strict": False},
        {"type": "function", "name": "h"},
        {"type": "custom", "name": "c", "format": {"type": "grammar", "syntax": "lark", "definition": "x"}},
    ],
]


@settings(max_examples=400, deadline=None, database=None)
@given(
    items=st.lists(ITEM, max_size=10),
    config=st.sampled_from(CONFIGS),
    instructions=st.sampled_from([None, "be"]),
    tools=st.sampled_from(TOOLS),
)
def test_a_body_built_with_the_rules_is_the_body_they_rewrite(items, config, instructions, tools):
    req = REQUEST_DECODER.decode(orjson.dumps({"input": items, "instructions": instructions, "tools": tools}))
    rules = boundary(**config)
    rewritten = rules.prepare(to_chat_body(req))
    built = rules.prepare(to_chat_body(req, rules), built=True)
    assert msgspec.json.encode(built) == msgspec.json.encode(rewritten)
