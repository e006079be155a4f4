"""`launch`: gymproxy starts, supervises and stops its vLLM replicas.

The lifecycle tests run `python -m gymproxy serve --launch-vllm ...` as a real process in front of
`fake_vllm_serve.py` (a stand-in `vllm` that serves the bundled fake vLLM, starts a child as vLLM
starts its EngineCore, and fails on cue, per replica and per start), and check what a user sees:
the log, /health, the exit status, and that no process of any replica is left behind.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from gymproxy import cli
from gymproxy.config import ConfigError, Launch, build_config, load_config, to_vllm_args
from gymproxy.launch import (
    LOG_BURST,
    LOG_RATE,
    PORT_FLOOR,
    REPLICA_ENV,
    gpu_groups,
    port_free,
    prepare,
    quiet_ports,
    shown_command,
    shown_line,
)

from .served import alive

FAKE = Path(__file__).with_name("fake_vllm_serve.py")
THIEF = Path(__file__).with_name("port_thief.py")
WAIT_S = 60.0  # generous: the machine may be busy; no test waits this long when it passes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> int:
    """A base port with `count` consecutive ports free right now (the kernel's pick may have a taken neighbour)."""
    for _ in range(100):
        base = free_port()
        if base + count - 1 <= 65535 and all(port_free(base + i) for i in range(count)):
            return base
    raise AssertionError(f"no {count} consecutive free ports found")


@pytest.fixture
def vllm_bin(tmp_path: Path) -> Path:
    """An executable `vllm` that runs the fake with this interpreter."""
    path = tmp_path / "bin" / "vllm"
    path.parent.mkdir()
    path.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    path.chmod(0o755)
    return path


def wait_until(check: Any, what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Gym:
    """One `gymproxy serve --launch-vllm` process and the fake replicas' records."""

    def __init__(self, tmp_path: Path, vllm_bin: Path, *args: str, plan: str = "", env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = tmp_path / "fake"
        self.state.mkdir(exist_ok=True)
        self.log_path = tmp_path / f"gymproxy-{self.port}.log"
        environ = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        environ |= {
            "FAKE_VLLM_DIR": str(self.state),
            "FAKE_VLLM_PLAN": plan,
            "PATH": f"{vllm_bin.parent}:/usr/bin:/bin",
        }
        environ |= env or {}
        command = [sys.executable, "-m", "gymproxy", "serve", "--port", str(self.port), *args]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True
            )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str) -> None:
        wait_until(lambda: text in self.log or self.process.poll() is not None, f"{text!r} in the log")
        assert text in self.log, self.log[-4000:]

    def wait_listening(self) -> None:
        self.wait_log(" listening on http://")

    def wait_serving(self) -> None:
        """Listening (at once), and one replica ready: /health answers 200."""
        self.wait_listening()

        def ready() -> bool:
            try:
                return self.health().get("status") == "ok"
            except urllib.error.URLError:  # refused: it is stopping (its log says why)
                return self.process.poll() is not None

        wait_until(lambda: ready() or self.process.poll() is not None, "a replica ready")
        assert self.process.poll() is None, self.log[-4000:]

    def wait_exit(self, timeout: float = WAIT_S) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"gymproxy did not exit:\n{self.log[-4000:]}") from None

    def health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as reply:
                return dict(json.load(reply))
        except urllib.error.HTTPError as exc:  # 503: no upstream healthy
            return dict(json.load(exc))

    def replica(self, name: str) -> dict[str, Any]:
        return next(r for r in self.health()["replicas"] if r["name"] == name)

    def upstream(self, name: str) -> dict[str, Any]:
        return next(u for u in self.health()["upstreams"] if u["name"] == name)

    def post(
        self, path: str, body: dict[str, Any], cookie: str | None = None
    ) -> tuple[int, dict[str, Any], str | None]:
        """Status, JSON body and the new pin cookie (None: kept) of one request."""
        headers = {"Content-Type": "application/json"}
        if cookie:
            headers["Cookie"] = cookie
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                status, data, got = reply.status, json.load(reply), reply.headers.get("Set-Cookie")
        except urllib.error.HTTPError as exc:
            status, data, got = exc.code, json.load(exc), exc.headers.get("Set-Cookie")
        return status, data, got.split(";", 1)[0] if got else None

    def chat(self, cookie: str | None = None) -> tuple[int, str | None]:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        status, data, new = self.post("/v1/chat/completions", body, cookie)
        assert status != 200 or data["choices"][0]["message"]["content"] == "echo: hi", data
        return status, new

    def checks(self, name: str) -> int:
        """Health checks of upstream `name` so far, over every worker (/metrics)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        found = re.findall(rf'gymproxy_health_checks_total{{upstream="{name}",result="\w+"}} (\d+)', text)
        return sum(int(n) for n in found)

    def pids(self) -> list[int]:
        """Every process of every replica start (each fake and its child)."""
        path = self.state / "pids"
        lines = path.read_text().split("\n") if path.exists() else []
        return [int(pid) for line in lines if line for pid in line.split()[2:]]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait_exit()

    def kill_all(self) -> None:
        """Teardown after a failed test: nothing of it may outlive the test."""
        if self.process.poll() is None:
            self.process.kill()
        for pid in self.pids():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def gyms() -> Any:
    started: list[Gym] = []
    yield started
    for gym in started:
        gym.kill_all()


def pinned_to(cookie: str | None) -> str | None:
    """The upstream a pin cookie names (its first field, base64url)."""
    if not cookie:
        return None
    name = cookie.split("=", 1)[1].split(".", 1)[0]
    return base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()


QUICK = ("--set", "launch.restart.backoff_s=0.1", "--set", "launch.stop_grace_s=2")
CHAT_HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# --- the lifecycle, through the real command ----------------------------------------------


def test_serves_once_one_replica_is_ready_and_reports_the_others(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    gym = Gym(
        tmp_path,
        vllm_bin,
        "--launch-vllm",
        "tiny --dtype auto",
        "--replicas",
        "2",
        "--set",
        "launch.progress_interval_s=0.5",
        plan="0=garbage;1=slow4",
    )
    gyms.append(gym)
    gym.wait_serving()
    # vllm-1 prints for 4 s before it listens: gymproxy serves without it, and says so.
    assert gym.replica("vllm-1")["state"] in ("starting", "loading")
    assert gym.upstream("vllm-1")["state"] == "starting" and not gym.upstream("vllm-1")["healthy"]
    assert gym.chat()[0] == 200
    status, reply, _ = gym.post("/v1/responses", {"model": "m", "input": "hello"})
    assert status == 200 and reply["output"][0]["content"][0]["text"] == "echo: hello"
    gym.wait_log("vllm-1 still loading after")
    wait_until(lambda: gym.replica("vllm-1")["state"] == "ready", "vllm-1 ready")
    wait_until(lambda: gym.upstream("vllm-1")["healthy"], "vllm-1 taking sessions")
    log = gym.log
    assert "[vllm-0] INFO args: serve tiny --dtype auto --host 127.0.0.1 --port" in log
    assert "[vllm-1] INFO Loading weights..." in log
    assert "vllm-0 ready after" in log and "vllm-1 ready after" in log
    assert "\\x00\\x1b[31m" in log and "more characters)" in log  # its garbage, made printable
    assert gym.stop() == 0
    assert "stopped 2 vLLM replica(s)" in gym.log
    assert not [pid for pid in gym.pids() if alive(pid)]


def raw_post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any], float]:
    """Status, headers, JSON body and seconds taken of one POST."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), json.load(reply), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.load(exc), time.monotonic() - started


