"""`gymproxy serve` as the installed command runs it, plus one hook for tests: on SIGUSR1 the process
writes what it holds to the file named by $GYMPROXY_STATS (RSS in MB, the peak RSS since the last
report, open file descriptors, live asyncio tasks, and timer handles, counted on the event loop itself)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys

import gymproxy.server
from gymproxy.cli import main

_new_loop = gymproxy.server.new_loop


def _stats() -> dict[str, float]:
    gc.collect()
    with open("/proc/self/status") as status:
        kb = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS:", "VmHWM:"))}
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak starts again from here (Linux 4.0 and later)
    return {
        "rss_mb": kb["VmRSS"] / 1024,
        "peak_rss_mb": kb["VmHWM"] / 1024,  # since the last report (or the start)
        "fds": len(os.listdir("/proc/self/fd")),
        "tasks": len(asyncio.all_tasks()),
        "timers": sum(1 for o in gc.get_objects() if type(o).__name__ == "TimerHandle"),
    }


def _dump() -> None:
    path = os.environ["GYMPROXY_STATS"]
    with open(path + ".tmp", "w") as out:
        json.dump(_stats(), out)
    os.replace(path + ".tmp", path)


def _loop_with_probe() -> asyncio.AbstractEventLoop:
    loop = _new_loop()
    loop.add_signal_handler(signal.SIGUSR1, _dump)
    return loop


if __name__ == "__main__":
    gymproxy.server.new_loop = _loop_with_probe
    main(sys.argv[1:])
