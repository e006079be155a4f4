"""Load in-process: concurrent pinned multi-turn streaming sessions over several fake vLLMs,
then a burst of mixed requests, then clients that walk away mid-stream (see tests/loadrun.py).

Sized by GYMPROXY_LOAD_SESSIONS (default 200 concurrent sessions) and GYMPROXY_LOAD_REQUESTS
(default 2000 requests); `bench/soak.py` runs the same scenario at full size. Deselect with
`-m "not load"`.

`test_zz_summary` is the session summary of tests/test_faults.py, tests/test_hostile.py and this
module: pytest runs files in name order and this one last among them, so when it runs the
counters in tests/faults.py are complete. See its output with `-rA` (or `-s`).
"""

from __future__ import annotations

import os

import pytest

from .faults import STATS, summary, survived
from .loadrun import run

SESSIONS = int(os.environ.get("GYMPROXY_LOAD_SESSIONS", "200"))
REQUESTS = int(os.environ.get("GYMPROXY_LOAD_REQUESTS", "2000"))
FD_SLACK = 16
RSS_SLACK_MB = 64 + SESSIONS * 0.25  # CPython keeps freed arenas; a leak grows with the load


@pytest.mark.load
async def test_load_sessions_requests_and_abandoned_streams():
    abandon = max(10, SESSIONS // 10)
    # Health checks are kept out of the way: with every client, fake and gymproxy on one loop, a
    # slow /health answer marks all upstreams down (test_faults.py::test_slow_health_checks_do_not_take_the_fleet_down).
    report = await run(
        sessions=SESSIONS, requests=REQUESTS, abandon=abandon, fd_slack=FD_SLACK, health={"interval": 3600}
    )
    STATS["lost"] += report.error_count
    survived(report.abandoned)
    details = "\n".join(report.lines())
    assert report.error_count == 0, details
    assert report.sessions_moved == 0, details  # every session stayed on one upstream
    assert report.sessions_short == 0, details
    assert all(report.spread), details  # and sessions went to every upstream
    assert report.upstream_generations == report.generations_expected, details  # nothing sent twice
    assert report.disconnects == abandon, details  # every walk-out reached the upstream
    assert report.acquired_after == 0 and report.inflight_after == 0, details
    assert report.fds[2] <= report.fds[0] + FD_SLACK, details
    assert report.rss[2] - report.rss[0] < RSS_SLACK_MB, details


def test_zz_summary():
    print(summary())
    assert STATS["lost"] == 0, summary()