@pytest.mark.parametrize("workers", [1, 2])
def test_the_port_opens_at_once_and_says_which_replicas_are_loading(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym], workers: int
):
    # Both replicas load for seconds (vllm-1 redraws a progress bar in place): gymproxy listens at
    # once, /health lists them (503: none ready), and a request is answered at once with a 503
    # and Retry-After naming them; once one is ready, it serves.
    gym = Gym(
        tmp_path,
        vllm_bin,
        "--launch-vllm",
        "tiny",
        "--replicas",
        "2",
        "--workers",
        str(workers),
        "--set",
        "launch.progress_interval_s=0.5",
        "--set",
        "launch.stop_grace_s=2",
        plan="0=slow6;1=progress6",
    )
    gyms.append(gym)
    wait_until(lambda: gym.log.count(" listening on http://") == workers or gym.process.poll() is not None, "listening")
    health = gym.health()
    assert health["status"] == "unavailable", health
    assert [r["state"] for r in health["replicas"]] != ["ready", "ready"]
    wait_until(lambda: {r["state"] for r in gym.health()["replicas"]} == {"loading"}, "both loading")
    states = gym.health()["replicas"]
    for replica in states:  # what an operator needs, and no key, command line or environment
        assert replica["pid"] and replica["started_at"] and replica["ready_after_s"] is None
        assert not {"api_key", "argv", "env", "command"} & replica.keys()
    assert "VLLM_API_KEY" not in json.dumps(states) and "--api-key" not in json.dumps(states)
    status, headers, body, took = raw_post(gym.url + "/v1/chat/completions", CHAT_HI)
    assert status == 503 and took < 5, (status, took)
    assert headers["Retry-After"] == "5" and body["error"]["code"] == "not_ready"
    message = body["error"]["message"]
    assert "vllm-0 is loading" in message and "vllm-1 is loading" in message and "retry" in message
    status, headers, _, _ = raw_post(gym.url + "/v1/responses", {"model": "m", "input": "hi"})
    assert status == 503 and headers["Retry-After"] == "5"
    # The progress report quotes the line being drawn now, not the last whole line.
    gym.wait_log("vllm-1 still loading after")
    reports = re.findall(r"vllm-1 still loading after \d+ s \(pid \d+\); its newest line \(\d+ s ago\): (.*)", gym.log)
    assert reports and all("Loading safetensors checkpoint shards: step" in r for r in reports), reports
    gym.wait_serving()
    assert gym.chat()[0] == 200
    wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "both ready")
    assert gym.stop() == 0
    assert not [pid for pid in gym.pids() if alive(pid)]


def test_an_unknown_model_ends_with_one_line_saying_why_and_what_to_check(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym]
):
    gym = Gym(
        tmp_path, vllm_bin, "--launch-vllm", "org/no-such-model", *QUICK, plan="0=nomodel", env={"HF_HUB_OFFLINE": "1"}
    )
    gyms.append(gym)
    assert gym.wait_exit() == 1
    last = gym.log.rstrip().splitlines()[-1]
    assert last.startswith("gymproxy: startup failed: vllm-0 exited with code 1 while starting (after "), last
    assert (
        "ValidationError: 1 validation error for ModelConfig: Invalid repository ID or local directory "
        "specified: 'org/no-such-model'." in last
    )
    assert "hint: check the model 'org/no-such-model' (launch.model, --launch-vllm)" in last
    assert "no HF_TOKEN is set" in last and "HF_HUB_OFFLINE set: the model must already be in the cache" in last
    assert "Traceback" in gym.log  # the whole output is in the log above it


