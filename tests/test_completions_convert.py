"""The /v1/completions backend (spec section 10): prompt rendering, body building, reply wrapping."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gymproxy.config import Config, ConfigError, build_config
from gymproxy.convert.completions import (
    CompletionChunks,
    Rules,
    chat_logprobs,
    check_chat_body,
    render_raw,
    template_kwargs,
    to_chat_completion,
    to_completions_body,
    token_fields,
)
from gymproxy.convert.tokens import tokenize_body
from gymproxy.errors import BadRequest, UpstreamError
from gymproxy.proxy import rules
from gymproxy.templates import ChatTemplate


def cfg(**fields: Any) -> Rules:
    """The backend's rules, as `Proxy` makes them from a config with these keys."""
    fields = {"base_url": ["http://vllm:8000/v1"], "model": "base-model", "use_completions_api": True, **fields}
    return rules(Rules, Config(**fields))


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def system(content: Any) -> dict[str, Any]:
    return {"role": "system", "content": content}


def bad_request(call: Any, *args: Any, **kwargs: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        call(*args, **kwargs)
    assert info.value.status == 400
    return info.value


# --- config ----------------------------------------------------------------------------------


def test_render_chat_template_needs_use_completions_api() -> None:
    with pytest.raises(ConfigError, match="render_chat_template"):
        build_config({"base_url": "http://vllm/v1", "render_chat_template": True}, environ={})


def test_completions_api_refuses_prefix_supply() -> None:
    with pytest.raises(ConfigError, match="supply_prefix_token_ids.*use_completions_api"):
        build_config(
            {"base_url": "http://vllm/v1", "use_completions_api": True, "supply_prefix_token_ids": True}, environ={}
        )


# --- raw rendering (render_chat_template: false) -----------------------------------------------


def test_raw_single_user_string_is_the_prompt() -> None:
    assert render_raw([user("Tell me a story.")]) == "Tell me a story."


def test_raw_system_and_user_are_joined_by_a_blank_line() -> None:
    assert render_raw([system("Be brief."), user("Hi")]) == "Be brief.\n\nHi"


def test_raw_text_parts_are_concatenated_without_separator() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, {"type": "text"}]
    assert render_raw([system([{"type": "text", "text": "S"}]), user(parts)]) == "S\n\nab"


def test_raw_responses_string_input_becomes_exactly_that_string() -> None:
    # A Responses `input: "hi"` reaches the chat body as a one-part list.
    assert render_raw([user([{"type": "input_text", "text": "hi\n"}])]) == "hi\n"


def test_raw_empty_messages() -> None:
    err = bad_request(render_raw, [])
    assert err.param == "messages"
    assert "empty messages list" in err.message


def test_raw_more_than_two_messages() -> None:
    err = bad_request(render_raw, [system("s"), user("u"), user("again")])
    assert err.param == "messages"
    assert "got 3 messages" in err.message


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([user("u"), system("s")], "messages[0].role"),
        ([system("s"), {"role": "assistant", "content": "a"}], "messages[1].role"),
        ([{"role": "developer", "content": "d"}, user("u")], "messages[0].role"),  # no developer->system here
        ([{"role": "assistant", "content": "a"}], "messages[0].role"),
        ([system("s")], "messages[0].role"),
        ([{"role": "tool", "content": "t", "tool_call_id": "c"}], "messages[0].role"),
    ],
)
def test_raw_refuses_other_role_shapes(messages: list[dict[str, Any]], param: str) -> None:
    err = bad_request(render_raw, messages)
    assert err.param == param
    assert "use_completions_api=true requires" in err.message


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [user([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}])],
            "messages[0].content[1]",
        ),
        ([system("s"), user([{"type": "input_audio", "input_audio": {}}])], "messages[1].content[0]"),
        ([user(["bare string part"])], "messages[0].content[0]"),
        ([user(None)], "messages[0].content"),
        ([user({"type": "text", "text": "a"})], "messages[0].content"),
        ([user([{"type": "text", "text": 5}])], "messages[0].content[0].text"),
    ],
)
def test_raw_refuses_non_text_content(messages: list[dict[str, Any]], param: str) -> None:
    assert bad_request(render_raw, messages).param == param


