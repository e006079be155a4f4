"""A per-upstream circuit breaker: after `failures` failures in a row, stop sending for `cooldown` seconds.

    closed ──(N failures in a row)──> open ──(cooldown over: one request let through)──> half-open
      ^                                 ^                                                  │
      └──────────(the probe succeeds)───┼──────────────────────────────────────────────────┤
                                        └────────────(the probe fails)─────────────────────┘

What counts as a failure is the fleet's business (connection-level failures and vLLM's "busy" and
"paused" 503s); this module only keeps the state. It is O(1) and allocation-free, so the common case
(closed) costs one comparison per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("gymproxy")

CLOSED, OPEN, HALF_OPEN = 0, 1, 2  # also the values of the `gymproxy_upstream_breaker` gauge


class Breaker:
    """The breaker of one upstream (`name` is for the log)."""

    __slots__ = ("name", "failures", "cooldown", "state", "streak", "opened_at", "opened", "_clock")

    def __init__(
        self, name: str, *, failures: int, cooldown: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.failures = failures
        self.cooldown = cooldown
        self.state = CLOSED
        self.streak = 0  # failures in a row
        self.opened_at = 0.0
        self.opened = 0  # times it opened (a counter)
        self._clock = clock

    @property
    def blocked(self) -> bool:
        """True while no request may go: open and cooling down, or half-open with its probe out."""
        if self.state == CLOSED:
            return False
        if self.state == HALF_OPEN:
            return True
        return self._clock() - self.opened_at < self.cooldown

    def admit(self) -> None:
        """A request is about to go: once the cooldown is over, it is the half-open probe."""
        if self.state == OPEN and not self.blocked:
            self.state = HALF_OPEN

    def succeeded(self) -> None:
        self.streak = 0
        if self.state != CLOSED:
            self.state = CLOSED
            log.info("upstream %s: circuit breaker closed (the probe succeeded)", self.name)

    def failed(self) -> None:
        self.streak += 1
        if self.state == HALF_OPEN or (self.state == CLOSED and self.streak >= self.failures):
            self.state = OPEN
            self.opened_at = self._clock()
            self.opened += 1
            log.warning(
                "upstream %s: circuit breaker open for %g s after %d failures in a row",
                self.name,
                self.cooldown,
                self.streak,
            )

    def abandon(self) -> None:
        """The probe ended without a verdict (cancelled, timed out): the next request probes again."""
        if self.state == HALF_OPEN:
            self.state = OPEN  # opened_at is over a cooldown ago: not blocked