def test_a_replica_whose_engine_dies_is_shown_unhealthy_at_once(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    # vllm-0's /health answers 503 after 3 s while its process stays up (vLLM's engine died); one
    # that is killed is shown down as soon as it exits.
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", "--replicas", "2", *QUICK, plan="0=sick3")
    gyms.append(gym)
    gym.wait_serving()
    wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "both ready")
    wait_until(lambda: gym.replica("vllm-0")["state"] == "unhealthy", "vllm-0 unhealthy", timeout=10)
    assert gym.replica("vllm-0")["error"] == "its /health answered 503"
    assert gym.upstream("vllm-0")["state"] == "down"
    assert all(pinned_to(gym.chat()[1]) in (None, "vllm-1") for _ in range(10))
    pid = gym.replica("vllm-1")["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: gym.replica("vllm-1")["state"] != "ready", "vllm-1 shown down")
    assert time.monotonic() - killed < 1.0
    assert gym.stop() == 0


def test_a_replica_that_exits_while_starting_fails_startup(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", "--replicas", "2", plan="0=exit3;1=slow20")
    gyms.append(gym)
    assert gym.wait_exit() == 1
    log = gym.log
    assert "  [vllm-0] ERROR fake vllm: something went wrong while loading" in log  # its last lines
    # The last line says why, in one line: the cause its output gives.
    assert (
        log.rstrip()
        .splitlines()[-1]
        .startswith("gymproxy: startup failed: vllm-0 exited with code 3 while starting (after ")
    )
    assert log.rstrip().endswith("s): fake vllm: something went wrong while loading")
    wait_until(lambda: not [pid for pid in gym.pids() if alive(pid)], "every replica process gone")


def test_a_replica_that_never_answers_fails_startup_after_the_timeout(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    logs = tmp_path / "vllm-logs"
    gym = Gym(
        tmp_path,
        vllm_bin,
        "--launch-vllm",
        "tiny",
        "--vllm-log-dir",
        str(logs),
        "--set",
        "launch.startup_timeout_s=3",
        *QUICK,
        plan="0=hang",
    )
    gyms.append(gym)
    assert gym.wait_exit() == 1
    log = gym.log
    assert "vllm-0 did not answer /health within 3 s (launch.startup_timeout_s)" in log
    assert f"its whole log: {logs / 'vllm-0.log'}" in log
    assert "  [vllm-0] INFO fake vllm tiny" in log  # the last lines, in the error
    assert "gymproxy: [vllm-0]" not in log  # its output went to its file only
    assert "fake vllm tiny: replica 0 start 1: hang" in (logs / "vllm-0.log").read_text()
    assert not [pid for pid in gym.pids() if alive(pid)]


def test_a_replica_that_crashes_is_restarted_and_takes_new_sessions_only(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym]
):
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", "--replicas", "2", *QUICK)
    gyms.append(gym)
    gym.wait_serving()
    wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "both replicas ready")
    wait_until(lambda: all(u["healthy"] for u in gym.health()["upstreams"]), "both upstreams healthy")
    cookies = [gym.chat()[1] for _ in range(12)]
    on_0 = next(c for c in cookies if pinned_to(c) == "vllm-0")
    first = gym.replica("vllm-0")
    os.kill(first["pid"], signal.SIGKILL)
    # Its session moves to vllm-1 (nothing fails), and the cookie says so.
    status, moved = gym.chat(on_0)
    assert status == 200 and pinned_to(moved) == "vllm-1"
    gym.wait_log("vllm-0 exited with code -9")
    for _ in range(5):
        assert gym.chat()[0] == 200
    wait_until(lambda: gym.replica("vllm-0")["starts"] == 2 and gym.replica("vllm-0")["state"] == "ready", "restart")
    wait_until(lambda: gym.upstream("vllm-0")["healthy"], "vllm-0 healthy again")
    assert gym.replica("vllm-0")["pid"] != first["pid"]
    # Its first life's child (vLLM's EngineCore, here) went with it.
    records = [line.split() for line in (gym.state / "pids").read_text().splitlines()]
    assert not [
        pid for replica, start, *pids in records if (replica, start) == ("0", "1") for pid in pids if alive(int(pid))
    ]
    # The moved session stays where it went; new sessions reach vllm-0 again.
    status, kept = gym.chat(moved)
    assert status == 200 and kept is None
    assert any(pinned_to(gym.chat()[1]) == "vllm-0" for _ in range(40))
    # /metrics says the same: both ready, vllm-0 started twice.
    with urllib.request.urlopen(gym.url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert 'gymproxy_replica_ready{replica="vllm-0"} 1' in text and 'gymproxy_replica_ready{replica="vllm-1"} 1' in text
    assert 'gymproxy_replica_starts_total{replica="vllm-0"} 2' in text
    assert gym.stop() == 0
    assert not [pid for pid in gym.pids() if alive(pid)]


def test_a_replica_that_hangs_is_stopped_and_restarted(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    # SIGSTOP hangs it the way a deadlock does: its port takes connections that never get an answer.
    gym = Gym(
        tmp_path, vllm_bin, "--launch-vllm", "tiny", "--replicas", "2", "--set", "launch.unresponsive_s=1", *QUICK
    )
    gyms.append(gym)
    gym.wait_serving()
    wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "both replicas ready")
    wait_until(lambda: all(u["healthy"] for u in gym.health()["upstreams"]), "both upstreams healthy")
    hung = gym.replica("vllm-0")
    os.kill(hung["pid"], signal.SIGSTOP)
    gym.wait_log("vllm-0 stopped answering /health for 1 s (launch.unresponsive_s): stopping it")
    for _ in range(5):
        assert gym.chat()[0] == 200  # vllm-1 serves meanwhile
    wait_until(lambda: gym.replica("vllm-0")["starts"] == 2 and gym.replica("vllm-0")["state"] == "ready", "restart")
    assert not alive(hung["pid"])  # the stopped process got its SIGTERM (or the SIGKILL after the grace)
    assert gym.replica("vllm-1")["starts"] == 1  # the one that answers is left alone
    wait_until(lambda: gym.upstream("vllm-0")["healthy"], "vllm-0 healthy again")
    assert any(pinned_to(gym.chat()[1]) == "vllm-0" for _ in range(40))
    assert gym.stop() == 0
    assert not [pid for pid in gym.pids() if alive(pid)]


def test_a_crash_loop_is_given_up_and_shown_in_health(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    gym = Gym(
        tmp_path,
        vllm_bin,
        "--launch-vllm",
        "tiny",
        "--replicas",
        "2",
        "--set",
        "launch.restart.attempts=2",
        *QUICK,
        plan="0=ok,exit7",
    )
    gyms.append(gym)
    gym.wait_serving()
    wait_until(lambda: gym.replica("vllm-0")["state"] == "ready", "vllm-0 ready")
    os.kill(gym.replica("vllm-0")["pid"], signal.SIGKILL)
    wait_until(lambda: gym.replica("vllm-0")["state"] == "failed", "vllm-0 given up")
    replica = gym.replica("vllm-0")
    assert replica["starts"] == 3 and replica["exit_code"] == 7
    assert "exited with code 7 while starting" in replica["error"] and "given up after 2 restart(s)" in replica["error"]
    assert "ERROR gymproxy: vllm-0 exited with code 7 while starting" in gym.log
    health = gym.health()
    assert health["status"] == "ok" and gym.upstream("vllm-0")["state"] == "down"
    assert gym.chat()[0] == 200  # vllm-1 serves on
    assert gym.stop() == 0
    assert not [pid for pid in gym.pids() if alive(pid)]


def test_sigkill_of_gymproxy_leaves_no_replica_process(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    # vllm-1 ignores SIGTERM: the reaper kills it after the grace.
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", "--replicas", "2", *QUICK, plan="1=stubborn")
    gyms.append(gym)
    gym.wait_serving()
    wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "both replicas ready")
    pids = gym.pids()
    assert len(pids) == 4 and all(alive(pid) for pid in pids)
    gym.process.kill()
    gym.process.wait()
    wait_until(lambda: not [pid for pid in pids if alive(pid)], "the reaper to stop every replica", timeout=20)


def test_sigterm_kills_a_replica_that_ignores_it_after_the_grace(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", *QUICK, plan="0=stubborn")
    gyms.append(gym)
    gym.wait_serving()
    assert gym.stop() == 0
    assert "vllm-0 did not stop in 2 s: killing it" in gym.log
    assert not [pid for pid in gym.pids() if alive(pid)]


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # one another user may run


class Thief:
    """`port_thief.py` as a process (as `user`, with the system's python3; else as this one), and
    what it printed."""

    def __init__(self, port: int, seconds: float, user: int | None = None) -> None:
        python, who = sys.executable, {}
        if user is not None:
            assert SYSTEM_PYTHON is not None
            python, who = SYSTEM_PYTHON, {"user": user, "group": user, "extra_groups": []}
        self.process = subprocess.Popen(
            [python, str(THIEF), str(port), str(seconds)],
            stdout=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            **who,
        )
        self.events: list[dict[str, Any]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        wait_until(lambda: self.events or self.process.poll() is not None, "the thief to start")
        assert self.events, f"the thief exited with {self.process.returncode}"

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.events.append(json.loads(line))

    def got(self) -> list[str]:
        """What it was sent: `METHOD path` (`+key`: with a bearer token)."""
        return [
            f"{e['method']} {e['path']}{' +key' if e['key'] else ''}" for e in self.events if e["event"] == "request"
        ]

    def bound(self) -> bool:
        return any(e["event"] == "bound" for e in self.events)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.reader.join(10)
        assert self.process.stdout is not None
        self.process.stdout.close()


def kill_replica(gym: Gym, name: str) -> int:
    """SIGKILL replica `name`; its port."""
    replica = gym.replica(name)
    os.kill(replica["pid"], signal.SIGKILL)
    return int(replica["url"].rsplit(":", 1)[1].split("/")[0])


def pinned_sessions(gym: Gym, replicas: int) -> list[str | None]:
    """A few pin cookies naming vllm-0 ([None] with one replica: nothing is pinned)."""
    if replicas == 1:
        return [None]
    cookies = [c for c in (gym.chat()[1] for _ in range(40)) if pinned_to(c) == "vllm-0"][:4]
    assert cookies, "no session was pinned to vllm-0"
    return cookies


HOLD = ("--set", "launch.hold_ports=true")  # with replicas that bind with SO_REUSEPORT (HOLDABLE)
HOLDABLE = {"FAKE_VLLM_REUSE_PORT": "1"}


def launched(
    tmp_path: Path,
    vllm_bin: Path,
    gyms: list[Gym],
    replicas: int,
    workers: int,
    *args: str,
    hold: bool = False,
    env: dict[str, str] | None = None,
    plan: str = "",
) -> Gym:
    gym = Gym(
        tmp_path,
        vllm_bin,
        "--launch-vllm",
        "tiny",
        "--replicas",
        str(replicas),
        "--workers",
        str(workers),
        "--set",
        "launch.restart.backoff_s=1",
        "--set",
        "launch.stop_grace_s=2",
        "--set",
        "health.interval=0.2",
        *(HOLD if hold else ()),
        *args,
        env={**(HOLDABLE if hold else {}), **(env or {})},
        plan=plan,
    )
    gyms.append(gym)
    wait_until(lambda: gym.log.count(" listening on http://") == workers or gym.process.poll() is not None, "serving")
    wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "the replicas ready")
    wait_until(lambda: all(u["healthy"] for u in gym.health()["upstreams"]), "the upstreams healthy")
    return gym


def rounds_of_checks(gym: Gym, workers: int) -> None:
    """A few more rounds of the fleet's health checks (counted on vllm-0, sent or not)."""
    checks = gym.checks("vllm-0")
    wait_until(lambda: gym.checks("vllm-0") >= checks + 4 * workers, "a few rounds of health checks")


SCENARIOS = [(2, 1), (2, 2), (1, 1)]  # (replicas, workers)


@pytest.mark.skipif(
    os.geteuid() != 0 or SYSTEM_PYTHON is None, reason="runs a process as another user (needs root and a python3)"
)
@pytest.mark.parametrize(("replicas", "workers"), SCENARIOS)
def test_another_user_cannot_take_a_restarting_replicas_port(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym], replicas: int, workers: int
):
    # Another local user's process tries, every millisecond and every way there is, to bind
    # vllm-0's port, from before vllm-0 is killed until after it has restarted: gymproxy holds
    # the port (launch.hold_ports, with a vLLM that binds with SO_REUSEPORT), so it never gets it;
    # vllm-0 comes back, and every session's request is answered by a replica.
    gym = launched(tmp_path, vllm_bin, gyms, replicas, workers, hold=True)
    cookies = pinned_sessions(gym, replicas)
    port = int(gym.replica("vllm-0")["url"].rsplit(":", 1)[1].split("/")[0])
    thief = Thief(port, 30, user=65534)
    try:
        kill_replica(gym, "vllm-0")
        wait_until(lambda: (r := gym.replica("vllm-0"))["starts"] == 2 and r["state"] == "ready", "vllm-0 restarted")
        assert replica_port(gym, "vllm-0") == port  # it kept its port: nobody else could bind it
        rounds_of_checks(gym, workers)
        answers = [gym.post("/v1/chat/completions", CHAT_HI, cookies[i % len(cookies)]) for i in range(40)]
        robbed = sum(1 for _, data, _ in answers if data.get("id") == "stranger")
        got = thief.got()
        assert not robbed and not got, f"{robbed} of 40 answered by the thief; it got {len(got)}: {got[:5]}"
        assert not thief.bound()
        assert [status for status, _, _ in answers] == [200] * 40
        assert gym.replica("vllm-0")["state"] == "ready" and gym.upstream("vllm-0")["healthy"]
    finally:
        thief.stop()
    assert gym.stop() == 0


@pytest.mark.parametrize(("replicas", "workers", "hold"), [(*s, True) for s in SCENARIOS] + [(2, 1, False)])
def test_a_process_on_a_restarting_replicas_port_gets_no_prompt(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym], replicas: int, workers: int, hold: bool
):
    # vllm-0 is killed; once gymproxy has seen it go, a process binds its port (here of gymproxy's
    # own user, which SO_REUSEPORT lets in; with launch.hold_ports off, anyone's) and answers 200
    # to everything. Nothing reaches that process (not a prompt, not a health check, not the
    # replica's key): vllm-0 starts again on another port, and the fleet follows it there.
    gym = launched(tmp_path, vllm_bin, gyms, replicas, workers, hold=hold)
    cookies = pinned_sessions(gym, replicas)
    port = kill_replica(gym, "vllm-0")
    gym.wait_log("vllm-0 exited with code -9")
    thief = Thief(port, 60)
    try:
        wait_until(thief.bound, "the thief on the port")
        wait_until(lambda: (r := gym.replica("vllm-0"))["starts"] == 2 and r["state"] == "ready", "vllm-0 restarted")
        moved = replica_port(gym, "vllm-0")
        assert moved != port and f"vllm-0: port {port} is taken by uid {os.geteuid()}" in gym.log
        rounds_of_checks(gym, workers)
        answers = [gym.post("/v1/chat/completions", CHAT_HI, cookies[i % len(cookies)]) for i in range(40)]
        robbed = sum(1 for _, data, _ in answers if data.get("id") == "stranger")
        got = thief.got()
        assert not robbed and not got, f"{robbed} of 40 answered by the thief; it got {len(got)}: {got[:5]}"
        assert [status for status, _, _ in answers] == [200] * 40
        assert gym.upstream("vllm-0")["url"] == f"http://127.0.0.1:{moved}/v1" and gym.upstream("vllm-0")["healthy"]
    finally:
        thief.stop()
    assert gym.stop() == 0


# Another local user is who the checks are about (gymproxy's own user is trusted: its processes can
# read a replica's key anyway). Without root the thief runs as this user, and what keeps it out is
# then the replica's pidfd alone, which leaves a window of microseconds (docs/launch.md, "A replica's
# port and key").
THIEF_USER = 65534 if os.geteuid() == 0 and SYSTEM_PYTHON is not None else None
THIEF_WHO = "uid 65534 (nobody), pid " if THIEF_USER is not None else f"uid {os.geteuid()}"
CHAT_SLOW = {"model": "m", "messages": [{"role": "user", "content": "hi [[slow]]"}]}  # FAKE_VLLM_SLOW


def replica_port(gym: Gym, name: str) -> int:
    return int(gym.replica(name)["url"].rsplit(":", 1)[1].split("/")[0])


@pytest.mark.parametrize(("replicas", "workers"), SCENARIOS)
def test_requests_in_flight_on_a_killed_replica_reach_no_process_on_its_port(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym], replicas: int, workers: int
):
    # The red team's H2: sessions pinned to vllm-0 keep requests in flight there (each answered
    # after 0.3 s), and another user's process spins on vllm-0's port from before vllm-0 is
    # SIGKILLed, so it binds the port within a millisecond of the death, before the launcher's
    # notice reaches the fleet. Those requests' connections close without a reply (as an idle
    # close does); none may be sent to that port again, nor a health check with the replica's key:
    # the client asks the replica's Owner before and after it opens any connection there. Three
    # kills in a row, each on the port vllm-0 moved to.
    gym = launched(tmp_path, vllm_bin, gyms, replicas, workers, env={"FAKE_VLLM_SLOW": "0.3"})
    cookies = pinned_sessions(gym, replicas)
    for kill in range(1, 4):
        answers, thief = killed_while_busy(gym, cookies, starts=kill + 1)
        got = thief.got()
        robbed = sum(1 for _, data, _ in answers if data.get("id") == "stranger")
        assert not got and not robbed, f"kill {kill}: the thief got {len(got)}: {got[:5]}; it answered {robbed}"
        assert thief.bound(), f"kill {kill}: the thief never had the port"
        statuses = {status for status, _, _ in answers}
        assert statuses == {200} if replicas > 1 else statuses <= {200, 502, 503}, statuses
    assert gym.stop() == 0


def killed_while_busy(
    gym: Gym, cookies: list[str | None], starts: int
) -> tuple[list[tuple[int, dict[str, Any], str | None]], Thief]:
    """With a thief spinning on vllm-0's port, and sessions keeping 12 requests in flight on it,
    SIGKILL vllm-0; the sessions go on until it has started `starts` times and is ready. Their
    answers, and the thief (stopped)."""
    thief = Thief(replica_port(gym, "vllm-0"), 30, user=THIEF_USER)
    answers: list[tuple[int, dict[str, Any], str | None]] = []
    stop = threading.Event()

    def client(cookie: str | None) -> None:
        while not stop.is_set():
            answers.append(gym.post("/v1/chat/completions", CHAT_SLOW, cookie))

    threads = [threading.Thread(target=client, args=(c,)) for c in cookies for _ in range(12 // len(cookies))]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # a few rounds of requests
        kill_replica(gym, "vllm-0")
        wait_until(lambda: (r := gym.replica("vllm-0"))["starts"] == starts and r["state"] == "ready", "vllm-0 back")
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        thief.stop()
    return answers, thief


@pytest.mark.parametrize("workers", [1, 2])
def test_a_replica_whose_port_is_taken_while_it_restarts_moves_and_keeps_its_sessions(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym], workers: int
):
    # One restart allowed, and another user's process takes vllm-0's port as it dies and keeps it:
    # vllm-0 starts again on a fresh port, spending no restart on that (a local user cannot use up
    # the budget, nor keep it out); the log names the port and who holds it; every worker's fleet
    # follows it there, and a session pinned to vllm-0 is served by it again.
    gym = launched(tmp_path, vllm_bin, gyms, 2, workers, "--set", "launch.restart.attempts=1")
    cookie = pinned_sessions(gym, 2)[0]
    port = replica_port(gym, "vllm-0")
    thief = Thief(port, 60, user=THIEF_USER)
    try:
        kill_replica(gym, "vllm-0")
        wait_until(lambda: (r := gym.replica("vllm-0"))["starts"] == 2 and r["state"] == "ready", "vllm-0 restarted")
        moved = replica_port(gym, "vllm-0")
        assert moved != port and thief.bound()
        assert f"vllm-0: port {port} is taken by {THIEF_WHO}" in gym.log and f": moved to port {moved}" in gym.log
        url = f"http://127.0.0.1:{moved}/v1"
        wait_until(lambda: all(gym.upstream("vllm-0")["url"] == url for _ in range(8)), "the fleet to follow it")
        rounds_of_checks(gym, workers)
        for _ in range(10):
            assert gym.chat(cookie) == (200, None)  # served where its pin says: vllm-0, on its new port
        assert not thief.got() and "given up" not in gym.log
        assert gym.replica("vllm-0")["state"] == "ready"
    finally:
        thief.stop()
    assert gym.stop() == 0


def test_a_port_taken_after_the_launcher_looked_and_before_the_replica_binds_it_costs_no_restart(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym]
):
    # vllm-0's second start prints for 2 s before it binds its port (as vLLM imports for seconds),
    # and another user's process takes the port meanwhile: that start fails, and it is no restart
    # spent (one allowed, used by the kill): vllm-0 moves to a fresh port and serves.
    gym = launched(tmp_path, vllm_bin, gyms, 2, 1, "--set", "launch.restart.attempts=1", plan="0=ok,slow2,ok")
    port = kill_replica(gym, "vllm-0")
    wait_until(lambda: gym.log.count(f"vllm-0 starting (port {port})") == 2, "vllm-0's second start")
    thief = Thief(port, 30, user=THIEF_USER)
    try:
        wait_until(thief.bound, "the thief on the port")
        wait_until(lambda: (r := gym.replica("vllm-0"))["starts"] == 3 and r["state"] == "ready", "vllm-0 restarted")
        moved = replica_port(gym, "vllm-0")
        log = gym.log
        assert re.search(
            rf"vllm-0 exited with code 1 while starting .*, and another process holds its port {port}\n", log
        )
        assert f"vllm-0: port {port} is taken by {THIEF_WHO}" in log and f": moved to port {moved}" in log
        assert "given up" not in log and not thief.got()
    finally:
        thief.stop()
    assert gym.stop() == 0


def test_a_fixed_port_taken_while_its_replica_restarts_is_waited_for_without_spending_restarts(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym]
):
    # With launch.base_port the replica keeps its port: while another process holds it, vllm-0 waits
    # (saying who holds it), spends no restart, and starts there once the port is free.
    base = free_ports(2)
    gym = launched(
        tmp_path, vllm_bin, gyms, 2, 1, "--set", f"launch.base_port={base}", "--set", "launch.restart.attempts=1"
    )
    thief = Thief(base, 4, user=THIEF_USER)  # it holds the port until 4 s after it started
    try:
        kill_replica(gym, "vllm-0")
        gym.wait_log(f"vllm-0: port {base} is taken by {THIEF_WHO}")
        assert "waiting for it (launch.base_port fixes the ports)" in gym.log
        assert thief.bound() and gym.replica("vllm-0")["state"] != "ready"
        wait_until(lambda: (r := gym.replica("vllm-0"))["starts"] == 2 and r["state"] == "ready", "vllm-0 restarted")
        assert replica_port(gym, "vllm-0") == base and "given up" not in gym.log and not thief.got()
    finally:
        thief.stop()
    assert gym.stop() == 0