# --- checks before rendering (steps 1-4) -------------------------------------------------------


def test_check_strips_strict_from_function_tools_only() -> None:
    custom = {"type": "custom", "custom": {"name": "c", "strict": True}}
    body = {
        "messages": [user("u")],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}, custom],
    }
    assert check_chat_body(body, rendered=True) is False
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}}, custom]


@pytest.mark.parametrize(("sent", "dropped"), [({"enable_thinking": False}, True), ({}, False), (None, False)])
def test_check_drops_request_chat_template_kwargs(sent: Any, dropped: bool) -> None:
    body: dict[str, Any] = {"messages": [user("u")], "chat_template_kwargs": sent}
    assert check_chat_body(body, rendered=False) is dropped
    assert "chat_template_kwargs" not in body


def test_check_without_chat_template_kwargs_reports_nothing_dropped() -> None:
    assert check_chat_body({"messages": [user("u")]}, rendered=False) is False


def test_check_refuses_tools_in_raw_mode() -> None:
    body = {"messages": [user("u")], "tools": [{"type": "function", "function": {"name": "f"}}]}
    err = bad_request(check_chat_body, body, rendered=False)
    assert err.param == "tools"
    assert "render_chat_template" in err.message


def test_check_accepts_an_empty_tool_list_in_raw_mode() -> None:
    assert check_chat_body({"messages": [user("u")], "tools": []}, rendered=False) is False


@pytest.mark.parametrize("render", [False, True])
@pytest.mark.parametrize("key", ["audio_data", "audio_path", "audio_paths"])
def test_check_refuses_audio_metadata_in_both_modes(key: str, render: bool) -> None:
    body = {"messages": [user("u")], "metadata": {key: "data:audio/wav;base64,AAAA"}}
    err = bad_request(check_chat_body, body, rendered=render)
    assert err.param == f"metadata.{key}"
    assert "text-only" in err.message


def test_check_ignores_empty_audio_metadata() -> None:
    assert (
        check_chat_body({"messages": [user("u")], "metadata": {"audio_path": "", "task": "x"}}, rendered=False) is False
    )


# --- chat_template_kwargs: config < metadata ----------------------------------------------------


def test_template_kwargs_config_overlaid_by_metadata() -> None:
    config = cfg(chat_template_kwargs={"enable_thinking": True, "lang": "en"})
    meta = {"chat_template_kwargs": '{"enable_thinking": false, "extra": 1}'}
    assert template_kwargs(config.chat_template_kwargs, meta) == {"enable_thinking": False, "lang": "en", "extra": 1}
    assert config.chat_template_kwargs == {"enable_thinking": True, "lang": "en"}  # not mutated


@pytest.mark.parametrize("metadata", [None, {}, {"chat_template_kwargs": ""}, {"other": "x"}])
def test_template_kwargs_without_metadata_is_the_config(metadata: Any) -> None:
    assert template_kwargs({"a": 1}, metadata) == {"a": 1}
    assert template_kwargs(None, metadata) == {}


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"text"', "3"])
def test_template_kwargs_refuses_what_is_not_a_json_object(raw: str) -> None:
    err = bad_request(template_kwargs, None, {"chat_template_kwargs": raw})
    assert err.param == "metadata.chat_template_kwargs"


def test_template_kwargs_refuse_a_request_template() -> None:
    err = bad_request(template_kwargs, None, {"chat_template_kwargs": '{"chat_template": "{{ 1 }}"}'})
    assert err.param == "metadata.chat_template_kwargs"


# --- the /v1/completions body (steps 6-7) -------------------------------------------------------


def test_body_minimal() -> None:
    chat = {
        "model": "client-model",
        "messages": [user("u")],
        "metadata": {"extra_body": '{"top_k": 3}', "k": "v"},
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning_effort": "high",
    }
    assert to_completions_body(chat, cfg(), "PROMPT") == {"model": "base-model", "prompt": "PROMPT"}


