"""Requests held while the fleet, or one engine, is paused for a weight update.

Two kinds of pause, one set of bounds (`hold`):

- the fleet's own: `/fleet/pause` (control.py) closes the gate; a request that arrives waits before
  it is sent, and goes to its pinned engine once `/fleet/resume` opens it again;
- one engine's: vLLM answered 503 "Generation is paused" (a trainer paused it directly), or cut a
  whole reply (`finish_reason: "abort"`) while paused: the request waits for that engine, whose
  `/is_paused` is asked every `hold.poll_s` while anything waits on it, and is sent there again.

At most `hold.max_requests` requests and `hold.max_bytes` of their bodies wait at once, and none
waits past `hold.timeout_s`; past either, a 503 with `Retry-After` (`HoldOver`). A held request keeps
its client's connection open, so `gymproxy serve` lowers that limit to a share of its connection cap
(`Holds.share`): the trainer's /fleet/resume, and /health and /metrics, always find a connection.
A request waits on one event, with one timer: nothing else is kept per held request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .config import Hold
from .errors import HoldFull, HoldOver, Unavailable
from .metrics import Histogram

log = logging.getLogger("gymproxy")

Ask = Callable[[Any], Awaitable[bool | None]]  # is this engine paused? (None: cannot tell)
# The share of a listener's connection cap that held requests may take (`Holds.share`): the rest
# is for everything else, the trainer's /fleet/resume first.
CONNECTION_SHARE = 0.5


class Holds:
    """Every request held in this process, and the fleet's gate."""

    def __init__(self, rules: Hold, pauses: Histogram) -> None:
        self.rules = rules
        self.count = 0  # held now
        self.bytes = 0  # their bodies' bytes
        self.held = 0  # requests ever held (a counter)
        self.expired = 0  # held past `hold.timeout_s`
        self.refused = 0  # not held: too many were
        self.released = 0  # released by a resume of the fleet
        self.gate = asyncio.Event()  # set while the fleet is not paused
        self.gate.set()
        self.paused = False  # the fleet is paused (`/fleet/pause`): requests wait before they are sent
        self.mode: str | None = None  # the fleet's pause mode, while paused
        self.since: float | None = None  # time.monotonic() when the fleet was paused
        self.pauses = pauses  # seconds the fleet was paused, by mode
        self.ended: str | None = None  # why nothing is held any more (shutting down)
        self.most = rules.max_requests  # held at once: `hold.max_requests`, or less (`share`)
        self._lowered = ""  # why `most` is below `hold.max_requests`, for the 503's message

    def share(self, connections: int, setting: str) -> None:
        """Hold at most `CONNECTION_SHARE` of the `connections` a listener takes (`setting` names its cap)."""
        fraction = CONNECTION_SHARE
        most = max(1, int(connections * fraction))
        if most < self.most:
            log.info(
                "hold.max_requests (%d) lowered to %d: held requests keep their connections open, and may take "
                "%d%% of the %d client connections (%s) at most, so /fleet/resume, /health and /metrics get in",
                self.rules.max_requests,
                most,
                round(fraction * 100),
                connections,
                setting,
            )
            self.most = most
            self._lowered = f", lowered to {most}: {round(fraction * 100)}% of {setting} ({connections})"

    def pause(self, mode: str) -> None:
        if not self.paused:
            self.paused = True
            self.gate.clear()
            self.since = time.monotonic()
        self.mode = mode

    def resume(self) -> int:
        """Open the gate; how many requests it releases."""
        released = self.count if self.paused else 0
        if self.since is not None:
            self.pauses.observe(self.mode or "abort", time.monotonic() - self.since)
        self.gate.set()
        self.paused = False
        self.mode = self.since = None
        self.released += released
        return released

    def end(self, why: str) -> None:
        """Hold nothing from now on: what is held gets a 503 saying `why` once its event is set."""
        self.ended = why
        self.paused = False
        self.gate.set()

    async def wait(self, event: asyncio.Event, until: float, size: int, what: str) -> None:
        """Held until `event` is set; a `HoldOver` past the bounds, or at loop time `until`.
        `size`: the request body's bytes; `what` says what is paused, for the message."""
        rules = self.rules
        if self.ended is not None:
            raise Unavailable(self.ended)
        if self.count >= self.most or self.bytes + size > rules.max_bytes:
            self.refused += 1
            raise HoldFull(
                f"{self.count} requests ({self.bytes} bytes) are held already while {what}: the most "
                f"hold.max_requests ({rules.max_requests}{self._lowered}) and hold.max_bytes ({rules.max_bytes}) allow"
            )
        remaining = until - asyncio.get_running_loop().time()
        self.count += 1
        self.bytes += size
        self.held += 1
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(event.wait(), remaining)
            if self.ended is not None:
                raise Unavailable(self.ended)
        except asyncio.TimeoutError:
            self.expired += 1
            raise HoldOver(f"held {rules.timeout_s:g} s while {what}, and it did not resume (hold.timeout_s)") from None
        finally:
            self.count -= 1
            self.bytes -= size


class Engines:
    """The engines found paused, each asked (`ask`) every `hold.poll_s` while requests wait on it."""

    def __init__(self, holds: Holds, ask: Ask) -> None:
        self.holds = holds
        self.ask = ask
        self._paused: dict[str, asyncio.Event] = {}  # by upstream name: set once it resumes
        self._waiting: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def resumed(self, upstream: Any, until: float, size: int) -> None:
        """Wait (held) until `upstream`, found paused, resumes; a `HoldOver` past the bounds."""
        name = upstream.name
        event = self._paused.get(name)
        if event is None:
            event = self._paused[name] = asyncio.Event()
            task = asyncio.ensure_future(self._poll(upstream, event))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._waiting[name] = self._waiting.get(name, 0) + 1
        try:
            await self.holds.wait(event, until, size, f"the engine {upstream.url} is paused")
        finally:
            left = self._waiting[name] - 1
            if left:
                self._waiting[name] = left
            else:
                del self._waiting[name]

    def waiting(self, upstream: Any) -> int:
        """Requests held for `upstream` now."""
        return self._waiting.get(upstream.name, 0)

    async def paused(self, upstream: Any) -> bool:
        """Whether `upstream` says it is paused now (False when it cannot say)."""
        return await self.ask(upstream) is True

    def release(self, upstream: Any) -> None:
        """`upstream` was resumed (`settle.py`): what waits on it goes now."""
        event = self._paused.pop(upstream.name, None)
        if event is not None:
            event.set()

    def resume_all(self) -> None:
        """Every engine was resumed (`/fleet/resume`): what waits on them goes now."""
        for event in self._paused.values():
            event.set()
        self._paused.clear()

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _poll(self, upstream: Any, event: asyncio.Event) -> None:
        """Ask until it resumes, or nothing waits on it any more; an engine that cannot say (no
        /is_paused, gone) counts as resumed: the request is sent again, and the send tells."""
        name = upstream.name
        try:
            while not event.is_set() and self._waiting.get(name, 0) > 0:
                await asyncio.sleep(self.holds.rules.poll_s)
                if await self.ask(upstream) is not True:
                    break
        except Exception:  # a bug: logged, and what waits is sent again
            log.exception("asking upstream %s whether it is paused failed", upstream.url)
        finally:
            event.set()
            if self._paused.get(name) is event:
                del self._paused[name]
