"""gymproxy's errors, each rendered as an OpenAI error body `{"error": {message, type, param, code}}`.

GymproxyError                   500 server_error
├── BadRequest                  400 invalid_request_error   (the client's request is wrong)
│   └── PayloadTooLarge         413 invalid_request_error
├── Unauthorized                401 invalid_request_error   (no valid inbound API key)
├── UpstreamStatus              <upstream status>           (vLLM answered with an error)
├── UpstreamError               502 upstream_error          (vLLM is unreachable or broke the protocol)
│   └── UpstreamTimeout         504 upstream_error
└── NoUpstream                  503 upstream_error          (every upstream is marked down)

Handlers raise; `render` turns what they raise into a response. No traceback or Python repr ever reaches a client.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

log = logging.getLogger("gymproxy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class GymproxyError(Exception):
    """Base: a failure of gymproxy itself (500)."""

    status = 500
    type = "server_error"
    code: str | int | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return msgspec.json.encode(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


class BadRequest(GymproxyError):
    """The request cannot be served as sent; `param` names the offending field."""

    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    """The request body is over `max_body_size`."""

    status = 413


class Unauthorized(GymproxyError):
    """The request carries no valid `Authorization: Bearer <key>` (401)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class UpstreamStatus(GymproxyError):
    """The upstream answered with an HTTP error: keep its status and carry its message."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message, param=param)
        self.status = status
        self.type = type or ("invalid_request_error" if status < 500 else "upstream_error")
        self.code = status


class UpstreamError(GymproxyError):
    """The upstream could not be reached or sent something that is not a valid reply (502)."""

    status = 502
    type = "upstream_error"


class UpstreamTimeout(UpstreamError):
    """The upstream did not answer in time (504)."""

    status = 504


class NoUpstream(GymproxyError):
    """No healthy upstream is left to serve the request (503)."""

    status = 503
    type = "upstream_error"


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"(?:unknown|missing required) field `([^`]*)`")


def from_validation(exc: msgspec.DecodeError, prefix: str = "") -> BadRequest:
    """Turn msgspec's message (``Expected `str`, got `int` - at `$.input[0].role` ``) into a 400."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):  # malformed JSON, not a schema mismatch
        return BadRequest(f"The request body is not valid JSON: {text}")
    match = _PATH.search(text)
    # msgspec writes a mapping's value as `[...]`: name the mapping itself.
    path = (prefix + match.group(1)).replace("[...]", "") if match else prefix.rstrip(".")
    if match:
        text = text[: match.start()]
    unknown = _UNKNOWN.search(text)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    if len(text) > 300 or len(path) > 300:  # the client's own (possibly huge) key, echoed: keep it short
        text, path = text[:300] + "...", path[:300] + "..."
    return BadRequest(f"{text} at `{path}`" if path and not unknown else text, param=path or None)


def render(exc: Exception, request: web.Request) -> web.Response:
    """Any error a handler raised, as an OpenAI error response; aiohttp's own HTTP exceptions go on."""
    if isinstance(exc, GymproxyError):
        return error_response(exc)
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return error_response(PayloadTooLarge(exc.text or "request body too large", param=None))
    if isinstance(exc, web.HTTPException):
        raise exc
    if isinstance(exc, RecursionError):  # only client JSON nests deep enough to exhaust the stack
        return error_response(BadRequest("the request body is nested too deeply"))
    # A bug in gymproxy: log it whole, tell the client only that it happened.
    log.error("unhandled error in %s %s", request.method, request.path, exc_info=exc)
    return error_response(GymproxyError("internal error in gymproxy (see its log)"))


def error_response(exc: GymproxyError) -> web.Response:
    return web.Response(body=exc.body(), status=exc.status, content_type="application/json")