def test_body_keeps_the_client_model_when_none_is_configured() -> None:
    config = cfg(model=None)
    body = to_completions_body({"model": "client-model"}, config, "P")
    assert body == {"model": "client-model", "prompt": "P"}
    assert tokenize_body(body) == {"model": "client-model", "prompt": "P"}


def test_body_passes_the_listed_fields_under_the_same_name() -> None:
    chat = {
        "messages": [user("u")],
        "max_tokens": 10,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "seed": 7,
        "stop": ["\n"],
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
        "logit_bias": {"5": -100},
        "response_format": {"type": "json_object"},
        "user": "u-1",
        "top_k": 40,  # a vLLM extra without a first-class completion field: not carried
    }
    body = to_completions_body(chat, cfg(), "P")
    expected = {k: v for k, v in chat.items() if k not in ("messages", "top_k")}
    assert body == {"model": "base-model", "prompt": "P", **expected}


def test_body_maps_max_completion_tokens_to_max_tokens() -> None:
    assert to_completions_body({"max_completion_tokens": 64}, cfg(), "P")["max_tokens"] == 64
    both = to_completions_body({"max_tokens": 8, "max_completion_tokens": 64}, cfg(), "P")
    assert both["max_tokens"] == 8
    assert "max_completion_tokens" not in both


@pytest.mark.parametrize(
    ("chat", "training", "expected"),
    [
        ({}, False, None),
        ({"logprobs": False}, False, None),
        ({"logprobs": True}, False, 0),
        ({"logprobs": True, "top_logprobs": 3}, False, 3),
        ({"top_logprobs": 2}, False, 2),  # top_logprobs alone is enough
        ({"logprobs": True, "top_logprobs": None}, False, 0),
        ({"logprobs": False, "top_logprobs": 0}, False, 0),
        ({}, True, 0),
        ({"logprobs": False}, True, 0),
        ({"top_logprobs": 5}, True, 5),
    ],
)
def test_body_logprobs_rule(chat: dict[str, Any], training: bool, expected: int | None) -> None:
    body = to_completions_body(chat, cfg(return_token_id_information=training), "P")
    assert body.get("logprobs", None) == expected
    assert ("logprobs" in body) is (expected is not None)
    assert "top_logprobs" not in body


def test_body_config_extra_body_goes_under_the_request() -> None:
    config = cfg(extra_body={"temperature": 0.1, "top_k": 5, "skip_special_tokens": False})
    body = to_completions_body({"temperature": 0.7}, config, "P")
    assert body == {"temperature": 0.7, "top_k": 5, "skip_special_tokens": False, "model": "base-model", "prompt": "P"}
    assert list(body)[:3] == ["temperature", "top_k", "skip_special_tokens"]  # extra_body keys first


def test_body_training_forces_token_id_flags() -> None:
    config = cfg(
        return_token_id_information=True,
        request_prompt_and_generation_token_ids=False,
        extra_body={"return_token_ids": False, "return_tokens_as_token_ids": False},
    )
    body = to_completions_body({}, config, "P")
    assert body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 0


def test_body_without_training_has_no_token_id_flags() -> None:
    body = to_completions_body({"logprobs": True}, cfg(), "P")
    assert "return_token_ids" not in body and "return_tokens_as_token_ids" not in body


