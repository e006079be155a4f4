#!/usr/bin/env python3
"""Soak: the load scenario of tests/test_load.py at full size, in one process.

    python bench/soak.py                       # 2,000 concurrent streaming sessions, then 20,000 requests
    python bench/soak.py --quick               # 500 sessions, then 5,000 requests: ~12 s
    python bench/soak.py --sessions 500 --requests 5000 --uvloop

Several fake vLLMs and gymproxy (mounted with `gymproxy.setup`) run on one event loop with the
clients. Phases: N concurrent 3-turn streaming sessions pinned by the gymproxy_pin cookie (even
ones on /v1/responses, odd ones on /v1/chat/completions); then M mixed requests, C at a time;
then A clients that walk away mid-stream. It prints a summary and exits non-zero when any request
failed, a session changed upstream, a generation was sent twice or lost, a walk-out did not reach
its upstream, the proxy still holds upstream connections, or open fds / RSS did not come back
near their baseline. The scenario itself lives in tests/loadrun.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import resource
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import options  # noqa: E402
from formats import Column, Table, csv_text, markdown  # noqa: E402
from progress import Progress  # noqa: E402

from tests.loadrun import LoadReport, run  # noqa: E402

QUICK = {"sessions": 500, "requests": 5000, "concurrency": 250, "abandon": 50}


def raise_fd_limit(needed: int) -> tuple[int, int]:
    """Lift the soft RLIMIT_NOFILE towards `needed` (at most the hard limit); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft, hard


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=2000, help="concurrent streaming sessions (default 2000)")
    parser.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    parser.add_argument("--requests", type=int, default=20000, help="requests after the sessions (default 20000)")
    parser.add_argument("--concurrency", type=int, default=500, help="requests in flight at once (default 500)")
    parser.add_argument("--abandon", type=int, default=200, help="streams abandoned mid-way (default 200)")
    parser.add_argument("--upstreams", type=int, default=3, help="fake vLLMs (default 3)")
    parser.add_argument("--keepalive", type=float, default=1.0, help="gymproxy timeouts.keepalive (default 1.0 s)")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds allowed for fds to come back (default 30)")
    parser.add_argument(
        "--fd-slack", type=int, default=32, help="open fds allowed above the baseline after (default 32)"
    )
    parser.add_argument(
        "--rss-slack", type=float, default=None, help="MiB of RSS growth allowed (default 64 + sessions/4)"
    )
    parser.add_argument(
        "--health-interval", type=float, default=None, help="gymproxy health.interval (default: gymproxy's)"
    )
    parser.add_argument(
        "--health-timeout", type=float, default=None, help="gymproxy health.timeout (default: gymproxy's)"
    )
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    options.add(parser, quick="500 sessions, then 5,000 requests 250 at a time, then 50 walk-outs: ~12 s")
    return options.parse(parser, argv, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Each stream holds 4 fds in one process: client, gymproxy's side, its upstream connection, the fake's side.
    needed = 4 * max(args.sessions, args.concurrency) + 4 * args.abandon + 1024
    soft, hard = raise_fd_limit(needed)
    if soft < needed:
        print(f"warning: RLIMIT_NOFILE is {soft} (hard {hard}); {needed} may be needed", file=sys.stderr)

    if args.uvloop:
        import uvloop

        uvloop.install()
    progress = Progress(args.sessions * args.turns + args.requests + args.abandon, quiet=args.quiet)
    report = asyncio.run(
        run(
            sessions=args.sessions,
            requests=args.requests,
            upstreams=args.upstreams,
            turns=args.turns,
            abandon=args.abandon,
            concurrency=args.concurrency,
            keepalive=args.keepalive,
            settle=args.settle,
            fd_slack=args.fd_slack,
            health={
                k: v for k, v in (("interval", args.health_interval), ("timeout", args.health_timeout)) if v is not None
            },
            phase_done=lambda phase, requests: progress.step(f"{phase}: done", requests),
        )
    )
    rss_slack = args.rss_slack if args.rss_slack is not None else 64 + args.sessions / 4
    failures = []
    if report.error_count:
        failures.append(f"{report.error_count} requests failed")
    if report.sessions_moved or report.sessions_short:
        failures.append(f"{report.sessions_moved} sessions moved, {report.sessions_short} short")
    if report.upstream_generations != report.generations_expected:
        failures.append(f"{report.upstream_generations} generations upstream, expected {report.generations_expected}")
    if report.disconnects != args.abandon:
        failures.append(f"{report.disconnects} of {args.abandon} walk-outs reached the upstream")
    if report.acquired_after or report.inflight_after:
        failures.append(f"{report.acquired_after} upstream connections still held, {report.inflight_after} in flight")
    if report.fds[2] > report.fds[0] + args.fd_slack:
        failures.append(f"open fds {report.fds[2]} vs baseline {report.fds[0]}")
    if report.rss[2] - report.rss[0] > rss_slack:
        failures.append(f"RSS grew {report.rss[2] - report.rss[0]:.0f} MiB (allowed {rss_slack:.0f})")
    head = f"soak: fd limit {soft}, loop {'uvloop' if args.uvloop else 'asyncio'}"
    verdict = "FAIL: " + "; ".join(failures) if failures else "PASS"
    if args.format == "json":
        print(json.dumps({**dataclasses.asdict(report), "failures": failures, "passed": not failures}, indent=1))
    elif args.format == "markdown":
        table = Table("soak", f"{head}: {verdict}", (Column("measure", "measure"), Column("value", "value")),
                      [[c.title, v] for c, v in zip(COLUMNS, figures(report, verdict), strict=True)])  # fmt: skip
        print(markdown([table]))
    elif args.format == "csv":
        print(csv_text([Table("soak", head, COLUMNS, [figures(report, verdict)])], "run"))
    else:
        print(head)
        for line in report.lines():
            print("soak: " + line)
        print("soak: " + verdict)
    return 1 if failures else 0


COLUMNS = tuple(
    Column(key, title)
    for key, title in (
        ("sessions", "concurrent sessions"), ("turns", "turns a session"), ("requests", "requests after them"),
        ("abandoned", "streams abandoned"), ("sessions_s", "sessions phase, s"), ("requests_s", "requests phase, s"),
        ("abandon_s", "abandon phase, s"), ("ok", "answers ok"), ("errors", "errors"),
        ("sessions_moved", "sessions moved"), ("sessions_short", "sessions short"),
        ("upstream_generations", "upstream generations"), ("generations_expected", "generations expected"),
        ("disconnects", "walk-outs seen upstream"), ("held_after", "upstream connections held after"),
        ("inflight_after", "in flight after"), ("fds_baseline", "open fds: baseline"), ("fds_peak", "open fds: peak"),
        ("fds_after", "open fds: after"), ("rss_baseline_mib", "RSS MiB: baseline"), ("rss_peak_mib", "RSS MiB: peak"),
        ("rss_after_mib", "RSS MiB: after"), ("result", "result"),
    )
)  # fmt: skip


def figures(report: LoadReport, verdict: str) -> list[Any]:
    """The values of COLUMNS, in order."""
    return [
        report.sessions, report.turns, report.requests, report.abandoned,
        *(round(report.seconds.get(phase, 0.0), 2) for phase in ("sessions", "requests", "abandon")),
        report.ok, report.error_count, report.sessions_moved, report.sessions_short, report.upstream_generations,
        report.generations_expected, report.disconnects, report.acquired_after, report.inflight_after,
        *report.fds, *(round(mib, 1) for mib in report.rss), verdict,
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
