"""What `POST /v1/responses` takes in: the body decoded into a `ResponsesRequest`, and what is
dropped on the way, each kind said once in the log (once per gymproxy instance, so once per
process under `gymproxy serve`; never once per request).

- Every field of the Responses API's request is understood (`schemas.responses.ResponsesRequest`);
  a top-level field outside that set is a 400 naming it (a typo is the client's mistake), or with
  `unknown_fields: drop` is dropped.
- Hosted tools (`web_search`, `mcp`, `shell`, ..., and tool types not known yet) have no chat form:
  they are dropped from `tools`, so neither vLLM nor the Response's echo has them.

What becomes of each accepted field (sent to vLLM, not sent, refused) is `convert/request.py`'s.
A body that decodes at once costs one decode plus a look at `tools`; only a body with an unknown
field or tool type is decoded a second time.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Final

import msgspec
import orjson

from .errors import BadRequest, from_validation
from .schemas.responses import REQUEST_DECODER, TOOL_TYPES, HostedTool, ResponsesRequest

log = logging.getLogger("gymproxy")

FIELDS: Final = frozenset(ResponsesRequest.__struct_encode_fields__)
HINT: Final = "; vLLM sampling extras go in metadata.extra_body (a JSON string)"
MAX_WARNED: Final = 256  # distinct names warned about; past it (a client sending junk), no more

# msgspec's message for a tool whose `type` none of the tool Structs carries.
_UNKNOWN_TOOL = re.compile(r"^Invalid value .* - at `\$\.tools\[\d+\]\.type`$")


class RequestReader:
    """Decodes `/v1/responses` bodies under one config's `unknown_fields` rule; warns once per kind."""

    def __init__(self, *, drop_unknown_fields: bool = False) -> None:
        self.drop_unknown_fields = drop_unknown_fields
        self._warned: set[tuple[str, str]] = set()  # (message, name) pairs logged

    def decode(self, raw: bytes) -> ResponsesRequest:
        """The request, or the 400 naming what is wrong with it."""
        try:
            req = REQUEST_DECODER.decode(raw)
        except msgspec.DecodeError as exc:  # a ValidationError too
            req = self._decode_again(raw, exc)
        tools = req.tools
        if tools:
            for tool in tools:
                if isinstance(tool, HostedTool):
                    req.tools = self._without_hosted(tools)
                    break
        return req

    def _decode_again(self, raw: bytes, exc: msgspec.DecodeError) -> ResponsesRequest:
        """A body with tools of unknown types (dropped) or, when dropping, unknown fields: decoded
        again without them. Any other error is the 400 it names."""
        error = _bad_request(exc)
        unknown_tool = isinstance(exc, msgspec.ValidationError) and _UNKNOWN_TOOL.search(str(exc)) is not None
        if not (unknown_tool or (self.drop_unknown_fields and _unknown_field(error))):
            raise error from exc
        try:
            body = orjson.loads(raw)  # a JSON object (msgspec got as far as its members)
        except orjson.JSONDecodeError:  # past orjson's limits (a 65-bit integer, deep nesting)
            raise error from exc
        if self.drop_unknown_fields:
            for name in [name for name in body if name not in FIELDS]:
                del body[name]
                self._warn(
                    "dropping the unknown top-level field %r from /v1/responses requests (unknown_fields: drop)", name
                )
        tools = body.get("tools")
        if isinstance(tools, list):
            body["tools"] = [tool for tool in tools if not self._unknown_tool(tool)]
        try:
            return REQUEST_DECODER.decode(orjson.dumps(body))
        except msgspec.DecodeError as again:
            raise _bad_request(again) from again

    def _unknown_tool(self, tool: Any) -> bool:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str) or kind in TOOL_TYPES:
            return False
        self._warn_tool(kind)
        return True

    def _without_hosted(self, tools: list[Any]) -> list[Any]:
        kept = []
        for tool in tools:
            if isinstance(tool, HostedTool):
                self._warn_tool(tool.kind)
            else:
                kept.append(tool)
        return kept

    def _warn_tool(self, kind: str) -> None:
        self._warn("dropping %r tools from /v1/responses requests: they have no Chat Completions form", kind)

    def _warn(self, message: str, name: str) -> None:
        """Log `message` once for `name` (a field's or a tool type's)."""
        key = (message, name)
        if key not in self._warned and len(self._warned) < MAX_WARNED:
            self._warned.add(key)
            log.warning(message + " (said once)", name)


def _unknown_field(error: BadRequest) -> bool:
    """Whether the 400 is for an unknown top-level field (its `param` is the field's name)."""
    param = error.param
    return "unknown field" in error.message and param is not None and "." not in param and "[" not in param


def _bad_request(exc: msgspec.DecodeError) -> BadRequest:
    error = from_validation(exc)
    if _unknown_field(error):
        error.message += HINT
    return error