def test_body_sampling_overrides_win_over_everything() -> None:
    config = cfg(
        extra_body={"temperature": 0.1, "top_k": 5},
        sampling_overrides={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": 2},
        return_token_id_information=True,
    )
    body = to_completions_body({"temperature": 0.7, "top_p": 0.5}, config, "P")
    assert (body["temperature"], body["top_p"], body["top_k"], body["logprobs"]) == (1.0, 1.0, -1, 2)


@pytest.mark.parametrize("n", [2, 0])
def test_body_training_needs_n_1(n: int) -> None:
    err = bad_request(to_completions_body, {"n": n}, cfg(return_token_id_information=True), "P")
    assert err.param == "n"


@pytest.mark.parametrize("chat", [{}, {"n": 1}, {"n": None}])
def test_body_training_accepts_n_1_or_absent(chat: dict[str, Any]) -> None:
    body = to_completions_body(chat, cfg(return_token_id_information=True), "P")
    assert body.get("n") == chat.get("n") and body["return_token_ids"] is True and body["prompt"] == "P"


def test_body_training_checks_n_after_sampling_overrides() -> None:
    config = cfg(return_token_id_information=True, sampling_overrides={"n": 4})
    assert bad_request(to_completions_body, {}, config, "P").param == "n"


def test_body_n_above_1_passes_outside_training() -> None:
    assert to_completions_body({"n": 3}, cfg(), "P")["n"] == 3


def test_body_streams_with_usage_when_the_chat_body_streams() -> None:
    body = to_completions_body({"stream": True}, cfg(), "P")
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_body_stream_keeps_other_stream_options() -> None:
    chat = {"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    body = to_completions_body(chat, cfg(), "P")
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("chat", [{}, {"stream": False}])
def test_body_non_streaming_never_streams(chat: dict[str, Any]) -> None:
    config = cfg(extra_body={"stream": True, "stream_options": {"include_usage": True}})
    body = to_completions_body(chat, config, "P")
    assert "stream" not in body and "stream_options" not in body


def test_tokenize_body() -> None:
    assert tokenize_body({"model": "base-model", "prompt": "P"}) == {"model": "base-model", "prompt": "P"}
    completion_body = to_completions_body({}, cfg(extra_body={"add_special_tokens": False}), "P")
    assert tokenize_body(completion_body) == {
        "model": "base-model",
        "prompt": "P",
        "add_special_tokens": False,
    }


# --- reply wrapping (step 10) -----------------------------------------------------------------


def text_logprobs(ids: list[int], values: list[float], *, as_ids: bool = True) -> dict[str, Any]:
    tokens = [f"token_id:{i}" if as_ids else f"t{i}" for i in ids]
    return {
        "text_offset": list(range(len(ids))),
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)],
    }


def vllm_reply(**choice: Any) -> dict[str, Any]:
    base = {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop", "stop_reason": None}
    return {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 1700000000,
        "model": "served-model",
        "choices": [{**base, **choice}],
        "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None},
        "kv_transfer_params": None,
    }


def test_reply_wraps_choice_0_as_a_chat_completion() -> None:
    chat = to_chat_completion(vllm_reply(text="<think>r</think>Hi"), "base-model", training=False)
    assert chat == {
        "id": "cmpl-abc",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "served-model",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "<think>r</think>Hi", "tool_calls": None},
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None},
    }


def test_reply_defaults() -> None:
    before = int(time.time())
    chat = to_chat_completion({"choices": [{"text": None}]}, "base-model", training=False)
    assert chat["id"].startswith("chatcmpl-") and len(chat["id"]) == len("chatcmpl-") + 32
    assert before <= chat["created"] <= time.time()
    assert chat["model"] == "base-model"
    assert chat["usage"] is None
    (choice,) = chat["choices"]
    assert (choice["index"], choice["finish_reason"]) == (0, "stop")
    assert choice["message"] == {"role": "assistant", "content": "", "tool_calls": None}


def test_reply_keeps_finish_reason_and_index_and_uses_choice_0_only() -> None:
    reply = vllm_reply(text="a", finish_reason="length", index=0)
    reply["choices"].append({"index": 1, "text": "b", "finish_reason": "stop"})
    chat = to_chat_completion(reply, "base-model", training=False)
    assert len(chat["choices"]) == 1
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["choices"][0]["message"]["content"] == "a"


@pytest.mark.parametrize("reply", [{}, {"choices": []}, {"choices": None}, {"choices": ["x"]}, []])
def test_reply_without_choices_is_an_upstream_error(reply: Any) -> None:
    with pytest.raises(UpstreamError) as info:
        to_chat_completion(reply, "base-model", training=False)
    assert info.value.status == 502


def test_reply_logprobs_outside_training_become_chat_logprobs() -> None:
    reply = vllm_reply(logprobs=text_logprobs([5, 6], [-0.5, -1.0], as_ids=False))
    choice = to_chat_completion(reply, "base-model", training=False)["choices"][0]
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "t5",
                "logprob": -0.5,
                "bytes": None,
                "top_logprobs": [{"token": "t5", "logprob": -0.5, "bytes": None}],
            },
            {
                "token": "t6",
                "logprob": -1.0,
                "bytes": None,
                "top_logprobs": [{"token": "t6", "logprob": -1.0, "bytes": None}],
            },
        ]
    }
    assert "generation_token_ids" not in choice["message"]


