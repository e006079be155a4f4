"""gymproxy's errors, each rendered as an OpenAI error body `{"error": {message, type, param, code}}`
(or in another API's envelope, when its route says so: `render(..., envelope)`).

GymproxyError                   500 server_error
├── AnswerLocally               (no error: the exchange answers with an empty reply, its finish reason)
│   └── ContextOverflow         "length": vLLM's context-length 400
├── BadRequest                  400 invalid_request_error   (the client's request is wrong)
│   ├── PayloadTooLarge         413 invalid_request_error
│   └── BodyTimeout             408 invalid_request_error   (the body stopped arriving)
├── Unauthorized                401 invalid_request_error   (no valid inbound API key)
├── Forbidden                   403 invalid_request_error   (refused by config: `access.admin_fleet_changes`)
├── NotFound                    404 invalid_request_error   (no such upstream, on the admin routes)
├── Conflict                    409 invalid_request_error   (an upstream of that name exists)
├── LoopDetected                508 server_error            (the request came back to a gymproxy it went through)
├── UpstreamStatus              <upstream status>           (vLLM answered with an error)
├── UpstreamError               502 upstream_error          (vLLM is unreachable or broke the protocol)
│   ├── NotConnected            502 upstream_error          (the connection never opened: safe to retry)
│   └── UpstreamTimeout         504 upstream_error
└── Unavailable                 503 upstream_error          (and: gymproxy is shutting down)
    ├── NoUpstream              (every upstream is down)
    │   └── NotReady            (none is ready yet: launched replicas loading or restarting; with Retry-After)
    ├── Saturated               (an upstream is at its in-flight cap and `when_full` is `reject`)
    └── HoldOver                (held for a paused fleet or engine past `hold.*`; with Retry-After)
        └── HoldFull            (not held: too many are; the connection is closed too)

Handlers raise; `render` turns what they raise into a response. No traceback or Python repr ever reaches a client.
A request aiohttp itself cannot parse is answered by aiohttp (400, 431); `MalformedRequests` keeps its
log to one short line (`quiet_malformed_requests`), since any client can send such requests.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("gymproxy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Envelope = Callable[["GymproxyError"], bytes]  # an error as the body of another API's error response


class GymproxyError(Exception):
    """Base: a failure of gymproxy itself (500)."""

    status = 500
    type = "server_error"
    code: str | int | None = None
    retry_after: int | None = None  # seconds, sent as `Retry-After`

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return msgspec.json.encode(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


class AnswerLocally(GymproxyError):
    """Not a failure: the request is answered without (more of) vLLM, with an empty reply.

    The exchange catches it and answers in the client's format (a chat completion or a Response,
    whole or streamed) with `finish_reason`; it never reaches `render`.
    """

    def __init__(self, finish_reason: str, message: str = "answered locally") -> None:
        super().__init__(message)
        self.finish_reason = finish_reason


class ContextOverflow(AnswerLocally):
    """vLLM refused the prompt as longer than the model's context: an empty `length` answer."""

    def __init__(self) -> None:
        super().__init__("length", "the prompt is over the model's context length")


class BadRequest(GymproxyError):
    """The request cannot be served as sent; `param` names the offending field."""

    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    """The request body is over `max_body_size`, or holds more JSON values than `limits.max_json_values`."""

    status = 413


class BodyTimeout(BadRequest):
    """The client stopped sending its request body (`limits.client_body_timeout`)."""

    status = 408
    code = "request_timeout"


class Unauthorized(GymproxyError):
    """The request carries no valid `Authorization: Bearer <key>` (401)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(GymproxyError):
    """The configuration refuses this request whoever sends it (403)."""

    status = 403
    type = "invalid_request_error"
    code = "forbidden"


class NotFound(GymproxyError):
    """What the request names does not exist (404)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Conflict(GymproxyError):
    """What the request would create exists already (409)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class LoopDetected(GymproxyError):
    """The request carries this gymproxy's own hop id (or came through too many): an upstream URL leads back (508)."""

    status = 508
    code = "loop_detected"