def test_replicas_serve_with_a_key_of_their_own_and_none_of_gymproxys_secrets(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym]
):
    secrets_env = {"GYMPROXY_PIN_SECRET": "pin-secret-of-gymproxy", "OPENAI_API_KEY": "sk-client-key"}
    gym = Gym(
        tmp_path,
        vllm_bin,
        "--launch-vllm",
        "tiny",
        "--replicas",
        "2",
        *QUICK,
        env={**secrets_env, "HF_TOKEN": "hf_for_gated_models"},
    )
    gyms.append(gym)
    gym.wait_serving()
    wait_until(lambda: all(u["healthy"] for u in gym.health()["upstreams"]), "both upstreams healthy")
    assert gym.chat()[0] == 200
    keys = []
    for replica in gym.health()["replicas"]:
        index = replica["name"].split("-")[1]
        env = json.loads((gym.state / f"env-{index}-1.json").read_text())
        assert not set(secrets_env) & set(env) and env["HF_TOKEN"] == "hf_for_gated_models"
        key = env["VLLM_API_KEY"]
        keys.append(key)
        assert key.encode() not in Path(f"/proc/{replica['pid']}/cmdline").read_bytes()  # `ps` shows argv
        # The replica takes nothing without its key: only gymproxy, which has it, gets answers.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(replica["url"] + "/models", timeout=10)
        assert refused.value.code == 401
        refused.value.close()
        request = urllib.request.Request(replica["url"] + "/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200
    assert len(set(keys)) == 2
    health = json.dumps(gym.health())
    assert gym.stop() == 0
    assert not [key for key in keys if key in health or key in gym.log]


def test_a_server_that_does_not_check_the_replicas_key_is_not_taken_for_it(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym]
):
    # What answers on the port must prove it is the replica: a server that takes any key (here the
    # replica itself, run by a wrapper that dropped VLLM_API_KEY) is never ready.
    gym = Gym(
        tmp_path, vllm_bin, "--launch-vllm", "tiny", "--set", "launch.startup_timeout_s=4", *QUICK, plan="0=nokey"
    )
    gyms.append(gym)
    assert gym.wait_exit() == 1
    log = gym.log
    assert "vllm-0 is not ready: the server on port" in log and "does not check vllm-0's API key" in log
    assert "vllm-0 was not ready within 4 s (launch.startup_timeout_s): the server on port" in log