def test_reply_training_inline_ids() -> None:
    reply = vllm_reply(token_ids=[11, 12], prompt_token_ids=[1, 2, 3], logprobs=text_logprobs([11, 12], [-0.25, -2]))
    choice = to_chat_completion(reply, "base-model", training=True)["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hello",
        "tool_calls": None,
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [11, 12],
        "generation_log_probs": [-0.25, -2.0],
        "routed_experts": None,
    }
    assert choice["logprobs"] is None


def test_reply_training_ids_from_logprob_tokens() -> None:
    reply = vllm_reply(prompt_token_ids=[1], logprobs=text_logprobs([42, 7], [-1.5, -0.5]))
    message = to_chat_completion(reply, "base-model", training=True)["choices"][0]["message"]
    assert message["generation_token_ids"] == [42, 7]
    assert message["generation_log_probs"] == [-1.5, -0.5]


def test_reply_training_inline_ids_win_over_logprob_tokens() -> None:
    logprobs = {"tokens": ["hello", "world"], "token_logprobs": [-1.0, -2.0]}
    message = to_chat_completion(vllm_reply(token_ids=[3, 4], logprobs=logprobs), "base-model", training=True)[
        "choices"
    ][0]["message"]
    assert message["generation_token_ids"] == [3, 4]


def test_reply_training_without_prompt_ids_leaves_them_to_tokenize() -> None:
    reply = vllm_reply(logprobs=text_logprobs([42], [-1.0]))
    message = to_chat_completion(reply, "base-model", training=True)["choices"][0]["message"]
    assert message["prompt_token_ids"] is None


def test_reply_training_zero_tokens() -> None:
    reply = vllm_reply(text="", prompt_token_ids=[1], token_ids=[], logprobs=text_logprobs([], []))
    message = to_chat_completion(reply, "base-model", training=True)["choices"][0]["message"]
    assert (message["generation_token_ids"], message["generation_log_probs"]) == ([], [])


@pytest.mark.parametrize(
    ("choice", "match"),
    [
        ({"logprobs": None}, "Cannot extract token IDs or logprobs"),
        ({"logprobs": {"tokens": ["token_id:1"], "token_logprobs": None}}, "Cannot extract token IDs or logprobs"),
        ({"logprobs": {"token_logprobs": [-1.0]}}, "neither choice.token_ids nor choice.logprobs.tokens"),
        (
            {"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}},
            r"tokens\[0\] must use the `token_id:<int>` format",
        ),
        ({"logprobs": {"tokens": [None], "token_logprobs": [-1.0]}}, r"tokens\[0\] must use"),
        ({"logprobs": {"tokens": ["token_id:1"], "token_logprobs": ["x"]}}, "numeric log probabilities"),
        ({"logprobs": {"tokens": ["token_id:1"], "token_logprobs": [True]}}, "numeric log probabilities"),
        ({"logprobs": {"tokens": ["token_id:1"], "token_logprobs": [None]}}, "numeric log probabilities"),
        ({"logprobs": {"tokens": ["token_id:1"], "token_logprobs": [-1.0, -2.0]}}, "mismatched"),
        ({"token_ids": ["1"], "logprobs": {"tokens": [], "token_logprobs": [-1.0]}}, "choice.token_ids"),
        ({"prompt_token_ids": "1 2", "logprobs": text_logprobs([1], [-1.0])}, "choice.prompt_token_ids"),
    ],
)
def test_reply_training_contract_breaks_are_upstream_errors(choice: dict[str, Any], match: str) -> None:
    with pytest.raises(UpstreamError, match=match):
        to_chat_completion(vllm_reply(**choice), "base-model", training=True)


def test_token_fields_accept_plain_integer_strings() -> None:
    # NeMo Gym strips the prefix and lets pydantic coerce, so a bare "17" is an id too.
    fields = token_fields({"logprobs": {"tokens": ["17", "token_id:0"], "token_logprobs": [-1, 0]}})
    assert fields["generation_token_ids"] == [17, 0]
    assert fields["generation_log_probs"] == [-1.0, 0.0]


def test_chat_logprobs_needs_parallel_lists() -> None:
    assert chat_logprobs(None) is None
    assert chat_logprobs({"tokens": [], "token_logprobs": [], "top_logprobs": None}) == {"content": []}
    with pytest.raises(UpstreamError):
        chat_logprobs({"tokens": ["a"], "token_logprobs": []})


# --- streaming ---------------------------------------------------------------------------------


def text_chunk(*choices: dict[str, Any], usage: Any = None, **top: Any) -> dict[str, Any]:
    base = {"id": "cmpl-s1", "object": "text_completion", "created": 1700000001, "model": "served-model"}
    return {**base, "choices": list(choices), "usage": usage, **top}


def piece(
    text: str, ids: list[int], *, first: bool = False, finish: str | None = None, index: int = 0
) -> dict[str, Any]:
    values = [-0.1 * (i + 1) for i in range(len(ids))]
    return {
        "index": index,
        "text": text,
        "logprobs": text_logprobs(ids, values),
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_token_ids": [1, 2, 3] if first else None,
        "token_ids": ids,
    }


STREAM = [
    text_chunk(piece("Hel", [10], first=True)),
    text_chunk(piece("lo", [11, 12])),
    text_chunk(piece("", [2], finish="stop")),  # EOS in a chunk of its own
    text_chunk(usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}),
]


