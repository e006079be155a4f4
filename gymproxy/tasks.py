"""Cancelling tasks for good.

Before Python 3.12, `asyncio.wait_for` returns the result of an operation that completes just as its
task is cancelled, and the cancellation is lost: a task that loops over such waits (health checks,
polls) goes on, and whoever awaits it after cancelling waits forever. A SIGTERM that came as a
worker's first health checks were answered kept the worker from exiting. `cancel` cancels, waits a
moment, and cancels again whatever still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

AGAIN_S: Final = 0.1  # how long a cancelled task has to end before it is cancelled again


async def cancel(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and return once every one has ended (their results and errors are dropped)."""
    every = list(tasks)
    pending = {task for task in every if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=AGAIN_S)
    for task in every:
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as never retrieved
