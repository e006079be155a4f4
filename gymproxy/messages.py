"""Anthropic's Messages API, relayed: what gymproxy reads and changes on `/v1/messages` and
`/v1/messages/count_tokens`, and how it says its own errors there.

vLLM serves the Messages API itself (`vllm/entrypoints/anthropic`), so gymproxy converts nothing
(but a captured call, `convert.anthropic`, whose tokens that endpoint does not return): the route relays the request to the session's upstream as every relayed route does (pinned, failed
over before a byte is sent, a stream passed on chunk by chunk and any other reply read whole
first, the generation aborted when the client leaves). On top of that:

- `prepare` checks that the body is one JSON object, and with `model` configured makes it the
  body's top-level `model` (Claude Code asks for Claude models that vLLM does not serve). A body
  whose first key is `model`, as the SDKs write it, is edited in place; any other is re-encoded
  with its other members copied as they are (never decoded). It also returns `metadata.user_id`,
  the Messages API's `user`, which may key the session, and whether the body asks for a stream.
- `upstream_headers`: the client's `anthropic-*` headers (`anthropic-version`, `anthropic-beta`)
  go upstream, if they are printable ASCII and at most `MAX_FORWARDED` of them with
  `MAX_FORWARDED_BYTES` in all (else a 400 naming the header); its `x-api-key`, like its
  `Authorization`, does not.
- `error_body` renders gymproxy's own errors in Anthropic's envelope
  `{"type": "error", "error": {"type", "message"}}`, and `stream_error` ends a relayed stream that
  broke with an `error` event, as Anthropic's own streams end; `upstream_error` says a captured
  call's chat error as vLLM's Anthropic endpoint says it.

vLLM's answers, its errors included (a context overflow is its own 400), pass as vLLM sent them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, Final, NamedTuple

import msgspec

from .errors import BadRequest, GymproxyError, UpstreamStatus
from .overflow import error_fields, status_error
from .schemas import ENCODER

FORWARDED_PREFIX: Final = "anthropic-"
# Claude Code sends two (`anthropic-version`, `anthropic-beta` with a few hundred bytes of betas). The
# bound keeps a request's head well within what an upstream takes (a head it refuses would read as
# a failure of the upstream, not of the request).
MAX_FORWARDED: Final = 32
MAX_FORWARDED_BYTES: Final = 8192  # names and values

# Anthropic's error types by status (its API docs, "HTTP errors"); other 4xx are invalid_request_error.
ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",  # gymproxy has no upstream to give, or is shutting down: retry later
    529: "overloaded_error",
}

# The body's first key is `model` with a string value: its span can be replaced without a parse.
_FIRST_MODEL: Final = re.compile(
    rb'\A[ \t\r\n]*\{[ \t\r\n]*"model"[ \t\r\n]*:[ \t\r\n]*(?P<value>"[^"\\]*(?:\\.[^"\\]*)*")'
)


class _View(msgspec.Struct):
    """The fields gymproxy reads; decoding it checks the whole body's JSON without building it."""

    model: Any = None
    metadata: Any = None
    stream: Any = None


class Prepared(NamedTuple):
    """A Messages body as it goes upstream, and what gymproxy read of it."""

    body: bytes
    user_id: str | None  # `metadata.user_id`, the Messages API's `user`
    stream: bool  # the client asked for an event stream


_VIEW: Final = msgspec.json.Decoder(_View)
# The body's top-level members, their values left as they are (skipped over, never built).
_MEMBERS: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])


def prepare(raw: bytes, model: str | None) -> Prepared:
    """The body to send upstream (its top-level `model` set to `model`, when given), the body's
    `metadata.user_id` and whether it asks for a stream. Raises `BadRequest` when the body is not
    one JSON object."""
    body = raw
    if model is not None and (match := _FIRST_MODEL.match(raw)) is not None:
        value = ENCODER.encode(model)
        if match["value"] != value:
            parts = memoryview(raw)  # joined from views: one copy of the body, not three
            body = b"".join((parts[: match.start("value")], value, parts[match.end("value") :]))
    view: _View = _decode(_VIEW.decode, body)
    if model is not None and view.model != model:
        # The first key was not `model`, or a later duplicate wins in vLLM's parser: re-encode, the
        # other members' values copied as they are.
        members: dict[str, Any] = _decode(_MEMBERS.decode, raw)
        members["model"] = msgspec.Raw(ENCODER.encode(model))
        body = ENCODER.encode(members)
    metadata = view.metadata
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    return Prepared(body, user_id if isinstance(user_id, str) and user_id else None, view.stream is True)


def _decode(decode: Callable[[bytes], Any], body: bytes) -> Any:
    try:
        decoded = decode(body)
    except msgspec.ValidationError as exc:  # the top level is not an object
        raise BadRequest("The request body must be a JSON object") from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from exc
    if isinstance(decoded, _View | dict):
        return decoded
    raise BadRequest("The request body must be a JSON object")


def upstream_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The client's `anthropic-*` headers, each once (a repeated one's values joined by commas).
    Raises `BadRequest` for a value that is not printable ASCII, or past the bounds above."""
    forwarded: dict[str, str] = {}
    count = size = 0
    for name, value in headers:
        key = name.lower()
        if not key.startswith(FORWARDED_PREFIX):
            continue
        count += 1
        size += len(name) + len(value)
        if count > MAX_FORWARDED or size > MAX_FORWARDED_BYTES:
            raise BadRequest(
                f"the request's {FORWARDED_PREFIX}* headers are over the limit of {MAX_FORWARDED} headers "
                f"or {MAX_FORWARDED_BYTES} bytes (at {name[:100]})",
                param=key[:100],
            )
        if not (value.isascii() and value.isprintable()):
            raise BadRequest(f"header {name[:100]} must be printable ASCII", param=key[:100])
        forwarded[key] = f"{forwarded[key]},{value}" if key in forwarded else value
    return forwarded


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def envelope(kind: str, message: str) -> bytes:
    """An error in Anthropic's envelope."""
    return ENCODER.encode({"type": "error", "error": {"type": kind, "message": message}})


def error_body(exc: GymproxyError) -> bytes:
    """gymproxy's error in Anthropic's envelope (an upstream's own error body stays as it was)."""
    if isinstance(exc, UpstreamStatus) and exc.raw is not None:
        return exc.raw
    return envelope(error_type(exc.status), exc.message)


def upstream_error(status: int, payload: bytes) -> UpstreamStatus:
    """vLLM's chat API's error (a captured call's) as vLLM's Anthropic endpoint answers it
    (`translate_error_response`): its status, and its error's own type and message in the envelope."""
    error = status_error(status, payload)
    kind = error_fields(payload)[2]
    error.raw = envelope(kind if isinstance(kind, str) else error_type(status), error.message)
    return error


def stream_error(exc: GymproxyError) -> bytes:
    """The `error` event that ends a Messages stream gymproxy could not finish."""
    return b"event: error\ndata: " + error_body(exc) + b"\n\n"
