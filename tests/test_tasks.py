"""tasks.cancel: a task that loses its cancellation (as `asyncio.wait_for` can before Python 3.12,
when the operation it waits for completes as the task is cancelled) is cancelled again until it ends."""

from __future__ import annotations

import asyncio

from gymproxy import tasks


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again() -> None:
    swallowed = 0

    async def checks() -> None:  # a health-check loop whose wait lost the first cancellation
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1

    task = asyncio.ensure_future(checks())
    await asyncio.sleep(0.02)
    await asyncio.wait_for(tasks.cancel([task]), 5)
    assert task.cancelled() and swallowed == 1


async def test_tasks_that_ended_or_failed_are_taken_as_they_are() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    done = asyncio.ensure_future(asyncio.sleep(0))
    failed = asyncio.ensure_future(fails())
    await asyncio.sleep(0.01)
    await tasks.cancel([done, failed])  # the error is retrieved: no "never retrieved" warning
    assert done.done() and isinstance(failed.exception(), ValueError)
