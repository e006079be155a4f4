"""`rollouts.trajectory.rebuild`: calls into segments with loss masks, side calls apart, and the
breaks where a harness rewrote its history."""

from __future__ import annotations

import random

from gymproxy.rollouts.record import Call, Rollout
from gymproxy.rollouts.trajectory import WINDOW, _common_prefix, rebuild, view


def call(seq: int, prompt: list[int] | None, generated: list[int] | None, logprobs: list[float] | None = None) -> Call:
    if logprobs is None and generated is not None:
        logprobs = [-0.01 * (i + 1) for i in range(len(generated))]
    return Call(
        rollout_id="r",
        call_id=f"c{seq}",
        route="responses",
        started=0.0,
        seq=seq,
        outcome="ok" if generated is not None else "error",
        prompt_token_ids=prompt,
        generation_token_ids=generated,
        generation_log_probs=logprobs,
    )


def chain(turns: int, rng: random.Random) -> list[Call]:
    """A harness's main chain: each prompt is the last prompt + generation + some tool tokens."""
    calls, tokens = [], [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
    for seq in range(1, turns + 1):
        generated = [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
        calls.append(call(seq, list(tokens), generated))
        tokens = tokens + generated + [rng.randrange(1000) for _ in range(rng.randrange(0, 9))]
    return calls


def test_a_chain_of_calls_is_one_segment_masking_exactly_what_was_generated() -> None:
    calls = [
        call(1, [1, 2, 3], [10, 11]),
        call(2, [1, 2, 3, 10, 11, 50, 51], [12]),
        call(3, [1, 2, 3, 10, 11, 50, 51, 12, 60], [13, 14, 15]),
    ]
    (segment,) = rebuild(calls).segments
    assert segment.calls == [1, 2, 3]
    assert segment.token_ids == [1, 2, 3, 10, 11, 50, 51, 12, 60, 13, 14, 15]
    assert segment.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert segment.logprobs == [0, 0, 0, -0.01, -0.02, 0, 0, -0.01, 0, -0.01, -0.02, -0.03]


def test_side_calls_form_their_own_segments_and_the_chain_goes_on() -> None:
    calls = [
        call(1, [1, 2, 3], [10]),
        call(2, [90, 91], [92]),  # a title: its own system prompt
        call(3, [1, 2, 3, 10, 4], [11]),
        call(4, [80], [81, 82]),
        call(5, [1, 2, 3, 10, 4, 11, 5], [12]),
    ]
    trajectory = rebuild(calls)
    assert [s.calls for s in trajectory.segments] == [[1, 3, 5], [2], [4]]
    assert trajectory.breaks == []


def test_a_compaction_is_a_break_at_the_first_differing_token() -> None:
    system = list(range(100, 140))
    calls = [
        call(1, [*system, 1, 2], [10, 11]),
        call(2, [*system, 1, 2, 10, 11, 3], [12]),
        call(3, [*system, 7, 7, 7], [13]),  # the history summarised
        call(4, [*system, 7, 7, 7, 13, 8], [14]),
    ]
    trajectory = rebuild(calls)
    assert [s.calls for s in trajectory.segments] == [[1, 2], [3, 4]]
    (cut,) = trajectory.breaks
    assert (cut.call, cut.segment, cut.position) == (3, 0, 40)
    assert cut.expected_start == 40 - WINDOW
    assert cut.expected == [*system[-WINDOW:], 1, 2, 10, 11, 3, 12]
    assert cut.got == [*system[-WINDOW:], 7, 7, 7]


def test_a_re_rendered_tool_call_breaks_in_the_middle() -> None:
    first = call(1, list(range(50)), [60, 61, 62, 63])
    rendered = [*range(50), 60, 99, 62, 63, 70]  # the harness re-rendered one token of the call
    trajectory = rebuild([first, call(2, rendered, [71])])
    (cut,) = trajectory.breaks
    assert (cut.call, cut.position) == (2, 51)
    assert cut.expected[WINDOW] == 61 and cut.got[WINDOW] == 99
    assert len(trajectory.segments) == 2


def test_calls_without_ids_join_no_segment_and_an_empty_rollout_has_none() -> None:
    trajectory = rebuild([call(1, [1], [2]), call(2, None, None), call(3, [1, 2, 3], [])])
    (segment,) = trajectory.segments
    assert segment.calls == [1, 3] and segment.loss_mask == [0, 1, 0]
    assert rebuild([]).segments == [] and rebuild([]).breaks == []


def test_missing_or_short_log_probs_keep_the_mask_right() -> None:
    (segment,) = rebuild([call(1, [1], [2, 3, 4], logprobs=[-0.5])]).segments
    assert segment.loss_mask == [0, 1, 1, 1] and segment.logprobs == [0.0, -0.5, 0.0, 0.0]
    (segment,) = rebuild(
        [
            Call(
                rollout_id="r",
                call_id="x",
                route="chat",
                started=0,
                seq=1,
                prompt_token_ids=[1],
                generation_token_ids=[2],
            )
        ]
    ).segments
    assert segment.logprobs == [0.0, 0.0]


def test_random_chains_with_side_calls_mask_every_generated_token_once() -> None:
    rng = random.Random(7)
    for _ in range(200):
        main = chain(rng.randrange(1, 12), rng)
        sides = [call(0, [5000 + rng.randrange(100)], [rng.randrange(1000)]) for _ in range(rng.randrange(0, 3))]
        calls = list(main)
        for side in sides:
            calls.insert(rng.randrange(len(calls) + 1), side)
        for seq, c in enumerate(calls, 1):
            c.seq = seq
        trajectory = rebuild(calls)
        assert trajectory.breaks == []
        (segment,) = [s for s in trajectory.segments if len(s.calls) == len(main) and s.calls[0] == main[0].seq]
        generated = [t for t, m in zip(segment.token_ids, segment.loss_mask, strict=True) if m]
        assert generated == [t for c in main for t in c.generation_token_ids or []]
        assert sum(segment.loss_mask) == sum(len(c.generation_token_ids or []) for c in main)
        masked = [lp for lp, m in zip(segment.logprobs, segment.loss_mask, strict=True) if m]
        assert masked == [lp for c in main for lp in c.generation_log_probs or []]


def test_the_common_prefix_is_exact() -> None:
    rng = random.Random(3)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert _common_prefix(a, b) == n


def test_the_view_has_every_call_field_and_the_trajectory() -> None:
    rollout = Rollout(rollout_id="r", created=1.0, updated=2.0, calls=[call(1, [1], [2]), call(2, [1, 2, 3], [4])])
    shown = view(rollout)
    assert shown["complete"] is True and shown["state"] == "open"
    assert set(shown["calls"][0]) >= {"seq", "route", "outcome", "finish_reason", "prompt_token_ids", "usage"}
    assert [s.calls for s in shown["segments"]] == [[1, 2]]
