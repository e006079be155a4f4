"""Recognising the "the prompt does not fit in the context" 400 of vLLM (every version) and its peers.

vLLM has worded this error at least five ways and used two JSON envelopes (flat
`{"object":"error","message",...}` up to 0.10.0, nested `{"error":{"message",...}}` since 0.10.1);
SGLang, TensorRT-LLM and OpenAI have wordings of their own (OpenAI also sets `code` to
`context_length_exceeded`).
`is_context_overflow` reads the message from either envelope and decides by its wording, with
regexes compiled once, plus the `param` vLLM sets to `input_tokens`/`input_text` on newer
releases; it never matches a loose substring such as "max_tokens", which would swallow unrelated
400s. `upstream_message` extracts the message for an error gymproxy passes on. Both are pure
functions over the status and body bytes.
"""

from __future__ import annotations

import re
from typing import Final

import orjson

from .errors import UpstreamStatus

MAX_TEXT_CHARS: Final = 500

# Each alternative is one family of real wordings, vLLM's first (L = max_model_len, N = prompt
# tokens, M = requested output tokens). Messages may carry a trailing " None" (<= 0.10.x) or
# " (parameter=input_tokens, value=N)" (later builds); nothing here is anchored at the end.
_OVERFLOW: Final = re.compile(
    "|".join(
        (
            # "This model's maximum context length is L tokens. However, ..." in every era:
            #   <= 0.10.0  "... you requested N tokens in the messages, Please reduce ..."
            #              "... you requested N+M tokens (N in the messages, M in the completion). ..."
            #   0.10.2+    "... your request has N input tokens. Please reduce ..."
            #              "'max_tokens' or 'max_completion_tokens' is too large: M. This model's maximum
            #               context length is L tokens and your request has N input tokens (M > L - N)."
            #   #36197+    "... you requested M output tokens and your prompt contains [at least] N input
            #               tokens, for a total of ..." / "... your prompt contains C characters (more than
            #               X characters, ..." / 0.32: "... your prompt contains at least N input tokens,
            #               which exceeds this limit even without any output tokens. ..."
            # The bare phrase also covers other servers and proxies, e.g. SGLang's "Requested token
            # count exceeds the model's maximum context length of L tokens. You requested a total of ...".
            r"maximum context length",
            # Renderer era (~0.15/0.16): "You passed N input tokens|characters and requested M output
            # tokens. However, the model's context length is only L tokens, ..."
            r"context length is only \d+ tokens",
            # vLLM derived max_tokens = L - N itself and it came out below 1: the prompt fills the whole
            # context (0.32, exactly L tokens: "got 0") or more (<= 0.4 and Mistral in 0.9: "got -186").
            # A client that itself sends max_tokens=0 or below gets the same words; that rare misuse
            # is accepted as a false positive.
            r"max_tokens must be at least 1, got (?:0|-\d+)(?!\.?\d)",
            # SGLang (and Together): "The input (N tokens) is longer than the model's context length
            # (L tokens)."
            r"is longer than the model's context length",
            # TensorRT-LLM's trtllm-serve, PyTorch backend: "The sum of prompt length (N), query length (Q)
            # should not exceed max_num_tokens (K)"; TensorRT backend: "The sum of prompt length (N) and
            # query length (Q) max_tokens (M) should not exceed max_seq_len (K)".
            r"prompt length \(\d+(?:\.\d+)?\).{0,80}should not exceed max_(?:num_tokens|seq_len)",
            # OpenAI's Responses API: "Your input exceeds the context window of this model. ..."
            r"exceeds the context window",
        )
    )
)
# OpenAI (and servers copying its envelope) name the overflow in `code`.
_OVERFLOW_CODE: Final = "context_length_exceeded"

# "max_tokens=1000 cannot be greater than max_model_len=512. Please request fewer output tokens."
# and the renderer's "max_completion_tokens=131072 cannot be greater than
# max_model_len=max_total_tokens=65536 ...": the request alone asks for more output than the model
# can ever produce, whatever the prompt. That is a bad request the client must fix, not a prompt
# that outgrew the context, so it is never an overflow, even if `param` claims otherwise. (Unlike
# "'max_tokens' ... is too large: M. This model's maximum context length is L tokens and your
# request has N input tokens", where M alone would fit and the prompt used up the rest.)
_TOO_MANY_OUTPUT_TOKENS: Final = re.compile(r"\d+ ?cannot be greater than max_(?:model_len|total_tokens)\b")

# vLLM names the offending input on overflow: `param` in the body, or in the message suffix of
# builds that leave `param` null.
_INPUT_PARAMS: Final = frozenset(("input_tokens", "input_text"))
_INPUT_PARAM_SUFFIX: Final = re.compile(r"\(parameter=input_(?:tokens|text)\b")


def is_context_overflow(status: int, body: bytes) -> bool:
    """True if an upstream error reply says the prompt does not fit in the model's context.

    Only HTTP 400 qualifies. A body that is not a JSON error envelope is judged by its text (the
    first 500 characters), so a plain-text overflow message, e.g. relayed by another proxy, counts.
    """
    if status != 400:
        return False
    message, param, _, code = error_fields(body)
    if message is None:
        message = _text(body)
    if _TOO_MANY_OUTPUT_TOKENS.search(message):
        return False
    if _OVERFLOW.search(message) or code == _OVERFLOW_CODE:
        return True
    if isinstance(param, str) and param in _INPUT_PARAMS:
        return True
    return _INPUT_PARAM_SUFFIX.search(message) is not None


def upstream_message(body: bytes) -> str:
    """The error message from either vLLM envelope, else the body text cut to 500 characters."""
    message = error_fields(body)[0]
    return _text(body) if message is None else message


def status_error(status: int, body: bytes) -> UpstreamStatus:
    """An upstream error reply as the error gymproxy raises: its status, message, param and type."""
    message, param, kind, _ = error_fields(body)
    return UpstreamStatus(
        status,
        (_text(body) if message is None else message) or f"the upstream answered HTTP {status}",
        param=param if isinstance(param, str) else None,
        type=kind if isinstance(kind, str) else None,
    )


def error_fields(body: bytes) -> tuple[str | None, object, object, object]:
    """(message, param, type, code) from `{"error": {...}}`, `{"error": "..."}`, a flat envelope or a JSON string.

    The message is None when the body is not JSON or holds no non-empty string message.
    """
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None, None, None
    if isinstance(payload, str):
        return payload or None, None, None, None
    if not isinstance(payload, dict):
        return None, None, None, None
    error = payload.get("error")
    if isinstance(error, str):
        return error or None, None, None, None
    fields = error if isinstance(error, dict) else payload
    message = fields.get("message")
    text = message if isinstance(message, str) and message else None
    return text, fields.get("param"), fields.get("type"), fields.get("code")


def _text(body: bytes) -> str:
    # No character takes more than 4 bytes in UTF-8, so this slice still holds 500 characters.
    return body[: 4 * MAX_TEXT_CHARS].decode("utf-8", errors="replace")[:MAX_TEXT_CHARS].strip()