def test_a_chatty_replica_is_logged_at_a_bounded_rate(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    # A vLLM logs a line per request: past a burst, at most LOG_RATE lines a second reach
    # gymproxy's log, and the number left out is logged instead.
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", *QUICK, plan="0=chatty5000")
    gyms.append(gym)
    gym.wait_serving()
    started = time.monotonic()
    wait_until(lambda: gym.log.count("Received request") > LOG_BURST + LOG_RATE // 2, "the burst spent")
    assert gym.chat()[0] == 200
    assert gym.stop() == 0
    elapsed = time.monotonic() - started
    log = gym.log
    logged = log.count("Received request")
    assert logged <= LOG_BURST + LOG_RATE * (elapsed + 10), (logged, elapsed)
    dropped = re.findall(r"\[vllm-0\] \.\.\. (\d+) more lines in the last \d+ s not logged \(over 100 a second", log)
    assert dropped and sum(int(n) for n in dropped) > 0


def test_a_vllm_that_cannot_bind_beside_the_held_port_says_what_to_do(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    # vLLM with one API server binds without SO_REUSEPORT: the port gymproxy holds for it is in use.
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", *HOLD, *QUICK, plan="0=noreuse", env=HOLDABLE)
    gyms.append(gym)
    assert gym.wait_exit() == 1
    assert "exited with code 1 while starting" in gym.log and "set launch.hold_ports: false" in gym.log
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", *QUICK, plan="0=noreuse")  # hold_ports is off by default
    gyms.append(gym)
    gym.wait_serving()
    assert gym.chat()[0] == 200
    assert gym.stop() == 0


def test_sighup_rereads_the_config_and_keeps_the_replicas(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", "--replicas", "2", *QUICK)
    gyms.append(gym)
    gym.wait_serving()
    gym.process.send_signal(signal.SIGHUP)
    gym.wait_log("fleet reloaded: 2 upstreams; added none, removed none, changed none")
    assert [u["name"] for u in gym.health()["upstreams"]] == ["vllm-0", "vllm-1"]
    assert gym.chat()[0] == 200
    assert gym.stop() == 0


def test_workers_serve_in_front_of_the_replicas_their_parent_runs(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", "--replicas", "2", "--workers", "2", *QUICK)
    gyms.append(gym)
    wait_until(lambda: gym.log.count(" listening on http://") == 2 or gym.process.poll() is not None, "2 workers")
    wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "both replicas ready")
    wait_until(lambda: all(u["healthy"] for u in gym.health()["upstreams"]), "both upstreams healthy")
    first = gym.replica("vllm-0")
    os.kill(first["pid"], signal.SIGKILL)
    # Each worker finds out on its own (a refused request is re-sent): no request fails.
    for _ in range(20):
        assert gym.chat()[0] == 200
    wait_until(lambda: gym.replica("vllm-0")["starts"] == 2 and gym.replica("vllm-0")["state"] == "ready", "restart")
    for _ in range(10):
        assert gym.chat()[0] == 200
    assert gym.stop() == 0
    assert "stopped 2 vLLM replica(s)" in gym.log
    assert not [pid for pid in gym.pids() if alive(pid)]


def test_sigkill_of_gymproxy_with_workers_leaves_no_worker_and_no_replica(
    tmp_path: Path, vllm_bin: Path, gyms: list[Gym]
):
    """The parent of `--workers` runs the replicas: after its SIGKILL the reaper stops them, and the
    workers, which went on answering 502 for good, stop too."""
    gym = Gym(tmp_path, vllm_bin, "--launch-vllm", "tiny", "--replicas", "2", "--workers", "2", *QUICK)
    gyms.append(gym)
    wait_until(lambda: gym.log.count(" listening on http://") == 2 or gym.process.poll() is not None, "2 workers")
    workers = [int(pid) for pid in re.findall(r" listening on http://\S+ \(pid (\d+),", gym.log)]
    try:
        wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "both replicas ready")
        assert gym.chat()[0] == 200
        replicas = gym.pids()
        assert len(workers) == 2 and len(replicas) == 4 and all(alive(pid) for pid in workers + replicas)
        gym.process.kill()
        gym.process.wait()
        wait_until(lambda: not [pid for pid in workers + replicas if alive(pid)], "every process to stop", timeout=20)
        assert port_free(gym.port)
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_nemo_gym_local_vllm_model_block_starts_the_same_server(tmp_path: Path, vllm_bin: Path, gyms: list[Gym]):
    config = tmp_path / "local_vllm_model.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "policy_model": {
                    "responses_api_models": {
                        "local_vllm_model": {
                            "entrypoint": "app.py",
                            "model": "${policy_model_name}",
                            "return_token_id_information": False,
                            "uses_reasoning_parser": False,
                            "debug": False,
                            "hf_home": str(tmp_path / "hf"),
                            "launcher": "subprocess",
                            "subprocess": {"executable": str(vllm_bin), "startup_timeout_seconds": 600},
                            "vllm_serve_env_vars": {"VLLM_RAY_DP_PACK_STRATEGY": "strict"},
                            "vllm_serve_kwargs": {
                                "data_parallel_size": 1,
                                "tensor_parallel_size": 1,
                                "pipeline_parallel_size": 1,
                                "enable_auto_tool_choice": True,
                                "tool_call_parser": "hermes",
                            },
                        }
                    }
                }
            },
            sort_keys=False,
        )
    )
    gym = Gym(tmp_path, vllm_bin, "--config", str(config), "--set", "policy_model_name=org/tiny")
    gyms.append(gym)
    gym.wait_serving()
    log = gym.log
    assert (
        f"[vllm-0] INFO args: serve org/tiny --data-parallel-size=1 --tensor-parallel-size=1 "
        f"--pipeline-parallel-size=1 --enable-auto-tool-choice --tool-call-parser=hermes "
        f"--download-dir={tmp_path / 'hf' / 'hub'} --disable-log-stats --host 127.0.0.1 --port"
    ) in log
    body = {"model": "org/tiny", "messages": [{"role": "user", "content": "hi"}]}
    status, reply, _ = gym.post("/v1/chat/completions", body)
    assert status == 200 and reply["model"] == "org/tiny"
    assert gym.stop() == 0