def test_stream_first_chunk_carries_role_prompt_ids_tokens_and_logprobs() -> None:
    out = CompletionChunks("base-model").feed(STREAM[0])
    assert out == {
        "id": "cmpl-s1",
        "object": "chat.completion.chunk",
        "created": 1700000001,
        "model": "served-model",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "Hel"},
                "logprobs": {
                    "content": [
                        {
                            "token": "token_id:10",
                            "logprob": -0.1,
                            "bytes": None,
                            "top_logprobs": [{"token": "token_id:10", "logprob": -0.1, "bytes": None}],
                        }
                    ]
                },
                "finish_reason": None,
                "token_ids": [10],
            }
        ],
        "prompt_token_ids": [1, 2, 3],
        "usage": None,
    }


def test_stream_later_chunks_finish_and_usage() -> None:
    chunks = CompletionChunks("base-model")
    out = [chunks.feed(c) for c in STREAM]
    assert out[1]["choices"][0]["delta"] == {"content": "lo"}
    assert "prompt_token_ids" not in out[1]
    assert [e["token"] for e in out[1]["choices"][0]["logprobs"]["content"]] == ["token_id:11", "token_id:12"]
    assert out[2]["choices"][0]["delta"] == {}
    assert out[2]["choices"][0]["finish_reason"] == "stop"
    assert out[2]["choices"][0]["token_ids"] == [2]
    assert out[3]["choices"] == []
    assert out[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert {o["id"] for o in out} == {"cmpl-s1"}
    assert {o["object"] for o in out} == {"chat.completion.chunk"}


def test_stream_text_adds_up_to_the_non_streaming_content() -> None:
    chunks = CompletionChunks("base-model")
    text = "".join(c["delta"].get("content", "") for o in map(chunks.feed, STREAM) for c in o["choices"])
    assert text == "Hello"


def test_stream_token_fields_match_the_non_streaming_rules() -> None:
    chunks = CompletionChunks("base-model")
    for chunk in STREAM:
        chunks.feed(chunk)
    assert chunks.token_fields() == {
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [10, 11, 12, 2],
        "generation_log_probs": [-0.1, -0.1, -0.2, -0.1],
    }


def test_stream_token_fields_from_tokens_without_prompt_ids() -> None:
    chunks = CompletionChunks("base-model")
    for ids in ([10], [11]):
        choice = {"index": 0, "text": "x", "logprobs": text_logprobs(ids, [-1.0]), "finish_reason": None}
        chunks.feed(text_chunk(choice))
    assert chunks.token_fields() == {
        "prompt_token_ids": None,
        "generation_token_ids": [10, 11],
        "generation_log_probs": [-1.0, -1.0],
    }


def test_stream_token_fields_without_logprobs_is_an_upstream_error() -> None:
    chunks = CompletionChunks("base-model")
    chunks.feed(text_chunk({"index": 0, "text": "x", "logprobs": None, "finish_reason": "stop"}))
    with pytest.raises(UpstreamError, match="Cannot extract token IDs or logprobs"):
        chunks.token_fields()


def test_stream_each_choice_gets_the_role_on_its_first_chunk() -> None:
    chunks = CompletionChunks("base-model")
    first = chunks.feed(text_chunk({"index": 0, "text": "a"}, {"index": 1, "text": "b"}))
    second = chunks.feed(text_chunk({"index": 1, "text": "c"}, {"index": 0, "text": "d"}))
    assert [c["delta"] for c in first["choices"]] == [
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    assert [c["delta"] for c in second["choices"]] == [{"content": "c"}, {"content": "d"}]
    assert [c["logprobs"] for c in second["choices"]] == [None, None]
    assert "token_ids" not in second["choices"][0]


def test_stream_first_chunk_with_empty_text_still_opens_the_message() -> None:
    out = CompletionChunks("base-model").feed(text_chunk({"index": 0, "text": "", "finish_reason": None}))
    assert out["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_stream_defaults_when_the_upstream_omits_envelope_fields() -> None:
    chunks = CompletionChunks("base-model")
    first = chunks.feed({"choices": [{"index": 0, "text": "a"}]})
    second = chunks.feed({"choices": [{"index": 0, "text": "b"}]})
    assert first["id"] == second["id"] and first["id"].startswith("chatcmpl-")
    assert first["model"] == "base-model"
    assert first["created"] == second["created"] > 0
    assert "usage" not in first


def test_stream_in_band_error_passes_through() -> None:
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    assert CompletionChunks("base-model").feed(error) is error


@pytest.mark.parametrize(
    "chunk",
    [
        {"choices": "x"},
        {"choices": ["x"]},
        {"choices": [{"index": 0, "text": 5}]},
        {"choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": []}}]},
    ],
)
def test_stream_malformed_chunks_are_upstream_errors(chunk: dict[str, Any]) -> None:
    with pytest.raises(UpstreamError):
        CompletionChunks("base-model").feed(chunk)