class UpstreamStatus(GymproxyError):
    """The upstream answered with an HTTP error: keep its status and carry its message.

    With `raw`, the upstream's own body is sent as it is (a propagated context overflow).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        raw: bytes | None = None,
    ) -> None:
        super().__init__(message, param=param)
        self.status = status
        self.type = type or ("invalid_request_error" if status < 500 else "upstream_error")
        self.code = status
        self.raw = raw

    def body(self) -> bytes:
        return self.raw if self.raw is not None else super().body()


class UpstreamError(GymproxyError):
    """The upstream could not be reached or sent something that is not a valid reply (502)."""

    status = 502
    type = "upstream_error"


class NotConnected(UpstreamError):
    """The connection to the upstream could not be opened: the request was never sent."""


class UpstreamTimeout(UpstreamError):
    """The upstream did not answer in time (504)."""

    status = 504


class Unavailable(GymproxyError):
    """gymproxy cannot serve the request now; a retry (later, or elsewhere) may succeed (503)."""

    status = 503
    type = "upstream_error"


class NoUpstream(Unavailable):
    """No healthy upstream is left to serve the request."""


class NotReady(NoUpstream):
    """Every upstream is one whose owner says it is not serving yet (vLLM replicas gymproxy launched,
    loading or restarting): the message names each and why; a retry later may succeed."""

    code = "not_ready"
    retry_after = 5


class Saturated(Unavailable):
    """The upstream is at its configured concurrency cap and `when_full` is `reject`."""


class HoldOver(Unavailable):
    """A request held while the fleet or its engine is paused (a weight update) waited too long, or
    too many are held already (`hold.*`): a retry in a moment may succeed."""

    code = "paused"
    retry_after = 1


class HoldFull(HoldOver):
    """Not held at all: too many requests are held already. Its connection is closed after the 503,
    so the requests turned away keep no connection open while the held ones do."""


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


def describe(exc: BaseException) -> str:
    """An exception for a message: gymproxy's own by its message, others by type and text."""
    if isinstance(exc, GymproxyError):
        return exc.message
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def render(exc: Exception, request: web.Request, envelope: Envelope | None = None) -> web.Response:
    """Any error a handler raised, as an error response (OpenAI's body, or `envelope`'s); aiohttp's own
    HTTP exceptions go on."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        exc = PayloadTooLarge(exc.text or "request body too large", param=None)
    if isinstance(exc, GymproxyError):
        response = error_response(exc, envelope)
        if isinstance(exc, PayloadTooLarge | BodyTimeout):
            _end_connection(request, response)  # the rest of the body may still come
        elif isinstance(exc, HoldFull):
            response.force_close()  # connections are what a full hold is short of
        return response
    if isinstance(exc, web.HTTPException):
        raise exc
    if isinstance(exc, RecursionError):  # only client JSON nests deep enough to exhaust the stack
        return error_response(BadRequest("the request body is nested too deeply"), envelope)
    # A bug in gymproxy: log it whole, tell the client only that it happened.
    log.error("unhandled error in %s %s", request.method, request.path, exc_info=exc)
    return error_response(GymproxyError("internal error in gymproxy (see its log)"), envelope)


def _end_connection(request: web.Request, response: web.Response) -> None:
    """A body refused before its end: the connection ends after `response` (`Connection: close`),
    and what more of the body arrives is dropped as it comes, never parsed. aiohttp would read it
    to its end first (its lingering close), inflating a compressed one on the event loop in one go;
    its lingering still waits (up to 10 s) for the client to stop sending, so the client can read
    the error before the connection closes."""
    response.force_close()
    request.protocol.close()


def error_response(exc: GymproxyError, envelope: Envelope | None = None) -> web.Response:
    body = exc.body() if envelope is None else envelope(exc)
    response = web.Response(body=body, status=exc.status, content_type="application/json")
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


class MalformedRequests(logging.Filter):
    """For `aiohttp.server`: a request it could not parse (a bad request line, header or body framing)
    is logged as one line, at INFO at most once every `every` seconds and at DEBUG otherwise, instead
    of aiohttp's ERROR and traceback for each one, with which any client could fill the disk."""

    def __init__(self, every: float = 60.0) -> None:
        super().__init__()
        self.every = every
        self.last = -every
        self.quiet = 0  # lines at DEBUG since the last one at INFO

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError | RequestPayloadError):
            return True  # anything else (a bug) keeps its traceback
        args = record.args if isinstance(record.args, tuple) else ()
        remote = args[0] if args and "%s" in str(record.msg) else "a client"
        if isinstance(exc, RequestPayloadError) and exc.__cause__ is not None:
            exc = exc.__cause__  # the body could not be read: why, as the parser said
        lines = [line.strip() for line in (getattr(exc, "message", "") or str(exc)).splitlines() if line.strip()]
        why = lines[0].rstrip(":")[:200] if lines else type(exc).__name__
        record.exc_info = record.exc_text = record.stack_info = None
        record.msg, record.args = "malformed request from %s refused: %s", (remote, why)
        now = time.monotonic()
        if record.levelno >= logging.INFO and now - self.last >= self.every:
            since = f", {self.quiet} since the last such line" if self.quiet else ""
            record.msg += f" (more within {self.every:g} s are logged at DEBUG{since})"
            self.last, self.quiet = now, 0
            record.levelno, record.levelname = logging.INFO, "INFO"
            return True
        self.quiet += 1
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_malformed_requests() -> None:
    """Install `MalformedRequests` on aiohttp's server logger (once)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in logger.filters):
        logger.addFilter(MalformedRequests())
