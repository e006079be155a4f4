"""gymproxy.workers: the workers of `gymproxy serve --workers N` die with their parent, and a worker
that stops answering its heartbeat, or exits, is replaced; tested on the real command.

The worker pids come from their "listening on" lines (each names its pid); the runtime directory from
the unix sockets a worker holds (`/proc/net/unix`), so the checks need nothing gymproxy chose to log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .served import Served, alive

WAIT_S = 30.0  # generous: the machine may be busy; no test waits this long when it passes
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def worker_pids(log: str) -> list[int]:
    """Every worker that has listened, in the order they did (a replacement comes last)."""
    return [int(pid) for pid in re.findall(r" listening on http://\S+ \(pid (\d+),", log)]


def runtime_dir(pid: int) -> Path:
    """The directory of the metrics socket worker `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[6] in inodes and fields[7].endswith(".sock"):
            return Path(fields[7]).parent
    raise AssertionError(f"worker {pid} holds no metrics socket")


def port_free(port: int) -> bool:
    """Nothing listens on `port` (a plain bind, without SO_REUSEPORT, would fail beside a listener)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
        return True


async def until(check: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def kill_all(pids: list[int]) -> None:
    """Teardown after a failed test: no process of it may outlive the test."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


async def answered_within(url: str, seconds: float, count: int) -> list[int]:
    """The statuses of `count` requests, each on a new connection (the kernel spreads them over the
    workers); a request not answered within `seconds` is a 0."""
    statuses = []
    timeout = aiohttp.ClientTimeout(total=seconds)
    for _ in range(count):
        async with aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()) as session:
            try:
                async with session.post(url + "/v1/chat/completions", json=CHAT) as response:
                    await response.read()
                    statuses.append(response.status)
            except asyncio.TimeoutError:
                statuses.append(0)
    return statuses


def samples(text: str, name: str) -> dict[str, float]:
    """The values of metric `name` by their `worker` label."""
    return {
        s.labels.get("worker", ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def test_the_workers_of_a_killed_parent_stop_and_free_the_port(fake_vllm, tmp_path):
    """SIGKILL of the parent: every worker is gone within seconds (they kept serving, with the old
    config and upstreams, beside the next gymproxy on the port), and so is the runtime directory."""
    served = Served(tmp_path, {"base_url": fake_vllm.url}, "--workers", "2")
    served.start()
    assert served.process is not None
    pids: list[int] = []
    try:
        await until(lambda: len(worker_pids(served.log)) == 2, "2 workers")
        pids = worker_pids(served.log)
        runtime = runtime_dir(pids[0])
        assert runtime.is_dir() and runtime_dir(pids[1]) == runtime
        assert (await answered_within(served.url, 5, 4)) == [200] * 4
        served.process.kill()
        served.process.wait(10)
        await until(lambda: not [pid for pid in pids if alive(pid)], "every worker to exit", timeout=10)
        assert port_free(served.port)
        await until(lambda: not runtime.exists(), "the runtime directory to go", timeout=5)
    finally:
        if served.process.poll() is None:
            served.process.kill()
        kill_all(pids)


async def test_a_stopped_worker_is_replaced_and_its_share_answered(fake_vllm, tmp_path):
    """SIGSTOP of one of 2 workers: the kernel keeps handing it connections nobody answers, until
    the parent, which gets no heartbeat from it, kills it and starts another in its place."""
    served = Served(tmp_path, {"base_url": fake_vllm.url}, "--workers", "2")
    try:
        async with served:
            await until(lambda: len(worker_pids(served.log)) == 2, "2 workers")
            stopped = worker_pids(served.log)[0]
            os.kill(stopped, signal.SIGSTOP)
            await until(lambda: len(worker_pids(served.log)) == 3, "a worker in place of the stopped one")
            assert not alive(stopped)
            assert re.search(rf"worker \d \(pid {stopped}\) sent no heartbeat for", served.log), served.log[-3000:]
            assert (await answered_within(served.url, 2, 20)) == [200] * 20
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
                for _ in range(6):
                    async with session.get(served.url + "/metrics") as response:
                        assert response.status == 200
                        text = await response.text()
                    assert samples(text, "gymproxy_metrics_workers_missing") == {"": 0}
                    restarts = samples(text, "gymproxy_worker_restarts_total")
                    assert sorted(restarts) == ["0", "1"] and sorted(restarts.values()) == [0, 1]
    finally:
        kill_all(worker_pids(served.log))
    assert served.process is not None and served.process.returncode == 0, served.log[-3000:]


async def test_a_worker_that_exits_is_replaced_and_rereads_the_config_its_siblings_did(fake_vllm, tmp_path):
    """A worker killed outright is started again under its index; since its siblings re-read the
    config on a SIGHUP, the new one does too once it listens (it started from the first config)."""
    served = Served(tmp_path, {"base_url": fake_vllm.url}, "--workers", "2")
    try:
        async with served:
            await until(lambda: len(worker_pids(served.log)) == 2, "2 workers")
            upstreams = [{"url": fake_vllm.url, "name": name} for name in "ab"]
            served.config_path.write_text(yaml.safe_dump({"port": served.port, "upstreams": upstreams}))
            assert served.process is not None
            served.process.send_signal(signal.SIGHUP)
            await until(lambda: served.log.count("fleet reloaded: 2 upstreams") == 2, "both workers to reload")
            killed = worker_pids(served.log)[1]
            os.kill(killed, signal.SIGKILL)
            await until(lambda: len(worker_pids(served.log)) == 3, "a worker in place of the killed one")
            assert re.search(rf"worker \d \(pid {killed}\) exited with SIGKILL; starting another", served.log)
            await until(lambda: served.log.count("fleet reloaded: 2 upstreams") == 3, "the new worker to reload")
            assert (await answered_within(served.url, 5, 10)) == [200] * 10
    finally:
        kill_all(worker_pids(served.log))
    assert served.process is not None and served.process.returncode == 0, served.log[-3000:]
    assert "needs a restart" not in served.log


async def test_a_worker_past_its_restarts_is_given_up_and_the_others_serve_on(fake_vllm, tmp_path):
    """One worker that keeps dying does not take gymproxy (and every other worker's requests) down
    with it; once no worker is left, gymproxy stops with an error."""
    config = {"base_url": fake_vllm.url, "workers": {"restart": {"attempts": 0}}}
    served = Served(tmp_path, config, "--workers", "2")
    try:
        served.start()
        await served.wait_listening()
        await until(lambda: len(worker_pids(served.log)) == 2, "2 workers")
        first, second = worker_pids(served.log)
        os.kill(first, signal.SIGKILL)
        await until(lambda: "1 of 2 workers serve on" in served.log, "the worker to be given up")
        assert (await answered_within(served.url, 2, 10)) == [200] * 10
        os.kill(second, signal.SIGKILL)
        assert await served.wait(WAIT_S) == 1
        assert "no worker is left" in served.log
    finally:
        if served.process is not None and served.process.poll() is None:
            served.process.kill()
        kill_all(worker_pids(served.log))


async def test_a_worker_that_cannot_start_stops_gymproxy_with_an_error(fake_vllm, tmp_path):
    """Not a restart loop: a worker of the first start that exits before it listens (here its admin
    port is taken) ends the parent with an error naming it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = {"base_url": fake_vllm.url, "access": {"admin_port": taken.getsockname()[1]}}
        served = Served(tmp_path, config, "--workers", "2")
        served.start()
        assert await served.wait(WAIT_S) != 0
    assert "before it listened" in served.log, served.log[-3000:]


def test_a_runtime_directory_nobody_holds_is_swept(tmp_path, caplog):
    """A gymproxy killed with all its workers leaves its runtime directory: the next one removes it,
    and only it (one still held, or not gymproxy's, stays)."""
    from gymproxy.workers import LOCK, PREFIX, RuntimeDir, sweep

    caplog.set_level(logging.INFO, logger="gymproxy")
    held = RuntimeDir.make(tmp_path)
    left = RuntimeDir.make(tmp_path)
    os.close(left.lock)  # as when every process holding it was killed
    foreign = tmp_path / f"{PREFIX}not-ours"
    foreign.mkdir()
    sweep(tmp_path)
    assert held.path.is_dir() and (held.path / LOCK).exists()
    assert not left.path.exists()
    assert foreign.is_dir()
    assert f"removed {left.path}" in caplog.text
    held.remove()
    assert not held.path.exists()


@pytest.mark.parametrize("last", [False, True])
def test_the_last_process_out_removes_the_runtime_directory(tmp_path, last):
    from gymproxy.workers import RuntimeDir, hold, leave

    runtime = RuntimeDir.make(tmp_path)
    worker = hold(runtime.path)
    if last:
        os.close(runtime.lock)  # the parent was killed
    leave(runtime.path, worker)
    assert runtime.path.exists() is not last
