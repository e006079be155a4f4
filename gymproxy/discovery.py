"""DNS discovery: `upstreams_dns` names a host whose every address is an upstream (a Kubernetes
headless Service resolves to one A/AAAA record per ready pod), re-resolved on a timer.

Resolution goes through `loop.getaddrinfo` (the system resolver, in the loop's executor), or
through any `Resolve` function given in its place (the tests inject one). A failed resolution keeps
the last set, since an empty answer from a flaky resolver must not empty the fleet; an answer with
no address at all is a failure too, for the same reason. An address that does not make a usable
upstream (`config.check_upstream`) is left out and logged.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from .config import BadUpstream, DnsTarget, UpstreamSpec, check_upstream

log = logging.getLogger("gymproxy")
Resolve = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, sorted, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def to_specs(target: DnsTarget, addresses: list[str]) -> list[UpstreamSpec]:
    """One upstream per address, named `address:port` (`[v6]:port`), at the target's scheme and path."""
    specs = []
    for address in addresses:
        shown = f"[{address}]" if ":" in address else address  # an IPv6 address
        at = f"{shown}:{target.port}"
        spec = UpstreamSpec(url=f"{target.scheme}://{at}{target.path}", name=at)
        try:
            check_upstream(spec)
        except BadUpstream as exc:
            log.warning("upstreams_dns: address %r left out: %s", address[:100], exc)
            continue
        specs.append(spec)
    return specs
