"""Engines that a weight-update call may have left paused, or running, behind the fleet's back.

A /pause or /resume that does not answer within `fleet_control.pause_timeout_s` is not over: vLLM
carries it out all the same (a closed connection does not stop it). So an engine may pause after
the barrier that asked it gave up and resumed the others, or resume after the fleet paused again.
Such a call is followed to its end (at most `fleet_control.follow_s` more), and the engine is then
*settled*: brought to the fleet's state (paused while a `/fleet/pause` holds, else running), going
by what it says (`/is_paused`) or, when it cannot say, by what its last answered call did. An
engine whose /resume failed outright is settled the same way. One that cannot say is asked again,
every `hold.poll_s` at first and at most every `health.interval`, until it answers, leaves the
fleet, or gymproxy stops. The decision and the call that carries it out hold the fleet control's
lock, so they never cross a barrier. Control calls to one engine never overtake each other: a new
one first waits for the one still open (`Settle.quiet`). Until an engine is settled,
`/fleet/status` shows it and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import describe
from .pause import Holds
from .upstream import Upstream

log = logging.getLogger("gymproxy")

Ask = Callable[[Upstream], Awaitable[bool | None]]  # its /is_paused (None: it cannot say)
Call = Callable[[Upstream, str, str], Awaitable[bool]]  # POST /{route}?{query} to it: answered 2xx


class Unsettled:
    """One engine whose pause gymproxy cannot vouch for."""

    __slots__ = ("upstream", "why", "since", "calls", "paused", "task")

    def __init__(self, upstream: Upstream, why: str) -> None:
        self.upstream = upstream
        self.why = why
        self.since = time.monotonic()
        self.calls: set[asyncio.Task[None]] = set()  # its control calls still open, followed
        self.paused: bool | None = None  # as its last answered /pause or /resume left it
        self.task: asyncio.Task[None] | None = None


class Settle:
    """The engines being settled, by name (see the module docstring)."""

    def __init__(
        self,
        *,
        lock: asyncio.Lock,
        holds: Holds,
        ask: Ask,
        call: Call,
        present: Callable[[Upstream], bool],
        release: Callable[[Upstream], None],
        follow_s: float,
        poll_s: float,
        most_s: float,
    ) -> None:
        self.lock = lock  # the fleet control's: one operation at a time
        self.holds = holds
        self.ask = ask
        self.call = call
        self.present = present  # still in the fleet, open, and gymproxy not stopping
        self.release = release  # it was resumed: what is held for it goes
        self.follow_s = follow_s
        self.poll_s = poll_s
        self.most_s = max(most_s, poll_s)
        self._by_name: dict[str, Unsettled] = {}
        self.stopped = False

    def follow(self, upstream: Upstream, call: asyncio.Future[tuple[int, Any]], route: str, waited: float) -> str:
        """`call` (/pause or /resume, `route`) is still open after its caller gave up on it (`waited`
        seconds): it is followed, and the engine settled once it ends. Says so, for the caller."""
        why = (
            f"its /{route} did not answer within {waited:g} s and is still open: followed for up to "
            f"{self.follow_s:g} s more (fleet_control.follow_s), then the engine is brought to the fleet's state"
        )
        if self.stopped:
            call.cancel()
            return why
        entry = self._entry(upstream, why)
        task = asyncio.ensure_future(self._follow(entry, call, route))
        entry.calls.add(task)
        task.add_done_callback(entry.calls.discard)
        return why

    def watch(self, upstream: Upstream, why: str, *, paused: bool | None = None) -> None:
        """Settle `upstream`, whose pause is in doubt (`why`); `paused`: what gymproxy last knew of it."""
        if self.stopped:
            return
        entry = self._entry(upstream, why)
        if paused is not None:
            entry.paused = paused

    async def quiet(self, upstream: Upstream, timeout: float) -> bool:
        """Wait (up to `timeout`) until no control call to `upstream` is still open: whether none is."""
        entry = self._by_name.get(upstream.name)
        if entry is None or not entry.calls:
            return True
        await asyncio.wait(set(entry.calls), timeout=timeout)
        return not entry.calls

    def why(self, upstream: Upstream) -> str | None:
        """Why `upstream` is not settled yet; None when it is."""
        entry = self._by_name.get(upstream.name)
        return None if entry is None else entry.why

    def believed(self, upstream: Upstream) -> bool | None:
        """Whether `upstream`, not settled yet, is paused as its last answered call left it."""
        entry = self._by_name.get(upstream.name)
        return None if entry is None else entry.paused

    def names(self) -> list[str]:
        return list(self._by_name)

    def stop(self) -> None:
        """gymproxy is stopping: the engines not settled yet are named in the log, and left as they are."""
        self.stopped = True
        for entry in self._by_name.values():
            log.warning(
                "stopping with upstream %s not settled (%s): it may be paused; ask %s/is_paused",
                entry.upstream.url,
                entry.why,
                entry.upstream.root,
            )
            for call in entry.calls:
                call.cancel()
            if entry.task is not None:
                entry.task.cancel()
        self._by_name.clear()

    def _entry(self, upstream: Upstream, why: str) -> Unsettled:
        entry = self._by_name.get(upstream.name)
        if entry is not None and entry.upstream is upstream:
            entry.why = why
            return entry
        entry = self._by_name[upstream.name] = Unsettled(upstream, why)
        entry.task = asyncio.ensure_future(self._settle(entry))
        log.warning("upstream %s may be paused behind the fleet's back: %s", upstream.url, why)
        return entry

    async def _follow(self, entry: Unsettled, call: asyncio.Future[tuple[int, Any]], route: str) -> None:
        """The open call's end: what it did to the engine, if it answered."""
        url = entry.upstream.url
        try:
            status, _ = await asyncio.wait_for(call, self.follow_s)
        except asyncio.TimeoutError:
            log.warning("upstream %s: its /%s did not answer within %g s more; closed", url, route, self.follow_s)
            return
        except Exception as exc:  # it failed, or broke the rules (too large): what it did is not known
            log.warning("upstream %s: its late /%s failed: %s", url, route, describe(exc))
            return
        log.info("upstream %s answered its late /%s: %d", url, route, status)
        if 200 <= status < 300:
            entry.paused = route == "pause"

    async def _settle(self, entry: Unsettled) -> None:
        upstream = entry.upstream
        wait = self.poll_s
        try:
            while True:
                while entry.calls:
                    await asyncio.wait(set(entry.calls))
                if not self.present(upstream):
                    log.warning(
                        "upstream %s left unsettled (%s): it left the fleet, or gymproxy stops", upstream.url, entry.why
                    )
                    return
                said = await self.ask(upstream)
                if said is None:
                    said = entry.paused
                async with self.lock:
                    if entry.calls:  # a new call went out while this one waited for the lock
                        continue
                    want = self.holds.paused
                    if said is want:
                        log.info(
                            "upstream %s settled: %s, as the fleet is", upstream.url, "paused" if want else "running"
                        )
                        del self._by_name[upstream.name]
                        return
                    if said is not None:
                        mode = self.holds.mode or "abort"
                        route, query = ("pause", f"mode={mode}") if want else ("resume", "")
                        log.info("upstream %s: /%s, to bring it to the fleet's state", upstream.url, route)
                        if await self.call(upstream, route, query):  # looked at again after a poll
                            entry.paused = want
                            if not want:
                                self.release(upstream)
                            wait = self.poll_s
                await asyncio.sleep(wait)
                wait = min(wait * 2, self.most_s)
        finally:
            if self._by_name.get(upstream.name) is entry:
                del self._by_name[upstream.name]
