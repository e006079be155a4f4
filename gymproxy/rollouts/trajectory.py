"""A rollout's calls rebuilt into trainable trajectories: `rebuild` and the `view` of
`GET /v1/rollouts/{id}`.

Calls are taken in `seq` order; a call without both prompt and generation ids (in flight, failed)
joins no segment. A call *extends* a segment when its prompt ids begin with the segment's tokens
(the previous call's prompt + generation): the harness sent back what was generated and added
tool results or a user turn after it. Every open segment is tried, the most recently extended
first, so a harness's side calls (a title, a summary), whose prompts extend nothing, make segments
of their own while the main chain goes on extending its own.

A call that extends nothing starts a new segment. When it shares at least half of the shorter
sequence with the best-matching segment (`REWRITE_SHARE`), the harness rewrote that history
(compaction, a re-rendered tool call, a reasoning block dropped): a `Break` says which call, the
first differing position and the token windows around it, and the old segment is closed, so the
chain goes on in the new one. A side call shares little (its own system prompt): no break.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, TypeVar

import msgspec

from .record import Call, Rollout, log_probs

T = TypeVar("T")

REWRITE_SHARE: Final = 0.5  # of the shorter sequence, in common: a rewrite, not a side call
WINDOW: Final = 8  # tokens each side of a break's position


class Segment(msgspec.Struct):
    """Calls that form one token sequence; `loss_mask` is 1 on tokens vLLM generated."""

    calls: list[int]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]


class Break(msgspec.Struct):
    """Where a call's prompt stopped extending `segment`: the first differing token index, and the
    windows of both sequences from `expected_start`."""

    call: int
    segment: int
    position: int
    expected_start: int
    expected: list[int]
    got: list[int]


class Trajectory(msgspec.Struct):
    segments: list[Segment]
    breaks: list[Break]


def rebuild(calls: Sequence[Call]) -> Trajectory:
    """The segments and breaks of a rollout's calls (see the module docstring)."""
    segments: list[Segment] = []
    breaks: list[Break] = []
    open_order: list[int] = []  # indexes of open segments, the most recently extended last
    for call in sorted(calls, key=lambda c: c.seq):
        prompt, generated = _read(call.prompt_token_ids), _read(call.generation_token_ids)
        if prompt is None or generated is None:
            continue
        logprobs = _aligned(log_probs(call.generation_log_probs), len(generated))
        extended = None
        for index in reversed(open_order):
            tokens = segments[index].token_ids
            if len(prompt) >= len(tokens) and prompt[: len(tokens)] == tokens:
                extended = index
                break
        if extended is not None:
            segment = segments[extended]
            added = len(prompt) - len(segment.token_ids)
            segment.calls.append(call.seq)
            segment.token_ids = prompt + generated
            segment.loss_mask += [0] * added + [1] * len(generated)
            segment.logprobs += [0.0] * added + logprobs
            open_order.remove(extended)
            open_order.append(extended)
            continue
        rewritten = _rewritten(segments, open_order, prompt)
        if rewritten is not None:
            index, position = rewritten
            old = segments[index].token_ids
            start = max(0, position - WINDOW)
            breaks.append(
                Break(
                    call.seq, index, position, start, old[start : position + WINDOW], prompt[start : position + WINDOW]
                )
            )
            open_order.remove(index)
        segments.append(
            Segment(
                [call.seq],
                prompt + generated,
                [0] * len(prompt) + [1] * len(generated),
                [0.0] * len(prompt) + logprobs,
            )
        )
        open_order.append(len(segments) - 1)
    return Trajectory(segments, breaks)


def view(rollout: Rollout) -> dict[str, Any]:
    """What `GET /v1/rollouts/{id}` answers: the rollout, its calls, and its trajectory."""
    trajectory = rebuild(rollout.calls)
    return {
        "rollout_id": rollout.rollout_id,
        "object": "rollout",
        "state": rollout.state,
        "complete": rollout.complete,
        "created": rollout.created,
        "updated": rollout.updated,
        "frozen_at": rollout.frozen_at,
        "refused": rollout.refused,
        "calls": [_call(call) for call in rollout.calls],
        "segments": trajectory.segments,
        "breaks": trajectory.breaks,
    }


CALL_FIELDS: Final = tuple(Call.__struct_fields__)


def _call(call: Call) -> dict[str, Any]:
    """A call with every field, nulls included (a reader need not guess which are absent)."""
    return {name: getattr(call, name) for name in CALL_FIELDS}


def _read(value: list[T] | msgspec.Raw | None) -> list[T] | None:
    """A call's token field as read back from a store (a list; `Raw` only in a record not yet written)."""
    return value if isinstance(value, list) else None


def _aligned(logprobs: list[float], n: int) -> list[float]:
    """A call's log probs, one per generated token (0.0 where vLLM gave none)."""
    return logprobs[:n] + [0.0] * max(0, n - len(logprobs))


def _rewritten(segments: list[Segment], open_order: list[int], prompt: list[int]) -> tuple[int, int] | None:
    """The open segment `prompt` rewrote, and the first differing position; None for a side call."""
    best: tuple[int, int] | None = None
    for index in open_order:
        common = _common_prefix(segments[index].token_ids, prompt)
        if best is None or common > best[1]:
            best = (index, common)
    if best is None:
        return None
    index, common = best
    shorter = min(len(segments[index].token_ids), len(prompt))
    return best if shorter and common >= REWRITE_SHARE * shorter else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the common prefix, by bisection over slice comparisons (C speed, not a Python loop)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
