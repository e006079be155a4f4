"""A simulated fleet: how well each router keeps prefix caches hot and engines evenly loaded.

Each run starts a fresh fleet of simulated vLLM engines (`sim_engines.py`, one process), one
router in front of it (a target), and drives many concurrent multi-turn agent sessions through it
on `/v1/chat/completions`. Scenarios change the fleet: one engine 3x slower, an engine added or
killed mid-run, prefill that stalls the whole batch, a trainer that pauses the fleet for a weight
update every few seconds. See bench/README.md ("fleet.py").

    python bench/fleet.py --quick                              # kill and weight-sync, hash-mod-n and gymproxy: ~40 s
    python bench/fleet.py --scenarios balanced,slow --targets round-robin,hash-mod-n,gymproxy
    python bench/fleet.py --variant 'new=/work/wt-x/.venv/bin/python -m gymproxy' --check
    python bench/fleet.py --scenarios weight-sync,weight-sync-keep --targets no-proxy,vllm-router:cache_aware,gymproxy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import options  # noqa: E402
import plot  # noqa: E402
from formats import Column, Table, csv_text, markdown  # noqa: E402
from procs import Service, free_port  # noqa: E402
from progress import Progress  # noqa: E402

BENCH = Path(__file__).resolve().parent
LOOPBACK = "127.0.0.1"
ROUTER_POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin")
BUILTIN = {"round-robin": "round_robin", "hash-mod-n": "hash_mod_n"}
STICKY_BASELINES = ("hash-mod-n", "vllm-router:cache_aware", "vllm-router:consistent_hash")
CLIENT_KINDS = ("cookie", "x-session-id", "session-id", "user")
NO_PROXY = "no-proxy"  # the clients talk to the engines themselves, each session to one of them


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    slow: float = 1.0  # slowdown of engine 0
    gpu_prefill: bool = False
    event: str = ""  # "kill" or "add", at `event_at` of the measured window
    sync: str = ""  # a weight update every --sync-every s, pausing the fleet in this mode
    retries: int = 2  # a client retries a failed turn this many times (0.5 s apart), then gives up the session


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("balanced", "N equal engines"),
        Scenario("slow", "engine e0 is 3x slower", slow=3.0),
        Scenario("add", "an engine joins mid-run", event="add"),
        Scenario("kill", "engine e1 is killed mid-run (listener closed, connections reset)", event="kill"),
        Scenario("gpu-prefill", "N equal engines; a prefill stalls the whole batch", gpu_prefill=True),
        Scenario("weight-sync", "a weight update every --sync-every s, pausing abort", sync="abort", retries=10),
        Scenario("weight-sync-keep", "a weight update every --sync-every s, pausing keep", sync="keep", retries=10),
    )
}


# --- the workload ----------------------------------------------------------------------------------


def words(rng: random.Random, n: int, prefix: str) -> str:
    return " ".join(f"{prefix}{rng.randrange(20000)}" for _ in range(n))


@dataclass
class Turn:
    session: str
    kind: str
    rid: str
    start: float
    end: float = 0.0
    ok: bool = False
    stream: bool = False
    error: str = ""
    status: int = 0  # the reply's HTTP status (0: none)
    finish: str = ""  # the reply's finish_reason
    stamp: str | None = None  # the reply's X-Weight-Version


@dataclass
class Workload:
    """Sessions of task families (shared system prompts), geometric numbers of turns, tool results."""

    sessions: int = 96
    families: int = 8
    system_words: int = 1000
    mean_turns: float = 8.0
    max_turns: int = 40
    tool_words: int = 120
    answer_tokens: tuple[int, int] = (20, 60)
    think: tuple[float, float] = (0.05, 0.3)
    stream_share: float = 0.25
    retries: int = 2
    retry_delay: float = 0.5
    seed: int = 1
    systems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.systems = [words(random.Random(f"family{f}"), self.system_words, f"f{f}w") for f in range(self.families)]


class Driver:
    """Keeps `sessions` agent sessions going against `urls` until `stop`; records every turn.

    With several URLs (no router: the clients talk to the engines), session n talks to `urls[n % len]`.
    """

    def __init__(self, work: Workload, urls: list[str], tag: str, *, rid_header: bool = True) -> None:
        self.work = work
        self.rid_header = rid_header
        self.urls = [url + "/v1/chat/completions" for url in urls]
        self.tag = tag
        self.turns: list[Turn] = []
        self.started = 0
        self.session_start: dict[str, float] = {}
        self.stop_at = 0.0
        self.rng = random.Random(work.seed)

    async def run(self, seconds: float) -> None:
        self.stop_at = time.monotonic() + seconds
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
        ) as http:
            await asyncio.gather(*(self.slot(http, i) for i in range(self.work.sessions)))

    async def slot(self, http: aiohttp.ClientSession, slot: int) -> None:
        await asyncio.sleep(slot * 0.01)  # a ramp, not a thundering herd
        while time.monotonic() < self.stop_at:
            await self.session(http)

    async def session(self, http: aiohttp.ClientSession) -> None:
        work, rng = self.work, self.rng
        n = self.started
        self.started += 1
        sid = f"{self.tag}-s{n}"
        url = self.urls[n % len(self.urls)]
        self.session_start[sid] = time.monotonic()
        kind = CLIENT_KINDS[n % len(CLIENT_KINDS)]
        family = min(int(rng.paretovariate(1.2)) - 1, work.families - 1)  # skewed: family 0 is the most common
        turns = min(work.max_turns, 1 + int(rng.expovariate(1 / (work.mean_turns - 1))))
        stream = rng.random() < work.stream_share
        messages: list[dict[str, str]] = [
            {"role": "system", "content": work.systems[family]},
            {"role": "user", "content": f"task {sid}: " + words(rng, 80, "u")},
        ]
        cookies: dict[str, str] = {}
        for t in range(turns):
            for attempt in range(work.retries + 1):
                if time.monotonic() >= self.stop_at:
                    return
                turn = Turn(sid, kind, f"{sid}-t{t}-a{attempt}", time.monotonic(), stream=stream)
                self.turns.append(turn)
                answer = await self.post(http, url, turn, messages, cookies, rng.randint(*work.answer_tokens))
                turn.end = time.monotonic()
                if answer is not None:
                    break
                await asyncio.sleep(work.retry_delay)
            else:
                return  # the rollout gives up
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": "tool result: " + words(rng, work.tool_words, "r")})
            await asyncio.sleep(rng.uniform(*work.think))

    async def post(
        self,
        http: aiohttp.ClientSession,
        url: str,
        turn: Turn,
        messages: list[dict[str, str]],
        cookies: dict[str, str],
        max_tokens: int,
    ) -> str | None:
        body: dict[str, Any] = {"model": "sim", "messages": messages, "max_tokens": max_tokens}
        # vllm-router's consistent_hash keys on X-Request-Id before the body's `user`: there the id
        # goes in the body (vLLM's own `request_id` field), which the engines read too.
        headers = {"X-Request-Id": turn.rid} if self.rid_header else {}
        if not self.rid_header:
            body["request_id"] = turn.rid
        if turn.kind == "cookie" and cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
        elif turn.kind == "x-session-id":
            headers["X-Session-ID"] = turn.session
        elif turn.kind == "session-id":
            headers["session-id"] = turn.session
        elif turn.kind == "user":
            body["user"] = turn.session
        if turn.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        try:
            async with http.post(url, json=body, headers=headers) as reply:
                turn.status, turn.stamp = reply.status, reply.headers.get("X-Weight-Version")
                if turn.kind == "cookie":
                    cookies.update({k: m.value for k, m in reply.cookies.items()})
                if reply.status != 200:
                    turn.error = f"{reply.status} {(await reply.text())[:120]}"
                    return None
                if not turn.stream:
                    choice = (await reply.json())["choices"][0]
                    content, turn.finish = choice["message"]["content"], choice.get("finish_reason") or ""
                else:
                    content, done = "", False
                    async for line in reply.content:
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif line.startswith(b"data: "):
                            for choice in json.loads(line[6:]).get("choices", []):
                                content += choice.get("delta", {}).get("content") or ""
                                turn.finish = choice.get("finish_reason") or turn.finish
                    if turn.finish != "abort" and not done:
                        turn.error = "stream ended without [DONE]"
                        return None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            turn.error = repr(exc)[:120]
            return None
        if turn.finish == "abort":  # the engine was paused under it: half an answer, the turn is tried again
            turn.error = "finish_reason abort"
            return None
        turn.ok = True
        return str(content)


# --- targets -----------------------------------------------------------------------------------------


def router_binary() -> str | None:
    """vllm-router from PATH or the bench venv (~/.cache/gymproxy/bench-venv), else None."""
    found = shutil.which("vllm-router")
    cached = Path.home() / ".cache/gymproxy/bench-venv/bin/vllm-router"
    return found or (str(cached) if cached.exists() else None)


def start_target(
    name: str, args: argparse.Namespace, upstreams: list[str], log_dir: Path, *, fleet_control: bool = False
) -> Service:
    port = free_port()
    if name in BUILTIN:
        argv = [sys.executable, str(BENCH / "sim_balancer.py"), "--policy", BUILTIN[name], "--port", str(port)]
        argv += [a for u in upstreams for a in ("--upstream", u)]
        service = Service(name, argv, port, log_dir)
    elif name.startswith("vllm-router:"):
        binary = router_binary()
        assert binary is not None
        bases = [u.removesuffix("/v1") for u in upstreams]
        argv = [binary, "--host", LOOPBACK, "--port", str(port), "--policy", name.split(":", 1)[1]]
        argv += ["--worker-urls", *bases, "--log-level", "warning", "--health-check-interval-secs", "2"]
        service = Service(name, argv, port, log_dir, ready_path="/health")
    else:
        command = [sys.executable, "-m", "gymproxy"] if name == "gymproxy" else shlex.split(dict(args.variant)[name])
        argv = [*command, "serve", "--host", LOOPBACK, "--port", str(port), "--model", "sim"]
        argv += [a for u in upstreams for a in ("--upstream", u)]
        argv += [a for item in args.set for a in ("--set", item)]
        if fleet_control:  # the trainer takes the fleet through its weight updates by gymproxy's /fleet routes
            argv += ["--set", "access.fleet_control=true"]
        service = Service(name, argv, port, log_dir, ready_path="/health")
    service.start()
    service.wait_ready(timeout=60)
    return service


def post(url: str, data: Any = None, timeout: float = 5) -> tuple[int, str]:
    body = json.dumps(data).encode() if data is not None else b""
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:200]
    except OSError as exc:
        return 0, repr(exc)


def add_upstream(target: str, base: str, url: str) -> str:
    """Tell the target about a new engine at `url` (ending in /v1); says how, or why it could not."""
    if target.startswith("vllm-router:"):
        engine = url.removesuffix("/v1")
        status, text = post(f"{base}/add_worker?url={engine}")
        if status // 100 == 2:
            return "added by POST /add_worker"
        status2, text2 = post(f"{base}/workers", {"url": engine})
        if status2 // 100 == 2:
            return "added by POST /workers"
        return f"needs a restart (POST /add_worker: {status}, POST /workers: {status2})"
    status, text = post(f"{base}/admin/upstreams", {"url": url})
    if status // 100 == 2:
        return "added by POST /admin/upstreams"
    return f"needs a restart (POST /admin/upstreams: {status})"


# --- the trainer (weight-sync scenarios) ---------------------------------------------------------------


@dataclass
class Update:
    """One weight update, as the trainer saw it (monotonic times)."""

    version: str
    pause_at: float  # the trainer asked for the pause
    paused_at: float = 0.0  # every engine had answered it (gymproxy's barrier: its one answer)
    resumed_at: float = 0.0  # the resume was answered: from here on, generation samples `version`
    errors: list[str] = field(default_factory=list)  # every call that did not answer 200


class Trainer:
    """Every `every` seconds: pause the fleet (`mode`), transfer the weights (a sleep), set the next
    version ("1", "2", ...: the engines start at "0") and resume.

    Through gymproxy (`proxy`): `POST /fleet/pause?mode=`, `POST /fleet/broadcast/update_weight_version`,
    `POST /fleet/resume`. Without (`proxy` None): each step on every engine at once, as RL
    trainers do today (SkyRL, prime-rl, veRL: an asyncio.gather over the engines' URLs).
    """

    def __init__(self, mode: str, every: float, transfer: float, engines: list[str], proxy: str | None) -> None:
        self.mode, self.every, self.transfer = mode, every, transfer
        self.engines, self.proxy = engines, proxy
        self.updates: list[Update] = []

    async def run(self, seconds: float) -> None:
        start = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            for n in range(1, int(seconds / self.every) + 1):
                at = start + n * self.every
                if at >= start + seconds:
                    break
                await asyncio.sleep(at - time.monotonic())
                await self.update(http, str(n))

    async def update(self, http: aiohttp.ClientSession, version: str) -> None:
        update = Update(version, time.monotonic())
        self.updates.append(update)
        await self.everywhere(http, update, f"pause?mode={self.mode}")
        update.paused_at = time.monotonic()
        await asyncio.sleep(self.transfer)
        await self.everywhere(http, update, "update_weight_version", {"new_version": version})
        await self.everywhere(http, update, "resume")
        update.resumed_at = time.monotonic()

    async def everywhere(self, http: aiohttp.ClientSession, update: Update, route: str, body: Any = None) -> None:
        if self.proxy is not None:
            where = "fleet/broadcast/" if route == "update_weight_version" else "fleet/"
            await self.call(http, update, f"{self.proxy}/{where}{route}", body)
        else:
            await asyncio.gather(*(self.call(http, update, f"{engine}/{route}", body) for engine in self.engines))

    @staticmethod
    async def call(http: aiohttp.ClientSession, update: Update, url: str, body: Any) -> None:
        try:
            async with http.post(url, json=body) as reply:
                text = await reply.text()
                if reply.status != 200:
                    update.errors.append(f"POST {url}: {reply.status} {text[:160]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            update.errors.append(f"POST {url}: {exc!r}"[:200])


# --- one run -----------------------------------------------------------------------------------------


def engine_specs(args: argparse.Namespace, scenario: Scenario) -> list[dict[str, Any]]:
    count = args.engines + (1 if scenario.event == "add" else 0)
    specs = []
    for i in range(count):
        specs.append(
            {
                "name": f"e{i}",
                "port": free_port(),
                "slowdown": scenario.slow if i == 0 else 1.0,
                "gpu_prefill": scenario.gpu_prefill,
                "cache_blocks": args.cache_blocks,
                "step_base": args.step_base,
                "step_per_seq": args.step_per_seq,
                "prefill_per_token": args.prefill_per_token,
                "late": i >= args.engines,
                "weight_version": "0",
                "paused_requests": args.paused_requests,
            }
        )
    return specs


async def run_once(
    args: argparse.Namespace, scenario: Scenario, target: str, rep: int, log_dir: Path
) -> dict[str, Any]:
    specs = engine_specs(args, scenario)
    control = free_port()
    engines = Service(
        "engines",
        [sys.executable, str(BENCH / "sim_engines.py"), "--control-port", str(control), "--spec", json.dumps(specs)],
        control,
        log_dir,
    )
    engines.start()
    service = None
    trainer = None
    try:
        engines.wait_ready()
        upstreams = [f"http://{LOOPBACK}:{s['port']}/v1" for s in specs if not s["late"]]
        via_fleet = bool(scenario.sync) and args.sync_through == "fleet" and not is_baseline(target)
        if target != NO_PROXY:
            service = start_target(target, args, upstreams, log_dir, fleet_control=via_fleet)
        retries = scenario.retries if args.retries is None else args.retries
        work = Workload(sessions=args.sessions, seed=args.seed + rep, retries=retries)
        urls = [service.url] if service is not None else [u.removesuffix("/v1") for u in upstreams]
        driver = Driver(work, urls, f"r{rep}", rid_header=not target.startswith("vllm-router:"))
        if scenario.sync:
            proxy = service.url if via_fleet and service is not None else None
            engine_urls = [u.removesuffix("/v1") for u in upstreams]
            trainer = Trainer(scenario.sync, args.sync_every, args.sync_transfer, engine_urls, proxy)
        t0 = time.monotonic()
        window = (t0 + args.warmup, t0 + args.warmup + args.duration)
        event_time, event_note = 0.0, ""

        async def event() -> None:
            nonlocal event_time, event_note
            await asyncio.sleep(args.warmup + args.duration * args.event_at)
            event_time = time.monotonic()
            if scenario.event == "kill":
                await asyncio.to_thread(post, f"http://{LOOPBACK}:{control}/kill/1")
            elif scenario.event == "add":
                late = specs[-1]
                await asyncio.to_thread(post, f"http://{LOOPBACK}:{control}/start/{len(specs) - 1}")
                url = f"http://{LOOPBACK}:{late['port']}/v1"
                if service is None:
                    event_note = "no router: the clients know only the first engines"
                else:
                    event_note = await asyncio.to_thread(add_upstream, target, service.url, url)

        tasks = [driver.run(args.warmup + args.duration)]
        if scenario.event:
            tasks.append(event())
        if trainer is not None:
            tasks.append(trainer.run(args.warmup + args.duration))
            event_note = "trainer: gymproxy's /fleet routes" if trainer.proxy else "trainer: each engine directly"
        cpu = service.cpu() if service is not None else 0.0
        await asyncio.gather(*tasks)
        cpu = service.cpu() - cpu if service is not None else 0.0
        await asyncio.sleep(0.2)
        with urllib.request.urlopen(f"http://{LOOPBACK}:{control}/stats", timeout=10) as reply:
            stats = json.loads(reply.read())["engines"]
    finally:
        if service is not None:
            service.stop()
        engines.stop()
    row = measure(scenario, target, driver, stats, window, event_time, event_note, args.engines)
    if trainer is not None:
        row.update(measure_sync(target, driver, stats, window, trainer.updates))
    completed = sum(1 for t in driver.turns if t.ok)
    row["cpu_ms"] = 1000 * cpu / completed if completed and service is not None else None  # the router's own CPU
    return row


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(
    scenario: Scenario,
    target: str,
    driver: Driver,
    stats: list[dict[str, Any]],
    window: tuple[float, float],
    event_time: float,
    event_note: str,
    engines: int,
) -> dict[str, Any]:
    start, end = window
    served: dict[str, list[tuple[str, float, int, int, int]]] = defaultdict(list)  # rid -> engine records
    for engine in stats:
        for rid, done, prompt, cached, gen in engine["records"]:
            served[rid].append((engine["name"], done, prompt, cached, gen))
    turns = [t for t in driver.turns if t.end and start <= t.end < end]
    ok = [t for t in turns if t.ok]
    failed = [t for t in driver.turns if t.end and not t.ok and t.end >= start]
    prompt = cached = 0
    per_engine: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    for t in ok:
        for name, _done, p, c, g in served.get(t.rid, [])[:1]:
            prompt, cached = prompt + p, cached + c
            per_engine[name] += p + g
            requests[name] += 1
    by_session: dict[str, set[str]] = defaultdict(set)
    for t in driver.turns:
        for name, *_ in served.get(t.rid, []):
            by_session[t.session].add(name)
    latencies = [t.end - t.start for t in ok]
    loads = [per_engine[e["name"]] for e in stats if per_engine[e["name"]]]
    row: dict[str, Any] = {
        "scenario": scenario.name,
        "target": target,
        "turns": len(ok),
        "turns_s": len(ok) / (end - start),
        "hit": cached / prompt if prompt else 0.0,
        "p50": _pct(latencies, 0.5),
        "p99": _pct(latencies, 0.99),
        "imbalance": max(loads) / statistics.mean(loads) if loads else None,
        "moved": sum(1 for names in by_session.values() if len(names) > 1),
        "sessions": len(by_session),
        "failed": len(failed),
        "failed_plain": sum(1 for t in failed if not t.stream),
        "twice": sum(1 for records in served.values() if len(records) > 1),
        "first_error": next((t.error for t in failed), ""),
        "share": {e["name"]: per_engine[e["name"]] for e in stats},
        "note": event_note,
    }
    if scenario.event == "add" and event_time:
        late = stats[-1]["name"]
        # Requests sent after the engine was added: those in flight then could not have gone to it.
        after = [r for t in driver.turns if t.start >= event_time for r in served.get(t.rid, [])[:1]]
        tokens = sum(r[2] + r[4] for r in after)
        row["new_share"] = sum(r[2] + r[4] for r in after if r[0] == late) / tokens if tokens else 0.0
        before: dict[str, set[str]] = defaultdict(set)
        later: dict[str, set[str]] = defaultdict(set)
        for t in driver.turns:
            for name, done, *_ in served.get(t.rid, [])[:1]:
                (before if done < event_time else later)[t.session].add(name)
        existing = [s for s in before if s in later]
        row["existing"] = len(existing)
        row["existing_moved"] = sum(1 for s in existing if later[s] - before[s])
    return row


def _version(text: str) -> int:
    """A weight version as the trainer numbers them ("0", "1", ...); anything else sorts first."""
    return int(text) if text.isdigit() else -1


def measure_sync(
    target: str, driver: Driver, stats: list[dict[str, Any]], window: tuple[float, float], updates: list[Update]
) -> dict[str, Any]:
    """What the weight updates did to the turns of the window, from the engines' own records.

    A turn's versions are those of the engine's reply the client got: the last one under its
    request id with the finish reason the client saw (gymproxy may re-send an aborted request
    under the same id). It is stale when it started after a resume and some of its tokens were
    sampled with a version older than that resume's.
    """
    start, end = window
    replies: dict[str, list[tuple[str, list[str]]]] = defaultdict(list)  # rid -> (finish, versions)
    for engine in stats:
        for rid, finish, _tokens, spans in engine["replies"]:
            replies[rid].append((finish, [version for version, _first in spans]))
    turns = [t for t in driver.turns if t.end and start <= t.end < end]
    resumes = sorted((u.resumed_at, u.version) for u in updates if u.resumed_at)
    stale = mixed = unmatched = misstamped = 0
    for t in turns:
        if not t.ok:
            continue
        versions = next((v for finish, v in reversed(replies.get(t.rid, [])) if finish == t.finish), None)
        if versions is None:
            unmatched += 1
            continue
        due = max((_version(v) for at, v in resumes if at <= t.start), default=0)
        stale += any(_version(v) < due for v in versions)
        mixed += len(set(versions)) > 1
        misstamped += t.stamp is not None and not set(versions) <= {v.strip() for v in t.stamp.split(",")}
    window_updates = [u for u in updates if start <= u.pause_at < end]
    pauses = [u.resumed_at - u.pause_at for u in window_updates if u.resumed_at]
    errors = [e for u in updates for e in u.errors]
    replied = [t for t in turns if t.status == 200]
    failed = Counter(
        "abort" if t.finish == "abort" else str(t.status) if t.status else "connection"
        for t in driver.turns
        if t.end >= start and t.error
    )
    return {
        "failed_by": dict(failed),  # "503", "abort" (finish_reason), "connection", other statuses
        "aborted": sum(1 for t in turns if t.finish == "abort"),
        "stale": stale,
        "mixed": mixed,  # replies sampled with two or more versions (keep: frozen across an update)
        "unmatched": unmatched,  # completed turns the engines have no reply for (should be 0)
        "unstamped": None if is_baseline(target) else sum(1 for t in replied if t.stamp is None),
        "misstamped": None if is_baseline(target) else misstamped,
        "replied": len(replied),
        "pause_s": statistics.mean(pauses) if pauses else None,
        "updates": len(updates),
        "update_errors": len(errors),
        "first_update_error": errors[0] if errors else "",
    }


# --- the report --------------------------------------------------------------------------------------


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rows if r.get(key) is not None]
            out[key] = statistics.median(values) if values else None
    out["runs"] = len(rows)
    return out


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_sync(name: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """The table of a weight-sync scenario: what the updates cost each target, and what went wrong."""
    lines = [f"\n{name}: {SCENARIOS[name].about}"]
    head = f"  {'target':28} {'hit %':>6} {'turns/s':>8} {'p99 s':>6} {'failed':>7} {'aborted':>7} {'stale':>5}"
    head += f" {'mixed':>5} {'unstamped':>9} {'pause s':>7} {'updates':>7}"
    lines.append(head)
    for target, r in rows.items():
        unstamped = "n/a" if r.get("unstamped") is None else f"{r['unstamped']:.0f}/{r['replied']:.0f}"
        updates = f"{r['updates']:.0f}" + (f" ({r['update_errors']:.0f} err)" if r.get("update_errors") else "")
        line = (
            f"  {target:28} {_f(100 * r['hit'], '6.1f')} {_f(r['turns_s'], '8.1f')} {_f(r['p99'], '6.2f')}"
            f" {r['failed']:>7.0f} {r['aborted']:>7.0f} {r['stale']:>5.0f} {r['mixed']:>5.0f} {unstamped:>9}"
            f" {_f(r.get('pause_s'), '7.2f')} {updates:>7}"
        )
        if r.get("note"):
            line += f"  ({r['note']})"
        lines.append(line)
        if r.get("first_update_error"):
            lines.append(f"    first trainer error: {r['first_update_error']}")
    return lines


SYNC_LEGEND = (
    "\n  weight-sync: failed: client turn attempts that failed (503, finish_reason abort, a connection error),"
    "\n  each retried by the client; aborted: replies with finish_reason abort that reached the client; stale:"
    "\n  turns started after a resume but sampled (partly) with an older version; mixed: replies sampled with"
    "\n  2+ versions; unstamped: 200 replies without X-Weight-Version (n/a: no proxy to stamp them); pause s:"
    "\n  mean seconds from the trainer's pause to its resume answering; updates: weight updates in the run"
)


def render(summary: dict[str, dict[str, dict[str, Any]]], checks: list[dict[str, Any]]) -> str:
    lines = []
    for name, rows in summary.items():
        if SCENARIOS[name].sync:
            lines += render_sync(name, rows)
            continue
        lines.append(f"\n{name}: {SCENARIOS[name].about}")
        head = f"  {'target':28} {'hit %':>6} {'turns/s':>8} {'p50 s':>6} {'p99 s':>6} {'imbal':>6}"
        head += f" {'moved':>7} {'failed':>7} {'twice':>5} {'cpu ms':>6}"
        if SCENARIOS[name].event == "add":
            head += f" {'new %':>6} {'exist moved':>11}"
        lines.append(head)
        for target, r in rows.items():
            line = (
                f"  {target:28} {_f(100 * r['hit'], '6.1f')} {_f(r['turns_s'], '8.1f')} {_f(r['p50'], '6.2f')}"
                f" {_f(r['p99'], '6.2f')} {_f(r['imbalance'], '6.2f')} {r['moved']:>3.0f}/{r['sessions']:<3.0f}"
                f" {r['failed']:>3.0f}/{r['failed_plain']:<3.0f} {r['twice']:>5.0f} {_f(r.get('cpu_ms'), '6.2f')}"
            )
            if "new_share" in r:
                line += f" {_f(100 * r['new_share'], '6.1f')} {r['existing_moved']:>5.0f}/{r['existing']:<5.0f}"
            if r.get("note"):
                line += f"  ({r['note']})"
            lines.append(line)
    lines.append(
        "\n  hit: cached/prompt tokens; imbal: max/mean tokens per engine; moved: sessions served by 2+ engines;"
        "\n  failed: failed turns (all/non-streamed); twice: requests completed by 2 engines; new %: the"
        "\n  added engine's share of the tokens of requests sent after it was added; exist moved: sessions from"
        "\n  before that moved; cpu ms: the router's own CPU time per completed turn (all its processes)"
    )
    if any(SCENARIOS[name].sync for name in summary):
        lines.append(SYNC_LEGEND)
    if checks:
        lines.append("\nchecks (each gymproxy target against the best baseline of its scenario):")
        for c in checks:
            lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['scenario']:16} {c['target']:20} {c['what']}")
    return "\n".join(lines)


COLUMNS = (
    Column("target", "target"),
    Column("hit_pct", "hit %", 1),
    Column("turns_s", "turns/s", 1),
    Column("p50_s", "p50 s", 2),
    Column("p99_s", "p99 s", 2),
    Column("imbalance", "imbal", 2),
    Column("moved", "moved", 0),
    Column("sessions", "sessions", 0),
    Column("failed", "failed", 0),
    Column("failed_plain", "failed non-streamed", 0),
    Column("twice", "twice", 0),
    Column("cpu_ms", "cpu ms", 2),
)
ADD_COLUMNS = (
    Column("new_pct", "new %", 1),
    Column("existing_moved", "exist moved", 0),
    Column("existing", "existing", 0),
)
SYNC_COLUMNS = (
    Column("target", "target"),
    Column("hit_pct", "hit %", 1),
    Column("turns_s", "turns/s", 1),
    Column("p99_s", "p99 s", 2),
    Column("failed", "failed", 0),
    Column("aborted", "aborted", 0),
    Column("stale", "stale", 0),
    Column("mixed", "mixed", 0),
    Column("unstamped", "unstamped", 0),
    Column("replied", "replied", 0),
    Column("pause_s", "pause s", 2),
    Column("updates", "updates", 0),
    Column("update_errors", "update errors", 0),
)


def tables(summary: dict[str, dict[str, dict[str, Any]]]) -> list[Table]:
    """One table a scenario, the figures of the text tables under the same names (a count a column)."""
    out = []
    for name, rows in summary.items():
        s = SCENARIOS[name]
        columns = SYNC_COLUMNS if s.sync else COLUMNS + (ADD_COLUMNS if s.event == "add" else ())
        columns += (Column("note", "note"),)
        values = []
        for target, r in rows.items():
            row = {**r, "target": target, "hit_pct": 100 * r["hit"], "p50_s": r["p50"], "p99_s": r["p99"],
                   "note": r.get("note") or None}  # fmt: skip
            if "new_share" in r:
                row["new_pct"] = 100 * r["new_share"]
            values.append([row.get(c.key) for c in columns])
        out.append(Table(name, f"{name}: {s.about}", columns, values))
    return out


def render_markdown(summary: dict[str, dict[str, dict[str, Any]]], checks: list[dict[str, Any]], head: str) -> str:
    parts = [head, markdown(tables(summary))]
    if checks:
        columns = (Column("scenario", "scenario"), Column("target", "target"), Column("result", "result"),
                   Column("check", "check"))  # fmt: skip
        rows = [[c["scenario"], c["target"], "PASS" if c["ok"] else "FAIL", c["what"]] for c in checks]
        parts.append(
            markdown([Table("checks", "checks: each gymproxy target against the best baseline", columns, rows)])
        )
    return "\n\n".join(parts)


def draw(path: str, runs: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Turns/s and p99 per scenario, a bar a target (median of the runs, whiskers the least and the most)."""
    scenarios = [name for name, by in runs.items() if by]
    targets = list(dict.fromkeys(t for name in scenarios for t in runs[name]))
    panels = []
    for key, label in (("turns_s", "turns/s (higher is better)"), ("p99", "p99 turn latency, s (lower is better)")):
        bars = {}
        for name in scenarios:
            for target, rows in runs[name].items():
                found = plot.bar([r.get(key) for r in rows])
                if found is not None:
                    bars[name, target] = found
        panels.append(plot.Panel(label, label.split(" (")[0], scenarios, targets, bars))
    repeats = max((len(rows) for by in runs.values() for rows in by.values()), default=1)
    title = f"fleet: median of {repeats} run(s) per target\n(whiskers: the least and the most)"
    plot.write(path, title, panels, columns=1)


def is_baseline(target: str) -> bool:
    return target in BUILTIN or target == NO_PROXY or target.startswith("vllm-router:")


def goal_checks(summary: dict[str, dict[str, dict[str, Any]]], engines: int) -> list[dict[str, Any]]:
    checks = []
    for name, rows in summary.items():
        baselines = {t: r for t, r in rows.items() if is_baseline(t)}
        sticky = {t: r for t, r in baselines.items() if t in STICKY_BASELINES}
        best = max(baselines.values(), key=lambda r: r["turns_s"]) if baselines else None
        for target, r in rows.items():
            if is_baseline(target):
                continue

            def check(ok: bool, what: str, target: str = target, scenario: str = name) -> None:
                checks.append({"scenario": scenario, "target": target, "ok": bool(ok), "what": what})

            if name in ("balanced", "gpu-prefill") and best is not None:
                if sticky:
                    best_hit = max(s["hit"] for s in sticky.values())
                    check(
                        r["hit"] >= best_hit - 0.01,
                        f"hit {100 * r['hit']:.1f}% >= best sticky {100 * best_hit:.1f}% - 1",
                    )
                check(
                    r["turns_s"] >= best["turns_s"],
                    f"turns/s {r['turns_s']:.1f} >= best baseline {best['turns_s']:.1f} ({best['target']})",
                )
            elif name == "slow" and best is not None:
                check(
                    r["turns_s"] >= 1.05 * best["turns_s"],
                    f"turns/s {r['turns_s']:.1f} >= 1.05 x {best['turns_s']:.1f} ({best['target']})",
                )
                check(
                    (r["p99"] or 1e9) <= (best["p99"] or 0),
                    f"p99 {_f(r['p99'], '.2f')} s <= {_f(best['p99'], '.2f')} s",
                )
            elif name == "add":
                check(
                    r.get("new_share", 0) >= 0.20,
                    f"new engine serves {100 * r.get('new_share', 0):.1f}% >= 20% of tokens",
                )
                limit = r.get("existing", 0) / engines
                check(
                    r.get("existing_moved", 0) <= limit,
                    f"existing sessions moved {r.get('existing_moved', 0):.0f} <= 1/N of {r.get('existing', 0):.0f}",
                )
            elif name == "kill":
                check(r["failed_plain"] == 0, f"{r['failed_plain']:.0f} failed non-streamed turns == 0")
                check(r["twice"] == 0, f"{r['twice']:.0f} requests completed twice == 0")
            elif SCENARIOS[name].sync:
                check(
                    r["updates"] > 0 and r["update_errors"] == 0,
                    f"{r['updates']:.0f} weight updates, {r['update_errors']:.0f} trainer calls failed == 0",
                )
                check(r["failed"] == 0, f"{r['failed']:.0f} failed client turn attempts == 0")
                check(r["aborted"] == 0, f"{r['aborted']:.0f} aborted replies reaching the client == 0")
                check(r["stale"] == 0, f"{r['stale']:.0f} turns after a resume sampled with an old version == 0")
                check(
                    r["unstamped"] == 0 and r["replied"] > 0,
                    f"{r['unstamped']:.0f} of {r['replied']:.0f} replies without X-Weight-Version == 0",
                )
                if best is not None:
                    check(
                        r["turns_s"] >= 0.97 * best["turns_s"],
                        f"turns/s {r['turns_s']:.1f} >= 0.97 x {best['turns_s']:.1f} ({best['target']})",
                    )
    return checks


# --- command line ------------------------------------------------------------------------------------


def _variant(text: str) -> tuple[str, str]:
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise argparse.ArgumentTypeError(f"--variant takes NAME=COMMAND, got {text!r}")
    return name.strip(), command


QUICK = {
    "scenarios": "kill,weight-sync",
    "targets": "hash-mod-n,gymproxy",
    "sessions": 48,
    "duration": 5.0,
    "warmup": 2.0,
    "sync_every": 2.0,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fleet.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="scenarios:\n" + "\n".join(f"  {s.name:12} {s.about}" for s in SCENARIOS.values()),
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated (default: all)")
    parser.add_argument(
        "--targets",
        help="round-robin, hash-mod-n, no-proxy, gymproxy, vllm-router:POLICY (skipped when not installed);"
        " variants are added. Default: all but no-proxy, which the weight-sync scenarios add",
    )
    parser.add_argument("--variant", action="append", type=_variant, default=[], metavar="NAME=COMMAND",
                        help="one more gymproxy target, started as `COMMAND serve ...` (absolute paths)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="passed to every gymproxy")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=96)
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=4.0, help="unmeasured seconds first (caches fill)")
    parser.add_argument("--event-at", type=float, default=0.3, help="kill/add at this fraction of the window")
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario and target; medians are shown")
    parser.add_argument("--cache-blocks", type=int, default=2500, help="16-token blocks of prefix cache per engine")
    parser.add_argument("--step-base", type=float, default=0.012, help="decode step seconds, empty batch")
    parser.add_argument("--step-per-seq", type=float, default=0.0004, help="decode step seconds added per sequence")
    parser.add_argument("--prefill-per-token", type=float, default=0.00005, help="seconds per uncached prompt token")
    parser.add_argument("--seed", type=int, default=1)
    sync = parser.add_argument_group("weight-sync scenarios")
    sync.add_argument("--sync-every", type=float, default=5.0, help="seconds between weight updates")
    sync.add_argument("--sync-transfer", type=float, default=0.5, help="seconds the weight transfer takes (a sleep)")
    sync.add_argument("--sync-through", choices=("fleet", "engines"), default="fleet",
                      help="gymproxy targets: the trainer uses gymproxy's /fleet routes (with access.fleet_control:"
                      " true), or calls each engine itself as the baselines' trainer does")  # fmt: skip
    sync.add_argument("--paused-requests", choices=("reject", "queue"), default="reject",
                      help="new requests to an engine paused in abort/wait: 503 (vLLM >= 0.33) or queued (0.32)")  # fmt: skip
    sync.add_argument("--retries", type=int, help="client retries of a failed turn (default: 2, weight-sync 10)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a check fails")
    parser.add_argument("--render", metavar="FILE", help="print the tables of a --json result and run nothing")
    options.add(
        parser,
        quick="scenarios kill and weight-sync, targets hash-mod-n and gymproxy, 48 sessions, 5 s after 2 s, "
        "a weight update every 2 s: ~40 s",
        pictures="turns/s and p99 latency, a group a scenario, a bar a target with its spread over --repeat runs",
    )
    args = options.parse(parser, argv, QUICK)
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenario_list if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    variants = [n for n, _ in args.variant]
    if args.targets is None:
        default = ["round-robin", "hash-mod-n", "gymproxy", *(f"vllm-router:{p}" for p in ROUTER_POLICIES)]
        synced = [NO_PROXY] if any(SCENARIOS[s].sync for s in args.scenario_list) else []
        args.target_list = synced + default + variants
        args.targets_of = {s: [t for t in args.target_list if t != NO_PROXY or SCENARIOS[s].sync] for s in SCENARIOS}
    else:
        args.target_list = [t.strip() for t in args.targets.split(",") if t.strip()] + variants
        args.targets_of = {s: args.target_list for s in SCENARIOS}
    return args


def report(args: argparse.Namespace, document: dict[str, Any], head: str) -> None:
    """Print the result in --format, and draw it with --plot."""
    if args.format == "json":
        print(json.dumps(document, indent=1))
    elif args.format == "markdown":
        print(render_markdown(document["summary"], document["checks"], head))
    elif args.format == "csv":
        print(csv_text(tables(document["summary"]), "scenario"))
    else:
        print(head)
        print(render(document["summary"], document["checks"]))
    if args.plot:
        draw(args.plot, document["runs"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        document = json.loads(Path(args.render).read_text())
        report(args, document, f"fleet: from {args.render}")
        return 1 if args.check and not all(c["ok"] for c in document["checks"]) else 0
    skipped = []
    targets = []
    for target in args.target_list:
        if target.startswith("vllm-router:"):
            if router_binary() is None:
                skipped.append(f"{target}: vllm-router is not installed (pip install vllm-router)")
                continue
            if target.split(":", 1)[1] not in ROUTER_POLICIES + ("random",):
                skipped.append(f"{target}: unknown policy")
                continue
        elif target not in (*BUILTIN, NO_PROXY, "gymproxy") and target not in dict(args.variant):
            raise SystemExit(f"unknown target {target}")
        targets.append(target)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    os.environ.setdefault("GYMPROXY_PIN_SECRET", "fleetbench")  # every gymproxy signs pins with one key
    log_dir = Path(tempfile.mkdtemp(prefix="fleetbench-"))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: defaultdict(list) for s in args.scenario_list}
    plan = {name: [t for t in targets if t in args.targets_of[name]] for name in args.scenario_list}
    progress = Progress(args.repeat * sum(map(len, plan.values())), quiet=args.quiet)
    for name, mine in plan.items():
        for rep in range(args.repeat if mine else 0):
            order = mine[rep % len(mine) :] + mine[: rep % len(mine)]
            for target in order:
                row = asyncio.run(run_once(args, SCENARIOS[name], target, rep, log_dir))
                runs[name][target].append(row)
                progress.step(
                    f"{name} {target} run {rep + 1}/{args.repeat}: {row['turns']} turns, hit {100 * row['hit']:.1f}%,"
                    f" failed {row['failed']}"
                    + (f", aborted {row['aborted']}, stale {row['stale']}" if "aborted" in row else "")
                )
    summary = {s: {t: median_row(runs[s][t]) for t in targets if runs[s][t]} for s in args.scenario_list}
    checks = goal_checks(summary, args.engines)
    head = (
        f"fleet: {args.engines} engines, {args.sessions} sessions, {args.duration:g} s measured after "
        f"{args.warmup:g} s, {args.repeat} run(s) each (median); logs in {log_dir}"
    )
    report(args, {"summary": summary, "checks": checks, "skipped": skipped, "runs": runs}, head)
    return 1 if args.check and not all(c["ok"] for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
