"""Responses streaming events (wire-facts B.2): one Struct per payload shape, `type` first.

Every event carries `sequence_number`; `encode_event` frames one as `event: <type>` plus its JSON
`data:` line, so the event name and the payload's `type` cannot disagree. `DeltaFrames` writes
the four `*.delta` events (one per streamed token) straight to bytes, identical to their Structs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import ENCODER
from .responses import OutputItem, OutputText, Refusal, Response, SummaryText


class Event(msgspec.Struct):
    """Base: every field is encoded (the SDK's event models require them all)."""


class ResponseEvent(Event):
    type: str
    sequence_number: int
    response: Response


class ItemEvent(Event):
    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | Refusal


class TextDelta(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class TextDone(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class RefusalDelta(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class RefusalDone(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    refusal: str


class SummaryPartEvent(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class SummaryDelta(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    delta: str


class SummaryDone(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    text: str


class ArgumentsDelta(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(Event):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


def encode_event(event: Event) -> bytes:
    """One SSE frame: `event: <type>\\ndata: <json>\\n\\n`."""
    kind: str = event.type  # type: ignore[attr-defined]  # every concrete event has one
    return b"event: " + kind.encode() + b"\ndata: " + ENCODER.encode(event) + b"\n\n"


# The delta events, sent once per streamed token: the index field after output_index, and the object's end.
_DELTA_FRAMES = {
    kind: (b'event: %s\ndata: {"type":"%s","sequence_number":' % (kind.encode(), kind.encode()), index, end)
    for kind, index, end in (
        ("response.output_text.delta", b',"content_index":%d', b',"logprobs":[]}'),
        ("response.refusal.delta", b',"content_index":%d', b"}"),
        ("response.reasoning_summary_text.delta", b',"summary_index":%d', b"}"),
        ("response.function_call_arguments.delta", b"", b"}"),
    )
}


class DeltaFrames:
    """The frames of one part's delta events, sent once per streamed token.

    Everything but the sequence number and the delta is fixed for a part, so it is encoded once;
    each frame is byte for byte what `encode_event` makes of the event's Struct.
    """

    __slots__ = ("_head", "_middle", "_end")

    def __init__(self, kind: str, item_id: str, output_index: int, index: int) -> None:
        head, index_field, end = _DELTA_FRAMES[kind]
        self._head = head
        self._middle = b"".join(
            (
                b',"item_id":',
                ENCODER.encode(item_id),
                b',"output_index":%d' % output_index,
                index_field % index if index_field else b"",
                b',"delta":',
            )
        )
        self._end = end + b"\n\n"

    def frame(self, sequence_number: int, delta: str) -> bytes:
        return b"".join((self._head, b"%d" % sequence_number, self._middle, ENCODER.encode(delta), self._end))