# --- chat-template mode -----------------------------------------------------------------------


class RecordingTokenizer:
    """Stands in for a transformers tokenizer: records the apply_chat_template call."""

    chat_template = "recorded"

    def __init__(self, result: Any = "PROMPT", error: Exception | None = None) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.result = result
        self.error = error

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        self.calls.append((conversation, kwargs))
        if self.error is not None:
            raise self.error
        return self.result


def test_render_calls_the_template_as_nemo_gym_does() -> None:
    tokenizer = RecordingTokenizer()
    messages = [system("s"), user("u"), {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert ChatTemplate(tokenizer, "t").render(messages, tools, {"enable_thinking": False}) == "PROMPT"
    ((conversation, kwargs),) = tokenizer.calls
    assert conversation == messages  # unchanged
    assert kwargs == {"tokenize": False, "add_generation_prompt": True, "tools": tools, "enable_thinking": False}


def test_render_flattens_text_parts_as_vllm_does() -> None:
    tokenizer = RecordingTokenizer()
    parts = [{"type": "text", "text": "what is "}, {"type": "input_text", "text": "the weather"}]
    ChatTemplate(tokenizer, "t").render([user(parts)], None, {})
    ((conversation, _),) = tokenizer.calls
    assert conversation == [{"role": "user", "content": "what is the weather"}]


@pytest.mark.parametrize("tools", [None, []])
def test_render_passes_no_tools_as_none(tools: Any) -> None:
    tokenizer = RecordingTokenizer()
    ChatTemplate(tokenizer, "t").render([user("u")], tools, {})
    assert tokenizer.calls[0][1]["tools"] is None


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [user("u"), {"role": "assistant", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[1].content[0]",
        ),
        ([user({"type": "text"})], "messages[0].content"),
        (["not a message"], "messages[0]"),
    ],
)
def test_render_is_text_only(messages: list[Any], param: str) -> None:
    tokenizer = RecordingTokenizer()
    assert bad_request(ChatTemplate(tokenizer, "t").render, messages, None, {}).param == param
    assert tokenizer.calls == []


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "tools", "conversation"])
def test_render_refuses_kwargs_gymproxy_sets(key: str) -> None:
    err = bad_request(ChatTemplate(RecordingTokenizer(), "t").render, [user("u")], None, {key: True})
    assert err.param == "chat_template_kwargs"


