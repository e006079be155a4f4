"""What capture records: one `Call` per model call, and a rollout as a store gives it back.

A call is written twice: when it starts (`outcome` "in_flight", no tokens yet) and when it ends,
under the same `call_id`. A rollout's calls are numbered in the order they started (`seq`, from 1:
`numbered`), whichever process recorded them, ties in the order their first records were written. A rollout is "open" until it is frozen; a frozen rollout never changes again: a
call that starts after the freeze is refused (and counted in `refused`), and the end of a call
that was in flight at the freeze is dropped, so the snapshot keeps it "in_flight".
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

Outcome = Literal["in_flight", "ok", "error", "cut", "overflow"]
State = Literal["open", "frozen"]

FAILED: Final = frozenset({"in_flight", "error", "cut"})  # a rollout holding one is not complete


class LogProb(msgspec.Struct):
    """One of vLLM's `logprobs.content` entries, as capture stores it (its other fields are skipped)."""

    logprob: float


class Call(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One model call of a rollout, as recorded."""

    rollout_id: str
    call_id: str  # unique (ids.hex32()); the start and the end of a call share it
    route: str  # "responses", "chat" or "messages": the client's API
    stream: bool = False
    started: float  # unix time the call arrived
    seq: int = 0  # given by the store (1, 2, ...); 0 until stored
    ended: float | None = None  # unix time the client's answer ended
    outcome: Outcome = "in_flight"
    upstream: str | None = None  # the fleet's name of the engine
    weight_version: str | None = None  # as X-Weight-Version says it (comma-separated when it changed)
    finish_reason: str | None = None
    error: str | None = None  # what went wrong, when outcome is "error" or "cut"
    usage: dict[str, Any] | None = None  # vLLM's usage object
    # The tokens as vLLM returned them. Capture keeps them as the JSON vLLM sent (`msgspec.Raw`, written
    # to the store as they are, never parsed on the request path): the ids, and for the log probs
    # vLLM's `logprobs.content` entries; a call read back (`decode_call`) has lists of numbers.
    prompt_token_ids: list[int] | msgspec.Raw | None = None
    generation_token_ids: list[int] | msgspec.Raw | None = None
    generation_log_probs: list[float | LogProb] | msgspec.Raw | None = None
    request: dict[str, Any] | None = None  # `capture.record_requests`: messages and tools as sent to vLLM


# How a store writes a call and reads it back: JSON, so the tokens capture kept as JSON go as they are.
encode_call: Final = msgspec.json.Encoder().encode
_DECODER: Final = msgspec.json.Decoder(Call)


def decode_call(data: bytes) -> Call:
    """A call as a store wrote it, its log probs as numbers."""
    call = _DECODER.decode(data)
    if isinstance(call.generation_log_probs, list):
        call.generation_log_probs = [*log_probs(call.generation_log_probs)]
    return call


def log_probs(values: list[float | LogProb] | msgspec.Raw | None) -> list[float]:
    """A call's log probs as numbers (none while they are still the JSON capture kept)."""
    if not isinstance(values, list):
        return []
    return [value.logprob if isinstance(value, LogProb) else value for value in values]


class Rollout(msgspec.Struct, kw_only=True):
    """A rollout as a store gives it back: its calls in `seq` order."""

    rollout_id: str
    state: State = "open"
    created: float  # unix time of its first call's start
    updated: float  # unix time of its last write
    frozen_at: float | None = None
    refused: int = 0  # calls refused because it was frozen
    calls: list[Call] = []

    @property
    def complete(self) -> bool:
        """No call failed, was cut or is still in flight."""
        return all(call.outcome not in FAILED for call in self.calls)


class Summary(msgspec.Struct, kw_only=True):
    """A rollout in a listing: no calls."""

    rollout_id: str
    state: State
    created: float
    updated: float
    calls: int
    complete: bool


def numbered(calls: list[Call]) -> list[Call]:
    """`calls` (in the order their first records were written) sorted by when they started, and
    numbered from 1: a worker's batch may reach the store after a later call's from another."""
    calls.sort(key=lambda call: call.started)  # stable: ties keep the written order
    for seq, call in enumerate(calls, 1):
        call.seq = seq
    return calls
