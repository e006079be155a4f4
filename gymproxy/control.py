"""Fleet control for weight updates: pause every engine, broadcast the trainer's calls, resume.

`routes.py` serves it as `/fleet/pause`, `/fleet/resume`, `/fleet/broadcast/{route}` and
`/fleet/status` (with `access.fleet_control`). One operation runs at a time (`Control.lock`).

- A pause is a barrier. gymproxy first closes its gate (`pause.Holds`: from then on every new
  request is held, not sent), then asks every engine `/pause?mode=...` at once, each within
  `fleet_control.pause_timeout_s`. When all answered 200 the fleet is paused. Otherwise the engines
  that did pause are resumed, the gate opens again, and the caller hears each engine's result (502):
  the fleet is never left half paused. A /pause that did not answer in time is still open, and
  vLLM may pause after the barrier gave up: it is followed, and the engine resumed once it answers
  (`settle.py`), unless the fleet is paused again by then.
- A resume asks every engine `/resume`, then opens the gate: what was held goes to its pinned engine.
  An engine whose /resume failed is settled as well (resumed once it answers).
- A pause or resume runs to its end even when its caller leaves (a trainer's client timeout): one
  cut halfway would leave the fleet half paused.
- A broadcast sends the trainer's body to one of vLLM's RL or dev routes (`ROUTES`) on every engine,
  each within `fleet_control.broadcast_timeout_s`. A successful `update_weight_version` (or
  `finish_weight_update` naming a version) sets that engine's weight version, which every reply it
  serves then carries (`X-Weight-Version`), and the fleet's: an engine that missed it takes no new
  requests until it has it (`Upstream.stale`).
- An engine that joins while the fleet is paused (added live, found by DNS, a restarted replica) is
  paused at once, with the fleet's mode; its weight version is read (`/weight_info`) as it joins.

Engines are every upstream that serves or drains; one its launcher closed gets nothing (its port
may be anyone's) and is reported as skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec
import orjson
from yarl import URL

from . import health
from .config import Config
from .errors import describe
from .fleet import Fleet
from .http1 import ClientError, ReplyTooLarge
from .settle import Settle
from .upstream import Upstream

log = logging.getLogger("gymproxy")

T = TypeVar("T")

PAUSE_MODES = ("abort", "wait", "keep")
SETTLED = frozenset({"pause", "resume"})  # control calls that are followed when late (`settle.py`)
# vLLM's RL and dev routes a broadcast may reach (`VLLM_SERVER_DEV_MODE=1`), and the method each takes.
ROUTES = {
    "init_weight_transfer_engine": "POST",
    "shutdown_weight_transfer_engine": "POST",
    "start_weight_update": "POST",
    "start_draft_weight_update": "POST",
    "update_weights": "POST",
    "finish_weight_update": "POST",
    "update_weight_version": "POST",
    "weight_checker": "POST",
    "weight_info": "GET",
    "abort_requests": "POST",
    "reset_prefix_cache": "POST",
    "reset_mm_cache": "POST",
    "sleep": "POST",
    "wake_up": "POST",
    "is_sleeping": "GET",
    "is_paused": "GET",
    "collective_rpc": "POST",
}


class _NewVersion(msgspec.Struct):
    new_version: str | int | None = None  # update_weight_version
    weight_version: str | int | None = None  # finish_weight_update


class Outcome(msgspec.Struct, omit_defaults=True):
    """One engine's answer to a control call."""

    name: str
    url: str
    status: int | None = None  # None: no answer (`error` says why)
    body: Any = None
    error: str | None = None
    resumed: bool | None = None  # a failed pause: whether this engine was resumed again
    pending: str | None = None  # what gymproxy still does about this engine (`settle.py`)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class Control:
    """The fleet's weight-update controls."""

    def __init__(self, fleet: Fleet, config: Config) -> None:
        self.fleet = fleet
        self.rules = config.fleet_control
        self.holds = fleet.holds
        self.lock = asyncio.Lock()
        self.version: str | None = None  # the fleet's weight version: the last one broadcast
        self._tasks: set[asyncio.Task[Any]] = set()
        self.settle = Settle(
            lock=self.lock,
            holds=self.holds,
            ask=self._is_paused,
            call=self._settle_call,
            present=self._present,
            release=fleet.engines.release,
            follow_s=self.rules.follow_s,
            poll_s=config.hold.poll_s,
            most_s=config.health.interval,
        )
        fleet.joining = self._joining

    def engines(self) -> list[Upstream]:
        """Every upstream that serves or drains (not those on their way out)."""
        return [*self.fleet.upstreams, *self.fleet.drained.values()]

    async def pause(self, mode: str, query: str) -> tuple[bool, list[Outcome]]:
        """The barrier (see the module docstring): (whether every engine paused, each one's answer)."""
        return await self._whole(self._pause(mode, query))

    async def resume(self) -> tuple[bool, list[Outcome], int]:
        """Resume every engine, then release what was held: (all resumed, answers, released)."""
        return await self._whole(self._resume())

    async def _pause(self, mode: str, query: str) -> tuple[bool, list[Outcome]]:
        async with self.lock:
            was_paused = self.holds.paused
            self.holds.pause(mode)
            outcomes = await self._each("POST", "pause", f"mode={mode}" + (f"&{query}" if query else ""), None)
            if all(o.ok for o in outcomes):
                log.info("fleet paused (mode %s): %d engines; new requests are held", mode, len(outcomes))
                return True, outcomes
            failed = ", ".join(f"{o.url} ({o.error or o.status})" for o in outcomes if not o.ok)
            if was_paused:  # a second pause (another mode) that failed: the first one stands
                log.warning("fleet pause (mode %s) failed: %s; the fleet stays paused", mode, failed)
                return False, outcomes
            paused = [o for o in outcomes if o.ok]
            undone = await self._each("POST", "resume", "", None, only={o.name for o in paused})
            resumed = {o.name for o in undone if o.ok}
            for outcome in paused:
                outcome.resumed = outcome.name in resumed
            self.holds.resume()
            self.fleet.engines.resume_all()
            self._settle_failed(undone, "resume after the failed pause", paused=True)
            log.warning("fleet pause failed: %s; the engines that paused were resumed", failed)
            return False, outcomes

    async def _resume(self) -> tuple[bool, list[Outcome], int]:
        async with self.lock:
            outcomes = await self._each("POST", "resume", "", None)
            released = self.holds.resume()
            self.fleet.engines.resume_all()
            self._settle_failed(outcomes, "resume", paused=None)
            log.info("fleet resumed: %d engines; %d held requests released", len(outcomes), released)
            return all(o.ok for o in outcomes), outcomes, released

    async def _whole(self, work: Coroutine[Any, Any, T]) -> T:
        """`work`, run to its end even if the caller is cancelled (its client left)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    def _settle_failed(self, outcomes: list[Outcome], what: str, *, paused: bool | None) -> None:
        """Settle each engine whose `what` failed (one still open is followed already)."""
        for outcome in outcomes:
            if outcome.ok or outcome.pending is not None or (upstream := self.fleet.find(outcome.name)) is None:
                continue
            if upstream.closed is not None:
                continue  # not serving: it gets nothing (its launcher restarts it, unpaused)
            why = f"its /{what} failed ({outcome.error or outcome.status}): asked /is_paused until it answers"
            outcome.pending = why
            self.settle.watch(upstream, why, paused=paused)

    async def broadcast(self, route: str, method: str, body: bytes | None, query: str) -> tuple[bool, list[Outcome]]:
        """`route` on every engine with `body`: (every engine answered 2xx, each one's answer)."""
        async with self.lock:
            engines = self.engines()
            outcomes = await self._each(method, route, query, body, timeout=self.rules.broadcast_timeout_s, on=engines)
            version = _version_set(route, body)
            if version is not None:
                for upstream, outcome in zip(engines, outcomes, strict=True):
                    if outcome.ok:
                        upstream.set_version(version)
                if any(o.ok for o in outcomes):
                    self._set_fleet_version(version)
            return all(o.ok for o in outcomes), outcomes

    async def status(self) -> dict[str, Any]:
        """The fleet's pause and weights, and each engine's (asked now: `/is_paused`, `/weight_info`)."""
        engines = self.engines()
        timeout = self.fleet.config.health.timeout
        client = self.fleet.client
        paused = await asyncio.gather(*(health.is_paused(client, u, timeout) for u in engines))
        versions = await asyncio.gather(*(health.weight_version(client, u, timeout) for u in engines))
        states = {s["name"]: s["state"] for s in self.fleet.states()}
        rows = []
        settle = self.settle
        for upstream, engine_paused, (answered, version) in zip(engines, paused, versions, strict=True):
            if answered:
                self._learned(upstream, version)
            rows.append(
                {
                    "name": upstream.name,
                    "url": upstream.url,
                    "state": "closed" if upstream.closed is not None else states.get(upstream.name, "healthy"),
                    # what it says; when it cannot say, what gymproxy last knew of it while settling it
                    "paused": settle.believed(upstream) if engine_paused is None else engine_paused,
                    "unsettled": settle.why(upstream),  # why its pause may not be the fleet's, until it is
                    "weight_version": upstream.version,
                    "stale": upstream.stale,
                    "inflight": upstream.inflight,
                    "held": self.fleet.engines.waiting(upstream),
                }
            )
        since = self.holds.since
        return {
            "paused": self.holds.paused,
            "mode": self.holds.mode,
            "paused_for_s": None if since is None else round(time.monotonic() - since, 3),
            "held": self.holds.count,
            "unsettled": settle.names(),
            "weight_version": self.version,
            "engines": rows,
        }

    def start(self) -> None:
        """Read every engine's weight version (`/weight_info`) as gymproxy starts."""
        for upstream in self.engines():
            self._joining(upstream)

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.settle.stop()

    # --- engines --------------------------------------------------------------------------------

    async def _each(
        self,
        method: str,
        route: str,
        query: str,
        body: bytes | None,
        *,
        timeout: float | None = None,
        only: set[str] | None = None,
        on: list[Upstream] | None = None,
    ) -> list[Outcome]:
        """`route` asked of every engine (`on`, else `engines()`; only those named in `only`) at once."""
        engines = [u for u in (self.engines() if on is None else on) if only is None or u.name in only]
        seconds = self.rules.pause_timeout_s if timeout is None else timeout
        return list(await asyncio.gather(*(self._call(u, method, route, query, body, seconds) for u in engines)))

    async def _call(
        self, upstream: Upstream, method: str, route: str, query: str, body: bytes | None, timeout: float
    ) -> Outcome:
        """One engine's answer; no failure escapes (it is the outcome's `error`). A /pause or /resume
        (`SETTLED`) waits for the one still open to that engine first, and one that does not answer
        in time is not cancelled: it is followed (`settle.py`), and `pending` says so."""
        outcome = Outcome(name=upstream.name, url=upstream.url)
        if upstream.closed is not None:
            outcome.error = f"skipped: not serving ({upstream.closed})"
            return outcome
        settled = route in SETTLED
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if settled and not await self.settle.quiet(upstream, timeout):
            outcome.error = f"not sent: its earlier control call is still open after {timeout:g} s"
            outcome.pending = self.settle.why(upstream)
            return outcome
        url = upstream.root / route
        if query:
            url = URL(f"{url}?{query}", encoded=True)
        headers = upstream.json_headers if body is not None else upstream.headers
        asking = asyncio.ensure_future(self._ask(method, url, headers, body))
        try:
            await asyncio.wait((asking,), timeout=max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:  # the caller is gone (shutdown): the call is followed, or ends too
            if settled and not asking.done():
                self.settle.follow(upstream, asking, route, timeout)
            else:
                asking.cancel()
            raise
        if not asking.done():
            outcome.error = f"no answer from {route} within {timeout:g} s"
            if settled:
                outcome.pending = self.settle.follow(upstream, asking, route, timeout)
            else:
                asking.cancel()
            return outcome
        try:
            outcome.status, outcome.body = asking.result()
        except ReplyTooLarge:
            outcome.error = f"its answer was over {self.rules.max_reply_size} bytes (fleet_control.max_reply_size)"
        except ClientError as exc:
            outcome.error = f"{route} failed: {describe(exc)}"
        return outcome

    # --- settling engines (settle.py) -----------------------------------------------------------

    async def _is_paused(self, upstream: Upstream) -> bool | None:
        return await health.is_paused(self.fleet.client, upstream, self.fleet.config.health.timeout)

    async def _settle_call(self, upstream: Upstream, route: str, query: str) -> bool:
        outcome = await self._call(upstream, "POST", route, query, None, self.rules.pause_timeout_s)
        if not outcome.ok:
            log.warning(
                "upstream %s: /%s to settle it failed: %s", upstream.url, route, outcome.error or outcome.status
            )
        return outcome.ok

    def _present(self, upstream: Upstream) -> bool:
        """Still an engine of the fleet, open, and gymproxy not stopping."""
        return upstream.closed is None and self.holds.ended is None and any(u is upstream for u in self.engines())

    async def _ask(self, method: str, url: URL, headers: dict[str, str], body: bytes | None) -> tuple[int, Any]:
        reply = await self.fleet.client.request(method, url, headers, body, fresh=True, first=True)
        try:
            reply.limit(self.rules.max_reply_size)
            data = await reply.read()
        finally:
            reply.release()
        try:
            return reply.status, orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            return reply.status, data.decode(errors="replace")

    # --- versions, and engines that join --------------------------------------------------------

    def _set_fleet_version(self, version: str) -> None:
        self.version = version
        for upstream in self.fleet.known():
            upstream.stale = upstream.version != version

    def _learned(self, upstream: Upstream, version: str | None) -> None:
        """`upstream` says its weight version is `version`."""
        upstream.set_version(version)
        upstream.stale = self.version is not None and version != self.version

    def _joining(self, upstream: Upstream) -> None:
        """`upstream` just became healthy (added, back up, or a replica ready again)."""
        task = asyncio.ensure_future(self._join(upstream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _join(self, upstream: Upstream) -> None:
        timeout = self.fleet.config.health.timeout
        if self.holds.paused:
            mode = self.holds.mode or "abort"
            outcome = await self._call(upstream, "POST", "pause", f"mode={mode}", None, self.rules.pause_timeout_s)
            if outcome.ok:
                log.info("upstream %s joined the paused fleet: paused (mode %s)", upstream.url, mode)
            else:
                log.warning(
                    "upstream %s joined the paused fleet and did not pause: %s",
                    upstream.url,
                    outcome.error or outcome.status,
                )
        answered, version = await health.weight_version(self.fleet.client, upstream, timeout)
        if answered:
            self._learned(upstream, version)
            if upstream.stale:
                log.warning(
                    "upstream %s has weight version %s, not the fleet's %s: it takes no requests until it has it",
                    upstream.url,
                    version,
                    self.version,
                )


def _version_set(route: str, body: bytes | None) -> str | None:
    """The weight version a broadcast of `route` with `body` sets, if it sets one."""
    if route not in ("update_weight_version", "finish_weight_update") or not body:
        return None
    try:
        fields = msgspec.json.decode(body, type=_NewVersion)
    except msgspec.DecodeError:
        return None
    version = fields.new_version if route == "update_weight_version" else fields.weight_version
    return None if version is None else str(version)
