"""Responses streaming events (wire-facts B.2): one Struct per payload shape, `type` first.

Every event carries `sequence_number`; `encode_event` frames one as `event: <type>` plus its JSON
`data:` line, so the event name and the payload's `type` cannot disagree.
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
    return b"event: " + event.type.encode() + b"\ndata: " + ENCODER.encode(event) + b"\n\n"  # type: ignore[attr-defined]
