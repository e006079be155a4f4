"""Wire schemas as msgspec Structs: the Responses API (`responses`) and Chat Completions (`chat`).

Request Structs track presence with `UNSET`, because only fields the client sent may be
forwarded. Reply Structs encode every declared field, nulls included, as the OpenAI SDK does.
"""

from __future__ import annotations

from typing import Final

import msgspec

ENCODER: Final = msgspec.json.Encoder()


class Wire(msgspec.Struct, omit_defaults=True):
    """Base for request-side wire objects: a field left `UNSET` stays absent on encode."""


class Strict(msgspec.Struct, forbid_unknown_fields=True):
    """Base for request objects where an unknown key is the client's mistake (a 400).

    Some of them are echoed back in the Response, so they encode every field, nulls included.
    """


class Reply(msgspec.Struct):
    """Base for objects gymproxy sends back: every declared field is encoded, nulls included."""
