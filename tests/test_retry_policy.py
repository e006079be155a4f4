"""The retry and hold policy alone (`retry.Attempts.decide`): no sockets, no clock.

test_retries.py drives the same rules through real sockets; here each rule is one decision.
"""

from __future__ import annotations

import pytest

from gymproxy.config import Retries
from gymproxy.http1 import ConnectTimeout
from gymproxy.retry import (
    ABANDON,
    ANSWER,
    FAIL,
    GIVE_UP,
    HERE,
    HOLD,
    KEEP,
    MOVE,
    PROBE,
    RESENT,
    STILL_UP,
    Attempts,
    abort_resend,
    failure_kind,
)

BUDGET = Retries(attempts=3, deadline_s=30.0, backoff_s=0.25, backoff_max_s=4.0)


def attempts(*, single: bool = False, hold_s: float = 300.0) -> Attempts:
    return Attempts(BUDGET, single, 0.0, hold_s)


def test_a_paused_engine_holds_the_request_for_itself_and_never_feeds_its_breaker():
    tries = attempts()
    for now in (0.0, 1.0, 299.0):
        decision = tries.decide("a", "paused", fleet=4, now=now)
        assert (decision.action, decision.breaker) == (HOLD, ABANDON)
        assert tries.here and tries.tried == [] and tries.sends == 0  # the same engine, nothing spent
    # Past the hold deadline, vLLM's own 503 goes to the client.
    assert tries.decide("a", "paused", fleet=4, now=300.0).action == ANSWER


def test_a_single_upstream_is_held_too():
    assert attempts(single=True).decide("a", "paused", fleet=1, now=0.0).action == HOLD


def test_a_busy_engine_moves_the_request_and_feeds_one_breaker_failure():
    tries = attempts()
    first = tries.decide("a", "busy", fleet=3, now=0.0)
    assert (first.action, first.breaker) == (MOVE, FAIL) and tries.reason == "busy"
    second = tries.decide("b", "busy", fleet=3, now=0.0)
    assert (second.action, second.breaker) == (MOVE, ABANDON)  # a request feeds one breaker at most
    third = tries.decide("c", "busy", fleet=3, now=0.0)
    assert third.action == ANSWER  # the budget is spent: vLLM's 503 is the answer


def test_a_refused_connection_moves_and_gives_up_when_every_upstream_refused():
    tries = attempts()
    assert tries.decide("a", "refused", fleet=2, now=0.0).action == MOVE
    assert tries.reason == "down"
    assert tries.decide("b", "refused", fleet=2, now=0.0).action == GIVE_UP


def test_a_connect_timeout_while_the_upstream_takes_others_stays_there_and_never_feeds_its_breaker():
    """`crowded`: the upstream took another connection meanwhile (a burst gymproxy sent it, such as
    a resume's): it is up. The request goes to it again, within the budget; the breaker hears nothing."""
    tries = attempts()
    for _ in range(BUDGET.attempts - 1):
        decision = tries.decide("a", "crowded", fleet=2, now=0.0)
        assert (decision.action, decision.breaker) == (HERE, ABANDON) and tries.here and tries.tried == []
    assert tries.decide("a", "crowded", fleet=2, now=0.0) == (GIVE_UP, ABANDON, 0.0, "")
    assert attempts().decide("a", "crowded", fleet=2, now=31.0).action == GIVE_UP  # past retries.deadline_s
    assert failure_kind(ConnectTimeout("busy accepting", crowded=True)) == "crowded"
    assert failure_kind(ConnectTimeout("no answer")) == "connect_timeout"


def test_a_stale_pooled_connection_goes_once_to_the_same_upstream_on_a_new_one():
    tries = attempts()
    decision = tries.decide("a", "stale", fleet=2, now=0.0)
    assert (decision.action, decision.breaker) == (HERE, KEEP) and tries.fresh
    assert tries.decide("a", "stale", fleet=2, now=0.0).action == PROBE  # the second is a drop


def test_a_stale_close_by_an_upstream_known_to_be_gone_moves_at_once():
    # A launched replica whose process exited closes its pooled connections just as an idle close
    # does; its port may be anyone's now, so the request goes to the next upstream, not there again.
    tries = attempts()
    decision = tries.decide("a", "stale", fleet=2, now=0.0, gone=True)
    assert (decision.action, decision.breaker) == (MOVE, FAIL) and tries.resent and not tries.retried_here
    assert attempts(single=True).decide("a", "stale", fleet=1, now=0.0, gone=True).action == GIVE_UP


@pytest.mark.parametrize("kind", ["closed", "reset"])
def test_a_drop_by_an_upstream_still_up_is_not_handed_to_another(kind):
    tries = attempts()
    assert tries.decide("a", kind, fleet=2, now=0.0).action == PROBE
    decision = tries.decide("a", kind, fleet=2, now=0.0, gone=False)
    assert (decision.action, decision.breaker, decision.why) == (GIVE_UP, ABANDON, STILL_UP)


def test_a_drop_by_an_upstream_that_is_gone_moves_once():
    tries = attempts()
    decision = tries.decide("a", "reset", fleet=3, now=0.0, gone=True)
    assert (decision.action, decision.breaker) == (MOVE, FAIL) and tries.resent
    again = tries.decide("b", "reset", fleet=3, now=0.0, gone=True)
    assert (again.action, again.why) == (GIVE_UP, RESENT)


def test_a_full_upstream_moves_at_once_until_every_one_is_full():
    tries = attempts()
    decision = tries.decide("a", "full", fleet=2, now=0.0)
    assert (decision.action, decision.wait, decision.breaker) == (MOVE, 0.0, ABANDON)
    assert tries.decide("b", "full", fleet=2, now=0.0).action == GIVE_UP


def test_retry_after_is_waited_and_the_deadline_ends_the_retries():
    tries = attempts()
    assert tries.decide("a", "busy", fleet=3, now=0.0, retry_after=2.0).wait == 2.0
    assert tries.decide("b", "busy", fleet=3, now=29.0, retry_after=2.0).action == ANSWER  # past 30 s


def test_a_reply_a_pause_cut_is_sent_again_a_few_times_within_the_hold():
    assert abort_resend(0, now=0.0, hold_until=300.0)
    assert not abort_resend(3, now=0.0, hold_until=300.0)
    assert not abort_resend(0, now=300.0, hold_until=300.0)
