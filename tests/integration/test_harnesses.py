"""The real-client suite: Codex CLI and Claude Code, unchanged, through `gymproxy serve`.

Each test runs a harness's own binary (installed by harnesses.sh) as a process, as its users run
it (`codex exec "..."`, `claude -p "..."`), pointed at gymproxy:

    harness -> client tap -> gymproxy (subprocess) -> upstream tap a | b -> fake vLLM or vllm serve

gymproxy has two upstreams (two taps in front of one server) and places new sessions round robin,
so a session that is not kept on one upstream shows at once. The taps keep every byte, so each
test checks both what the harness printed and what reached the upstreams.

Two backends: the fake vLLM (`python -m gymproxy.testing.fake_vllm`, steered by directives in the
prompt: `[[call:<tool> <args>]]`, `[[no-call]]`) and the real vLLM of this directory's suite,
whose tiny model calls `get_weather {"city": "Paris"}` when tools are offered and the user spoke
last, a tool neither harness has, once a conversation: after the tool's result it answers in text.

With GYMPROXY_RECORD=1 the plain-answer tests write each harness's first request, redacted, to
tests/data/harnesses/ (replayed by tests/test_harness_requests.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .clients import SAMPLES, ClaudeCode, Codex, Harness, Turn, base_env, run, sample, turns
from .conftest import RECORD, Proxy, ProxyFactory
from .harness import MAX_MODEL_LEN, MODEL_NAME, Exchange, LoopThread, free_port, stop, wait_http
from .make_model import ANSWER_TEXT, TOOL_NAME

HERE = Path(__file__).resolve().parent
REQUIRE = os.environ.get("GYMPROXY_REQUIRE_HARNESSES") == "1"
# Seconds a harness run may take: the fake answers at once; the real vLLM prefills 16k-28k prompt
# tokens per request on a shared CPU (about 15 s cold, a few seconds once its prefix is cached).
TIMEOUT = {"fake": 90.0, "vllm": 300.0}
GENERATIONS = ("/v1/responses", "/v1/messages", "/v1/chat/completions")
# What the harnesses' streams end with when they are complete.
TERMINAL = {"codex": "response.completed", "claude": "message_stop"}
VERSIONS = {"codex": ("codex-cli 0.169.0", "codex-0.169"), "claude": ("Claude Code 2.1.332", "claude-code-2.1")}
PROXY_CONFIG: dict[str, Any] = {
    "uses_reasoning_parser": True,
    "pinning": {"secret": "harness-secret", "placement": "round_robin"},
}


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def installed() -> dict[str, str]:
    """The harness executables: from GYMPROXY_CODEX / GYMPROXY_CLAUDE (run.sh), or harnesses.sh."""
    if unavailable := os.environ.get("GYMPROXY_HARNESSES_UNAVAILABLE"):  # run.sh: harnesses.sh said why
        pytest.skip(unavailable)
    found = {"codex": os.environ.get("GYMPROXY_CODEX", ""), "claude": os.environ.get("GYMPROXY_CLAUDE", "")}
    if not all(found.values()):
        done = subprocess.run(["bash", str(HERE / "harnesses.sh")], capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            reason = lines[-1] if lines else f"harnesses.sh exited {done.returncode}"
            if REQUIRE:
                pytest.fail(f"GYMPROXY_REQUIRE_HARNESSES=1 but {reason}", pytrace=False)
            pytest.skip(reason)
        paths = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
        found = {"codex": paths.get("CODEX", ""), "claude": paths.get("CLAUDE", "")}
    return found


@pytest.fixture(params=["codex", "claude"])
def harness(request: pytest.FixtureRequest, installed: dict[str, str], tmp_path: Path) -> Harness:
    kind = Codex if request.param == "codex" else ClaudeCode
    return kind(installed[request.param], tmp_path / request.param)


@dataclass(frozen=True)
class FakeServer:
    root: str


@pytest.fixture(scope="session")
def fake_server(logs: Path) -> Any:
    """The fake vLLM as its own process, with the real one's model name and context length."""
    port = free_port()
    log = logs / "fake-vllm.log"
    argv = [sys.executable, "-m", "gymproxy.testing.fake_vllm", "--port", str(port), "--model", MODEL_NAME]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*argv, "--max-model-len", str(MAX_MODEL_LEN)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        server = FakeServer(f"http://127.0.0.1:{port}")
        wait_http(server.root + "/health", 30, proc, log)
        yield server
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def fake_factory(loop_thread: LoopThread, logs: Path) -> Any:
    factory = ProxyFactory(loop_thread, logs)
    yield factory
    factory.close()


