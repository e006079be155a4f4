"""Tests for gymproxy.overflow: every vLLM context-length wording, both envelopes, and look-alikes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gymproxy.overflow import is_context_overflow, upstream_message

# Real vLLM messages, by era (see spec/wire-facts.md sections 0 and A.4).
OVERFLOW_MESSAGES = {
    # <= 0.10.0, no max_tokens and the prompt alone is too long (note the comma before "Please")
    "requested_in_messages": "This model's maximum context length is 32768 tokens. However, you requested "
    "32818 tokens in the messages, Please reduce the length of the messages.",
    # <= 0.10.0, prompt + max_tokens too long
    "messages_and_completion": "This model's maximum context length is 4096 tokens. However, you requested "
    "4196 tokens (3196 in the messages, 1000 in the completion). Please reduce the length of the messages "
    "or completion.",
    # 0.10.2 - 0.14
    "request_has_input_tokens": "This model's maximum context length is 4096 tokens. However, your request "
    "has 9691 input tokens. Please reduce the length of the input messages.",
    "max_tokens_too_large": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
    "context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).",
    # 0.15.0rc2 bug: the reported limit is L - M
    "wrong_limit": "This model's maximum context length is 3 tokens. However, your request has 8 input tokens. "
    "Please reduce the length of the input messages.",
    # renderer era (~0.15/0.16)
    "you_passed_tokens": "You passed 70000 input tokens and requested 1000 output tokens. However, the model's "
    "context length is only 65536 tokens, resulting in a maximum input length of 64536 tokens. Please reduce "
    "the length of the input prompt.",
    "you_passed_characters": "You passed 500000 input characters and requested 1000 output tokens. However, the "
    "model's context length is only 65536 tokens, resulting in a maximum input length of 64536 tokens (at most "
    "451752 characters). Please reduce the length of the input prompt.",
    # after vllm#36197
    "prompt_contains": "This model's maximum context length is 4096 tokens. However, you requested 1000 output "
    "tokens and your prompt contains 3500 input tokens, for a total of 4500 tokens. Please reduce the length of "
    "the input prompt or the number of requested output tokens.",
    "prompt_contains_at_least": "This model's maximum context length is 4096 tokens. However, you requested 1000 "
    "output tokens and your prompt contains at least 3097 input tokens, for a total of at least 4097 tokens. "
    "Please reduce the length of the input prompt or the number of requested output tokens.",
    "prompt_contains_characters": "This model's maximum context length is 4096 tokens. However, you requested "
    "1000 output tokens and your prompt contains 50000 characters (more than 24576 characters, which is the "
    "upper bound for 3096 input tokens). Please reduce the length of the input prompt or the number of "
    "requested output tokens.",
    # observed on vLLM 0.32
    "at_least_without_output": "This model's maximum context length is 512 tokens. However, your prompt "
    "contains at least 513 input tokens, which exceeds this limit even without any output tokens. Please "
    "reduce the length of the input prompt.",
    "max_tokens_got_0": "max_tokens must be at least 1, got 0",  # 0.32: a prompt of exactly L tokens
    "max_tokens_got_0_period": "max_tokens must be at least 1, got 0.",
    "max_tokens_got_negative": "max_tokens must be at least 1, got -186.",  # <= 0.4, Mistral in 0.9.2
}

# Other servers' wordings, and the bare phrase (spec/nemo-gym-behavior.md, deliberate difference 2).
PEER_OVERFLOW_MESSAGES = {
    "bare_phrase": "Input exceeds the maximum context length.",
    "sglang_input_longer": "The input (10009 tokens) is longer than the model's context length (8192 tokens).",
    "sglang_total": "Requested token count exceeds the model's maximum context length of 64000 tokens. You "
    "requested a total of 71897 tokens: 7897 tokens from the input messages and 64000 tokens for the "
    "completion. Please reduce the number of tokens in the input messages or the completion to fit within "
    "the limit.",
    "trtllm_pytorch": "The sum of prompt length (72417.0), query length (0) should not exceed max_num_tokens (69632)",
    "trtllm_tensorrt": "The sum of prompt length (4000) and query length (0) max_tokens (2048) should not exceed "
    "max_seq_len (4096)",
    "openai_chat": "This model's maximum context length is 128000 tokens. However, your messages resulted in "
    "130500 tokens. Please reduce the length of the messages.",
    "openai_responses": "Your input exceeds the context window of this model. Please adjust your input and try again.",
}

SUFFIXES = {
    "bare": "",
    "none": " None",  # f"{e} {e.__cause__}" in <= 0.10.x
    "parameter": " (parameter=input_tokens, value=513)",  # VLLMValidationError in later builds
}

NOT_OVERFLOW_MESSAGES = {
    # The request alone asks for more output than max_model_len: the client must fix it.
    "max_tokens_above_model_len": "max_tokens=1000 cannot be greater than max_model_len=512. Please request "
    "fewer output tokens. (parameter=max_tokens, value=1000)",
    "renderer_max_completion_tokens": "max_completion_tokens=131072 cannot be greater than "
    "max_model_len=max_total_tokens=65536. Please request fewer output tokens.",
    "renderer_missing_space": "max_tokens=131072cannot be greater than max_total_tokens=max_total_tokens=65536. "
    "Please request fewer output tokens.",
    # Other 400s that mention max_tokens or the context
    "max_tokens_integer": "max_tokens must be an integer",
    "max_tokens_invalid": "Invalid value for max_tokens: 'abc'",
    "max_tokens_positive": "max_tokens must be at least 1, got 5.",
    "max_tokens_fraction": "max_tokens must be at least 1, got 0.5.",
    "max_tokens_negative_fraction": "max_tokens must be at least 1, got -0.5.",
    "pydantic": "[{'type': 'int_parsing', 'loc': ('body', 'max_tokens'), 'msg': 'Input should be a valid "
    "integer', 'input': 'x'}]",
    "truncate": "truncate_prompt_tokens value (9000) is greater than max_model_len (4096). Please request a "
    "smaller truncation size.",
    "context_word": "The context field is not supported; maximum length of a stop string is 64 tokens.",
    "model": "The model `gpt-4` does not exist.",
    "template": "Chat template error: the context length of this template is unknown",
    "json": "Expecting value: line 1 column 1 (char 0)",
    # Peer servers' 400s about other limits
    "trtllm_other": "The sum of prompt length (10) and query length (0) should be positive",
    "payload_size": "Input exceeds the maximum length of 1048576 characters.",
    "context_window_word": "The context window option is not supported by this model.",
}


def _flat(message: str, param: Any = None) -> bytes:
    return orjson.dumps({"object": "error", "message": message, "type": "BadRequestError", "param": param, "code": 400})


def _nested(message: str, param: Any = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}})


ENVELOPES = {"flat": _flat, "nested": _nested}


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("wording", OVERFLOW_MESSAGES)
def test_every_overflow_wording(wording: str, envelope: str, suffix: str) -> None:
    # param stays null here, so only the wording (or the message suffix) can decide.
    body = ENVELOPES[envelope](OVERFLOW_MESSAGES[wording] + SUFFIXES[suffix])
    assert is_context_overflow(400, body)


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("wording", PEER_OVERFLOW_MESSAGES)
def test_peer_servers_overflow_wordings(wording: str, envelope: str) -> None:
    assert is_context_overflow(400, ENVELOPES[envelope](PEER_OVERFLOW_MESSAGES[wording]))
    assert is_context_overflow(400, PEER_OVERFLOW_MESSAGES[wording].encode())


def test_openai_overflow_code_counts_whatever_the_wording() -> None:
    body = orjson.dumps(
        {
            "error": {
                "message": "Request too big for this model.",
                "type": "invalid_request_error",
                "param": "input",
                "code": "context_length_exceeded",
            }
        }
    )
    assert is_context_overflow(400, body)
    assert not is_context_overflow(429, body)
    assert not is_context_overflow(400, body.replace(b"context_length_exceeded", b"rate_limit_exceeded"))


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("wording", NOT_OVERFLOW_MESSAGES)
def test_look_alikes_are_not_overflow(wording: str, envelope: str) -> None:
    assert not is_context_overflow(400, ENVELOPES[envelope](NOT_OVERFLOW_MESSAGES[wording]))


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize(
    "wording", ["max_tokens_above_model_len", "renderer_max_completion_tokens", "renderer_missing_space"]
)
@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens", "input_tokens"])
def test_too_many_output_tokens_is_never_overflow(envelope: str, wording: str, param: str) -> None:
    """Even a `param` naming the input does not turn a bad max_tokens into an overflow."""
    assert not is_context_overflow(400, ENVELOPES[envelope](NOT_OVERFLOW_MESSAGES[wording], param))


def test_observed_vllm_0_32_body() -> None:
    body = (
        b'{"error":{"message":"This model\'s maximum context length is 512 tokens. However, your prompt contains '
        b"at least 513 input tokens, which exceeds this limit even without any output tokens. Please reduce the "
        b'length of the input prompt. (parameter=input_tokens, value=513)","type":"BadRequestError",'
        b'"param":"input_tokens","code":400}}'
    )
    assert is_context_overflow(400, body)
    assert not is_context_overflow(500, body)


@pytest.mark.parametrize("status", [200, 401, 404, 413, 422, 429, 500, 502, 503])
@pytest.mark.parametrize("envelope", ENVELOPES)
def test_only_status_400_counts(status: int, envelope: str) -> None:
    body = ENVELOPES[envelope](OVERFLOW_MESSAGES["request_has_input_tokens"], "input_tokens")
    assert is_context_overflow(400, body)
    assert not is_context_overflow(status, body)


# --- the `param` signal ---


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("param", ["input_tokens", "input_text"])
def test_input_param_with_unknown_wording_is_overflow(envelope: str, param: str) -> None:
    body = ENVELOPES[envelope]("The prompt is far too long for this deployment.", param)
    assert is_context_overflow(400, body)


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("param", [None, "max_tokens", "messages", "input", 7, ["input_tokens"], {"a": 1}])
def test_other_params_with_unknown_wording_are_not(envelope: str, param: Any) -> None:
    body = ENVELOPES[envelope]("The prompt is far too long for this deployment.", param)
    assert not is_context_overflow(400, body)


@pytest.mark.parametrize("suffix", [" (parameter=input_tokens, value=9)", " (parameter=input_text, value=9000)"])
def test_input_parameter_suffix_with_null_param_is_overflow(suffix: str) -> None:
    assert is_context_overflow(400, _nested("Some future wording." + suffix))
    assert not is_context_overflow(400, _nested("Some future wording. (parameter=max_tokens, value=9)"))


# --- bodies that are not a JSON error envelope ---


def test_plain_text_overflow_counts() -> None:
    """Decision: a non-JSON body is judged by its text, e.g. a message relayed by another proxy."""
    for message in OVERFLOW_MESSAGES.values():
        assert is_context_overflow(400, message.encode())


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"Bad Request",
        b"<html><body><h1>400 Bad Request</h1>max_tokens</body></html>",
        NOT_OVERFLOW_MESSAGES["max_tokens_above_model_len"].encode(),
        b"\xff\xfe\x00garbage \xc3",
        b"null",
        b"[]",
        b"42",
        b'{"detail": "Not Found"}',
        b'{"error": null, "message": null}',
    ],
)
def test_other_bodies_are_not_overflow(body: bytes) -> None:
    assert not is_context_overflow(400, body)


@pytest.mark.parametrize(
    "body",
    [
        # truncated JSON: judged as text
        _nested(OVERFLOW_MESSAGES["request_has_input_tokens"])[:-20],
        # JSON without a known envelope
        orjson.dumps({"detail": OVERFLOW_MESSAGES["you_passed_tokens"]}),
        # a JSON string, and the `{"error": "..."}` shape some servers use
        orjson.dumps(OVERFLOW_MESSAGES["prompt_contains"]),
        orjson.dumps({"error": OVERFLOW_MESSAGES["prompt_contains"]}),
        # invalid UTF-8 around the message
        b"\xff\xfe " + OVERFLOW_MESSAGES["max_tokens_got_0"].encode(),
    ],
)
def test_other_shapes_carrying_an_overflow_message(body: bytes) -> None:
    assert is_context_overflow(400, body)


def test_envelope_message_wins_over_the_rest_of_the_body() -> None:
    body = orjson.dumps(
        {"error": {"message": "Invalid request", "param": None}, "hint": OVERFLOW_MESSAGES["wrong_limit"]}
    )
    assert not is_context_overflow(400, body)


# --- upstream_message ---


@pytest.mark.parametrize("envelope", ENVELOPES)
def test_upstream_message_from_either_envelope(envelope: str) -> None:
    message = OVERFLOW_MESSAGES["max_tokens_too_large"] + " None"
    assert upstream_message(ENVELOPES[envelope](message, "max_tokens")) == message


def test_upstream_message_keeps_a_long_envelope_message_whole() -> None:
    message = "x" * 2000
    assert upstream_message(_nested(message)) == message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"Internal Server Error", "Internal Server Error"),
        (b"upstream connect error\n", "upstream connect error"),
        (b'"a JSON string"', "a JSON string"),
        (b'{"error": "plain error string"}', "plain error string"),
        (b'{"message": "flat without object"}', "flat without object"),
        (b'{"object":"error","message":', '{"object":"error","message":'),  # invalid JSON: the text
        (b'{"detail": "Not Found"}', '{"detail": "Not Found"}'),  # no envelope: the text
        (b'{"error": {"message": ""}}', '{"error": {"message": ""}}'),  # empty message: the text
        (b'{"error": {"message": 42}}', '{"error": {"message": 42}}'),
        (b"[1, 2]", "[1, 2]"),
        (b"caf\xc3\xa9 \xff\xfe", "caf\u00e9 \ufffd\ufffd"),  # non-UTF-8 bytes are replaced
        (b"", ""),
    ],
)
def test_upstream_message_other_bodies(body: bytes, expected: str) -> None:
    assert upstream_message(body) == expected


def test_upstream_message_cuts_text_to_500_characters() -> None:
    assert upstream_message(b"a" * 10_000) == "a" * 500
    assert upstream_message("\u00e9".encode() * 1000) == "\u00e9" * 500  # characters, not bytes
    assert upstream_message("\U0001f600".encode() * 1000) == "\U0001f600" * 500
