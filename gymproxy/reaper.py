"""The last guard of `launch`: stops gymproxy's vLLM process groups once gymproxy is gone, however
it went (SIGKILL included), since a group's grandchildren (vLLM's EngineCore) outlive any signal
sent to their parent alone.

gymproxy runs this file as a script in a session of its own (so a kill of gymproxy's group spares
it) and writes `+PGID` / `-PGID` lines to its stdin as it starts and reaps each group. End of input
means gymproxy has exited: every group still listed gets SIGTERM, and SIGKILL after the grace
given as the only argument. It imports nothing of gymproxy, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.1


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the id went to someone else's group: not ours to kill
        return False
    return True


def kill(groups: set[int], signum: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str]) -> None:
    grace = float(argv[1]) if len(argv) > 1 else 10.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is gymproxy's to handle, not ours
    groups: set[int] = set()
    for line in sys.stdin.buffer:
        text = line.strip().decode(errors="replace")
        try:
            pgid = int(text[1:])
        except ValueError:
            continue
        if text.startswith("+"):
            groups.add(pgid)
        elif text.startswith("-"):
            groups.discard(pgid)
    groups = {pgid for pgid in groups if alive(pgid)}
    if not groups:
        return
    print(f"gymproxy-reaper: gymproxy is gone; stopping vLLM process groups {sorted(groups)}", file=sys.stderr)
    kill(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pgid) for pgid in groups):
        time.sleep(POLL_S)
    kill({pgid for pgid in groups if alive(pgid)}, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv)