def test_render_turns_a_template_refusal_into_a_bad_request() -> None:
    template = ChatTemplate(RecordingTokenizer(error=ValueError("roles must alternate")), "t")
    err = bad_request(template.render, [user("u")], None, {})
    assert err.param == "messages"
    assert "roles must alternate" in err.message


def test_render_needs_text_back() -> None:
    err = bad_request(ChatTemplate(RecordingTokenizer(result=[1, 2]), "t").render, [user("u")], None, {})
    assert err.param == "chat_template_kwargs"


def test_load_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ConfigError, match=r"pip install 'gymproxy\[template\]'"):
        ChatTemplate.load("/does/not/matter")


# transformers renders with trim_blocks (a newline right after a tag is dropped), hence the '\n' strings.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }}]{% endfor %}"
    "{% elif m.role == 'assistant' and '<think>' in m.content and not keep_thinking %}{{ m.content.split('</think>')[-1] }}"
    "{% elif m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>{% endif %}{% endif %}"
)


def save_tokenizer(directory: Path, chat_template: str | None) -> str:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
    backend.train_from_iterator(["the cat sat on the mat", "hello world", "what is the weather"], trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    return ChatTemplate.load(save_tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE))


def test_template_renders_a_single_user_turn(template: ChatTemplate) -> None:
    assert template.render([user("hello world")], None, {}) == "<|user|>hello world\n<|assistant|>"


def test_template_renders_multi_turn_tools_and_think(template: ChatTemplate) -> None:
    messages = [
        system("Be kind."),
        user([{"type": "input_text", "text": "what is "}, {"type": "text", "text": "the weather"}]),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "<think>it is sunny</think>Sunny."},
        user("thanks"),
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    assert template.render(messages, tools, {}) == (
        "<tools>weather;</tools>\n"
        "<|system|>Be kind.\n"
        "<|user|>what is the weather\n"
        "<|assistant|>[call weather]\n"
        "<|tool|>sunny\n"
        "<|assistant|>Sunny.\n"
        "<|user|>thanks\n"
        "<|assistant|>"
    )
    kept = template.render(messages[4:], None, {"keep_thinking": True, "enable_thinking": True})
    assert kept == "<|assistant|><think>it is sunny</think>Sunny.\n<|user|>thanks\n<|assistant|><think>"


def test_template_kwargs_reach_the_template(template: ChatTemplate) -> None:
    config = cfg(render_chat_template=True, chat_template_kwargs={"enable_thinking": False})
    kwargs = template_kwargs(config.chat_template_kwargs, {"chat_template_kwargs": '{"enable_thinking": true}'})
    assert template.render([user("hi")], None, kwargs) == "<|user|>hi\n<|assistant|><think>"
    assert template.render([user("hi")], None, template_kwargs(config.chat_template_kwargs, None)) == (
        "<|user|>hi\n<|assistant|>"
    )


def test_template_raise_exception_is_a_bad_request(tmp_path: Path) -> None:
    strict = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}x"
    )
    template = ChatTemplate.load(save_tokenizer(tmp_path, strict))
    assert template.render([user("u")], None, {}) == "x"
    err = bad_request(template.render, [system("s"), user("u")], None, {})
    assert "first message must be from the user" in err.message


def test_load_refuses_a_tokenizer_without_chat_template(tmp_path: Path) -> None:
    path = save_tokenizer(tmp_path, None)
    with pytest.raises(ConfigError, match="has no chat template"):
        ChatTemplate.load(path)


def test_load_reports_a_tokenizer_that_cannot_be_loaded(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        ChatTemplate.load(str(tmp_path / "missing"))