# --- bad input: a message naming the option, exit status 2, nothing started ----------------


@pytest.mark.parametrize(
    ("args", "environ", "message"),
    [
        (["--vllm-bin", "/no/such/vllm"], {}, "launch.vllm_bin: '/no/such/vllm' is not an executable file"),
        (["--vllm-bin", "no-such-vllm"], {}, "launch.vllm_bin: 'no-such-vllm' is not on PATH"),
        (["--replicas", "2", "--gpus-per-replica", "2"], {"CUDA_VISIBLE_DEVICES": "0,1"}, "need 4 GPUs"),
        (["--gpus-per-replica", "1"], {}, "need 1 GPUs, but nvidia-smi -L lists 0"),
        (["--launch-vllm", "tiny --port 9000"], {}, "launch.args: gymproxy sets --port for each replica"),
        (["--launch-vllm", "--model tiny"], {}, "the model first"),
        (["--launch-vllm", "tiny 'unclosed"], {}, "--launch-vllm: cannot split"),
        (["--replicas", "0"], {}, "launch.replicas: expected `int` >= 1"),
        (["--upstream", "http://x/v1"], {}, "give it or `base_url`/`upstreams`/`upstreams_dns`, not both"),
    ],
)
def test_bad_launch_input_is_an_error_naming_the_option(
    args: list[str], environ: dict[str, str], message: str, vllm_bin: Path, monkeypatch: pytest.MonkeyPatch, capsys
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", f"{vllm_bin.parent}:/usr/bin:/bin")
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    command = ["serve", "--port", str(free_port())]
    if not any(a == "--launch-vllm" for a in args):
        command += ["--launch-vllm", "tiny"]
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_taken_port_is_an_error_before_anything_starts(vllm_bin: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.setenv("PATH", f"{vllm_bin.parent}:/usr/bin:/bin")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit):
            cli.main(["serve", "--launch-vllm", "tiny", "--set", f"launch.base_port={port}"])
    assert f"launch.base_port: port {port} (of [{port}]) is taken by another process" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit):
            cli.main(["serve", "--launch-vllm", "tiny", "--port", str(port)])
    assert f"port: 127.0.0.1:{port} (gymproxy's own, --port) is taken" in capsys.readouterr().err


# --- planning: GPUs, command lines, the config ----------------------------------------------


def plan(environ: dict[str, str], **launch: Any) -> list[str | None]:
    config = build_config({"port": 0, "launch": {"model": "m", "vllm_bin": "/bin/sh", **launch}}, environ={})
    replicas = prepare(config, environ).replicas
    for r in replicas:  # a replica without GPUs of its own keeps gymproxy's CUDA_VISIBLE_DEVICES
        assert r.env.get("CUDA_VISIBLE_DEVICES") == (
            ",".join(r.devices) if r.devices else environ.get("CUDA_VISIBLE_DEVICES")
        )
    return [",".join(r.devices) if r.devices is not None else None for r in replicas]


