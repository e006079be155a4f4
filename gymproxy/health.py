"""What the fleet asks each engine about itself: `/health` (the checks, and whether an upstream that
dropped a request is gone), `/is_paused` and `/weight_info` (weight updates), and the startup probe
of `/v1/models`. Each question is one GET with its own deadline; the answers are verdicts, which the
fleet applies (`Fleet.mark`), so nothing here changes an upstream's state.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

import msgspec

from .errors import describe
from .http1 import Aborted, CannotConnect, Client, ClientError
from .upstream import Upstream, shown

log = logging.getLogger("gymproxy")

PROBE_TIMEOUT = 10.0


class Verdict(NamedTuple):
    ok: bool
    why: str  # for the log when it marks the upstream down
    result: str  # `gymproxy_health_checks_total`'s label: ok, failed, error


class _Paused(msgspec.Struct):
    is_paused: bool


class _WeightInfo(msgspec.Struct):
    weight_version: str | int | None = None


async def get(client: Client, upstream: Upstream, route: str, *, fresh: bool = False) -> tuple[int, bytes]:
    """A GET of the fleet's own to one of `upstream.urls`: status and body. A new connection for it
    opens ahead of the requests' (`first`): it asks about the engine, not gymproxy's queue."""
    async with await client.request("GET", upstream.urls[route], upstream.headers, fresh=fresh, first=True) as reply:
        return reply.status, await reply.read()


async def check(client: Client, upstream: Upstream, timeout: float) -> Verdict:
    """One `/health` check; no failure escapes it."""
    try:
        status, _ = await asyncio.wait_for(get(client, upstream, "health"), timeout)
    except (ClientError, asyncio.TimeoutError) as exc:
        return Verdict(False, f"/health failed: {describe(exc)}", "failed")
    except Exception as exc:  # a bug: logged and counted, and the next round runs as usual
        log.exception("health check of upstream %s failed unexpectedly", upstream.url)
        return Verdict(False, f"/health check raised {describe(exc)}", "error")
    return Verdict(status == 200, f"/health answered {status}", "ok" if status == 200 else "failed")


async def gone(client: Client, upstream: Upstream, timeout: float) -> tuple[bool, str | None]:
    """Whether `upstream`, which just dropped a request, is gone (its process died): its /health,
    asked on a new connection, gets no answer (refused, reset, or none within `timeout`). Any answer
    at all means the process is there and chose to drop it. The second value: why to mark it down.

    A connect alone would not do: a dying process's connections may be reset a moment before its
    listener closes, and a connect in that moment still succeeds."""
    health = upstream.urls["health"]
    try:
        reply = await asyncio.wait_for(client.request("GET", health, upstream.headers, fresh=True, first=True), timeout)
    except Aborted:
        return True, None  # shutting down: the next send says so
    except CannotConnect as exc:
        return True, f"it dropped a request, then refused a connection: {describe(exc)}"
    except (ClientError, asyncio.TimeoutError) as exc:
        log.warning(
            "upstream %s dropped a request, then %s did not answer: %s", upstream.url, shown(health), describe(exc)
        )
        return True, None
    reply.close()
    return False, None


async def is_paused(client: Client, upstream: Upstream, timeout: float) -> bool | None:
    """vLLM's `GET /is_paused` (`VLLM_SERVER_DEV_MODE=1`); None when it cannot say (no such route,
    no answer, not its format). Nothing is asked of a closed upstream."""
    if upstream.closed is not None:
        return None
    try:
        status, body = await asyncio.wait_for(get(client, upstream, "is_paused"), timeout)
        return msgspec.json.decode(body, type=_Paused).is_paused if status == 200 else None
    except (ClientError, asyncio.TimeoutError, msgspec.DecodeError):
        return None


async def weight_version(client: Client, upstream: Upstream, timeout: float) -> tuple[bool, str | None]:
    """vLLM's `GET /weight_info`: (answered, its `weight_version`); (False, None) when it cannot say."""
    if upstream.closed is not None:
        return False, None
    try:
        status, body = await asyncio.wait_for(get(client, upstream, "weight_info"), timeout)
        if status != 200:
            return False, None
        version = msgspec.json.decode(body, type=_WeightInfo).weight_version
    except (ClientError, asyncio.TimeoutError, msgspec.DecodeError):
        return False, None
    return True, None if version is None else str(version)


async def probe(client: Client, upstreams: list[Upstream]) -> None:
    """Log each upstream and whether its /v1/models answered, naming the URL tried."""
    for upstream in upstreams:
        if upstream.closed is not None:
            continue  # not serving yet: its owner reports it
        url = shown(upstream.urls["models"])
        try:
            status, body = await asyncio.wait_for(get(client, upstream, "models"), PROBE_TIMEOUT)
        except (ClientError, asyncio.TimeoutError) as exc:
            log.warning("upstream %s: %s is NOT answering: %s", upstream.url, url, describe(exc))
            continue
        except Exception as exc:  # a bug: logged, and the other upstreams are still probed
            log.exception("upstream %s: %s is NOT answering: the probe raised %s", upstream.url, url, describe(exc))
            continue
        if status == 200:
            log.info("upstream %s: %s answered 200", upstream.url, url)
        else:
            log.warning(
                "upstream %s: %s answered %d: %s (is base_url right? it should end in /v1)",
                upstream.url,
                url,
                status,
                body[:200].decode(errors="replace"),
            )
