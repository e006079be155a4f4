"""What a request does after a failed send: the retry and hold policy, as a pure decision.

`Attempts.decide` is told what happened to the last send (a `failure_kind` or a `busy_kind`) and
answers what next (`Decision`): send again to the same upstream, move to the session's next, hold
until the engine resumes, probe whether the upstream is gone, hand vLLM's own answer to the
client, or give up. It opens no socket and reads no clock (the caller passes `now`), so each rule
is tested alone (tests/test_retry_policy.py); `Fleet.send` carries the decisions out.

- A connect timeout while the upstream took other connections (`crowded`: it waited behind a burst,
  such as the requests a resume released) goes to the same upstream again, within
  `retries.attempts` and `retries.deadline_s`, and never feeds its breaker: the upstream is up.
- What no upstream began moves to the next upstream: a refused connection or connect timeout,
  vLLM's busy 503 (the round starts again once every upstream was busy), an upstream at its cap;
  within `retries.attempts` sends and `retries.deadline_s`, backing off when the same kind of
  failure repeats.
- vLLM's paused 503 (a weight update: the trainer paused the engine, through gymproxy or not) is
  held for the same engine until it resumes, then sent there again, for up to `hold.timeout_s`
  from the first hold: the pin stays, no budget is spent, and the breaker is not fed (it is no
  failure: the engine is fine, and every engine of the fleet pauses at once).
- What an upstream dropped after it was written (`DROPPED`: closed or reset before a reply byte)
  may have been read, and may be what made it drop. A pooled connection closed so goes once to the
  same upstream on a new connection (the upstream's idle close may have crossed it), unless the
  upstream is known to be gone (a launched replica whose process exited: its port may be anyone's
  now, and its closing connections look just like idle closes); a drop moves
  to the next upstream once per request at most, and only when the one that dropped it is gone
  (the fleet probes its /health: an upstream killed mid-request drops its pooled connections and
  resets the new one). An upstream still up chose to drop that input (a query of death): it is not
  handed one more engine to kill, and, as for its 500s, its breaker is not fed. So a request
  reaches two upstreams at most after drops (the first one twice at most).
- A request feeds one breaker failure at most, its first: however many upstreams it tries, one
  request can never open more than one breaker.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from .config import Retries
from .http1 import CannotConnect, ClientError, ConnectTimeout, NoReply, Reply

HERE = "here"  # the same upstream again, on a new connection, at once
MOVE = "move"  # the session's next upstream (after `wait`)
HOLD = "hold"  # the same upstream once it resumes from its pause
PROBE = "probe"  # ask whether the upstream is gone, then decide again with `gone`
ANSWER = "answer"  # hand vLLM's own answer (its 503 and Retry-After) to the client
GIVE_UP = "give_up"  # the client hears the failure

# What the upstream's breaker makes of a failure: a failure counted, the half-open probe let go
# without a verdict (`Breaker.abandon`), or nothing (the same upstream is tried again at once).
FAIL, ABANDON, KEEP = "fail", "abandon", "keep"

DROPPED = frozenset({"stale", "closed", "reset"})  # `failure_kind`s of a request an upstream may have read
CONNECTION = frozenset({"refused", "connect_timeout", *DROPPED})  # failures with no reply at all
STILL_UP = "the upstream still answers its /health, so it may be this request that it cannot take"
RESENT = "it was already sent to another upstream after a dropped connection"
MAX_ABORT_RESENDS = 3  # a whole reply cut by a pause in abort mode is sent again at most this often


class Decision(NamedTuple):
    action: str  # HERE, MOVE, HOLD, PROBE, ANSWER or GIVE_UP
    breaker: str = KEEP  # FAIL, ABANDON or KEEP: the verdict on the upstream's breaker
    wait: float = 0.0  # seconds before the next send (MOVE)
    why: str = ""  # GIVE_UP: what the client's message adds, if anything


class Attempts:
    """The sends of one client request so far, and the rules for the next (see the module docstring)."""

    __slots__ = (
        "budget",
        "single",
        "deadline",
        "hold_until",
        "tried",
        "failures",
        "reason",
        "sends",
        "streak",
        "last_kind",
        "here",
        "fresh",
        "retried_here",
        "resent",
        "charged",
        "holds",
    )

    def __init__(self, budget: Retries, single: bool, now: float, hold_s: float) -> None:
        self.budget = budget
        self.single = single  # one upstream: nowhere else to go, and no breaker
        self.deadline = now + budget.deadline_s  # loop time after which no send starts
        self.hold_until = now + hold_s  # loop time after which a paused engine's 503 goes to the client
        self.tried: list[Any] = []  # upstreams excluded from the next pick
        self.failures: list[Any] = []  # every upstream that failed it, for the message
        self.reason = "down"  # why the session moves, for `Pinner.pick`
        self.sends = 0  # failed sends counted against `retries.attempts`
        self.streak = 0  # failures of `last_kind` in a row
        self.last_kind = ""
        self.here = False  # the next send goes to the same upstream again
        self.fresh = False  # the next sends go on new connections
        self.retried_here = False  # its one send to the same upstream after a stale close is spent
        self.resent = False  # its one send to another upstream after a drop is spent
        self.charged = False  # its one breaker failure is spent
        self.holds = 0  # times it was held for a paused engine

    def decide(
        self,
        upstream: Any,
        kind: str,
        *,
        fleet: int,
        now: float,
        retry_after: float = 0.0,
        gone: bool | None = None,
    ) -> Decision:
        """What follows a send to `upstream` that failed with `kind` (`failure_kind`, `busy_kind`, or
        `full`: the upstream is at its cap); `fleet`: how many upstreams serve; `retry_after`: the
        503's own Retry-After; `gone`: for a drop, whether the upstream is gone (after PROBE, or
        known before: a launched replica whose process exited)."""
        self.here = False
        if kind == "crowded":
            self.sends += 1
            if self.sends >= self.budget.attempts or now > self.deadline:
                return Decision(GIVE_UP, ABANDON)
            self.here = True
            return Decision(HERE, ABANDON)
        if kind == "paused":
            if now >= self.hold_until:
                return Decision(ANSWER, ABANDON)
            self.holds += 1
            self.here = True
            return Decision(HOLD, ABANDON)
        if kind == "full":
            if self.single or len(self.tried) + 1 >= fleet:
                return Decision(GIVE_UP, ABANDON)  # every upstream is at its cap
            self.tried.append(upstream)
            self.reason = "busy"
            return Decision(MOVE, ABANDON)
        if kind in DROPPED:
            if kind == "stale" and not (self.retried_here or self.resent or gone):
                self.here = self.fresh = self.retried_here = True
                return Decision(HERE)
            if self.single:
                return Decision(GIVE_UP)  # nowhere else to send it
            if gone is None:
                return Decision(PROBE)
            if not gone:
                return Decision(GIVE_UP, ABANDON, why=STILL_UP)  # it answers: refusing this input
            if self.resent:
                return Decision(GIVE_UP, self._charge(), why=RESENT)
        return self._failed(upstream, kind, fleet, now, retry_after)

    def _charge(self) -> str:
        """The request's first failure counts on its upstream's breaker; any later one does not."""
        if self.single:
            return KEEP
        if self.charged:
            return ABANDON
        self.charged = True
        return FAIL

    def _failed(self, upstream: Any, kind: str, fleet: int, now: float, retry_after: float) -> Decision:
        """A failure no upstream began (or a drop by one that is gone): to the next, or the end."""
        breaker = self._charge()
        self.failures.append(upstream)
        if upstream not in self.tried:
            self.tried.append(upstream)
        self.sends += 1
        if kind in DROPPED:
            self.resent = self.fresh = True
        connection = kind in CONNECTION
        budget = self.budget
        done = self.single or self.sends >= budget.attempts
        if len(self.tried) >= fleet:
            if connection:
                done = True  # every upstream failed to take it: nothing left to try
            else:
                self.tried.clear()  # every one is busy: round again, after the backoff
        self.streak = self.streak + 1 if kind == self.last_kind else 1
        self.last_kind = kind
        wait = 0.0
        if self.streak > 1 and not done:  # the same failure again: back off (full jitter)
            wait = random.uniform(0.0, min(budget.backoff_max_s, budget.backoff_s * 2 ** (self.streak - 2)))
        wait = max(wait, retry_after)
        if done or now + wait > self.deadline:
            return Decision(GIVE_UP if connection else ANSWER, breaker)
        self.reason = "down" if connection else "busy"
        return Decision(MOVE, breaker, wait)


def failure_kind(exc: BaseException | None) -> str | None:
    """How a request failed before any reply byte, or None (no retry). `refused`, `connect_timeout`
    and `crowded` (a connect timeout while the upstream took other connections): it was never sent. `stale`, `closed` and `reset` (`DROPPED`): it was
    written, and the connection ended; `Attempts` says what may go again."""
    if isinstance(exc, NoReply):
        # A pooled connection closed (a FIN, no reply): the upstream's idle close may have crossed
        # our request on the wire. A reset, or any close of a fresh connection, came after the
        # upstream had the request.
        if exc.reset:
            return "reset"
        return "stale" if exc.reused else "closed"
    if isinstance(exc, ConnectTimeout):
        return "crowded" if exc.crowded else "connect_timeout"
    if isinstance(exc, CannotConnect):
        return "refused"
    return None


BUSY = b"Please try again later or on a different instance"  # vLLM's admission 503s end so
PAUSED = b"generation is paused"  # vLLM 0.33+: "Generation is paused. Please retry after it resumes."


async def busy_kind(reply: Reply) -> str | None:
    """`busy` for vLLM's admission 503, `paused` for its paused-for-a-weight-update 503, else None.

    The body of a 503 is read and kept, so the caller still reads it when the reply is handed on
    (one over `limits.max_error_reply_size` is no busy 503: its reader gets the `ReplyTooLarge`)."""
    if reply.status != 503:
        return None
    try:
        body = await reply.buffer()
    except (ClientError, asyncio.TimeoutError):
        return None  # the reply broke: its reader sees that, and nothing is re-sent
    if BUSY in body:
        return "busy"
    if PAUSED in body.lower():
        return "paused"
    return None


def abort_resend(resends: int, now: float, hold_until: float) -> bool:
    """Whether a whole reply that a pause cut (`finish_reason: "abort"`) is sent again, from the
    start, once its engine resumes: at most `MAX_ABORT_RESENDS` times, and within the hold deadline."""
    return resends < MAX_ABORT_RESENDS and now < hold_until


def retry_after(headers: Mapping[str, str]) -> float:
    """`Retry-After` in seconds (a number or an HTTP date); 0 when absent or unreadable."""
    value = headers.get("retry-after")
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    return max(0.0, when.timestamp() - time.time())