@dataclass(frozen=True)
class Backend:
    name: str  # fake or vllm
    proxy: Proxy

    @property
    def timeout(self) -> float:
        return TIMEOUT[self.name]


@pytest.fixture(params=["fake", "vllm"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """gymproxy with two upstreams in front of the fake vLLM or of the real one (skipped without it)."""
    if request.param == "fake":
        server = request.getfixturevalue("fake_server")
        factory = request.getfixturevalue("fake_factory")
        upstreams = [("fake-a", server), ("fake-b", server)]
        return Backend("fake", factory.get("harness-fake", upstreams, **PROXY_CONFIG))
    servers = request.getfixturevalue("vllm")
    factory = request.getfixturevalue("factory")
    upstreams = [("vllm-a", servers.reasoning), ("vllm-b", servers.reasoning)]
    return Backend("vllm", factory.get("harness-vllm", upstreams, **PROXY_CONFIG))


# --- what reached gymproxy and the upstreams ----------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    client: list[Exchange]  # harness -> gymproxy
    upstream: list[Exchange]  # gymproxy -> upstreams, oldest first (health checks left out)

    @property
    def generations(self) -> list[Exchange]:
        return [e for e in self.upstream if e.path.split("?")[0] in GENERATIONS]

    def report(self) -> str:
        lines = [f"client -> gymproxy: {e.method} {e.path} -> {e.status}" for e in self.client]
        lines += [f"gymproxy -> {e.tap}: {e.method} {e.path} -> {e.status}" for e in self.upstream]
        bad = [e for e in [*self.client, *self.upstream] if e.status != 200]
        lines += [f"--- {e.tap} {e.path} answered {e.status}: {e.response[:2000]!r}" for e in bad]
        return "\n".join(lines)


def traffic(proxy: Proxy) -> Traffic:
    """Everything that crossed the taps since the last call."""
    client = proxy.client_tap.take()
    upstream = sorted((e for tap in proxy.upstream_taps for e in tap.take()), key=lambda e: e.started)
    return Traffic(client, [e for e in upstream if e.path != "/health"])


def conversation(exchange: Exchange) -> list[Turn]:
    return turns(exchange.path, exchange.request_json())


def check_streams(harness: Harness, seen: Traffic, why: str) -> None:
    """Every harness request was answered 200 with a complete stream, and streamed upstream too."""
    assert seen.client and seen.generations, why
    for exchange in seen.client:
        assert exchange.status == 200 and exchange.content_type == "text/event-stream", why
        events = [e.get("type") for e in exchange.sse() if isinstance(e, dict)]
        assert events and events[-1] == TERMINAL[harness.name], f"{events[-3:]}\n{why}"
    assert all(e.request_json().get("stream") is True for e in seen.generations), why


def check_one_upstream(seen: Traffic, why: str) -> None:
    """The whole session stayed on one upstream (new sessions are placed round robin)."""
    taps = [e.tap for e in seen.generations]
    assert len(set(taps)) == 1, f"the session moved between upstreams: {taps}\n{why}"


def check_round_trip(conversation: list[Turn], tool: str, output: str, why: str) -> None:
    """The conversation ends with a call of `tool` and its result, which contains `output`."""
    called = [i for i, turn in enumerate(conversation) if turn.calls]
    assert called, f"no tool call in {conversation}\n{why}"
    results = conversation[called[-1] + 1 :]
    assert conversation[called[-1]].calls == (tool,), why
    assert [t.role for t in results] == ["tool"] and output in results[0].text, f"{results}\n{why}"


def record(harness: Harness, seen: Traffic, command: str) -> None:
    version, stem = VERSIONS[harness.name]
    SAMPLES.mkdir(parents=True, exist_ok=True)
    data = sample(harness, seen.client[0], version, command)
    (SAMPLES / f"{stem}-first-request.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


# --- the tests --------------------------------------------------------------------------------


def marker() -> str:
    return uuid.uuid4().hex[:12]


@pytest.mark.parametrize("backend", ["fake"], indirect=True)
def test_plain_answer(harness: Harness, backend: Backend) -> None:
    """A one-request session: the harness prints the model's text answer."""
    prompt = "Say hello [[no-call]]"
    done = harness.run(prompt, url=backend.proxy.root, timeout=backend.timeout)
    seen = traffic(backend.proxy)
    if RECORD and seen.client:  # what the harness sends does not depend on what gymproxy answers
        record(harness, seen, f"{'codex exec' if harness.name == 'codex' else 'claude -p'} {prompt!r}")
    why = f"{done.report()}\n{seen.report()}"
    done.check(seen.report())
    assert [e.path.split("?")[0] for e in seen.client] == [harness.route], why
    check_streams(harness, seen, why)
    (generation,) = seen.generations
    assert conversation(generation)[-1].role == "user" and prompt in conversation(generation)[-1].text, why
    assert done.stdout.startswith("echo: ") and prompt in done.stdout, why  # Claude Code's note comes first


def test_tool_round_trip(harness: Harness, backend: Backend) -> None:
    """The model calls a tool, the harness runs it and sends its output back, the model answers."""
    if backend.name == "fake":
        mark = marker()
        # The command prints gp-<mark> but does not contain it: only its output can bring it back.
        prompt = "Run this, please. " + harness.shell_call(f"printf '%s-%s\\n' gp {mark}")
        tool, output, answer = ("exec_command" if harness.name == "codex" else "Bash"), f"gp-{mark}", "tool said: "
    else:
        # The tiny model calls get_weather, which neither harness has: its error is the tool output.
        prompt, tool, output, answer = "What is the weather in Paris?", TOOL_NAME, TOOL_NAME, ANSWER_TEXT
    done = harness.run(prompt, url=backend.proxy.root, timeout=backend.timeout)
    seen = traffic(backend.proxy)
    why = f"{done.report()}\n{seen.report()}"
    done.check(seen.report())
    check_streams(harness, seen, why)
    assert len(seen.generations) == 2, why
    first, second = (conversation(e) for e in seen.generations)
    assert first[-1].role == "user" and not any(t.calls for t in first), why
    check_round_trip(second, tool, output, why)
    assert answer in done.stdout, why
    if backend.name == "fake":
        assert output in done.stdout, why
    check_one_upstream(seen, why)


def test_second_turn_stays_on_one_upstream(harness: Harness, backend: Backend) -> None:
    """A tool round trip, then `codex exec resume --last` / `claude -p --continue`: one session,
    every request of it (three) on the same upstream, the history carried."""
    mark = marker()
    if backend.name == "fake":
        first_prompt = f"Run this ({mark}). " + harness.shell_call(f"printf '%s-%s\\n' gp {mark}")
        second_prompt, answer, requests = f"Thanks {mark}, that is all. [[no-call]]", "echo: ", 3
    else:
        first_prompt, second_prompt, answer, requests = f"Weather in Paris? ({mark})", "Thanks!", ANSWER_TEXT, 3
    one = harness.run(first_prompt, url=backend.proxy.root, timeout=backend.timeout)
    seen = traffic(backend.proxy)
    one.check(seen.report())
    two = harness.run(second_prompt, url=backend.proxy.root, timeout=backend.timeout, again=True)
    seen = Traffic(seen.client + (more := traffic(backend.proxy)).client, seen.upstream + more.upstream)
    why = f"first turn:\n{one.report()}\nsecond turn:\n{two.report()}\n{seen.report()}"
    two.check(seen.report())
    check_streams(harness, seen, why)
    assert len(seen.generations) == requests, why
    check_one_upstream(seen, why)
    last = conversation(seen.generations[-1])
    users = [t.text for t in last if t.role == "user"]
    assert any(mark in text for text in users[:-1]) and "Thanks" in users[-1], f"{last}\n{why}"
    assert answer in two.stdout, why


# --- a harness that hangs ------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_hanging_harness_is_killed_at_its_timeout(tmp_path: Path) -> None:
    """The run ends at its timeout with what it printed, and takes the commands it started along."""
    script = "echo started; echo oops >&2; sleep 300 & echo $! > child.pid; wait"
    began = time.monotonic()
    done = run(["bash", "-c", script], base_env(tmp_path), tmp_path, timeout=2)
    assert time.monotonic() - began < 10
    assert done.timed_out and done.stdout == "started\n" and done.stderr == "oops\n"
    assert "killed after its 2 s timeout" in done.report() and "started" in done.report()
    with pytest.raises(AssertionError, match="killed after its 2 s timeout"):
        done.check()
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_a_harness_whose_descendant_keeps_its_output_open_still_ends(tmp_path: Path) -> None:
    """A descendant in a session of its own survives the kill and holds the pipes: the run ends anyway."""
    script = "echo started; setsid sleep 300 & echo $! > escaped.pid; wait"
    began = time.monotonic()
    done = run(["bash", "-c", script], base_env(tmp_path), tmp_path, timeout=1)
    escaped = int((tmp_path / "escaped.pid").read_text())
    try:
        assert time.monotonic() - began < 20
        assert done.timed_out and "(output pipes still held open)" in done.stderr
    finally:
        os.kill(escaped, signal.SIGKILL)


# --- rollout capture: a harness's calls recorded with the tokens vLLM returned -------------------

CAPTURE_CONFIG: dict[str, Any] = {**PROXY_CONFIG, "capture": {"enabled": True}}


def returned_tokens(exchange: Exchange) -> dict[str, Any]:
    """What vLLM returned for one upstream chat call, read from the bytes the tap kept: the prompt's
    ids, the generated ids and their log probs, as a capturing gymproxy must record them."""
    if exchange.content_type == "text/event-stream":
        prompt, generated, logprobs = None, [], []
        for chunk in exchange.sse():
            if not isinstance(chunk, dict):
                continue
            prompt = chunk.get("prompt_token_ids") or prompt
            for choice in chunk.get("choices") or ():
                generated += choice.get("token_ids") or []
                logprobs += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or ()]
    else:
        reply = exchange.json()
        choice = reply["choices"][0]
        prompt, generated = reply["prompt_token_ids"], choice["token_ids"]
        logprobs = [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or ()]
    return {"prompt_token_ids": prompt, "generation_token_ids": generated, "generation_log_probs": logprobs}


def rollout_of(proxy: Proxy, rid: str) -> dict[str, Any]:
    """`GET /v1/rollouts/<rid>` once every call has ended (records are written in batches)."""
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"{proxy.gymproxy.root}/v1/rollouts/{rid}", timeout=10) as r:
            got: dict[str, Any] = json.loads(r.read())
        if all(c["outcome"] != "in_flight" for c in got["calls"]) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.fixture(params=["fake", "vllm"])
def capturing(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """As `backend`, with rollout capture on (an SQLite store of its own)."""
    config = {**CAPTURE_CONFIG, "capture": {"enabled": True, "store": f"sqlite:///{tmp_path / 'rollouts.db'}"}}
    if request.param == "fake":
        server = request.getfixturevalue("fake_server")
        factory = request.getfixturevalue("fake_factory")
        return Backend("fake", factory.get(f"capture-fake-{tmp_path.name}", [("fake-a", server)], **config))
    servers = request.getfixturevalue("vllm")
    factory = request.getfixturevalue("factory")
    return Backend("vllm", factory.get(f"capture-vllm-{tmp_path.name}", [("vllm-a", servers.reasoning)], **config))


def test_a_harness_rollout_is_captured_with_the_tokens_vllm_returned(harness: Harness, capturing: Backend) -> None:
    """A tool task of at least three model calls, the harness's base URL under /ng-rollout/<id>/: the
    rollout holds every call with exactly the ids vLLM returned, rebuilt into one segment whose loss
    mask covers the completion tokens, and the harness never saw a token field."""
    rid = f"{harness.name}-{marker()}"
    url = f"{capturing.proxy.root}/ng-rollout/{rid}"
    if capturing.name == "fake":
        mark = marker()
        first = f"Run this ({mark}). " + harness.shell_call(f"printf '%s-%s\\n' gp {mark}")
        second = f"Thanks {mark}, that is all. [[no-call]]"
    else:
        first, second = "What is the weather in Paris?", "Thanks!"
    one = harness.run(first, url=url, timeout=capturing.timeout)
    seen = traffic(capturing.proxy)
    one.check(seen.report())
    two = harness.run(second, url=url, timeout=capturing.timeout, again=True)
    more = traffic(capturing.proxy)
    seen = Traffic(seen.client + more.client, seen.upstream + more.upstream)
    why = f"{one.report()}\n{two.report()}\n{seen.report()}"
    two.check(seen.report())
    got = rollout_of(capturing.proxy, rid)
    calls = got["calls"]
    why += "\n" + json.dumps({k: v for k, v in got.items() if k != "calls"}, default=str)[:4000]
    assert len(calls) == len(seen.generations) >= 3, why
    assert [c["seq"] for c in calls] == list(range(1, len(calls) + 1)), why
    assert all(c["outcome"] == "ok" for c in calls), why
    for call, exchange in zip(calls, seen.generations, strict=True):
        sent = returned_tokens(exchange)
        assert call["prompt_token_ids"] == sent["prompt_token_ids"], why
        assert call["generation_token_ids"] == sent["generation_token_ids"], why
        assert call["generation_log_probs"] == sent["generation_log_probs"], why
    assert got["breaks"] == [], f"{got['breaks']}\n{why}"
    (segment,) = got["segments"]
    assert sum(segment["loss_mask"]) == sum(c["usage"]["completion_tokens"] for c in calls), why
    for exchange in seen.client:  # the harness saw none of what was asked for capture
        assert b"token_ids" not in exchange.response and b'"logprob"' not in exchange.response, why