def test_each_replica_gets_its_own_gpus():
    assert plan({"CUDA_VISIBLE_DEVICES": "3,4,5,6"}, replicas=2, gpus_per_replica=2) == ["3,4", "5,6"]
    assert plan({"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}, replicas=2) == ["GPU-a", "GPU-b"]
    # The default is what the parallel sizes of the args need.
    assert plan({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, replicas=2, args=["-tp", "2"]) == ["0,1", "2,3"]
    assert plan(
        {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, args=["--tensor-parallel-size=2", "--data-parallel-size", "2"]
    ) == ["0,1,2,3"]
    # 0, or no GPUs at all with the default: CUDA_VISIBLE_DEVICES is left alone (a CPU vLLM).
    assert plan({"CUDA_VISIBLE_DEVICES": "0,1"}, replicas=2, gpus_per_replica=0) == [None, None]
    assert plan({"PATH": "/nonexistent"}, replicas=2) == [None, None]


def test_gpus_come_from_nvidia_smi_without_cuda_visible_devices(tmp_path: Path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\nfor i in 0 1 2; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n')
    smi.chmod(0o755)
    environ = {"PATH": str(tmp_path)}
    assert plan(environ, replicas=3) == ["0", "1", "2"]
    launch = build_config({"launch": {"model": "m", "replicas": 2, "gpus_per_replica": 2}}, environ={}).launch
    assert isinstance(launch, Launch)
    with pytest.raises(ConfigError, match=r"need 4 GPUs, but nvidia-smi -L lists 3; use fewer"):
        gpu_groups(launch, environ)


def test_replica_command_lines_and_environment(tmp_path: Path):
    config = build_config(
        {
            "port": 0,
            "launch": {
                "model": "Qwen/Qwen3-8B",
                "args": "--served-model-name qwen --api-key 'se cret' --max-model-len 4096",
                "replicas": 2,
                "env": {"VLLM_X": "1"},
                "hf_home": str(tmp_path / "hf"),
                "vllm_bin": "/bin/sh",
                "base_port": free_ports(2),
            },
        },
        environ={},
    )
    launcher = prepare(config, {"PATH": "/usr/bin", "VLLM_API_KEY": "inherited"})
    first, second = launcher.replicas
    assert first.argv[1:] == [
        "serve",
        "Qwen/Qwen3-8B",
        "--served-model-name",
        "qwen",
        "--api-key",
        "se cret",
        "--max-model-len",
        "4096",
        "--host",
        "127.0.0.1",
        "--port",
        str(first.port),
    ]
    assert second.port == first.port + 1
    assert first.env["HF_HOME"] == str(tmp_path / "hf") and first.env["VLLM_X"] == "1"
    assert (first.env[REPLICA_ENV], second.env[REPLICA_ENV]) == ("0", "1")
    # The fleet is the replicas, sent the name and key vLLM serves with.
    served = launcher.config
    assert [(u.name, u.url) for u in served.upstreams] == [("vllm-0", first.url), ("vllm-1", second.url)]
    assert served.model == "qwen" and served.api_key == "se cret"
    # The user's --api-key is the replicas' key, and the only one: no VLLM_API_KEY beside it.
    assert [u.api_key for u in served.upstreams] == ["se cret", "se cret"]
    assert "VLLM_API_KEY" not in first.env and "VLLM_API_KEY" not in second.env
    assert "--api-key **** " in shown_command(first.argv) and "se cret" not in shown_command(first.argv)
    assert shown_command(["x", "--hf-token=abc"]) == "x --hf-token=****"


def test_each_replica_gets_a_key_of_its_own_and_none_of_gymproxys_secrets(tmp_path: Path):
    config = build_config(
        {
            "port": 0,
            "api_key": "upstream-key-of-gymproxy",
            "access": {"api_keys": ["client-key-of-gymproxy"]},
            "pinning": {"secret_env": "MY_PIN_SECRET"},
            "launch": {"model": "m", "replicas": 2, "vllm_bin": "/bin/sh", "env": {"OPENAI_API_KEY": "given"}},
        },
        environ={},
    )
    environ = {
        "PATH": "/usr/bin",
        "MY_PIN_SECRET": "pin-secret",
        "OPENAI_API_KEY": "sk-client",
        "HF_TOKEN": "hf_gated_models",  # vLLM needs it to download a gated model
        "UPSTREAM_KEY": "upstream-key-of-gymproxy",
        "CLIENT_KEYS": "client-key-of-gymproxy",
        "SHORT": "EMPTY",
        "VLLM_API_KEY": "inherited",
    }
    launcher = prepare(config, environ)
    first, second = launcher.replicas
    for replica in (first, second):
        assert replica.env["HF_TOKEN"] == "hf_gated_models" and replica.env["SHORT"] == "EMPTY"
        assert replica.env["OPENAI_API_KEY"] == "given"  # launch.env is the user's word
        assert not {"MY_PIN_SECRET", "UPSTREAM_KEY", "CLIENT_KEYS"} & set(replica.env)
        assert replica.env["VLLM_API_KEY"] == replica.api_key and len(replica.api_key) >= 32
        assert replica.api_key not in " ".join(replica.argv)  # argv is for every local user to see
    assert first.api_key != second.api_key
    assert [u.api_key for u in launcher.config.upstreams] == [first.api_key, second.api_key]
    plain = build_config({"port": 0, "launch": {"model": "m", "vllm_bin": "/bin/sh"}}, environ={})
    assert "OPENAI_API_KEY" not in prepare(plain, environ).replicas[0].env
    assert "GYMPROXY_PIN_SECRET" not in prepare(plain, {"GYMPROXY_PIN_SECRET": "p", "PATH": "/usr/bin"}).replicas[0].env


def test_replica_ports_are_free_and_outside_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # An outgoing connection's local port comes from the ephemeral range: there it could take a
    # replica's port while the replica restarts.
    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("32768\t60999\n")
    ports = quiet_ports(8, ephemeral)
    assert len(set(ports)) == 8 and all(PORT_FLOOR <= p < 32768 or p > 60999 for p in ports)
    assert all(port_free(p) for p in ports)
    ephemeral.write_text("1024 65535\n")  # no room outside it: the kernel picks
    assert len(set(quiet_ports(3, ephemeral))) == 3
    ephemeral.write_text("garbage")  # unreadable: Linux's default range is assumed
    assert all(PORT_FLOOR <= p < 32768 or p > 60999 for p in quiet_ports(2, ephemeral))
    # A taken port is passed over: the scan starts at a listener's port.
    ephemeral.write_text("32768 60999")
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: past a TIME_WAIT there
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        monkeypatch.setattr("gymproxy.launch.random.randrange", lambda size: ports[0] - PORT_FLOOR)
        assert quiet_ports(2, ephemeral) == [ports[0] + 1, ports[0] + 2] or not port_free(ports[0] + 1)
    monkeypatch.undo()
    config = build_config({"port": 0, "launch": {"model": "m", "replicas": 3, "vllm_bin": "/bin/sh"}}, environ={})
    planned = [r.port for r in prepare(config, {"PATH": "/usr/bin"}).replicas]
    assert len(set(planned)) == 3 and all(PORT_FLOOR <= p < 32768 or p > 60999 for p in planned)


def test_output_lines_are_made_safe_to_log():
    assert shown_line(b"plain\r\n") == "plain"
    assert shown_line(b"10%\r50%\r100%\n") == "100%"
    assert shown_line(b"\x00\x1b[1m\xffok\t.") == "\\x00\\x1b[1m\ufffdok\t."
    long = shown_line(b"y" * 5000)
    assert long.startswith("y" * 4096) and long.endswith("(904 more characters)")


def test_the_launch_section_from_a_flat_file(tmp_path: Path):
    path = tmp_path / "gymproxy.yaml"
    path.write_text("launch:\n  model: tiny\n  args: --dtype auto\n  replicas: 2\n  env: {VLLM_USE_V1: 1, X: true}\n")
    config = load_config(path, environ={}, extra={"launch": {"replicas": 3}})
    assert config.launch is not None
    assert (config.launch.model, config.launch.args, config.launch.replicas) == ("tiny", ["--dtype", "auto"], 3)
    assert config.launch.env == {"VLLM_USE_V1": "1", "X": "true"}  # as written, though YAML reads numbers
    with pytest.raises(ConfigError, match=r"unknown key; did you mean launch.replicas\?"):
        load_config(path, environ={}, overrides={"launch.replica": "2"})


def test_vllm_serve_kwargs_become_flags():
    options = {"tensor_parallel_size": 2, "trust_remote_code": True, "enforce_eager": False, "seed": None}
    options |= {"model_loader_extra_config": {"num_threads": 16}, "middleware": ["a", "b"]}
    assert to_vllm_args(options) == [
        "--tensor-parallel-size=2",
        "--trust-remote-code",
        "--no-enforce-eager",
        '--model-loader-extra-config={"num_threads": 16}',
        "--middleware",
        "a",
        "b",
    ]


def nemo(block: dict[str, Any], tmp_path: Path) -> Any:
    path = tmp_path / "nemo.yaml"
    path.write_text(
        yaml.safe_dump({"policy_model": {"responses_api_models": {"local_vllm_model": block}}}, sort_keys=False)
    )
    return load_config(path, environ={})


def test_a_local_vllm_model_block_loads_as_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    kwargs = {"model": "/ckpt/step-100", "tensor_parallel_size": 4, "gpu_memory_utilization": 0.9}
    config = nemo({"model": "policy", "vllm_serve_kwargs": kwargs, "vllm_serve_env_vars": {"A": "1"}}, tmp_path)
    launch = config.launch
    assert launch is not None and launch.model == "/ckpt/step-100" and launch.env == {"A": "1"}
    hf_home = tmp_path / ".cache" / "huggingface"  # NeMo Gym's default
    assert launch.hf_home == str(hf_home)
    assert launch.args == [
        "--tensor-parallel-size=4",
        "--gpu-memory-utilization=0.9",
        "--served-model-name=policy",
        f"--download-dir={hf_home / 'hub'}",
        "--disable-log-stats",
    ]
    assert config.model == "policy" and config.name == "policy_model"
    assert gpu_groups(launch, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) == [["0", "1", "2", "3"]]
    # A block with a base_url names a server already running: nothing is launched.
    external = nemo({"model": "m", "base_url": "http://h:8000/v1", "vllm_serve_kwargs": {}}, tmp_path)
    assert external.launch is None and external.base_url == ["http://h:8000/v1"]
    # gymproxy's own launch keys may sit beside NeMo Gym's.
    both = nemo({"model": "m", "vllm_serve_kwargs": {}, "launch": {"replicas": 4}}, tmp_path)
    assert both.launch is not None and both.launch.replicas == 4 and both.launch.model == "m"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"router": {"port": 1}}, "local_vllm_model `router` is not supported by gymproxy"),
        ({"pd": {"prefill": {}}}, "local_vllm_model `pd` is not supported"),
        ({"ray_worker_py_executable": "/x/python"}, "`ray_worker_py_executable` is not supported"),
        ({"subprocess": {"probe_timeout_seconds": 5}}, "`subprocess.probe_timeout_seconds` is not supported"),
        ({"vllm_serve_kwargs": {"port": 9000}}, "`vllm_serve_kwargs.port` is set by gymproxy"),
        ({"launcher": "slurm"}, "`launcher` must be ray or subprocess"),
        ({"supply_prefix_token_ids": True}, "`supply_prefix_token_ids` is not supported"),
    ],
)
def test_local_vllm_model_keys_gymproxy_does_not_implement_are_refused(
    extra: dict[str, Any], message: str, tmp_path: Path
):
    with pytest.raises(ConfigError, match=message.replace("`", "`").replace("(", r"\(")):
        nemo({"model": "m", "vllm_serve_kwargs": {}, **extra}, tmp_path)


def test_check_config_says_what_it_launches(tmp_path: Path, capsys):
    path = tmp_path / "g.yaml"
    path.write_text("launch: {model: tiny, replicas: 2}\n")
    cli.main(["check-config", str(path)])
    assert capsys.readouterr().out.strip() == "ok: launches 2 vLLM replica(s) of tiny"


def test_the_reference_config_documents_every_launch_key():
    """conf/gymproxy.yaml has `launch: null` (the test of test_config checks that) and, commented
    below it, every key of the section at its default."""
    import msgspec

    from gymproxy.config import Restart

    text = (Path(__file__).parent.parent / "conf" / "gymproxy.yaml").read_text()
    block = text[text.index("\nlaunch: null") :].split("\n\n", 1)[0]
    lines = [line[1:] for line in block.splitlines()[1:] if line.startswith("#   ") and ":" in line]
    documented = yaml.safe_load("\n".join(line.split("  #", 1)[0].rstrip() for line in lines))
    defaults = msgspec.to_builtins(Launch(model="Qwen/Qwen3-8B"))
    defaults["restart"] = msgspec.to_builtins(Restart())
    assert documented == defaults


def test_with_fleet_control_replicas_run_in_vllm_dev_mode():
    """`access.fleet_control`: vLLM mounts /pause, /resume and the weight routes only with
    VLLM_SERVER_DEV_MODE=1, so every replica gets it; without fleet control none does."""
    launch = {"model": "m", "replicas": 2, "vllm_bin": "/bin/sh", "base_port": free_ports(2)}
    on = build_config({"port": 0, "access": {"fleet_control": True}, "launch": launch}, environ={})
    off = build_config({"port": 0, "launch": {**launch, "base_port": free_ports(2)}}, environ={})
    assert [r.env.get("VLLM_SERVER_DEV_MODE") for r in prepare(on, {"PATH": "/usr/bin"}).replicas] == ["1", "1"]
    assert [r.env.get("VLLM_SERVER_DEV_MODE") for r in prepare(off, {"PATH": "/usr/bin"}).replicas] == [None, None]


def test_a_reasoning_parser_in_the_launch_args_sets_uses_reasoning_parser(caplog: pytest.LogCaptureFixture):
    launch = {"model": "m", "args": "--reasoning-parser qwen3"}
    with caplog.at_level(logging.INFO, logger="gymproxy"):
        assert build_config({"launch": launch}, environ={}).uses_reasoning_parser is True
    assert "launch.args has --reasoning-parser: uses_reasoning_parser is true" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gymproxy"):
        said = build_config({"launch": launch, "uses_reasoning_parser": False}, environ={})
    assert said.uses_reasoning_parser is False
    assert "the config sets uses_reasoning_parser: false" in caplog.text
    kwargs = {"model": "m", "args": ["--reasoning-parser=deepseek_r1"]}
    assert build_config({"launch": kwargs}, environ={}).uses_reasoning_parser is True
    assert build_config({"launch": {"model": "m", "args": "--dtype auto"}}, environ={}).uses_reasoning_parser is False
    assert build_config({"base_url": "http://h:1/v1"}, environ={}).uses_reasoning_parser is False
